"""``effitrain plan`` for several processes (the printed command carries its ``accelerate
launch``) and a plan stopped by a signal (its workers end with it). Apart from test_plan.py so
that the suite's two workers share the plan's slow tests. The printed FSDP2 command is run in
test_fsdp2_optim.py's two-process launch (test_the_fsdp2_command_shards_the_run)."""

from __future__ import annotations

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


def test_sharding_on_cpu_processes_is_refused(train_cli):
    """train refuses FSDP on CPU processes: the plan does not print commands that cannot run."""
    proc = train_cli("plan", *LM, "--memory", "1GiB", "--num-processes", "2",
                     "--sharding", "fsdp", "--device", "cpu")  # fmt: skip
    assert_clean_error(proc, "--sharding fsdp runs on GPUs only", "--device cuda")


# -- a signal ends the plan and its workers ----------------------------------------------------

PLANS_SCRIPT = """
import os
import sys
import effitrain.plan_workers as plan_workers
plan_workers.PARALLEL_FROM_SECONDS = 0.0  # verifications in worker processes, at any size
plan_workers._cores = lambda: 2
# What a plan imports before its workers start, paid once for both plans:
import datasets, torch._dynamo, transformers.models.llama.modeling_llama
import effitrain.estimation, effitrain.planning
from effitrain.cli import main
plans = []
for stderr in sys.argv[1:3]:
    plan = os.fork()
    if plan == 0:  # a plan process: its output (and its workers') to /dev/null and a file
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT), 2)
        main(sys.argv[3:])  # leaves by SystemExit, as `effitrain plan` does
    plans.append(plan)
print(*plans, flush=True)
for plan in plans:
    print(os.waitstatus_to_exitcode(os.waitpid(plan, 0)[1]), flush=True)
"""
"""Two plans, each in a process forked from one that imported what a plan imports (torch,
transformers, effitrain's estimation: one start-up for both): prints their ids, then each
one's exit code when it has ended."""


@pytest.mark.slow
def test_a_signal_ends_the_plan_and_its_workers(tmp_path):
    """SIGTERM: exit 143, one line, no worker left (they were left blocked forever). SIGKILL,
    which the plan cannot handle: its workers end by themselves. One plan process for each
    signal, both forked from one process (:data:`PLANS_SCRIPT`)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from tests.conftest import OFFLINE

    env = {**os.environ, **OFFLINE, "COLUMNS": "200"}
    stderr = [tmp_path / "sigterm.stderr", tmp_path / "sigkill.stderr"]
    proc = subprocess.Popen(
        [sys.executable, "-c", PLANS_SCRIPT, *map(str, stderr), "plan", *LM, "--batch-size", "2",
         *ONE, "--memory", "1GiB"],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    plans = [psutil.Process(int(pid)) for pid in proc.stdout.readline().split()]
    assert len(plans) == 2, proc.communicate(timeout=120)
    everything = []
    for plan, signum in zip(plans, (signal.SIGTERM, signal.SIGKILL), strict=True):
        workers: list[psutil.Process] = []
        deadline = time.monotonic() + 120
        while not workers and plan.is_running() and time.monotonic() < deadline:
            time.sleep(0.1)
            children = plan.children(recursive=True)
            workers = [c for c in children if "spawn_main" in " ".join(_cmdline(c))]
        assert workers, "no worker process started"
        everything += plan.children(recursive=True)
        plan.send_signal(signum)
    codes, _ = proc.communicate(timeout=120)
    gone, alive = psutil.wait_procs(everything, timeout=60)
    assert not alive, [_cmdline(p) for p in alive]
    assert codes.split() == ["143", "-9"]
    assert stderr[0].read_text().strip().splitlines() == [
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
