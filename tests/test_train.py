"""`effitrain train` end to end on the tiny preset: outputs, data sources, models, bad inputs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.conftest import assert_clean_error

METRIC_FIELDS = (
    "optimizer",
    "global_steps",
    "train_loss",
    "eval",
    "optimizer_state",
    "parameter_bytes",
    "gradient_bytes",
    "adamw_equivalent_bytes",
    "peak_memory_bytes",
    "seconds_per_step",
    "samples_per_second",
)
EXPECTED_KEYS = {
    "adamw": {"step", "exp_avg", "exp_avg_sq"},
    "adafactor": {"step", "row_var", "col_var", "variance"},
    "adafactor-hf": {"step", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "RMS"},
    "adamw-8bit": {"step", "state1", "state2"},
    "sgd": {"momentum_buffer"},
}
QUICK = ("--max-steps", "4", "--batch-size", "8", "--log-every", "2")


@pytest.fixture
def small(data) -> tuple[str, ...]:
    """The tiny preset on the session's 24/8-row csvs instead of the 3,400-row demo, for runs
    whose subject is not the data."""
    train, validation, _ = data
    return ("--train-file", str(train), "--validation-file", str(validation))


def metrics(path: Path) -> dict:
    return json.loads(path.read_text())


def write_rows(path: Path, rows: list[dict]) -> Path:
    """Write rows as csv, json (list), jsonl or parquet depending on the suffix."""
    if path.suffix == ".csv":
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".parquet":
        import pandas as pd

        pd.DataFrame(rows).to_parquet(path)
    return path


def review_rows(n: int, labels=("bad", "good", "okay")) -> list[dict]:
    words = {"bad": "awful terrible", "good": "great lovely", "okay": "fine average"}
    return [
        {
            "review": f"the film was {words[labels[i % len(labels)]]} number {i}",
            "label": labels[i % len(labels)],
        }
        for i in range(n)
    ]


def test_demo_run_prints_progress_eval_and_tables(train_cli, tmp_path):
    out = tmp_path / "m.json"
    proc = train_cli("train", *QUICK, "--metrics-json", str(out))
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    # Not a terminal here: plain log lines with the loss, then eval, then the tables.
    assert "step 2/4" in text and "step 4/4" in text and "loss" in text
    assert "eval (end)" in text and "accuracy" in text
    assert "Optimizer state: adamw (torch.optim.AdamW)" in text
    for key in (
        "exp_avg_sq",
        "Memory (no levers)",
        "fp32 AdamW, no levers",
        "activations",
        "peak tensor memory",
        "peak RSS",
        "gradients",
    ):
        assert key in text
    data = metrics(out)
    for field in METRIC_FIELDS:
        assert field in data, field
    assert data["global_steps"] == 4
    assert set(data["eval"]) >= {"accuracy", "f1", "loss"}
    assert data["eval"]["examples"] == 400  # every validation example, once
    state = data["optimizer_state"]
    assert {"tensors", "elements", "bytes", "by_key"} <= set(state)
    assert state["bytes"] == sum(v["bytes"] for v in state["by_key"].values())
    # AdamW's own state is exactly the AdamW reference.
    assert state["bytes"] == data["adamw_equivalent_bytes"]
    assert data["gradient_bytes"] == data["parameter_bytes"]
    assert data["peak_memory_bytes"] > 0 and data["seconds_per_step"] > 0
    assert_memory_breakdown(data)
    # The first step's FLOPs (effitrain.cost); no MFU on a CPU, whose peak is not known.
    assert data["flops_per_step"] > 0 and data["recompute_flops"] == 0
    assert data["achieved_tflops"] == pytest.approx(
        data["flops_per_step"] / data["seconds_per_step"] / 1e12
    )
    assert data["mfu"] is None and data["peak_tflops"] is None and data["device_name"] == "cpu"
    assert text.count("no MFU: the peak FLOP/s of cpu is unknown") == 1 and "FLOP/step" in text


def assert_memory_breakdown(data):
    """The tracker's parts agree with effitrain's own true-storage counts, and add up."""
    step = data["step_memory"]
    at_peak, peaks = step["at_peak"], step["kind_peaks"]
    assert data["peak_tensor_bytes"] == step["peak_tensor_bytes"] == sum(at_peak.values())
    assert data["activation_bytes"] == peaks["activations"] > 0
    assert at_peak["parameters"] == data["parameter_bytes"]
    # A late step is measured (Plan.measured_step): the optimizer state exists throughout it.
    assert at_peak["optimizer_state"] == data["optimizer_state"]["bytes"]
    assert peaks["gradients"] == data["gradient_bytes"]
    assert data["levers"] == []
    whole = data["baseline"]
    assert whole["parameter_bytes"] == whole["gradient_bytes"] == data["parameter_bytes"]
    assert whole["optimizer_state_bytes"] == data["adamw_equivalent_bytes"]
    assert data["trainable_parameter_bytes"] == data["parameter_bytes"]


@pytest.mark.parametrize(
    "optim",
    [
        pytest.param(name, marks=pytest.mark.slow) if name in ("adafactor-hf", "sgd") else name
        for name in sorted(EXPECTED_KEYS)
    ],
)
def test_each_optimizer_runs_and_reports_its_state(train_cli, small, tmp_path, optim):
    out = tmp_path / "m.json"
    proc = train_cli("train", *small, *QUICK, "--optim", optim, "--metrics-json", str(out))
    assert proc.returncode == 0, proc.stderr
    data = metrics(out)
    assert data["optimizer"] == optim
    assert set(data["optimizer_state"]["by_key"]) >= EXPECTED_KEYS[optim]
    if optim != "adamw":
        assert data["optimizer_state"]["bytes"] < data["adamw_equivalent_bytes"]


def test_quiet_prints_only_results(train_cli, small):
    proc = train_cli("train", *small, *QUICK, "--quiet")
    assert proc.returncode == 0
    assert "step 2/4" not in proc.stdout and "effitrain ·" not in proc.stdout
    assert "done" in proc.stdout and "Optimizer state" in proc.stdout


def test_grad_accum_scheduler_and_bf16(train_cli, small, tmp_path):
    out = tmp_path / "m.json"
    proc = train_cli(
        "train",
        *small,
        "--max-steps",
        "4",
        "--batch-size",
        "4",
        "--grad-accum",
        "2",
        "--scheduler",
        "cosine",
        "--log-every",
        "1",
        "--mixed-precision",
        "bf16",
        "--metrics-json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    data = metrics(out)
    assert data["global_steps"] == 4
    assert data["mixed_precision"] == "bf16"  # what the Accelerator runs with, not the option
    # Every optimizer step saw two micro-batches of 4.
    assert data["samples_per_second"] * data["train_seconds"] == pytest.approx(4 * 2 * 4)
    assert "global batch 8" in proc.stdout
    # 1 warmup step, then cosine: after step 2, 0.5 * (1 + cos(pi / 3)) of 1e-3 (linear: 6.67e-4).
    # 2 epochs of 3 steps: the log line names the epoch
    assert "step 2/4 · epoch 1 · loss" in proc.stdout and "lr 7.50e-04" in proc.stdout


def test_yaml_config_with_cli_override(train_cli, small, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("optim: sgd\nmax_steps: 2\nbatch_size: 4\nlog_every: 1\n")
    out = tmp_path / "m.json"
    proc = train_cli(
        "train", *small, "--config", str(config), "--optim", "adafactor", "--metrics-json", str(out)
    )
    assert proc.returncode == 0, proc.stderr
    data = metrics(out)
    assert data["optimizer"] == "adafactor" and data["global_steps"] == 2
    assert data["config"]["batch_size"] == 4


@pytest.mark.parametrize(
    "suffix",
    [".csv", ".jsonl", *(pytest.param(s, marks=pytest.mark.slow) for s in (".json", ".parquet"))],
)
def test_local_files_with_string_labels(train_cli, tmp_path, suffix):
    train = write_rows(tmp_path / f"train{suffix}", review_rows(60))
    dev = write_rows(tmp_path / f"dev{suffix}", review_rows(12))
    out = tmp_path / "m.json"
    proc = train_cli(
        "train",
        "--dataset",
        str(train),
        "--validation-file",
        str(dev),
        *QUICK,
        "--metrics-json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert "text review, label label (3 classes)" in proc.stdout
    assert metrics(out)["eval"]["examples"] == 12


def test_local_model_folder_and_dataset_folder(train_cli, tmp_path, tiny_model_dir):
    """Hub ids go through from_pretrained / load_dataset: exercised with local folders."""
    import datasets

    rows = review_rows(40)
    folder = tmp_path / "ds"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(rows),
            "validation": datasets.Dataset.from_list(rows[:9]),
        }
    ).save_to_disk(str(folder))
    out = tmp_path / "m.json"
    proc = train_cli(
        "train",
        "--model",
        str(tiny_model_dir),
        "--dataset",
        str(folder),
        *QUICK,
        "--metrics-json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert "DistilBertForSequenceClassification" in proc.stdout
    # A folder holds pretrained weights: the optimizer's fine-tuning default, and why.
    assert "lr 0.0002 (adamw default for fine-tuning)" in proc.stdout
    data = metrics(out)
    assert data["eval"]["examples"] == 9
    # The saved model had 2 labels; the dataset has 3: the head was resized.
    assert "(3 classes)" in proc.stdout


def test_held_out_split_when_no_validation(train_cli, tmp_path):
    train = write_rows(tmp_path / "train.csv", review_rows(50))
    proc = train_cli("train", "--train-file", str(train), *QUICK)
    assert proc.returncode == 0, proc.stderr
    assert "10% held out of train" in proc.stdout


# --- bad inputs that need data or models ---------------------------------------------------------


def test_model_folder_missing(train_cli, tmp_path):
    assert_clean_error(
        train_cli("train", "--model", str(tmp_path / "nope")), "cannot load", "no such folder"
    )


def test_hub_model_offline(train_cli):
    assert_clean_error(
        train_cli("train", "--model", "someone/not-a-model"), "cannot load", "offline"
    )


def test_folder_that_is_not_a_model(train_cli, tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    assert_clean_error(
        train_cli("train", "--model", str(tmp_path)), "cannot load", "no config.json"
    )


def test_dataset_path_missing(train_cli, tmp_path, monkeypatch):
    assert_clean_error(train_cli("train", "--dataset", str(tmp_path / "missing.csv")), "not found")
    # A missing --train-file or --validation-file is found before anything is built.
    import effitrain.training

    monkeypatch.setattr(effitrain.training, "build_run", lambda *_: pytest.fail("built"))
    for option in ("--train-file", "--validation-file"):
        assert_clean_error(
            train_cli("train", option, str(tmp_path / "dev.csv")),
            f"dataset file not found: {tmp_path / 'dev.csv'}",
        )


def test_hub_dataset_offline(train_cli):
    assert_clean_error(train_cli("train", "--dataset", "someone/not-a-dataset"), "offline")


def test_no_text_column_lists_columns(train_cli, tmp_path):
    rows = [{"foo": f"x {i}", "bar": f"y {i}", "label": i % 2} for i in range(20)]
    path = write_rows(tmp_path / "t.csv", rows)
    line = assert_clean_error(train_cli("train", "--dataset", str(path)), "no usable text column")
    assert "foo" in line and "bar" in line and "--text-columns" in line


def test_no_label_column_lists_columns(train_cli, tmp_path):
    rows = [{"text": f"x {i}", "rating": i % 2} for i in range(20)]
    path = write_rows(tmp_path / "t.csv", rows)
    line = assert_clean_error(train_cli("train", "--dataset", str(path)), "no label column")
    assert "rating" in line and "--label-column" in line


def test_named_column_missing(train_cli, tmp_path):
    path = write_rows(tmp_path / "t.csv", [{"text": f"x {i}", "label": i % 2} for i in range(20)])
    assert_clean_error(
        train_cli("train", "--dataset", str(path), "--label-column", "y"), "--label-column y"
    )


def test_labels_out_of_range(train_cli, tmp_path):
    train = write_rows(
        tmp_path / "train.csv", [{"text": f"x {i}", "label": i % 2} for i in range(20)]
    )
    dev = write_rows(tmp_path / "dev.csv", [{"text": f"x {i}", "label": i % 3} for i in range(9)])
    assert_clean_error(
        train_cli("train", "--dataset", str(train), "--validation-file", str(dev)),
        "validation label 2 is out of range for a model with 2 labels",
    )
    negative = write_rows(
        tmp_path / "neg.csv", [{"text": f"x {i}", "label": i % 2 - 1} for i in range(20)]
    )
    assert_clean_error(train_cli("train", "--dataset", str(negative)), "label -1 is out of range")


def test_empty_training_set(train_cli, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    dev = write_rows(tmp_path / "dev.jsonl", [{"text": "x", "label": 0}])
    assert_clean_error(
        train_cli("train", "--dataset", str(path), "--validation-file", str(dev)), "empty"
    )


def test_bitsandbytes_missing(train_cli, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def without_bnb(name, *args, **kwargs):
        return None if name == "bitsandbytes" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", without_bnb)
    assert_clean_error(
        train_cli("train", "--optim", "adamw-8bit", *QUICK), "bitsandbytes", "pip install"
    )


def test_metrics_json_unwritable_fails_before_training(train_cli, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = train_cli("train", *QUICK, "--metrics-json", str(blocker / "m.json"))
    assert_clean_error(proc, "--metrics-json")
    assert "step" not in proc.stdout


@pytest.mark.parametrize("num_labels", [2, 3, 5])
def test_scores_are_scikit_learns(num_labels):
    """Accuracy and F1 as scikit-learn's accuracy_score and f1_score give them: binary for two
    labels, macro otherwise, 0 where a label is never predicted or true."""
    import torch
    from sklearn.metrics import accuracy_score, f1_score

    from effitrain.tasks.classification import scores

    generator = torch.Generator().manual_seed(num_labels)
    average = "binary" if num_labels == 2 else "macro"
    cases = [torch.randint(0, num_labels, (2, 37), generator=generator) for _ in range(20)]
    # Edge cases: every prediction right, none right, one label never predicted nor true.
    cases += [torch.zeros(2, 9, dtype=torch.long), torch.stack([torch.zeros(9), torch.ones(9)])]
    for y_pred, y_true in (case.long() for case in cases):
        ours = scores(y_pred, y_true, num_labels)
        assert ours["accuracy"] == pytest.approx(accuracy_score(y_true, y_pred), abs=1e-12)
        expected = f1_score(y_true, y_pred, average=average, zero_division=0)
        assert ours["f1"] == pytest.approx(expected, abs=1e-12)
