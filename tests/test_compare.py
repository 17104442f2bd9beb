"""``effitrain compare``: configurations, the runs, the table and the files (JSON, CSV, PNG)."""

from __future__ import annotations

import csv
import json

import pytest

from effitrain.compare import PARTS, configurations, parse_variant, plot
from effitrain.errors import EffitrainError
from tests.conftest import assert_clean_error


def test_variants_become_train_options():
    row = parse_variant("adafactor +gradient-checkpointing +lora-rank=8")
    assert row.label == "adafactor +gradient-checkpointing +lora-rank=8"
    assert row.args == ["--optim", "adafactor", "--gradient-checkpointing", "--lora-rank", "8"]
    for bad in ("", "+gradient-checkpointing", "adamw gradient-checkpointing", "adamw +"):
        with pytest.raises(EffitrainError, match="--variant"):
            parse_variant(bad)


def test_default_is_the_course_comparison():
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


def test_plot_draws_the_json_numbers(tmp_path):
    data = {"rows": [_row("adamw", 2**30, 3), _row("adafactor +gradient-checkpointing", 2**29, 3)]}
    drawn = plot(data, tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 10_000
    assert drawn["unit"] == "GiB"
    for name, key in PARTS:
        assert drawn["bars"][name] == [row[key] / 2**30 for row in data["rows"]]
    assert drawn["peak_tensors"] == [12.0, 6.0]
    assert drawn["curves"]["adamw"] == ([1, 2, 3], [1.0, 0.5, 1 / 3])


def test_cli_errors_are_one_line(cli):
    assert_clean_error(cli("compare", "--optim", "nope"), "unknown optimizer 'nope'")
    assert_clean_error(cli("compare", "--steps", "2", "--epochs", "1"), "--steps or --epochs")
    assert_clean_error(cli("compare", "--variant", "+lora-rank=4"), "--variant")


@pytest.mark.slow
def test_compare_runs_writes_and_reports_failures(cli, tmp_path):
    out = tmp_path / "cmp"
    proc = cli(
        "compare", "--model", "tiny", "--steps", "2", "--max-length", "32",
        "--optim", "adamw,sgd", "--variant", "adamw +no-such-option",
        "--output-dir", str(out),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr  # one configuration failed
    assert (
        "[1/3] adamw: running" in proc.stderr
        and "[3/3] adamw +no-such-option: failed" in proc.stderr
    )
    assert "failed: adamw +no-such-option" in proc.stdout
    data = json.loads((out / "compare.json").read_text())
    assert [row["label"] for row in data["rows"]] == ["adamw", "sgd"]
    assert list(data["failed"]) == ["adamw +no-such-option"]
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
