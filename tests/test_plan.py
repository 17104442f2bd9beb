"""``effitrain plan`` and ``effitrain train --max-memory``: sizes, the search on fake tensors,
what it prints, and that what it prints fits when run."""

from __future__ import annotations

import json

import pytest

from tests.conftest import assert_clean_error

LM = ["--task", "causal-lm", "--model", "tiny-llama", "--max-length", "64"]
NO_LEVERS = "optimizer-in-backward,bf16-weights,chunked-loss,gradient-checkpointing,load-in-4bit"
ONE = ["--full-parameter", "--optim", "adamw", "--without", NO_LEVERS]
"""One lever set, one optimizer: a plan of one screen."""


def test_sizes():
    from effitrain.config import parse_size
    from effitrain.errors import EffitrainError

    assert parse_size("24GiB", "--memory") == 24 * 2**30
    assert parse_size("24GB", "--memory") == 24 * 10**9
    assert parse_size("512 MiB", "--memory") == 512 * 2**20
    assert parse_size("1.5gib", "--memory") == 3 * 2**29
    for bad in ("24", "24 gigs", "-1GiB", "0GB", ""):
        with pytest.raises(EffitrainError, match="--memory '.*': not a size"):
            parse_size(bad, "--memory")


def test_max_memory_is_an_option_of_the_table():
    from effitrain.cli.compare import train_config
    from effitrain.config import to_arguments
    from effitrain.errors import EffitrainError

    assert to_arguments({"max_memory": "24GiB"}) == ["--max-memory", "24GiB"]
    assert train_config(["--max-memory", "3GB"]).max_memory == "3GB"
    with pytest.raises(EffitrainError, match="--max-memory 'lots'"):
        train_config(["--max-memory", "lots"])


def test_nothing_fits(train_cli):
    """One line: the smallest peak found and how far over it is; a non-zero exit."""
    proc = train_cli("plan", *LM, "--batch-size", "1", *ONE, "--memory", "1KiB")
    assert_clean_error(proc, "nothing fits 1.0 KiB per device", "smallest peak found", "over")


def test_bad_options(train_cli):
    assert_clean_error(train_cli("plan", *LM, "--memory", "a lot"), "--memory 'a lot'")
    assert_clean_error(
        train_cli("plan", *LM, "--memory", "1GiB", "--without", "turbo"), "unknown lever 'turbo'"
    )
    assert_clean_error(
        train_cli("plan", *LM, "--memory", "1GiB", "--lora-rank", "8", "--full-parameter"),
        "--full-parameter contradicts --lora-rank",
    )


@pytest.mark.slow
def test_json_fields(train_cli):
    """A budget the plain run fits: one screen, three candidates verified."""
    proc = train_cli("plan", *LM, "--batch-size", "2", *ONE, "--memory", "1GiB", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["budget_bytes"] == 2**30 and result["margin_bytes"] == 0
    first = result["candidates"][0]
    expected = {"args", "command", "peak_tensor_bytes", "host_peak_bytes", "flops_per_step"}
    expected |= {"relative_step_time", "full_parameter", "verified", "levers"}
    assert expected <= set(first)
    assert first["verified"] and first["relative_step_time"] == 1.0 and first["full_parameter"]
    assert first["args"] == ["--optim", "adamw", "--batch-size", "2", "--grad-accum", "1"]
    assert first["command"].startswith("effitrain train --task causal-lm --model tiny-llama")
    assert first["command"].endswith(" ".join(first["args"]))
    assert first["flops_per_step"] > 0
    # The verifying estimate's host RAM: on the CPU, the step plus the libraries.
    assert first["host_peak_bytes"] > first["peak_tensor_bytes"]
    # micro-batch 1 x 2 is the same global batch, slower
    second = result["candidates"][1]
    assert second["args"][-4:] == ["--batch-size", "1", "--grad-accum", "2"]
    assert second["relative_step_time"] > 1.0


@pytest.mark.slow
def test_what_the_plan_prints_fits_when_run(train_cli, tmp_path):
    """A budget below the plain run's peak: every verified candidate, run for two steps,
    measures peak tensors within it, and its printed peak is ``estimate``'s for its command."""
    from effitrain.cli.compare import train_config
    from effitrain.estimation import estimate

    base = [*LM, "--batch-size", "2"]
    budget = 6 * 2**20
    proc = train_cli("plan", *base, "--memory", "6MiB", "--json")
    assert proc.returncode == 0, proc.stderr
    candidates = json.loads(proc.stdout)["candidates"]
    verified = [c for c in candidates if c["verified"]]
    assert len(verified) >= 3 and candidates[:3] == verified[:3]
    assert {c["full_parameter"] for c in candidates} == {True, False}
    assert all(c["levers"] for c in candidates)
    for number, candidate in enumerate(verified):
        args = [*base, *candidate["args"]]
        assert (
            estimate(train_config(args)).memory.peak_tensor_bytes
            == (candidate["peak_tensor_bytes"])
        )
        metrics = tmp_path / f"{number}.json"
        run = train_cli("train", "--quiet", "--max-steps", "2", *args, "--metrics-json", metrics)
        assert run.returncode == 0, run.stderr
        assert json.loads(metrics.read_text())["peak_tensor_bytes"] <= budget, candidate


def test_max_memory_refuses_before_reading_weights(train_cli, monkeypatch, tmp_path):
    """The estimate refuses the run; the task's model loader is never called (the plan's
    suggestion left out: a plan that finds nothing tries every lever)."""
    import effitrain.planning
    from effitrain.tasks.causal_lm import CausalLMTask

    monkeypatch.setattr(effitrain.planning, "QUICK_PLAN_BYTES", 0)

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(CausalLMTask, "load_model", no_weights)
    proc = train_cli("train", *LM, "--batch-size", "2", "--max-memory", "64KiB")
    assert_clean_error(
        proc, "--max-memory 64KiB: the estimated peak", "over; find one that fits: effitrain plan"
    )


def test_max_memory_stops_after_the_measured_step_with_a_checkpoint(
    train_cli, monkeypatch, tmp_path
):
    """The estimate fits; the measured step (the second: the first with optimizer state) does
    not: a checkpoint, one line, exit 1."""
    import effitrain.loop

    measured = effitrain.loop.measured_peak
    monkeypatch.setattr(
        effitrain.loop, "measured_peak", lambda run, progress: measured(run, progress) + 2**30
    )
    out = tmp_path / "out"
    proc = train_cli(
        "train", *LM, "--batch-size", "2", "--max-steps", "3", "--max-memory", "1GiB",
        "--output-dir", str(out),
    )  # fmt: skip
    line = assert_clean_error(proc, "--max-memory 1GiB: step 2 measured", "over; stopped")
    assert f"checkpoint: {out}" in line
    assert (out / "checkpoint-2").is_dir(), sorted(p.name for p in out.iterdir())


def _measured_only(monkeypatch):
    """``--max-memory`` decided by the measured step alone: the estimate before the build,
    which would refuse these budgets first, is left out."""
    import effitrain.planning

    monkeypatch.setattr(effitrain.planning, "check_budget", lambda *args: 0)


def _peak(metrics) -> int:
    return json.loads(metrics.read_text())["peak_tensor_bytes"]


def test_max_memory_measures_a_step_that_holds_the_optimizer_state(
    train_cli, monkeypatch, tmp_path
):
    """AdamW creates its state in the first step, whose backward then runs without it: a budget
    that the first step fits and every later step exceeds is refused at step 2."""
    _measured_only(monkeypatch)
    base = ["train", *LM, "--batch-size", "2", "--optim", "adamw", "--max-steps", "3", "--quiet"]
    metrics = tmp_path / "metrics.json"
    assert train_cli(*base, "--metrics-json", str(metrics)).returncode == 0
    budget = f"{_peak(metrics) - 1}B"  # the late step's breakdown, one byte under it
    proc = train_cli(*base, "--max-memory", budget)
    assert_clean_error(proc, f"--max-memory {budget}: step 2 measured", "1 B over; stopped")


@pytest.mark.slow
def test_max_memory_after_a_resume_measures_this_run(train_cli, monkeypatch, tmp_path):
    """A resume without the lever its checkpoint's run had (gradient checkpointing) measures its
    own step: the metrics JSON holds this run's peak, not the checkpoint's, and a budget between
    the two is refused."""
    import shutil

    _measured_only(monkeypatch)
    base = ["train", *LM, "--batch-size", "2", "--optim", "adamw", "--quiet"]
    out, copy = tmp_path / "out", tmp_path / "copy"
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    first = train_cli(
        *base, "--gradient-checkpointing", "--max-steps", "2", "--save-every", "1",
        "--output-dir", str(out), "--metrics-json", str(before),
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    shutil.copytree(out, copy)
    resume = [*base, "--max-steps", "4", "--resume", "latest"]
    resumed = train_cli(*resume, "--output-dir", str(out), "--metrics-json", str(after))
    assert resumed.returncode == 0, resumed.stderr
    assert _peak(after) > _peak(before)  # activations kept, no longer recomputed
    budget = f"{(_peak(before) + _peak(after)) // 2}B"
    proc = train_cli(*resume, "--output-dir", str(copy), "--max-memory", budget)
    assert_clean_error(proc, f"--max-memory {budget}: step 3 measured", "over; stopped")


@pytest.mark.slow
def test_verified_in_worker_processes_as_in_this_one():
    """Verifications side by side in spawned workers give the figures this process's estimate
    gives for the same options."""
    from effitrain.cli.compare import train_config
    from effitrain.distributed import Launch
    from effitrain.estimation import estimate
    from effitrain.planning import plan

    base = [*LM, "--batch-size", "2"]
    launch = Launch.described(1, "ddp", "cpu")
    result = plan(train_config(base), launch, 6 * 2**20, workers=2)
    verified = [c for c in result.candidates if c.verified]
    assert len(verified) >= 3 and result.candidates[:3] == verified[:3]
    for candidate in verified:
        here = estimate(train_config([*base, *candidate.args]), launch)
        assert here.memory.peak_tensor_bytes == candidate.peak_tensor_bytes, candidate.args
