"""Several ``effitrain`` runs, one after the other, in the same two processes of one
``accelerate launch`` (DDP, or Accelerate's real FSDP2 on CPU over gloo): a test harness, so
that the runs pay one launch's start-up (two processes importing torch) between them.

    accelerate launch --config_file <config> tests/launch_runs.py
        (LAUNCH_RUNS=<runs.json>, READ_SPY_DIR=<folder> in the env)

``runs.json`` lists ``{"name", "args", "copy"}``: each run is the CLI with ``args``, after the
main process copied the folder ``copy[0]`` to ``copy[1]`` (a checkpoint to resume from) where
given. A ``{"name", "script"}`` entry runs a Python file instead, as ``python script`` would
(checks of torch itself that need the launch's processes; last, where the script ends the
process group). Either kind may add ``env`` to the environment and remove the variables named
in ``unset`` (a run under other launch settings than the config's), for that run only. Between
runs Accelerate's process-wide state is reset, as ``tests.conftest`` does between in-process
runs; the process group stays. Each rank writes ``<name>.rank<R>.json`` (the exit code),
``.stdout`` and ``.stderr`` (what the run printed) beside ``runs.json``, and the files each run
opens are recorded under its name (:mod:`tests.read_spy`). ``fsdp2_cpu_launch`` lets Accelerate
choose FSDP on CPU processes (it changes nothing when FSDP is not asked for).

:func:`launch_runs` is the test side: it writes ``runs.json``, launches, and reads back.
:func:`one_rank_here` runs one entry as a launch of one process would, in the test's process.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path


def run(entry: dict) -> int:
    """The entry's ``effitrain ARGS`` (or its script) in this process; its exit code (1 for a
    crash, traceback printed)."""
    import runpy

    from accelerate.state import AcceleratorState, GradientState, PartialState

    from effitrain.cli import main

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    environment = dict(os.environ)
    os.environ.update(entry.get("env", {}))
    for name in entry.get("unset", ()):
        os.environ.pop(name, None)
    sys.argv = [entry["script"]] if "script" in entry else ["effitrain", *entry["args"]]
    try:
        if "script" in entry:
            runpy.run_path(entry["script"], run_name="__main__")
        else:
            main()
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    except Exception:  # noqa: BLE001  (the next runs still run; the test reads this one's stderr)
        traceback.print_exc()
        return 1
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
        os.environ.clear()
        os.environ.update(environment)
    return 0


@dataclass
class Launched:
    """One launch of :data:`runs`: its process and each run's exit codes and output."""

    out: Path
    proc: subprocess.CompletedProcess

    def _read(self, name: str, suffix: str) -> list[str]:
        paths = [self.out / f"{name}.rank{rank}.{suffix}" for rank in (0, 1)]
        return [path.read_text() if path.exists() else "" for path in paths]

    def codes(self, name: str) -> list[int | None]:
        """Each rank's exit code of run ``name`` (None: the rank never finished it)."""
        return [json.loads(text) if text else None for text in self._read(name, "json")]

    def stdout(self, name: str) -> str:
        """What run ``name`` printed to stdout, rank 0's then rank 1's."""
        return "".join(self._read(name, "stdout"))

    def stderr(self, name: str) -> str:
        return "".join(self._read(name, "stderr"))

    def tail(self, name: str) -> str:
        """For a failing test: the run's output and the launch's."""
        return "\n".join(
            text[-3000:]
            for text in (self.stdout(name), self.stderr(name), self.proc.stdout, self.proc.stderr)
        )

    def assert_ran(self, name: str, codes: tuple[int, int] = (0, 0)) -> None:
        assert self.proc.returncode == 0, self.tail(name)
        assert self.codes(name) == list(codes), self.tail(name)


def recorded(entry: dict, out: Path, rank: str) -> None:
    """:func:`run` with what it prints in ``<name>.rank<R>.stdout`` and ``.stderr`` under
    ``out``, and its exit code in ``.json``: what :class:`Launched` reads back."""
    stem = out / f"{entry['name']}.rank{rank}"
    with (
        open(f"{stem}.stdout", "w") as printed,
        open(f"{stem}.stderr", "w") as err,
        contextlib.redirect_stdout(printed),
        contextlib.redirect_stderr(err),
    ):
        code = run(entry)
    Path(f"{stem}.json").write_text(json.dumps(code))


def one_rank_here(out: Path, entry: dict, config: Path) -> Launched:
    """``entry`` as the one process of ``accelerate launch --config_file CONFIG
    --num_processes 1`` would run it, in this process: the variables of that launch (by
    accelerate's own parsing) and of torchrun's one rank, a process group of one, FSDP on CPU
    as in a launch (:mod:`tests.fsdp2_cpu_launch`); read back as a launch's run. A launch of
    one paid seconds of start-up (two processes importing torch and transformers) for a run
    of one second."""
    import torch.distributed as dist

    from tests.conftest import OFFLINE
    from tests.fsdp2_cpu_launch import fsdp_on_cpu
    from tests.test_distributed import free_port, launch_environment

    rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # fmt: skip
    environment = launch_environment(["--config_file", str(config), "--num_processes", "1"])
    environment |= {**rank, **OFFLINE, "ACCELERATE_USE_CPU": "1", "COLUMNS": "200"}
    if entry.get("copy"):
        shutil.copytree(*entry["copy"])
    try:
        with fsdp_on_cpu():
            recorded({**entry, "env": {**environment, **entry.get("env", {})}}, out, "0")
    finally:
        if dist.is_initialized():  # made by the run's Accelerator
            dist.destroy_process_group()
    return Launched(out, subprocess.CompletedProcess([entry["name"]], 0, "", ""))


def launch_runs(out: Path, runs: list[dict], **launch_options) -> Launched:
    """Run ``runs`` (``{"name", "args", "copy"?}`` or ``{"name", "script"}``, each with
    ``env``/``unset`` where given) in one launch of two processes, with their files under
    ``out``; ``launch_options`` go to :func:`tests.test_distributed.launch`."""
    from tests.test_distributed import launch

    (out / "runs.json").write_text(json.dumps(runs))
    env = {"LAUNCH_RUNS": str(out / "runs.json"), "READ_SPY_DIR": str(out)}
    proc = launch(script=Path(__file__), extra_env=env, **launch_options)
    return Launched(out, proc)


if __name__ == "__main__":
    import torch.distributed as dist

    from tests import fsdp2_cpu_launch  # noqa: F401  (Accelerate chooses FSDP on CPU processes)
    from tests.read_spy import install

    install(os.environ["READ_SPY_DIR"])
    runs_file = Path(os.environ["LAUNCH_RUNS"])
    rank = os.environ["RANK"]
    for entry in json.loads(runs_file.read_text()):
        if entry.get("copy") and rank == "0":
            shutil.copytree(*entry["copy"])
        if dist.is_initialized():  # made by the first run's Accelerator
            dist.barrier()
        os.environ["READ_SPY_TAG"] = entry["name"]
        recorded(entry, runs_file.parent, rank)
