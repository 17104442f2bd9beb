"""Several ``effitrain train`` runs, one after the other, in the same two processes under
Accelerate's real FSDP2 on CPU over gloo: a test harness (one launch's start-up for all of them).

    accelerate launch --config_file configs/accelerate/fsdp2-full-shard.yaml --num_processes 2 \\
        tests/fsdp2_runs.py        (FSDP2_RUNS=<runs.json>, READ_SPY_DIR=<folder> in the env)

``runs.json`` lists ``{"name", "args", "copy"}``: each run is the CLI with ``args``, after the
main process copied the folder ``copy[0]`` to ``copy[1]`` (a checkpoint to resume from) where
given. Between runs Accelerate's process-wide state is reset, as ``tests.conftest`` does between
in-process runs; the process group stays. Each rank writes ``<name>.rank<R>.json`` (the exit
code) beside ``runs.json``, and the files each run opens are recorded under its name
(:mod:`tests.read_spy`). ``fsdp2_cpu_launch`` lets Accelerate choose FSDP on CPU processes.
"""

import json
import os
import shutil
import sys
from pathlib import Path

from tests import fsdp2_cpu_launch  # noqa: F401  (Accelerate chooses FSDP on CPU processes)
from tests.read_spy import install


def run(args: list[str]) -> int:
    """``effitrain ARGS`` in this process; its exit code."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from effitrain.cli import main

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    sys.argv = ["effitrain", *args]
    try:
        main()
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
    return 0


if __name__ == "__main__":
    import torch.distributed as dist

    install(os.environ["READ_SPY_DIR"])
    runs_file = Path(os.environ["FSDP2_RUNS"])
    rank = os.environ["RANK"]
    for entry in json.loads(runs_file.read_text()):
        if entry.get("copy") and rank == "0":
            shutil.copytree(*entry["copy"])
        if dist.is_initialized():  # made by the first run's Accelerator
            dist.barrier()
        os.environ["READ_SPY_TAG"] = entry["name"]
        code = run(entry["args"])
        (runs_file.parent / f"{entry['name']}.rank{rank}.json").write_text(json.dumps(code))
