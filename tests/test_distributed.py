"""Several processes under ``accelerate launch``: real two-process CPU runs (gloo) and the
sharding rules.

The two-process runs really start two processes (asserted through ``num_processes`` and the
``ranks`` list): a plain ``accelerate launch --cpu --num_processes 2`` would start one.
FSDP and DeepSpeed need GPUs under Accelerate, so their rules are tested on stand-in state
objects with the attributes :mod:`effitrain.distributed` reads; what those rules rely on
(FSDP1 flattens, FSDP2 DTensors crash Adafactor and bitsandbytes) is checked on real FSDP
over gloo by ``fsdp_facts.py``, which uses torch directly (test_fsdp2_optim.py, in the launch of
its own FSDP2 checks). Every two-process DDP ``effitrain train`` run of the suite (here, LoRA's,
the causal LM's and the tiled MLP's included), :func:`ddp_launch_runs`, runs in the suite's one
two-process launch (conftest's ``two_process_launch``, with test_fsdp2_optim.py's FSDP2 runs),
under the settings of ``cpu-2proc.yaml``'s launch.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from effitrain import distributed
from effitrain.errors import EffitrainError
from tests.conftest import OFFLINE, train_in_process

REPO = Path(__file__).resolve().parents[1]
CPU_CONFIG = REPO / "configs" / "accelerate" / "cpu-2proc.yaml"
BIN = Path(sys.executable).parent
# Global batch 16 either way: 2 processes x 8, or 1 process x 16.
STEPS = ("--max-steps", "6", "--log-every", "3", "--warmup-steps", "1", "--seed", "7")
# Adam-mini reads the model's structure (per-head and per-row blocks); under DDP, whose weights
# are replicated, it must still need no collective of its own.
OPTIM = ("--optim", "adam-mini")
BANNER = "effitrain · model"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(
    *args: str,
    no_python: bool = False,
    use_cpu_env: bool = True,
    timeout: int = 240,
    config: Path = CPU_CONFIG,
    script: Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """``accelerate launch`` two CPU processes running ``effitrain ARGS``.

    The config file is the shipped ``cpu-2proc.yaml`` unless ``config`` says otherwise; the
    port is a free one. ``no_python``: the console-script form (``--no_python effitrain …``)
    instead of ``-m effitrain …``; ``script``: a Python file to run instead (effitrain's CLI
    behind a harness, or a test script); ``extra_env``: more environment variables.
    ``use_cpu_env``: set ``ACCELERATE_USE_CPU=1``; without it, on a machine without GPUs,
    effitrain itself must put the processes on CPU (``distributed.cpu_for_launch``).
    """
    env = {k: v for k, v in os.environ.items() if k != "EFFITRAIN_DEBUG"}
    env.update({**OFFLINE, "COLUMNS": "200"})
    if use_cpu_env:
        env["ACCELERATE_USE_CPU"] = "1"
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    target = ["--no_python", "effitrain"] if no_python else ["-m", "effitrain"]
    if script is not None:
        target = [str(script)]
        env["PYTHONPATH"] = str(REPO)
    env.update(extra_env or {})
    # torchrun's agent makes a torchelastic_* folder for its logs in the temp folder: a private
    # one, removed after the launch, leaves none behind in the system's.
    scratch = tempfile.mkdtemp(prefix="effitrain-launch-")
    env["TMPDIR"] = scratch
    # Inductor's compile cache stays where it was (it lives in the temp folder by default).
    env.setdefault(
        "TORCHINDUCTOR_CACHE_DIR",
        str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"),
    )
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        *(("--num_processes", "2") if config != CPU_CONFIG else ()),
        "--main_process_port",
        str(free_port()),
        *target,
        *args,
    ]
    try:
        return subprocess.run(
            command, capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def load_parameters(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def max_abs_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def write_splits(folder: Path, name: str, splits) -> None:
    """A demo's ``train`` and ``validation`` splits as JSON-lines files in ``folder``."""
    for split in ("train", "validation"):
        splits[split].to_json(folder / f"{name}-{split}.jsonl", lines=True)


def split_files(folder: Path, name: str) -> list[str]:
    """The options that read :func:`write_splits`'s files."""
    return ["--train-file", str(folder / f"{name}-train.jsonl"),
            "--validation-file", str(folder / f"{name}-validation.jsonl")]  # fmt: skip


def write_sentence_pairs(folder: Path) -> None:
    """128 of the demo's sentence pairs to train on (8 global batches of 16: the 6 steps stay
    in one epoch) and 40 to evaluate (not a multiple of the global eval batch, 32): each run
    tokenizes 168 pairs, not the demo's 3,400."""
    from effitrain.demo import build_demo_dataset

    write_splits(folder, "sentences", build_demo_dataset(num_train=128, num_validation=40))


def sentence_files(folder: Path) -> list[str]:
    return split_files(folder, "sentences")


def two_process_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """The two-process Adam-mini run of :func:`ddp_runs` on :func:`sentence_files` in
    ``data``, saving at step 3, and its resume."""
    return ["train", "--model", str(model), *sentence_files(data), *OPTIM, *STEPS,
            "--batch-size", "8", "--output-dir", str(out / "run"), "--save-every", "3",
            "--metrics-json", str(out / "metrics.json"), *extra]  # fmt: skip


TOKEN_WEIGHTED = (
    "train", "--quiet", "--task", "causal-lm", "--no-packing", "--max-steps", "1",
    "--max-grad-norm", "0", "--warmup-steps", "0", "--optim", "sgd", "--lr", "0.5",
    "--no-memory-breakdown",
)  # fmt: skip
"""Causal LM on padded texts of very different lengths, one SGD step (plus model and data)."""
UNEVEN_LENGTHS = (60, 2, 3, 50, 1, 40, 2, 2)
TILED = ("--tiled-mlp", "--mlp-tiles", "3")
"""The tiled MLP in 3 tiles (its check under DDP: this module's shared launch)."""


def token_weighted_args(model: Path, uneven: Path, out: Path) -> list[str]:
    """:data:`TOKEN_WEIGHTED` on the texts of :data:`UNEVEN_LENGTHS` (train and validation)."""
    return [*TOKEN_WEIGHTED, "--model", str(model), "--train-file", str(uneven),
            "--validation-file", str(uneven), "--output-dir", str(out)]  # fmt: skip


LORA_DDP = (
    "--max-steps", "4", "--warmup-steps", "1", "--seed", "7",
    "--lora-rank", "4", "--lora-dropout", "0", "--lora-merge",
)  # fmt: skip
"""LoRA under DDP (plus the model): two processes x 8 or one process x 16."""


PREFERENCE = ["train", "--task", "preference", "--max-steps", "3", "--max-length", "40"]
"""DPO (precomputed reference), plus :func:`preference_files`: two processes x 4 pairs or one
x 8."""


def write_preference_pairs(folder: Path) -> None:
    """24 of the demo's pairs to train on (3 steps of 8) and 10 to evaluate (not a multiple of
    the global eval batch, 16): the reference pass reads 34 pairs, not the demo's 1,200."""
    from effitrain.demo.preference_pairs import build_demo_pairs

    write_splits(folder, "pairs", build_demo_pairs(num_train=24, num_validation=10))


def preference_files(folder: Path) -> list[str]:
    return split_files(folder, "pairs")


GRPO = [
    "train", "--task", "grpo", "--batch-size", "4", "--num-generations", "2",
    "--max-completion-length", "4", "--max-steps", "3", "--num-iterations", "2",
    "--scale-rewards", "batch", "--lr", "1e-2", "--warmup-steps", "0", "--log-every", "1",
    "--beta", "0.04",
]  # fmt: skip
"""GRPO on its demo, each generation serving 2 steps, the rewards scaled over the whole batch,
the KL to a frozen copy: two processes x one micro-batch of 2 prompts, or one process x two
accumulated."""


def ddp_launch_runs(
    tmp_path_factory, no_dropout_model_dir: Path, lm_model_dir: Path, fsdp_config: Path
) -> tuple[list[dict], SimpleNamespace]:
    """Every two-process DDP ``effitrain train`` run of these tests, as runs of the suite's one
    two-process launch (``conftest.two_process_launch``: a launch of ``fsdp_config``, each of
    these runs under the settings ``cpu-2proc.yaml``'s launch gives, :func:`ddp_settings`),
    each file of safetensors that a rank opens recorded (``tests/read_spy.py``):

    - ``two-proc``: an uninterrupted Adam-mini run with a checkpoint at step 3 (this and the
      other sequence-classification runs: on :func:`write_sentence_pairs`'s files);
    - ``two-proc-resumed``: the same run resumed from a copy of that checkpoint;
    - ``from-one-proc``: the same run resumed from a one-process run's step-3 checkpoint;
    - ``token-weighted``: one SGD step of two processes x two micro-batches of 2 uneven texts;
    - ``tiled``: the same step with ``--tiled-mlp`` (3 tiles);
    - ``ddp-lora``: LoRA under DDP (where peft is installed);
    - ``causal-lm``: the causal-LM task with a sample prompt;
    - ``preference``: DPO on 24 of the preference demo's pairs, its reference log-probs
      precomputed;
    - ``grpo``: GRPO on its demo;
    - ``refused``: ``--optimizer-in-backward``, which DDP refuses (last: it trains nothing).

    Without ``ACCELERATE_USE_CPU`` where there is no GPU: the config file alone must give two
    processes that train together. Returns the runs and what the tests read (``launched``: the
    launch, set once it ran).
    """
    import importlib.util

    from tests.test_causal_lm import SHORT, TEXT

    out = tmp_path_factory.mktemp("ddp")
    write_sentence_pairs(out)
    # One process x 8 x 2 accumulated, saving at step 3: the launch's two processes continue it.
    one = train_in_process(
        *two_process_args(no_dropout_model_dir, out, out / "one-proc", "--grad-accum", "2")
    )
    assert one.returncode == 0, one.stdout + one.stderr
    uneven = out / "uneven.jsonl"
    uneven.write_text(
        "".join(json.dumps({"text": " ".join(["word"] * n)}) + "\n" for n in UNEVEN_LENGTHS)
    )
    (out / "corpus.txt").write_text(TEXT)
    write_preference_pairs(out)
    model = str(no_dropout_model_dir)
    runs = [
        {"name": "two-proc", "args": two_process_args(no_dropout_model_dir, out, out / "two-proc")},
        {
            "name": "two-proc-resumed",
            "args": two_process_args(
                no_dropout_model_dir, out, out / "resumed", "--resume", "latest"
            ),
            "copy": [
                str(out / "two-proc" / "run" / "checkpoint-3"),
                str(out / "resumed" / "run" / "checkpoint-3"),
            ],
        },
        {
            "name": "from-one-proc",
            # The one-process command repeated under the launcher: --grad-accum 2 becomes 1.
            "args": two_process_args(
                no_dropout_model_dir,
                out,
                out / "from-one-proc",
                "--grad-accum",
                "2",
                "--resume",
                "latest",
            ),
            "copy": [
                str(out / "one-proc" / "run" / "checkpoint-3"),
                str(out / "from-one-proc" / "run" / "checkpoint-3"),
            ],
        },
        {
            "name": "token-weighted",
            "args": [
                *token_weighted_args(lm_model_dir, uneven, out / "token-weighted"),
                "--batch-size",
                "2",
                "--grad-accum",
                "2",
            ],  # fmt: skip
        },
        {
            "name": "causal-lm",
            "args": [
                "train",
                "--task",
                "causal-lm",
                "--dataset",
                str(out / "corpus.txt"),
                "--max-steps",
                "3",
                "--sample-prompt",
                "The river town",
                "--metrics-json",
                str(out / "causal-lm.json"),
                "--output-dir",
                str(out / "causal-lm"),
                "--max-memory",
                "1GiB",
                *SHORT,
            ],  # fmt: skip
        },
    ]
    # Not quiet: its banner's lever line is checked (test_tiled_mlp.py's runs are quiet).
    tiled = [a for a in token_weighted_args(lm_model_dir, uneven, out / "tiled") if a != "--quiet"]
    runs.append(
        {"name": "tiled", "args": [*tiled, "--batch-size", "2", "--grad-accum", "2", *TILED,
                                   "--metrics-json", str(out / "tiled.json")]}
    )  # fmt: skip
    preference = [*PREFERENCE, *preference_files(out), "--batch-size", "4",
                  "--output-dir", str(out / "preference")]  # fmt: skip
    runs.append(
        {"name": "preference", "args": [*preference, "--metrics-json", str(out / "pref.json")]}
    )
    grpo = [*GRPO, "--output-dir", str(out / "grpo")]
    runs.append({"name": "grpo", "args": [*grpo, "--metrics-json", str(out / "grpo.json")]})
    if importlib.util.find_spec("peft") is not None:
        lora = ["train", "--model", model, *sentence_files(out), *LORA_DDP, "--batch-size", "8"]
        runs.append({"name": "ddp-lora", "args": [*lora, "--output-dir", str(out / "lora")]})
    refused = ["train", "--optimizer-in-backward", "--max-steps", "1", "--model", model]
    runs.append({"name": "refused", "args": [*refused, "--output-dir", str(out / "refused")]})
    settings = ddp_settings(fsdp_config)
    runs = [{**run, **settings} for run in runs]
    return runs, SimpleNamespace(
        launched=None, out=out, uneven=uneven, model=no_dropout_model_dir, lm=lm_model_dir
    )


def ddp_settings(config: Path) -> dict:
    """``env`` and ``unset`` that make a run of a two-process launch of ``config`` a run of
    ``cpu-2proc.yaml``'s launch: its variables, by accelerate's own parsing, and none of the
    others (nor ``ACCELERATE_USE_CPU`` where there is no GPU, as :func:`launch` leaves it)."""
    import torch

    ddp = launch_environment(["--config_file", str(CPU_CONFIG)])
    other = launch_environment(["--config_file", str(config), "--num_processes", "2"])
    unset = set(other) - set(ddp)
    if not torch.cuda.is_available():
        unset.add("ACCELERATE_USE_CPU")
    return {"env": ddp, "unset": sorted(unset)}


def launch_environment(words: list[str]) -> dict[str, str]:
    """The variables that ``accelerate launch WORDS`` sets for its processes (two or more), by
    accelerate's own parsing and environment (as test_plan_launch.py reads a printed command)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args([*words, "script.py"])
    args, _, _ = _validate_launch_command(args)
    before = dict(os.environ)
    return {k: v for k, v in prepare_multi_gpu_env(args).items() if before.get(k) != v}


@pytest.fixture(scope="module")
def ddp_runs(two_process_launch):
    """:func:`ddp_launch_runs`' runs, run (conftest's ``two_process_launch``)."""
    return two_process_launch.ddp


@pytest.fixture(scope="module")
def two_process_run(ddp_runs):
    """The ``two-proc`` run of :func:`ddp_runs`: its folder, metrics and printed output."""
    ddp_runs.launched.assert_ran("two-proc")
    out = ddp_runs.out / "two-proc"
    return SimpleNamespace(
        out=out,
        data=ddp_runs.out,
        spy=ddp_runs.launched.out,
        stdout=ddp_runs.launched.stdout("two-proc"),
        metrics=json.loads((out / "metrics.json").read_text()),
    )


@pytest.mark.slow
def test_a_refused_launch_prints_one_error_line(ddp_runs):
    """Every process meets DDP's refusal of ``--optimizer-in-backward``: each exits 1, only
    the main one prints, and it prints the one line and nothing else."""
    ddp_runs.launched.assert_ran("refused", codes=(1, 1))
    rank0, rank1 = (ddp_runs.launched.out / f"refused.rank{rank}.stderr" for rank in (0, 1))
    assert rank0.read_text() == (
        "error: --optimizer-in-backward cannot run on DDP over 2 processes (gloo): each update "
        "runs as soon as this process's gradient is ready, before the processes average their "
        "gradients; run one process, or drop --optimizer-in-backward\n"
    )
    assert rank1.read_text() == ""
    assert ddp_runs.launched.stdout("refused") == ""  # nothing built or printed before it


@pytest.mark.slow
def test_the_console_script_under_a_launch_prints_its_error_first():
    """The console-script form (``--no_python effitrain``), which the shared launch of
    :func:`ddp_runs` does not use: the launch fails with the main process's one error line
    first in its stderr, before the launcher's own report of the failed processes (torchrun
    prints it for any failed child). A refusal of the options, made before torch is imported,
    keeps the two processes' start-up light (the DDP refusal itself: the shared launch)."""
    proc = launch("train", "--tiled-mlp", no_python=True)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: --tiled-mlp needs --task causal-lm or preference or grpo (this run is "
        "sequence-classification); drop it"
    ]
    assert proc.stderr.startswith(errors[0])


def test_a_sharding_refusal_comes_before_any_data_or_model_is_loaded(monkeypatch):
    """FSDP refuses a whole-matrix optimizer from the accelerator's state alone."""
    from effitrain import build
    from effitrain.report.live import Reporter

    def loaded(*_args, **_kwargs):
        raise AssertionError("the model or data was loaded before the refusal")

    # What reads the data, the tokenizer or the model: the task (its load_data follows it),
    # the tokenizer and the model's loader.
    for name in ("resolve_task", "load_tokenizer", "build_model"):
        monkeypatch.setattr(build, name, loaded)
    accelerator = SimpleNamespace(state=fsdp(1), num_processes=2, is_main_process=True)
    monkeypatch.setattr(build, "build_accelerator", lambda config: accelerator)
    config = build.checked_config(None, {"optim": "muon"})
    with pytest.raises(EffitrainError, match="--optim muon cannot run under FSDP"):
        build.build_run(config, Reporter(quiet=True))


@pytest.fixture(scope="module")
def one_big_batch(ddp_runs, tmp_path_factory) -> dict:
    """The weights one process reaches with one batch of the 8 uneven texts (no tiling)."""
    import torch

    out = tmp_path_factory.mktemp("one-big-batch")
    one = train_in_process(
        *token_weighted_args(ddp_runs.lm, ddp_runs.uneven, out), "--batch-size", "8"
    )
    assert one.returncode == 0, one.stdout + one.stderr
    single = load_parameters(out / "final")
    start = load_parameters(ddp_runs.lm)
    assert any(not torch.equal(single[k], start[k]) for k in start if "mlp" in k)  # it stepped
    return single


@pytest.mark.slow
def test_token_weighted_loss_over_two_processes_equals_one_big_batch(ddp_runs, one_big_batch):
    """Causal LM on padded texts of very different lengths: two processes x two micro-batches
    of 2 step to the same weights as one process with one batch of the same 8 texts (each
    labelled token weighs the same, wherever it falls)."""
    import torch

    ddp_runs.launched.assert_ran("token-weighted")
    two = load_parameters(ddp_runs.out / "token-weighted" / "final")
    assert two.keys() == one_big_batch.keys()
    for key, single in one_big_batch.items():
        torch.testing.assert_close(two[key], single, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_tiled_mlp_under_two_processes_steps_as_one_big_batch(ddp_runs, one_big_batch):
    """``--tiled-mlp`` under DDP: each trained parameter's gradient is accumulated once per
    backward (the tiled Function returns the sums), so DDP's reducer averages it once: two
    processes x two micro-batches of 2 uneven texts, each MLP in 3 tiles, step to the weights
    one untiled process reaches with the 8 (the tiling is exact: tests/test_tiled_mlp.py).
    The run reports the lever: its banner line, once, and in the metrics."""
    import torch

    ddp_runs.launched.assert_ran("tiled")
    stdout = ddp_runs.launched.stdout("tiled")
    assert stdout.count("  lever     tiled MLP: 2 MLPs over 3 tiles of the sequence") == 1
    assert stdout.count("Per rank: DDP over 2 processes") == 1
    assert "tiled-mlp" in json.loads((ddp_runs.out / "tiled.json").read_text())["levers"]
    two = load_parameters(ddp_runs.out / "tiled" / "final")
    assert two.keys() == one_big_batch.keys()
    for key, single in one_big_batch.items():
        torch.testing.assert_close(two[key], single, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_two_processes_match_one_process(
    two_process_run, no_dropout_model_dir, train_cli, tmp_path
):
    from tests.read_spy import reads

    run = two_process_run
    data = run.metrics
    # Two real processes, each on its half of every global batch.
    assert data["num_processes"] == 2
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert data["sharding"]["kind"] == "ddp" and "gloo" in data["sharding"]["description"]
    assert data["mixed_precision"] == "no"  # cpu-2proc.yaml's, not the shared launch's FSDP bf16
    first, second = data["ranks"]
    assert first["parameter_checksum"] == second["parameter_checksum"]
    # Only the main process read the checkpoint: DDP's wrap sent rank 1, built empty, its
    # parameters and buffers (the equality with one process below says they arrived).
    assert reads(run.spy, 0, "two-proc") == [str(no_dropout_model_dir / "model.safetensors")]
    assert reads(run.spy, 1, "two-proc") == []
    assert [first["weights"], second["weights"]] == ["read", "from rank 0"]
    assert first["optimizer_state_bytes"] == second["optimizer_state_bytes"] > 0
    assert data["ranks_total"]["optimizer_state_bytes"] == 2 * first["optimizer_state_bytes"]
    # Every validation example counted once (40 is not a multiple of the global eval batch 32).
    assert data["eval"]["examples"] == 40
    # samples/s counts both ranks: 6 steps x global batch 16.
    assert data["samples_per_second"] * data["train_seconds"] == pytest.approx(6 * 16)

    # Printed once (by both ranks together): one banner, one summary, one per-rank table.
    text = run.stdout
    assert text.count(BANNER) == 1, text
    assert text.count("step 3/6") == 1 and text.count("step 6/6") == 1
    assert text.count("done ·") == 1 and text.count("Per rank: DDP over 2 processes") == 1

    one = train_cli(
        "train",
        "--model",
        str(no_dropout_model_dir),
        *sentence_files(run.data),
        *OPTIM,
        *STEPS,
        "--batch-size",
        "16",
        "--output-dir",
        str(tmp_path / "run"),
        "--metrics-json",
        str(tmp_path / "metrics.json"),
    )
    assert one.returncode == 0, one.stdout + one.stderr
    single = json.loads((tmp_path / "metrics.json").read_text())
    assert single["num_processes"] == 1 and single["ranks"][0]["rank"] == 0
    difference = max_abs_difference(
        load_parameters(run.out / "run" / "final"), load_parameters(tmp_path / "run" / "final")
    )
    assert difference < 1e-5
    # The logged loss is the mean over ranks: the same as one process over the whole batch.
    assert data["train_loss"] == pytest.approx(single["train_loss"], abs=1e-5)
    assert data["eval"]["loss"] == pytest.approx(single["eval"]["loss"], abs=1e-5)
    assert first["parameter_checksum"] == pytest.approx(
        single["ranks"][0]["parameter_checksum"], abs=1e-3
    )


@pytest.mark.slow
def test_two_process_resume_is_exact(ddp_runs, two_process_run):
    """Resume the step-3 checkpoint with two processes: same weights."""
    ddp_runs.launched.assert_ran("two-proc-resumed")
    out = ddp_runs.out / "resumed"
    assert ddp_runs.launched.stdout("two-proc-resumed").count("resumed from") == 1
    resumed = json.loads((out / "metrics.json").read_text())
    assert resumed["num_processes"] == 2 and len(resumed["ranks"]) == 2
    assert resumed["global_steps"] == 6
    difference = max_abs_difference(
        load_parameters(two_process_run.out / "run" / "final"),
        load_parameters(out / "run" / "final"),
    )
    assert difference == 0.0
    checksums = {r["parameter_checksum"] for r in resumed["ranks"]}
    assert checksums == {two_process_run.metrics["ranks"][0]["parameter_checksum"]}


def logged_lr(stdout: str) -> dict[int, str]:
    """The lr each progress line printed, by step."""
    found = re.findall(r"^step (\d+)/\d+ .* lr (\S+) ", stdout, flags=re.MULTILINE)
    return {int(step): lr for step, lr in found}


@pytest.mark.slow
def test_one_process_continues_a_two_process_run(ddp_runs, two_process_run, train_cli, tmp_path):
    """The two-process run's step-3 checkpoint finished by one process: the accumulation
    doubles to keep the global batch, the lr continues the schedule (it was 0 from the resume
    on: the scheduler counted both processes' steps), and the weights end as the uninterrupted
    two-process run's (no dropout)."""
    out = tmp_path / "out"
    (out / "run").mkdir(parents=True)
    shutil.copytree(two_process_run.out / "run" / "checkpoint-3", out / "run" / "checkpoint-3")
    args = two_process_args(
        ddp_runs.model, ddp_runs.out, out, "--resume", "latest", "--log-every", "1"
    )
    proc = train_cli(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "has 1: --grad-accum 2 keeps its global batch of 16" in proc.stdout
    assert "not an exact continuation" not in proc.stdout
    lr = logged_lr(proc.stdout)
    base = json.loads((out / "metrics.json").read_text())["lr"]
    # warmup 1, linear to 0 at step 6: the lr after step k is base x (6 - k) / 5.
    assert lr == {k: f"{base * (6 - k) / 5:.2e}" for k in (4, 5, 6)}
    assert logged_lr(two_process_run.stdout)[6] == lr[6]
    difference = max_abs_difference(
        load_parameters(two_process_run.out / "run" / "final"),
        load_parameters(out / "run" / "final"),
    )
    assert difference < 1e-5


@pytest.mark.slow
def test_two_processes_continue_a_one_process_run(ddp_runs, two_process_run):
    """A one-process run (8 x 2 accumulated) continued by two processes (8 each): the same
    global batch, the same schedule, the weights of the uninterrupted two-process run; the
    second process has no random state of its own in the checkpoint, and says so."""
    ddp_runs.launched.assert_ran("from-one-proc")
    stdout = ddp_runs.launched.stdout("from-one-proc")
    assert "has 2: --grad-accum 1 keeps its global batch of 16" in stdout
    assert "process 1 has no random state in a checkpoint of 1 process(es)" in stdout
    assert "random_states_1.pkl is missing" not in stdout
    assert logged_lr(stdout)[6] == logged_lr(two_process_run.stdout)[6]
    difference = max_abs_difference(
        load_parameters(two_process_run.out / "run" / "final"),
        load_parameters(ddp_runs.out / "from-one-proc" / "run" / "final"),
    )
    assert difference < 1e-5


@pytest.mark.slow
def test_lora_with_two_ddp_processes_matches_one_process(ddp_runs, train_cli, tmp_path):
    """DDP (not refused): two CPU processes train the same adapters as one process."""
    pytest.importorskip("peft")
    import torch
    from safetensors.torch import load_file

    ddp_runs.launched.assert_ran("ddp-lora")
    assert ddp_runs.launched.stdout("ddp-lora").count("  lever     LoRA r=4") == 1
    one = train_cli(
        "train", "--model", str(ddp_runs.model), *sentence_files(ddp_runs.out), *LORA_DDP,
        "--batch-size", "16",
        "--output-dir", str(tmp_path / "one"),
    )  # fmt: skip
    assert one.returncode == 0, one.stdout + one.stderr
    for folder, name in (
        ("final", "adapter_model.safetensors"),
        ("final-merged", "model.safetensors"),
    ):
        a = load_file(ddp_runs.out / "lora" / folder / name)
        b = load_file(tmp_path / "one" / folder / name)
        assert max_abs_difference(a, b) < 1e-5, folder
    adapters = load_file(tmp_path / "one" / "final" / "adapter_model.safetensors")
    assert any("lora_B" in k and torch.count_nonzero(v) for k, v in adapters.items())


@pytest.mark.slow
def test_causal_lm_under_two_processes(ddp_runs):
    """``--task causal-lm`` with a sample prompt: both ranks train, the main one prints. Under
    ``--max-memory``: the estimate before the first step is made in one process for the launch
    (it joined the launch's process group with fake tensors: "cannot estimate --optim adamw on
    fake tensors")."""
    ddp_runs.launched.assert_ran("causal-lm")
    metrics = json.loads((ddp_runs.out / "causal-lm.json").read_text())
    assert metrics["num_processes"] == 2 and metrics["task"] == "causal-lm"
    assert len(metrics["ranks"]) == 2
    stdout = ddp_runs.launched.stdout("causal-lm")
    assert stdout.count("perplexity") >= 1 and stdout.count("sample ") == 1  # main only
    assert (ddp_runs.out / "causal-lm" / "final" / "model.safetensors").exists()


@pytest.mark.slow
def test_preference_under_two_processes_matches_one_process(ddp_runs, train_cli, tmp_path):
    """DPO with the reference precomputed (each process its share of the pass, the table
    gathered), on 24 of the demo's pairs: the same weights, losses and rewards as one process
    on the whole batch."""
    ddp_runs.launched.assert_ran("preference")
    data = json.loads((ddp_runs.out / "pref.json").read_text())
    assert data["num_processes"] == 2 and data["reference"]["how"] == "precompute"
    assert ddp_runs.launched.stdout("preference").count("eval (") == 1  # main only
    one = train_cli(
        *PREFERENCE, *preference_files(ddp_runs.out), "--batch-size", "8",
        "--output-dir", str(tmp_path / "one"), "--metrics-json", str(tmp_path / "one.json"),
    )  # fmt: skip
    assert one.returncode == 0, one.stderr
    single = json.loads((tmp_path / "one.json").read_text())
    assert data["eval"]["pairs"] == single["eval"]["pairs"] == 10  # each counted once
    for key in ("loss", "rewards/accuracies", "rewards/margins"):
        assert data["eval"][key] == pytest.approx(single["eval"][key], abs=1e-5), key
    assert data["train_loss"] == pytest.approx(single["train_loss"], abs=1e-5)
    difference = max_abs_difference(
        load_parameters(ddp_runs.out / "preference" / "final"),
        load_parameters(tmp_path / "one" / "final"),
    )
    assert difference < 1e-5


@pytest.mark.slow
def test_grpo_under_two_processes_matches_one_process(ddp_runs, train_cli, tmp_path):
    """Each micro-batch's completions are sampled from its place in the global batch, wherever
    it runs: two processes draw the completions one process draws from the same prompts, and
    train to the same weights, rewards, losses, clipped shares and KL (the rewards gathered for
    the batch's std, the dapo token mean and the KL's over both processes' tokens)."""
    ddp_runs.launched.assert_ran("grpo")
    data = json.loads((ddp_runs.out / "grpo.json").read_text())
    assert data["num_processes"] == 2
    one = train_cli(
        *GRPO, "--grad-accum", "2", "--output-dir", str(tmp_path / "one"),
        "--metrics-json", str(tmp_path / "one.json"),
    )  # fmt: skip
    assert one.returncode == 0, one.stdout + one.stderr
    single = json.loads((tmp_path / "one.json").read_text())
    assert data["reward_history"] == single["reward_history"]  # the same completions
    assert len(data["loss_history"]) == len(single["loss_history"]) == 3
    for two_step, one_step in zip(data["loss_history"], single["loss_history"], strict=True):
        assert two_step.keys() == one_step.keys()
        for key, value in one_step.items():
            assert two_step[key] == pytest.approx(value, abs=1e-6), key
    assert data["loss_history"][1]["clip_ratio/region_mean"] > 0  # the ratio moved
    assert data["loss_history"][2]["kl"] > 0  # the policy moved from the copy
    for key in ("reward", "completions/mean_length"):
        assert data["eval"][key] == pytest.approx(single["eval"][key], abs=1e-6), key
    difference = max_abs_difference(
        load_parameters(ddp_runs.out / "grpo" / "final"),
        load_parameters(tmp_path / "one" / "final"),
    )
    assert difference < 1e-6


# --------------------------------------------------------------------------------------------
# The sharding rules, on stand-in Accelerate state objects
# --------------------------------------------------------------------------------------------


def fake_state(kind: str = "NO", num_processes: int = 2, **extra) -> SimpleNamespace:
    """What :func:`distributed.detect_sharding` reads from an ``AcceleratorState``."""
    return SimpleNamespace(
        distributed_type=kind, num_processes=num_processes, backend="nccl", **extra
    )


def fsdp(version: int, use_orig_params: bool = True) -> SimpleNamespace:
    return fake_state(
        "FSDP",
        fsdp_plugin=SimpleNamespace(
            fsdp_version=version,
            use_orig_params=use_orig_params,
            reshard_after_forward=True if version == 2 else None,
            sharding_strategy=SimpleNamespace(name="FULL_SHARD") if version == 1 else None,
        ),
    )


def deepspeed(stage: int = 2, **ds_config) -> SimpleNamespace:
    ds_config.setdefault("zero_optimization", {"stage": stage})
    return fake_state(
        "DEEPSPEED",
        deepspeed_plugin=SimpleNamespace(zero_stage=stage, deepspeed_config=ds_config),
    )


@pytest.fixture(autouse=True)
def plain_launch_environment(monkeypatch):
    """Unit tests below must not see the launcher's variables of an outer run."""
    for name in ("WORLD_SIZE", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("state", "kind", "description"),
    [
        (fake_state("NO", 1), "single", "single process"),
        (fake_state("MULTI_GPU"), "ddp", "DDP over 2 processes (nccl)"),
        (fake_state("MULTI_CPU"), "ddp", "DDP over 2 processes"),
        (fsdp(1), "fsdp1", "FSDP1 FULL_SHARD, use_orig_params=True"),
        (fsdp(2), "fsdp2", "FSDP2 full shard"),
        (deepspeed(3), "deepspeed", "DeepSpeed ZeRO-3"),
    ],
)
def test_detect_sharding(state, kind, description):
    sharding = distributed.detect_sharding(state)
    assert sharding.kind == kind
    assert description in sharding.description
    assert sharding.flat_params == (kind in ("fsdp1", "deepspeed"))
    assert sharding.dtensor_params == (kind == "fsdp2")


def test_real_accelerator_state_is_read():
    from accelerate import Accelerator

    from tests.conftest import _reset_accelerate

    _reset_accelerate()
    try:
        sharding = distributed.detect_sharding(Accelerator(cpu=True).state)
    finally:
        _reset_accelerate()
    assert (sharding.kind, sharding.num_processes) == ("single", 1)


@pytest.mark.parametrize("optim", ["adamw", "sgd", "adafactor", "adafactor-hf", "adamw-8bit"])
def test_ddp_accepts_every_optimizer_silently(optim):
    assert distributed.optimizer_notes(fake_state("MULTI_GPU"), optim) == []


@pytest.mark.parametrize(
    ("optim", "library", "alternative"),
    [
        ("adamw-8bit", "bitsandbytes' 8-bit AdamW", "use --optim adamw-8bit-ao"),
        ("lion-8bit", "bitsandbytes' 8-bit Lion", "use --optim lion (its"),
    ],
)
def test_fsdp2_refuses_dtensor_incompatible_optimizers(optim, library, alternative):
    with pytest.raises(EffitrainError) as error:
        distributed.optimizer_notes(fsdp(2), optim)
    message = str(error.value)
    assert "\n" not in message
    assert f"--optim {optim} cannot run under FSDP2" in message
    assert library in message and "DTensor" in message
    assert "DDP (accelerate launch --multi_gpu)" in message and alternative in message


@pytest.mark.parametrize(
    "optim", ["adamw", "sgd", "lion", "adamw-schedule-free", "adafactor", "adafactor-hf", "came"]
)
def test_fsdp2_accepts_elementwise_and_factored_optimizers(optim):
    assert distributed.optimizer_notes(fsdp(2), optim) == []


@pytest.mark.parametrize("optim", ["adafactor", "adafactor-hf", "came"])
def test_fsdp1_warns_that_adafactor_keeps_a_full_second_moment(optim):
    (note,) = distributed.optimizer_notes(fsdp(1), optim)
    assert "FSDP1" in note and "flattened 1-D" in note and "full second moment" in note
    assert "use FSDP2 (fsdp_version: 2) or DDP" in note
    assert ("as much as AdamW" if optim == "came" else "half of AdamW") in note


@pytest.mark.parametrize(
    "optim", ["adamw", "adamw-8bit", "sgd", "lion", "lion-8bit", "adamw-schedule-free"]
)
def test_fsdp1_keeps_elementwise_optimizers_quiet(optim):
    assert distributed.optimizer_notes(fsdp(1), optim) == []


def test_fsdp1_without_orig_params_is_refused():
    with pytest.raises(EffitrainError, match="nothing would train.*fsdp_use_orig_params: true"):
        distributed.optimizer_notes(fsdp(1, use_orig_params=False), "adamw")


@pytest.mark.parametrize("optim", ["adafactor", "adafactor-hf", "came"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_warns_that_adafactor_keeps_a_full_second_moment(optim, stage):
    (note,) = distributed.optimizer_notes(deepspeed(stage), optim)
    assert f"ZeRO-{stage}" in note and "flat 1-D partitions" in note
    assert "full second moment" in note


@pytest.mark.parametrize("optim", ["adamw", "adamw-8bit", "sgd", "lion", "adamw-schedule-free"])
def test_deepspeed_keeps_elementwise_optimizers_quiet(optim):
    assert distributed.optimizer_notes(deepspeed(2), optim) == []


@pytest.mark.parametrize("section", ["optimizer", "scheduler"])
def test_deepspeed_config_with_its_own_optimizer_or_scheduler_is_refused(section):
    state = deepspeed(2, **{section: {"type": "AdamW"}})
    with pytest.raises(EffitrainError, match=f"own '{section}' section.*remove that section"):
        distributed.optimizer_notes(state, "adamw")


def test_deepspeed_untested_optimizer_false_is_refused():
    state = deepspeed(2, zero_allow_untested_optimizer=False)
    with pytest.raises(EffitrainError, match="zero_allow_untested_optimizer: false"):
        distributed.optimizer_notes(state, "adamw")


def test_deepspeed_optimizer_offload_is_refused_unless_forced():
    offload = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    with pytest.raises(EffitrainError, match="offload_optimizer to cpu.*CPU Adam"):
        distributed.optimizer_notes(deepspeed(2, zero_optimization=offload), "adamw")
    state = deepspeed(2, zero_optimization=offload, zero_force_ds_cpu_optimizer=False)
    (note,) = distributed.optimizer_notes(state, "adamw")
    assert "offloads the optimizer to cpu" in note


def test_configure_deepspeed_readies_a_client_optimizer():
    state = deepspeed(2, train_micro_batch_size_per_gpu="auto", train_batch_size="auto")
    assert distributed.optimizer_notes(state, "adamw-8bit") == []
    distributed.configure_deepspeed(state, batch_size=8, grad_accum=2)
    ds_config = state.deepspeed_plugin.deepspeed_config
    assert ds_config["zero_allow_untested_optimizer"] is True
    assert ds_config["train_micro_batch_size_per_gpu"] == 8
    assert ds_config["train_batch_size"] == 8 * 2 * 2


def test_configure_deepspeed_keeps_explicit_batch_sizes():
    state = deepspeed(2, train_micro_batch_size_per_gpu=4, train_batch_size=16)
    distributed.configure_deepspeed(state, batch_size=8, grad_accum=2)
    ds_config = state.deepspeed_plugin.deepspeed_config
    assert (ds_config["train_micro_batch_size_per_gpu"], ds_config["train_batch_size"]) == (4, 16)


def test_optimizer_notes_do_not_touch_the_config():
    state = deepspeed(2, train_micro_batch_size_per_gpu="auto")
    distributed.optimizer_notes(state, "adamw")
    assert "zero_allow_untested_optimizer" not in state.deepspeed_plugin.deepspeed_config


def test_processes_that_would_train_alone_are_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(EffitrainError, match="2 processes were launched but each would train"):
        distributed.optimizer_notes(fake_state("NO", 1), "adamw")


@pytest.mark.parametrize(
    ("variable", "name"),
    [("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")],
)
def test_sharding_asked_for_but_not_in_use_is_refused(monkeypatch, variable, name):
    monkeypatch.setenv(variable, "true")
    with pytest.raises(EffitrainError, match=f"asks for {name}, but this run is DDP"):
        distributed.optimizer_notes(fake_state("MULTI_CPU"), "adamw")


def test_cpu_for_launch(monkeypatch):
    monkeypatch.setattr(distributed, "_has_distributed_accelerator", lambda: False)
    assert distributed.cpu_for_launch() is False  # not launched: leave Accelerate's choice
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert distributed.cpu_for_launch() is True
    monkeypatch.setattr(distributed, "_has_distributed_accelerator", lambda: True)
    assert distributed.cpu_for_launch() is False


def test_deepspeed_asked_for_but_missing_is_one_line(monkeypatch):
    import importlib.util

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "deepspeed" else real_find_spec(name, *a),
    )
    with pytest.raises(EffitrainError, match="DeepSpeed, which is not installed: pip install"):
        distributed.cpu_for_launch()


def test_rank_totals_and_single_process_gather():
    import torch

    from tests.conftest import _reset_accelerate

    _reset_accelerate()
    try:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        (entry,) = distributed.gather_rank_memory(accelerator, model, optimizer)
    finally:
        _reset_accelerate()
    assert entry["rank"] == 0 and entry["parameter_bytes"] == (12 + 3) * 4
    assert entry["optimizer_state_bytes"] == 2 * (12 + 3) * 4 + 2 * 4
    expected = sum(float(p.detach().double().sum()) for p in model.parameters())
    assert entry["parameter_checksum"] == pytest.approx(expected)
    totals = distributed.rank_totals([entry, {**entry, "rank": 1}])
    assert totals["optimizer_state_bytes"] == 2 * entry["optimizer_state_bytes"]
    assert set(totals) == set(distributed.RANK_FIELDS)


def test_shipped_accelerate_configs_load():
    """Every config in configs/accelerate/ is read by Accelerate's own loader as documented."""
    from accelerate.commands.config.config_args import load_config_from_file

    expected = {
        "cpu-2proc.yaml": ("MULTI_GPU", 2),
        "single-gpu.yaml": ("NO", 1),
        "multi-gpu-ddp.yaml": ("MULTI_GPU", 8),
        "fsdp2-full-shard.yaml": ("FSDP", 8),
        "fsdp2-context-parallel.yaml": ("FSDP", 8),
        "deepspeed-zero2.yaml": ("DEEPSPEED", 8),
        "deepspeed-zero3.yaml": ("DEEPSPEED", 8),
        "two-node-template.yaml": ("MULTI_GPU", 16),
    }
    folder = REPO / "configs" / "accelerate"
    assert {path.name for path in folder.glob("*.yaml")} == set(expected)
    for name, (kind, processes) in expected.items():
        config = load_config_from_file(str(folder / name))
        assert (str(config.distributed_type.value), config.num_processes) == (kind, processes)
    assert (
        load_config_from_file(str(folder / "fsdp2-full-shard.yaml")).fsdp_config["fsdp_version"]
        == 2
    )
    context = load_config_from_file(str(folder / "fsdp2-context-parallel.yaml"))
    assert context.parallelism_config == {"parallelism_config_cp_size": 2}
    zero3 = load_config_from_file(str(folder / "deepspeed-zero3.yaml")).deepspeed_config
    assert zero3["zero_stage"] == 3 and zero3["offload_optimizer_device"] == "none"


@pytest.mark.parametrize(
    ("state", "where"), [(fsdp(1), "FSDP1"), (deepspeed(2), "DeepSpeed ZeRO-2")]
)
def test_adam_mini_is_refused_on_flat_shards(state, where):
    with pytest.raises(EffitrainError) as error:
        distributed.optimizer_notes(state, "adam-mini")
    message = str(error.value)
    assert "\n" not in message and f"--optim adam-mini cannot run under {where}" in message
    assert "flat 1-D shards" in message and "use FSDP2" in message and "or DDP" in message


@pytest.mark.parametrize("state", [fsdp(2), fake_state("MULTI_GPU")])
def test_adam_mini_runs_on_fsdp2_and_ddp(state):
    assert distributed.optimizer_notes(state, "adam-mini") == []


def test_only_the_main_process_reads_where_the_launch_can_send_the_weights():
    def rank(state: SimpleNamespace, index: int) -> str | None:
        state.process_index = index
        return distributed.Launch.of(state).receives_weights

    efficient = fsdp(2)
    efficient.fsdp_plugin.cpu_ram_efficient_loading = True
    assert [rank(efficient, 0), rank(efficient, 1)] == [None, "meta"]
    assert [rank(fake_state("MULTI_CPU"), 0), rank(fake_state("MULTI_CPU"), 3)] == [None, "empty"]
    # Every rank reads: FSDP2 without the setting, FSDP1 (not tried), DeepSpeed, one process.
    for state in (fsdp(2), fsdp(1), deepspeed(3), fake_state("NO", 1)):
        assert rank(state, 1) is None
