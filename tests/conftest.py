"""Shared test setup: everything offline, one intra-op thread, the read-only inputs that many
tests share (built once per session), and helpers to run the CLI in this process or a new one."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

# A slip that tries the network fails fast instead of hanging.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
os.environ.update(OFFLINE)
# The tests' models are tiny: a second intra-op thread buys nothing, and on a busy machine its
# threads wait for a core at every operation. Set before torch is imported; subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

LONGEST_FIRST = (
    "tests/test_plan.py",
    "tests/test_fsdp2_optim.py",
    "tests/test_distributed.py",
    "tests/test_optim_ao.py",
    "tests/test_optimizers_learn.py",
    "tests/test_estimate.py",
    "tests/test_compare.py",
    "tests/test_loading.py",
    "tests/test_optimizer_costs.py",
    "tests/test_resume.py",
    "tests/test_grpo_memory.py",
    "tests/test_tiled_mlp.py",
    "tests/test_lever_plugin.py",
    "tests/test_resume_processes.py",
    "tests/test_plan_launch.py",
)
"""The files that take longest (10 s and more), longest first (each file's summed durations).
Under ``-n 2 --dist loadfile`` xdist hands out whole files, by default those with the most tests
first: a long file of few tests (launches, a subprocess) came last, and one worker waited for
the other (test_grpo_memory.py's 15 s ended one worker's run 8 s after the other's)."""


SAME_WORKER = {
    "tests/test_fsdp2_optim.py": "tests/test_distributed.py",
    "tests/test_optimizers_learn.py": "tests/test_optim_ao.py",
}
"""Files whose tests xdist hands out as one (one worker runs both): the runs of one launch,
:func:`two_process_launch`, which each worker would otherwise start again; torchao's traced
updates on the tiny preset's shapes (``traced_not_inductor``), which dynamo traces once per
process."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, with the files of :data:`SAME_WORKER` as one."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class OneLaunch(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SAME_WORKER.get(scope, scope)

    return OneLaunch(config, log)


def _cache_typer_commands() -> None:
    """typer's ``CliRunner.invoke`` builds the click command from the app's functions on every
    call (tens of milliseconds for effitrain's options, seconds over the suite's in-process
    runs). The functions do not change within a session, so neither does the command."""
    import functools

    import typer.testing

    typer.testing._get_command = functools.cache(typer.testing._get_command)


def pytest_configure(config: pytest.Config) -> None:
    _cache_typer_commands()
    _verified_in_process()
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False  # the order below instead


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker: :data:`LONGEST_FIRST`, then the files with the most tests (the order
    the workers collect is the order ``loadfile`` hands the files out in, see above)."""
    if not hasattr(config, "workerinput"):
        return
    counts = Counter(item.nodeid.split("::")[0] for item in items)

    def rank(item: pytest.Item) -> tuple[int, int]:
        file = item.nodeid.split("::")[0]
        longest = LONGEST_FIRST.index(file) if file in LONGEST_FIRST else len(LONGEST_FIRST)
        return longest, -counts[file]

    items.sort(key=rank)  # stable: each file's tests stay together, in their order


def run_cli(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: int = 300
):
    """Run ``python -m effitrain ARGS`` in a fresh process; return the CompletedProcess."""
    full_env = {k: v for k, v in os.environ.items() if k != "EFFITRAIN_DEBUG"}
    full_env.update({**OFFLINE, "COLUMNS": "200", **(env or {})})
    return subprocess.run(
        [sys.executable, "-m", "effitrain", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=full_env,
        timeout=timeout,
    )


def assert_clean_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """A user error: non-zero exit, one 'error:' line on stderr naming the problem, no traceback."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in error_lines[0], error_lines[0]
    return error_lines[0]


def hide_package(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Make ``importlib.util.find_spec`` say that ``package`` is not installed."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == package else find_spec(name, *a),
    )


@pytest.fixture
def cli():
    return run_cli


def _verified_in_process() -> None:
    """The plan verifies its candidates in the test's process, for the whole session (module-
    scoped fixtures' plans included). Its worker processes start where a verification looks
    slower than ``PARALLEL_FROM_SECONDS`` by the clock, so on a loaded machine any test's plan
    spawned two, each paying seconds of imports and a warm-up estimate. The tests of the
    workers set it to 0 themselves (monkeypatch puts this back after them)."""
    import effitrain.plan_workers

    effitrain.plan_workers.PARALLEL_FROM_SECONDS = float("inf")


class InProcessResult:
    """What an in-process CLI run printed and returned."""

    def __init__(self, exit_code: int, stdout: str, stderr: str):
        self.returncode = exit_code
        self.stdout = stdout
        self.stderr = stderr


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def assert_resume_command_round_trips(arguments: list[str]) -> None:
    """The config that ``effitrain train ARGUMENTS`` gives comes back, with ``--resume latest``,
    from the command a stop would print (parsing only). Arguments that do not parse (the suite
    runs bad input on purpose) are skipped; so is a run with no --output-dir, which prints no
    command: it is checked as if it had one."""
    import dataclasses
    import shlex

    from effitrain.checkpoint import resume_command
    from effitrain.cli.compare import train_config
    from effitrain.errors import EffitrainError

    if {"--help", "-h"} & set(arguments):
        return
    try:
        config = train_config(arguments)
    except EffitrainError:
        return
    if not config.output_dir:
        config = dataclasses.replace(config, output_dir="resume-check")
    command = shlex.split(resume_command(config, 1))
    assert command[:2] == ["effitrain", "train"], command
    assert train_config(command[2:]) == dataclasses.replace(config, resume="latest"), command


def train_in_process(*args: str) -> InProcessResult:
    """Run ``effitrain ARGS`` inside this process (fast: torch is imported once per session).

    Accelerate keeps process-wide singletons; they are reset around each run so runs with
    different options do not leak into each other. Every ``train`` command line is also checked
    to survive the resume command a stopped run prints (:func:`assert_resume_command_round_trips`).
    """
    from typer.testing import CliRunner

    from effitrain.cli import app

    if args[:1] == ("train",):
        assert_resume_command_round_trips(list(args[1:]))
    _reset_accelerate()
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200", **OFFLINE})
    _reset_accelerate()
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return InProcessResult(result.exit_code, result.stdout, result.stderr)


@pytest.fixture
def train_cli():
    return train_in_process


@pytest.fixture
def uncompiled(monkeypatch):
    """``torch.compile(f)`` returns ``f``: torchao's optimizers run their update eagerly, the
    same function without inductor's compile (seconds per parameter shape on a CPU). Tests of
    the update as torchao compiles it take ``traced_not_inductor`` instead."""
    import torch

    monkeypatch.setattr(torch, "compile", lambda function=None, **_options: function)


@pytest.fixture
def traced_not_inductor(monkeypatch):
    """``torch.compile`` as asked (torchao asks for ``fullgraph=True``), with dynamo's
    ``eager`` backend: the update is traced whole into a graph (a graph break fails, as it
    would compiled) and the graph runs eagerly. Inductor's C++ kernels are not built: where
    its cache is empty (CI, a fresh venv) they took a CPU 40 s for one optimizer and 80 s for
    torchao's three. Those kernels are PyTorch's and torchao's; effitrain's part is the step
    compiled inside its loop."""
    import torch

    real = torch.compile

    def traced(model: Any = None, **options: Any) -> Any:
        options["backend"] = "eager"
        if model is None:
            return lambda function: real(function, **options)
        return real(model, **options)

    monkeypatch.setattr(torch, "compile", traced)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny preset saved with save_pretrained: a stand-in for a hub model, loaded by path."""
    from effitrain.models import load_model, load_tokenizer

    folder = tmp_path_factory.mktemp("tiny-model")
    tokenizer = load_tokenizer("tiny")
    model = load_model("tiny", ["no", "yes"], tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """The checkpoint tests' inputs, read-only: a 24-row training csv, an 8-row validation csv
    and the tiny preset with dropout 0.1 saved as a folder (see ``write_data``)."""
    from tests.checkpoint_helpers import write_data

    return write_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def no_dropout_model_dir(tmp_path_factory) -> Path:
    """The tiny preset with every dropout off and the demo's label names, so that one and two
    processes can agree exactly."""
    from tests.checkpoint_helpers import save_tiny_model

    folder = tmp_path_factory.mktemp("tiny-no-dropout")
    return save_tiny_model(folder, dropout=0.0, labels=("not_equivalent", "equivalent"))


@pytest.fixture(scope="session")
def lm_model_dir(tmp_path_factory) -> Path:
    """The tiny-llama preset saved with save_pretrained: a pretrained-style causal LM folder."""
    from effitrain.models import load_causal_lm, load_tokenizer

    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = load_tokenizer("tiny-llama")
    model = load_causal_lm("tiny-llama", tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def two_process_launch(tmp_path_factory, no_dropout_model_dir, lm_model_dir) -> Any:
    """The suite's two-process launch, one start-up for all: every DDP run of
    tests/test_distributed.py (under the settings of cpu-2proc.yaml's launch) inside the launch
    of tests/test_fsdp2_optim.py's FSDP2 runs (with its one-process runs before and after it);
    one xdist worker runs both files (:data:`SAME_WORKER`)."""
    from types import SimpleNamespace

    from tests.test_distributed import ddp_launch_runs
    from tests.test_fsdp2_optim import FSDP2_CONFIG, fsdp2_launches, plan_fsdp2_command

    ddp_entries, ddp = ddp_launch_runs(
        tmp_path_factory, no_dropout_model_dir, lm_model_dir, FSDP2_CONFIG
    )
    command = plan_fsdp2_command()
    fsdp2 = fsdp2_launches(
        tmp_path_factory, no_dropout_model_dir, lm_model_dir, command, ddp_entries
    )
    ddp.launched = fsdp2.two
    return SimpleNamespace(ddp=ddp, fsdp2=fsdp2, fsdp2_command=command)


@pytest.fixture(scope="session")
def long_lm_model_dir(tmp_path_factory) -> Path:
    """The tiny-llama preset taking 32,768 positions (model and tokenizer), saved as a folder:
    a causal LM for long-context tests (RoPE: only the configured maximum changes)."""
    from effitrain.demo.lm import build_lm_tokenizer
    from effitrain.models import load_causal_lm

    folder = tmp_path_factory.mktemp("tiny-llama-long")
    tokenizer = build_lm_tokenizer(model_max_length=32768)
    model = load_causal_lm("tiny-llama", tokenizer)
    model.config.max_position_embeddings = 32768
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def long_text_file(tmp_path_factory) -> Path:
    """A .txt corpus of 40 documents of 500 to 3,000 words (blank-line separated): enough
    tokens for packed blocks of 32k tokens, each holding several documents."""
    import random

    rng = random.Random(0)
    words = [
        "the",
        "cat",
        "sat",
        "on",
        "a",
        "mat",
        "while",
        "dogs",
        "ran",
        "over",
        "hills",
        "and",
        "rivers",
        "under",
        "skies",
    ]
    path = tmp_path_factory.mktemp("long-text") / "long.txt"
    documents = [" ".join(rng.choices(words, k=rng.randint(500, 3000))) for _ in range(40)]
    path.write_text("\n\n".join(documents) + "\n")
    return path


@pytest.fixture(scope="session")
def saved_run(tmp_path_factory, data):
    """One finished 4-step adamw run on ``data``, saving at step 3 and at the end; shared
    read-only (copy ``out`` to change it). Fields: data, out, options, proc."""
    from types import SimpleNamespace

    from tests.checkpoint_helpers import train_args

    out = tmp_path_factory.mktemp("saved") / "out"
    options = ("--max-steps", "4", "--save-every", "3")
    proc = train_in_process(*train_args(data, out, *options))
    assert proc.returncode == 0, proc.stderr
    return SimpleNamespace(data=data, out=out, options=options, proc=proc)
