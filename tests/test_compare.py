"""``effitrain compare``: configurations, the runs, the table and the files (JSON, CSV, PNG)."""

from __future__ import annotations

import csv
import json

import pytest

from effitrain.comparison import child_error, configurations, parse_variant, plot
from effitrain.errors import EffitrainError
from effitrain.report.comparison_table import PARTS
from tests.conftest import assert_clean_error


def test_variants_become_train_options():
    row = parse_variant("adafactor +gradient-checkpointing +lora-rank=8")
    assert row.label == "adafactor +gradient-checkpointing +lora-rank=8"
    assert row.args == ["--optim", "adafactor", "--gradient-checkpointing", "--lora-rank", "8"]
    for bad in ("", "+gradient-checkpointing", "adamw gradient-checkpointing", "adamw +"):
        with pytest.raises(EffitrainError, match="--variant"):
            parse_variant(bad)


def test_default_is_adamw_against_adafactor_and_8bit():
    assert [row.label for row in configurations([], [])] == ["adamw", "adafactor", "adamw-8bit"]
    with pytest.raises(EffitrainError, match="unknown optimizer 'nope'"):
        configurations(["nope"], [])
    with pytest.raises(EffitrainError, match="twice"):
        configurations(["adamw"], ["adamw"])


def _row(label, scale, steps):
    return {
        "label": label,
        "parameter_bytes": 3 * scale,
        "gradient_bytes": 3 * scale,
        "optimizer_state_bytes": 6 * scale,
        "activation_bytes": 2 * scale,
        "peak_tensor_bytes": 12 * scale,
        "loss_history": [{"step": s, "loss": 1.0 / s} for s in range(1, steps + 1)],
    }


@pytest.mark.slow
def test_plot_draws_the_json_numbers(tmp_path):
    data = {"rows": [_row("adamw", 2**30, 3), _row("adafactor +gradient-checkpointing", 2**29, 3)]}
    drawn = plot(data, tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 10_000
    assert drawn["unit"] == "GiB"
    for name, key in PARTS:
        assert drawn["bars"][name] == [row[key] / 2**30 for row in data["rows"]]
    assert drawn["peak_tensors"] == [12.0, 6.0]
    assert drawn["curves"]["adamw"] == ([1, 2, 3], [1.0, 0.5, 1 / 3])


def test_shared_arguments_default_and_given():
    from effitrain.cli.compare import shared_arguments

    assert shared_arguments({}) == [
        "--model", "distilbert-base", "--batch-size", "8", "--max-steps", "10", "--log-every", "1",
    ]  # fmt: skip
    given = shared_arguments({"max_steps": 5, "mixed_precision": "bf16", "packing": False})
    assert given[4:] == ["--max-steps", "5", "--mixed-precision", "bf16", "--no-packing",
                         "--log-every", "1"]  # fmt: skip
    assert "--max-steps" not in shared_arguments({"epochs": 1})  # epochs instead of 10 steps


def test_the_default_comparison_trains_stably():
    """With no options, the default three run at learning rates that keep the random-init
    distilbert-base shape from diverging, warming up over half the steps; --help says which.
    Other optimizers, another model or --lr: the optimizers' own defaults."""
    from effitrain.cli.compare import (
        DEFAULT_COMPARISON_LR,
        _configurations,
        _is_default_comparison,
        shared_arguments,
    )
    from effitrain.cli.optimizers import short_number

    assert _is_default_comparison(None, None, {}) and _is_default_comparison(
        None, None, {"max_steps": 20}
    )
    for optim, variants, given in [
        ("adamw", None, {}),
        (None, ["adamw"], {}),
        (None, None, {"model": "tiny"}),
        (None, None, {"lr": 1e-4}),
    ]:
        assert not _is_default_comparison(optim, variants, given)  # fmt: skip
    common = shared_arguments({}, default=True)
    assert common[-4:] == ["--warmup-ratio", "0.5", "--log-every", "1"]
    assert "--warmup-ratio" not in shared_arguments({"warmup_steps": 2}, default=True)
    rows = _configurations(None, None, common, 1, default=True)
    assert {row.label: row.args for row in rows} == {
        name: ["--optim", name, "--lr", short_number(lr)]
        for name, lr in DEFAULT_COMPARISON_LR.items()
    }
    text = " ".join(_compare_help().split())
    assert all(
        f"{name} {short_number(lr)}" in text for name, lr in DEFAULT_COMPARISON_LR.items()
    ), text


def _compare_help() -> str:
    from typer.testing import CliRunner

    from effitrain.cli import app

    return CliRunner().invoke(app, ["compare", "--help"], env={"COLUMNS": "200"}).stdout


def test_max_steps_is_the_option_train_knows(train_cli, monkeypatch, tmp_path):
    """`compare --max-steps 5` (as train spells it) reaches every run; nothing is run here."""
    import effitrain.cli.compare as cli_compare

    seen = {}

    def fake_run(rows, common, output_dir, repeats, model):
        seen.update(rows=[row.label for row in rows], common=common, model=model)
        raise SystemExit(0)

    monkeypatch.setattr(cli_compare, "_run", fake_run)
    args = ("compare", "--max-steps", "5", "--optim", "adamw,sgd", "--model", "tiny")
    assert train_cli(*args, "--output-dir", str(tmp_path)).returncode == 0
    assert seen["rows"] == ["adamw", "sgd"] and seen["model"] == "tiny"
    assert seen["common"][:6] == ["--model", "tiny", "--batch-size", "8", "--max-steps", "5"]


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--optim", "nope"], "unknown optimizer 'nope'"),
        (["--variant", "+lora-rank=4"], "--variant"),
        (["--repeats", "0"], "--repeats must be 1 or more"),
        (
            ["--variant", "adamw +no-such-flag"],
            "adamw +no-such-flag: no such option: --no-such-flag",
        ),
        (
            ["--variant", "adamw +lora-alpha=4"],
            "adamw +lora-alpha=4: --lora-alpha needs --lora-rank",
        ),
        (["--variant", "adamw +lr=-1"], "adamw +lr=-1: --lr must be greater than 0"),
        (["--optim", "adamw", "--batch-size", "0"], "adamw: --batch-size must be greater than 0"),
    ],
)
def test_errors_are_one_line_before_any_run(train_cli, tmp_path, args, error):
    """Each configuration's options are parsed and checked as its train run will, before any
    run starts: a typo fails at once, with its reason."""
    proc = train_cli("compare", "--model", "tiny", *args, "--output-dir", str(tmp_path / "out"))
    assert_clean_error(proc, error)
    assert not (tmp_path / "out").exists()


def test_a_childs_error_is_its_reason():
    typer_box = (
        "Usage: effitrain train [OPTIONS]\n"
        "Try 'effitrain train -h' for help.\n"
        "╭─ Error ─────────────────────────────╮\n"
        "│ No such option: --no-such-flag       │\n"
        "╰──────────────────────────────────────╯\n"
    )
    assert child_error(typer_box, 2) == "No such option: --no-such-flag"
    one_line = "Skipping a check\nerror: dataset file not found: x.csv\n"
    assert child_error(one_line, 1) == "dataset file not found: x.csv"
    traceback = "Traceback (most recent call last):\n  File 'x'\nRuntimeError: CUDA out of memory\n"
    assert child_error(traceback, 1) == "RuntimeError: CUDA out of memory"
    assert child_error("", -9) == "killed by SIGKILL (out of memory?)"
    assert child_error("", 3) == "exit code 3"


@pytest.mark.slow
def test_compare_runs_writes_and_reports_failures(train_cli, tmp_path):
    """Each configuration is its own ``effitrain train`` process; compare itself runs in this
    one (a process of its own paid the imports once more and proved nothing more)."""
    out = tmp_path / "cmp"
    proc = train_cli(
        "compare", "--model", "tiny", "--max-steps", "2", "--max-length", "32",
        "--optim", "adamw,sgd", "--variant", "adamw +validation-file=missing.csv",
        "--output-dir", str(out),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr  # one configuration failed, in its run
    label = "adamw +validation-file=missing.csv"
    assert "[1/3] adamw: running" in proc.stderr
    assert f"[3/3] {label}: failed (dataset file not found: missing.csv)" in proc.stderr
    assert f"failed: {label}: dataset file not found: missing.csv" in proc.stdout
    data = json.loads((out / "compare.json").read_text())
    assert [row["label"] for row in data["rows"]] == ["adamw", "sgd"]
    assert list(data["failed"]) == [label]
    for row in data["rows"]:
        (run,) = data["runs"][row["label"]]
        assert row["optimizer_state_bytes"] == run["optimizer_state"]["bytes"]
        assert row["peak_tensor_bytes"] == run["peak_tensor_bytes"]
        assert [p["step"] for p in row["loss_history"]] == [1, 2]
        assert json.loads((out / "runs" / f"1-{row['label']}.json").read_text()) == run
    adamw, sgd = data["rows"]
    assert sgd["optimizer_state_bytes"] < adamw["optimizer_state_bytes"]
    with (out / "compare.csv").open() as handle:
        lines = list(csv.DictReader(handle))
    assert [line["configuration"] for line in lines] == ["adamw", "sgd"]
    assert int(lines[1]["optimizer_state_bytes"]) == sgd["optimizer_state_bytes"]
    assert (out / "compare.png").stat().st_size > 10_000
    assert "optimizer state" in proc.stdout and "(0.50×)" in proc.stdout  # sgd: half of AdamW
    # The same model and batch: the same FLOPs (the optimizers' updates are elementwise).
    assert adamw["flops_per_step"] == sgd["flops_per_step"] == run["flops_per_step"] > 0
    assert "FLOPs/step" in proc.stdout and "TFLOP/s" in proc.stdout
    assert "MFU" not in proc.stdout and adamw["mfu"] is None  # no peak known for a CPU


def test_the_table_has_flops_and_mfu_where_a_peak_is_known():
    """FLOPs per step (with ratios), TFLOP/s, and MFU only where some run has one."""
    from rich.console import Console

    from effitrain.report.comparison_table import COLUMNS, comparison_table

    def row(label, flops, tflops, mfu):
        values = {key: None for _, key in COLUMNS}
        values.update(seconds_per_step=1.0, peak_tensor_bytes=2**20)
        return {**values, "label": label, "flops_per_step": flops,
                "achieved_tflops": tflops, "mfu": mfu}  # fmt: skip

    def render(rows):
        console = Console(width=200, record=True)
        console.print(comparison_table(rows))
        return console.export_text()

    text = render([row("a", 4e12, 4.0, None), row("b", 5e12, 5.0, None)])
    assert "4.0 TFLOP" in text and "5.0 TFLOP (1.25×)" in text and "TFLOP/s" in text
    assert "MFU" not in text
    text = render([row("a", 4e12, 4.0, 0.404), row("b", 5e12, 5.0, 0.505)])
    assert "40.4%" in text and "50.5%" in text


def test_a_preference_runs_reward_accuracy_is_a_row():
    """Read from the run's evaluation under TRL's name; absent for the other tasks."""
    from rich.console import Console

    from effitrain.comparison import Configuration, summarize
    from effitrain.report.comparison_table import comparison_table

    metrics = {
        "label": "adamw", "optimizer": "adamw", "optimizer_class": "torch.optim.AdamW",
        "parameter_bytes": 1, "gradient_bytes": 1, "peak_memory_bytes": 1,
        "peak_memory_kind": "rss", "seconds_per_step": 1.0, "train_loss": 0.5,
        "optimizer_state": {"bytes": 1, "elements": 1},
        "eval": {"loss": 0.4, "rewards/accuracies": 0.875},
    }  # fmt: skip
    row = summarize(Configuration("adamw"), [metrics])
    assert row["eval_reward_accuracy"] == 0.875 and row["eval_accuracy"] is None
    console = Console(width=200, record=True)
    console.print(comparison_table([row]))
    text = console.export_text()  # it empties the record
    assert "eval reward acc" in text and "0.875" in text


@pytest.mark.slow
def test_plot_says_what_bars_and_line_are_and_which_curves_coincide(tmp_path):
    """Two equal loss curves hid each other, one legend entry showing nothing; nothing said why
    bars stand above the peak line."""
    close = _row("lion", 2**29, 5)
    close["loss_history"][2]["loss"] *= 1.0005
    data = {"rows": [_row("adamw", 2**30, 5), _row("adamw-8bit", 2**29, 5), close]}
    data["rows"].append(_row("sgd", 2**29, 4))
    data["rows"][3]["loss_history"][1]["loss"] = 3.0  # a jump in 4 points
    drawn = plot(data, tmp_path / "c.png")
    assert drawn["curve_labels"] == [
        "adamw",
        "adamw-8bit (same losses as adamw)",
        "lion (losses within 0.1% of adamw)",
        "sgd",
    ]
    assert drawn["legend"][0] == "line: the step's peak (all at once)"
    assert (
        drawn["bars_title"]
        == "bars: each part at its own peak, stacked\n(so they can pass the line)"
    )
    assert drawn["loss_axis"] == pytest.approx(
        (0.0, 3.3)
    )  # few points: from 0, so a jump is seen at its size


def test_a_failed_runs_install_hint_keeps_its_extra(train_cli, monkeypatch, tmp_path):
    """The progress line read ``pip install 'effitrain'``: rich took ``[mini]`` for markup."""
    import effitrain.comparison as comparison

    hint = "optimizer 'adam-mini' needs the 'adam_mini' package: pip install 'effitrain[mini]'"
    monkeypatch.setattr(comparison, "run_one", lambda *args: (None, hint))
    proc = train_cli(
        "compare", "--optim", "adamw", "--model", "tiny", "--output-dir", str(tmp_path)
    )
    assert proc.returncode != 0
    assert f"[1/1] adamw: failed ({hint})" in proc.stderr
