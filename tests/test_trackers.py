"""``--report-to``: Accelerate's trackers, checked offline through TensorBoard's event files.

TensorBoard keeps scalars as float32, so numbers from the metrics JSON are compared with their
float32 rounding, exactly; numbers only printed (the log lines' loss and lr) are compared
within the printed precision.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from effitrain.build import checked_config
from effitrain.config import TRACKERS
from tests.conftest import assert_clean_error

TRAIN_TAGS = (
    "train/loss",
    "train/lr",
    "train/samples_per_second",
    "train/tokens_per_second",
    "train/epoch",
)
EVAL_TAGS = ("eval/loss", "eval/accuracy", "eval/f1")
MEMORY = {
    "memory/optimizer_state_bytes": lambda m: m["optimizer_state"]["bytes"],
    "memory/adamw_equivalent_bytes": lambda m: m["adamw_equivalent_bytes"],
    "memory/parameter_bytes": lambda m: m["parameter_bytes"],
    "memory/gradient_bytes": lambda m: m["gradient_bytes"],
    "memory/peak_memory_bytes": lambda m: m["peak_memory_bytes"],
    "memory/activation_bytes": lambda m: m["activation_bytes"],
    "memory/peak_tensor_bytes": lambda m: m["peak_tensor_bytes"],
}
LOG_LINE = re.compile(r"^step (\d+)/\d+(?: · epoch \d+)? · loss ([\d.]+) · lr ([\d.e+-]+)", re.M)


def args(data, *extra: str) -> list[str]:
    train, validation, model = data
    return [
        "train",
        "--model",
        str(model),
        "--train-file",
        str(train),
        "--validation-file",
        str(validation),
        "--max-steps",
        "4",
        "--batch-size",
        "8",
        *extra,
    ]


def scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a TensorBoard run folder: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def float32(value: float) -> float:
    import numpy as np

    return float(np.float32(value))


def test_tensorboard_gets_the_log_lines_evaluations_memory_and_config(train_cli, data, tmp_path):
    import yaml

    out, metrics_json = tmp_path / "out", tmp_path / "metrics.json"
    proc = train_cli(
        *args(data, "--log-every", "2", "--output-dir", str(out)),
        *("--report-to", "tensorboard", "--metrics-json", str(metrics_json)),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = out / "runs" / "effitrain"
    assert f"note: logging to tensorboard ({run_dir})" in proc.stdout
    logged = scalars(run_dir)
    metrics = json.loads(metrics_json.read_text())

    assert set(logged) == {*TRAIN_TAGS, *EVAL_TAGS, *MEMORY}
    printed = LOG_LINE.findall(proc.stdout)
    assert [int(step) for step, _, _ in printed] == [2, 4]
    for tag in TRAIN_TAGS:
        assert [step for step, _ in logged[tag]] == [2, 4], tag
    for (_, loss), (_, lr), (_, printed_loss, printed_lr) in zip(
        logged["train/loss"], logged["train/lr"], printed, strict=True
    ):
        assert abs(loss - float(printed_loss)) <= 5e-5 + 1e-6  # printed to 4 decimals
        assert lr == pytest.approx(float(printed_lr), rel=5e-3, abs=1e-12)  # printed as 6.67e-04

    # Evaluations: at the end of epoch 1 (step 3) and at the end of the run (step 4).
    history = metrics["eval_history"]
    assert [e["step"] for e in history] == [3, 4]
    for tag in EVAL_TAGS:
        key = tag.removeprefix("eval/")
        assert logged[tag] == [(e["step"], float32(e[key])) for e in history], tag
    assert logged["eval/accuracy"][-1][1] == float32(metrics["eval"]["accuracy"])

    for tag, read in MEMORY.items():
        assert read(metrics) > 0, tag
        assert logged[tag] == [(4, float32(read(metrics)))], tag

    # The config, once, as hyperparameters (lists joined, None kept).
    (hparams_file,) = run_dir.glob("*/hparams.yml")
    hparams = yaml.safe_load(hparams_file.read_text())
    assert hparams["max_steps"] == 4
    assert hparams["report_to"] == "tensorboard"
    assert hparams["resume"] is None


def test_resumed_run_continues_the_curve(train_cli, data, tmp_path):
    """A run that logged to step 4 but saved only at step 2 (a crash), resumed: TensorBoard
    shows each step once, the resumed run's (equal to the uninterrupted run's)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    options = ("--log-every", "1", "--save-every", "2", "--report-to", "tensorboard")
    proc = train_cli(*args(data, *options, "--output-dir", str(straight)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed.mkdir()
    for name in ("checkpoint-2", "runs"):
        shutil.copytree(straight / name, resumed / name)
    proc = train_cli(*args(data, *options, "--output-dir", str(resumed), "--resume", "latest"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "not an exact continuation" not in proc.stdout

    before = scalars(straight / "runs" / "effitrain")
    after = scalars(resumed / "runs" / "effitrain")
    assert len(list((resumed / "runs" / "effitrain").glob("events.out.tfevents.*"))) == 2
    assert set(after) == set(before)
    assert [step for step, _ in after["train/loss"]] == [1, 2, 3, 4]
    assert [step for step, _ in after["eval/accuracy"]] == [3, 4]
    for tag in (*TRAIN_TAGS, *EVAL_TAGS, *MEMORY):
        if tag not in (
            "train/samples_per_second",
            "train/tokens_per_second",
            "memory/peak_memory_bytes",
        ):
            assert after[tag] == before[tag], tag  # exact resume: the same numbers


@pytest.mark.parametrize("report_to", [None, pytest.param("none", marks=pytest.mark.slow)])
def test_no_tracker_writes_no_tracker_files(train_cli, data, tmp_path, monkeypatch, report_to):
    monkeypatch.chdir(tmp_path)
    extra = ("--report-to", report_to) if report_to else ()
    proc = train_cli(*args(data, "--output-dir", "out", *extra))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "logging to" not in proc.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["final"]
    assert not (tmp_path / "runs").exists()


def test_without_output_dir_logs_under_runs(train_cli, data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    proc = train_cli(*args(data, "--report-to", "tensorboard"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = (tmp_path / "runs").glob("*/effitrain")  # runs/<YYYYmmdd-HHMMSS>/effitrain
    assert re.fullmatch(r"\d{8}-\d{6}", run_dir.parent.name)
    assert [step for step, _ in scalars(run_dir)["train/loss"]] == [4]


@pytest.mark.parametrize(
    "report_to, fragments",
    [
        ("tensorbored", ("unknown --report-to 'tensorbored'", "none, all, tensorboard, wandb")),
        ("none,tensorboard", ("--report-to none contradicts tensorboard",)),
    ],
)
def test_bad_tracker_names_are_one_clean_line(train_cli, report_to, fragments):
    assert_clean_error(train_cli("train", "--report-to", report_to), *fragments)


@pytest.mark.parametrize(
    "report_to, unavailable, fragment",
    [
        (
            "tensorboard",
            ("accelerate.utils.is_tensorboard_available", lambda: False),
            "--report-to tensorboard needs the 'tensorboard' package: pip install tensorboard",
        ),
        (
            "all",
            ("accelerate.tracking.get_available_trackers", lambda: []),
            "--report-to all found no tracker installed: pip install tensorboard",
        ),
    ],
)
def test_missing_tracker_package_is_one_install_line(
    train_cli, data, tmp_path, monkeypatch, report_to, unavailable, fragment
):
    monkeypatch.setattr(*unavailable)
    out = tmp_path / "out"
    proc = train_cli(*args(data, "--output-dir", str(out), "--report-to", report_to))
    assert_clean_error(proc, fragment)
    assert not out.exists()  # refused before anything was built


def test_report_to_parses_like_the_other_list_options():
    assert checked_config(overrides={"report_to": "tensorboard, wandb"}).trackers == [
        "tensorboard",
        "wandb",
    ]
    assert checked_config(overrides={"report_to": ["mlflow"]}).trackers == ["mlflow"]
    assert checked_config(overrides={"report_to": "none"}).trackers == []
    assert checked_config().trackers == []


def test_tracker_names_are_accelerates():
    from accelerate import utils

    for name in TRACKERS:
        assert name in utils.LoggerType.list(), name
        assert callable(getattr(utils, f"is_{name}_available")), name
