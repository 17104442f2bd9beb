"""``effitrain plan`` for several processes (the printed command carries its ``accelerate
launch``) and a plan stopped by a signal (its workers end with it). Apart from test_plan.py so
that the suite's two workers share the plan's slow tests."""

from __future__ import annotations

import json
import shlex

import pytest

from tests.conftest import assert_clean_error
from tests.test_plan import LM, ONE

# -- several processes: the command carries its launch --------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "device"), [("fsdp", "cuda"), ("ddp", "cpu"), ("ddp", "cuda"), ("zero2", "cuda")]
)
def test_a_multi_process_command_carries_its_launch(monkeypatch, strategy, device):
    """The printed ``accelerate launch`` flags, parsed by accelerate itself, set up the launch
    the plan estimated (as each process reads it: distributed.launch_from_environment)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    from effitrain.distributed import Launch, launch_from_environment
    from effitrain.planning import launch_arguments

    launch = Launch.described(2, strategy, device)
    words = launch_arguments(launch, grad_accum=4)
    variables = dict(w.split("=", 1) for w in words if "=" in w)
    words = [w for w in words if "=" not in w]
    assert words[:2] == ["accelerate", "launch"]
    args = launch_command_parser().parse_args([*words[2:], "-m", "effitrain", "train"])
    args, _, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ""
        environment = prepare_deepspeed_cmd_env(args)[1]
        assert environment["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "4"
    else:
        environment = prepare_multi_gpu_env(args)
    for name, value in {**environment, **variables, "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    seen = launch_from_environment()
    assert (seen.strategy, seen.num_processes) == (strategy, 2)
    if device == "cpu":
        assert variables == {"ACCELERATE_USE_CPU": "1"}


@pytest.fixture(scope="module")
def fsdp2_command() -> str:
    """The first command of a plan for two FSDP2 processes on GPUs (one plan for the tests
    that read it)."""
    from tests.conftest import train_in_process

    proc = train_in_process("plan", *LM, "--batch-size", "2", *ONE, "--memory", "2GiB", "--json",
                            "--num-processes", "2", "--sharding", "fsdp", "--device", "cuda")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["candidates"][0]["command"]


@pytest.mark.slow
def test_the_plan_prints_fsdp2_launch_flags(fsdp2_command):
    assert fsdp2_command.startswith(
        "accelerate launch --num_processes 2 --use_fsdp --fsdp_version 2 "
        "--fsdp_reshard_after_forward true --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP "
        "--fsdp_state_dict_type SHARDED_STATE_DICT -m effitrain train "
    ), fsdp2_command


def test_sharding_on_cpu_processes_is_refused(train_cli):
    """train refuses FSDP on CPU processes: the plan does not print commands that cannot run."""
    proc = train_cli("plan", *LM, "--memory", "1GiB", "--num-processes", "2",
                     "--sharding", "fsdp", "--device", "cpu")  # fmt: skip
    assert_clean_error(proc, "--sharding fsdp runs on GPUs only", "--device cuda")


# -- a signal ends the plan and its workers ----------------------------------------------------

WORKERS_SCRIPT = """
import sys
import effitrain.plan_workers as plan_workers
plan_workers.PARALLEL_FROM_SECONDS = 0.0  # verifications in worker processes, at any size
plan_workers._cores = lambda: 2
from effitrain.cli import main
main(sys.argv[1:])
"""


@pytest.mark.slow
@pytest.mark.parametrize("signum", [15, 9])
def test_a_signal_ends_the_plan_and_its_workers(signum):
    """SIGTERM: exit 143, one line, no worker left (they were left blocked forever). SIGKILL,
    which the plan cannot handle: its workers end by themselves."""
    import os
    import subprocess
    import sys
    import time

    import psutil

    from tests.conftest import OFFLINE

    env = {**os.environ, **OFFLINE, "COLUMNS": "200"}
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKERS_SCRIPT, "plan", *LM, "--batch-size", "2", *ONE,
         "--memory", "1GiB"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    parent = psutil.Process(proc.pid)
    workers: list[psutil.Process] = []
    deadline = time.monotonic() + 120
    while not workers and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
        children = parent.children(recursive=True)
        workers = [c for c in children if "spawn_main" in " ".join(_cmdline(c))]
    assert workers, "no worker process started"
    everything = parent.children(recursive=True)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    gone, alive = psutil.wait_procs(everything, timeout=60)
    assert not alive, [_cmdline(p) for p in alive]
    if signum == 15:
        assert proc.returncode == 143
        assert stderr.strip().splitlines() == [
            "plan stopped by SIGTERM before it finished; no worker process is left"
        ]


def test_a_signal_while_workers_spawn_waits_for_the_spawn():
    """A signal inside ``submit`` (which spawns the workers) is taken when the block ends: a
    worker whose start-up data was never sent printed a traceback after the plan's line."""
    import signal

    from effitrain.plan_workers import held_signal, signals_held

    taken = []

    def handler(signum, frame):
        if not held_signal(signum):
            taken.append(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with signals_held():
            signal.raise_signal(signal.SIGTERM)
            assert taken == []
        assert taken == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def _cmdline(process) -> list[str]:
    import psutil

    try:
        return process.cmdline()
    except psutil.Error:
        return []


@pytest.mark.slow
def test_the_fsdp2_command_shards_the_run(fsdp2_command):
    """The printed FSDP2 command, its accelerate flags as printed, on two CPU processes
    (tests/fsdp2_cpu_launch.py in place of ``-m effitrain``: FSDP on gloo): the run is FSDP2's
    full shard (the command without them trained unsharded)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import OFFLINE

    words = shlex.split(fsdp2_command)
    module = words.index("-m")
    assert words[module + 1 : module + 3] == ["effitrain", "train"]
    root = Path(__file__).parents[1]
    harness = str(root / "tests" / "fsdp2_cpu_launch.py")
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", *words[2:module], harness,
         *words[module + 2 :], "--max-memory", "2GiB", "--max-steps", "2"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, **OFFLINE, "COLUMNS": "200", "PYTHONPATH": path},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "FSDP2 full shard over 2 processes" in run.stdout
