"""``effitrain plan`` and ``effitrain train --max-memory``: sizes, the search on fake tensors,
what it prints, and that what it prints fits when run."""

from __future__ import annotations

import json
import shlex

import pytest

from tests.conftest import assert_clean_error

LM = ["--task", "causal-lm", "--model", "tiny-llama", "--max-length", "64"]


def searched_levers(*kept: str) -> str:
    """A --without value: every lever the plan searches (adapters aside), less ``kept``."""
    import effitrain.levers as levers

    return ",".join(
        lever.name
        for lever in levers.LEVERS.values()
        if lever.search is not None and not lever.trains_adapters and lever.name not in kept
    )


NO_LEVERS = searched_levers()
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


@pytest.mark.slow
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
@pytest.mark.parametrize(
    ("shape", "memory"),
    [(["--batch-size", "8", "--max-length", "256"], "20MiB")],
)  # fmt: skip
def test_what_the_plan_prints_fits_when_run(train_cli, monkeypatch, tmp_path, shape, memory):
    """A budget below the plain run's peak, verified in two spawned worker processes: every
    verified candidate's printed peak is the estimate this process makes for its printed
    command (the workers give the figures this process gives: the one ``train --max-memory``
    checks before it builds), and that command, run for two steps under ``--max-memory`` at
    the budget, trains and measures peak tensors within it. One plan for both claims: its
    search is the slow part. tiny-llama at 8 x 256 and 20 MiB printed adamw 2 x 4 at a
    screened 18.7 MiB; its own command with --max-memory 20MiB was refused (21.8 MB)."""
    import effitrain.budget
    import effitrain.plan_workers as plan_workers
    import effitrain.planning as planning
    from effitrain.config import parse_size

    # Verifications in worker processes at any size, two of them, as on a machine whose
    # estimates take seconds; every verification round is recorded with its parallelism.
    monkeypatch.setattr(plan_workers, "PARALLEL_FROM_SECONDS", 0.0)
    monkeypatch.setattr(plan_workers, "_cores", lambda: 2)
    rounds: list[tuple[int, int]] = []
    verify = planning._Search.verify

    def recorded(search, options):
        rounds.append((search.verifiers.parallel, len(options)))
        return verify(search, options)

    monkeypatch.setattr(planning._Search, "verify", recorded)
    # The train run's own estimate of its command, which --max-memory checks before the build.
    checked: list[int] = []
    check_budget = effitrain.budget.check_budget

    def recorded_check(*args):
        checked.append(check_budget(*args))
        return checked[-1]

    monkeypatch.setattr(effitrain.budget, "check_budget", recorded_check)
    proc = train_cli("plan", "--task", "causal-lm", "--model", "tiny-llama", *shape,
                     "--memory", memory, "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    parallel, count = rounds[0]
    assert parallel == 2 and count >= 3, rounds  # the first candidates verified side by side
    result = json.loads(proc.stdout)
    candidates = result["candidates"]
    verified = [c for c in candidates if c["verified"]]
    assert len(verified) >= 3 and candidates == verified
    searched = candidates + result["not_verified"]
    assert {c["full_parameter"] for c in searched} == {True, False}
    assert all(c["levers"] for c in searched)
    for number, candidate in enumerate(verified):
        args = shlex.split(candidate["command"])
        assert args[:2] == ["effitrain", "train"], candidate["command"]
        metrics = tmp_path / f"{number}.json"
        run = train_cli("train", *args[2:], "--quiet", "--max-steps", "2",
                        "--metrics-json", str(metrics), "--max-memory", memory)  # fmt: skip
        assert run.returncode == 0, (candidate["command"], run.stderr)
        assert checked == [candidate["peak_tensor_bytes"]], candidate["command"]
        checked.clear()
        measured = json.loads(metrics.read_text())["peak_tensor_bytes"]
        assert measured <= parse_size(memory, "--memory"), candidate


def test_max_memory_refuses_before_reading_weights(train_cli, monkeypatch, tmp_path):
    """The estimate refuses the run; the task's model loader is never called (the plan's
    suggestion left out: a plan that finds nothing tries every lever)."""
    import effitrain.budget
    from effitrain.tasks.causal_lm import CausalLMTask

    monkeypatch.setattr(effitrain.budget, "QUICK_PLAN_BYTES", 0)

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
    import effitrain.budget

    monkeypatch.setattr(effitrain.budget, "check_budget", lambda *args: 0)


def _peak(metrics) -> int:
    return json.loads(metrics.read_text())["peak_tensor_bytes"]


@pytest.mark.slow
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


# -- sizes, the model, the task ----------------------------------------------------------------


def test_a_size_below_one_byte_is_refused(train_cli):
    """0.0000001KiB is not a budget of 0 B: one line, for --memory and --max-memory alike."""
    from effitrain.cli.compare import train_config
    from effitrain.config import parse_size
    from effitrain.errors import EffitrainError

    assert parse_size("1B", "--memory") == 1
    with pytest.raises(EffitrainError, match="--max-memory '0.5B': less than one byte"):
        train_config(["--max-memory", "0.5B"])
    proc = train_cli("plan", *LM, "--memory", "0.0000001KiB")
    assert_clean_error(proc, "--memory '0.0000001KiB': less than one byte")


def test_no_such_model_folder(train_cli):
    """As estimate says it, not "no configuration can be estimated"."""
    assert_clean_error(
        train_cli("plan", "--model", "./nope", "--memory", "1GiB"),
        "cannot load model './nope': no such folder",
    )


def test_a_classifier_plan_names_no_causal_lm_lever(train_cli):
    proc = train_cli("plan", "--model", "tiny", "--max-length", "32", "--batch-size", "1", *ONE,
                     "--memory", "1GiB", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    candidates = json.loads(proc.stdout)["candidates"]
    assert candidates
    for candidate in candidates:
        assert "chunked-loss" not in candidate["levers"], candidate["levers"]
        assert "--chunked-loss" not in candidate["command"]


def test_fsdp2_yaml_says_what_the_checks_do():
    """configs/accelerate/fsdp2-full-shard.yaml's optimizer note: each optimizer it says runs
    is taken under FSDP2 by train's checks, each it says is refused is refused."""
    import re
    from pathlib import Path

    from effitrain.build import check_launch
    from effitrain.config import TrainConfig
    from effitrain.distributed import Launch
    from effitrain.errors import EffitrainError
    from effitrain.optim import OPTIMIZERS

    text = (Path(__file__).parents[1] / "configs/accelerate/fsdp2-full-shard.yaml").read_text()
    note = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    runs = re.search(r"Optimizers that run: (.*?)Refused before training:", note).group(1)
    refused = re.search(r"Refused before training: (.*?)Use ", note).group(1)

    def named(words: str) -> set[str]:
        return {w for w in re.findall(r"[\w-]+", words) if w in OPTIMIZERS}

    assert "adafactor" in named(runs) and "adamw-8bit" in named(refused)
    launch = Launch.described(2, "fsdp", "cuda")
    for name in named(runs):
        check_launch(TrainConfig(optim=name), launch)
    for name in named(refused):
        with pytest.raises(EffitrainError, match="cannot run under FSDP2"):
            check_launch(TrainConfig(optim=name), launch)


# -- a missing package costs only what needs it ------------------------------------------------

SMALL = ["--task", "causal-lm", "--model", "tiny-llama", "--batch-size", "1", "--max-length", "256"]
BF16_OR_NOTHING = ["--full-parameter", "--without", searched_levers("bf16-weights", "chunked-loss")]
"""A search of the bf16 weights alone: at 7 MiB only adafactor's bf16 weights fit (adamw's
need torch-optimi)."""


@pytest.mark.slow
def test_a_missing_package_costs_only_what_needs_it(train_cli, monkeypatch):
    """Without torch-optimi, adamw's bf16 weights are left out and said so; adafactor's (torch's
    own stochastic rounding) are screened on their own and fit (the reference optimizer's
    missing package dropped the lever set for every optimizer: "nothing fits")."""
    from tests.conftest import hide_package

    hide_package(monkeypatch, "optimi")
    proc = train_cli("plan", *SMALL, *BF16_OR_NOTHING, "--memory", "7MiB", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert [c["optimizer"] for c in result["candidates"]] == ["adafactor"]
    assert "--weights-dtype bf16" in result["candidates"][0]["command"]
    assert (
        "not tried for want of a package: pip install 'effitrain[bf16]' (torch-optimi) would "
        "add --weights-dtype bf16 with adamw" in result["notes"]
    )


def test_nothing_fits_names_what_installing_would_add(train_cli, monkeypatch):
    from tests.conftest import hide_package

    hide_package(monkeypatch, "optimi")
    hide_package(monkeypatch, "peft")
    proc = train_cli(
        "plan", *SMALL, "--without", searched_levers("bf16-weights", "chunked-loss"),
        "--optim", "adamw", "--memory", "1KiB",
    )  # fmt: skip
    assert_clean_error(
        proc,
        "nothing fits 1.0 KiB per device",
        "pip install 'effitrain[bf16]' (torch-optimi) would add --weights-dtype bf16 with adamw",
        "pip install 'effitrain[lora]' would add --lora-rank 16 with adamw",
    )


NO_WORKERS = """
import sys
import effitrain.plan_workers as plan_workers
plan_workers.PARALLEL_FROM_SECONDS = float("inf")  # every verification in this process
from effitrain.cli import main
main(sys.argv[1:])
"""


@pytest.mark.slow
def test_qwen_on_the_base_install_finds_what_fits(tmp_path):
    """The README's base install (+ the 8bit extra): no peft, torch-optimi, trl, torchao or the
    other optimizers' packages. Qwen2.5-0.5B at 3 GiB x 1024 tokens: adafactor fits. A fresh
    process, the packages hidden before anything imports; its verifications in that process
    (worker processes would each pay its imports again; they are
    :func:`test_what_the_plan_prints_fits_when_run`'s)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import OFFLINE

    hidden = ("peft", "optimi", "trl", "torchao", "lion_pytorch", "pytorch_optimizer",
              "apollo_torch", "adam_mini", "schedulefree", "liger_kernel", "cut_cross_entropy")  # fmt: skip
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in hidden)
    )
    path = [str(tmp_path), str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
    proc = subprocess.run(
        [sys.executable, "-c", NO_WORKERS, "plan", "--task", "causal-lm", "--model",
         "qwen2.5-0.5b", "--memory", "3GiB", "--batch-size", "1", "--max-length", "1024",
         "--json"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, **OFFLINE, "PYTHONPATH": os.pathsep.join(path)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["candidates"][0]["optimizer"] == "adafactor"
    assert result["candidates"][0]["peak_tensor_bytes"] <= 3 * 2**30
    assert any("effitrain[lora]" in note for note in result["notes"])


# -- every printed candidate runs under its budget -----------------------------------------------


def _trains_under(train_cli, command: str, memory: str) -> None:
    """``command`` (as the plan printed it) trains two steps under ``--max-memory memory``:
    not refused by the estimate before it, nor stopped by the measured step."""
    args = shlex.split(command)
    assert args[:2] == ["effitrain", "train"], command
    proc = train_cli("train", *args[2:], "--max-memory", memory, "--max-steps", "2", "--quiet")
    assert proc.returncode == 0, (command, proc.stderr)


@pytest.mark.slow
def test_only_verified_candidates_are_answers(train_cli):
    """With one answer asked for (``train --max-memory``'s advice), one candidate is verified,
    with fewer estimates: one of the full plan's answers (not always its first: a candidate
    ranked below it by its screen can verify faster, as adamw 2 x 1 does here, which the full
    plan's three verifications reach); the rest the screens pass are listed apart, not as
    answers; each answer trains under --max-memory at the plan's budget."""
    from rich.console import Console

    import effitrain.planning
    from effitrain.cli.compare import train_config
    from effitrain.distributed import Launch
    from effitrain.report.plan_table import print_plan

    options = [*LM, "--batch-size", "2"]

    def planned(**answers):
        return effitrain.planning.plan(
            train_config(options), Launch.described(1, "ddp", "cpu"), 2**30, workers=0,
            full_parameter=True, optimizers=["adamw", "adafactor"],
            without=NO_LEVERS.split(","), **answers,
        )  # fmt: skip

    result, every = planned(answers=1), planned()
    assert [c.verified for c in result.candidates] == [True]
    assert result.candidates[0].args in [c.args for c in every.candidates]
    assert result.estimates < every.estimates and len(every.candidates) >= 3
    assert result.not_verified and not any(c.verified for c in result.not_verified)
    for candidate in result.candidates:
        _trains_under(train_cli, shlex.join(["effitrain", "train", *options, *candidate.args]),
                      "1GiB")  # fmt: skip
    console = Console(record=True, width=200)
    print_plan(result, console)
    text = console.export_text()
    assert "Screened to fit but not verified" in text and "screened peak" in text
