"""Run by ``benchmarks/sharding/run.py`` under ``accelerate launch`` with two CPU processes: the
optimizer step's time under real FSDP2 (8 Linear layers of 1024 x 1024, one thread per process)
for AdamW and the factored optimizers, and on one process (rank 0 alone, the whole model, the
library's optimizer) for comparison. Writes ``$FSDP_FACTS_DIR/step-time.json`` from rank 0."""

from __future__ import annotations

import json
import os
import statistics
import time
import warnings
from pathlib import Path

import torch
from accelerate import PartialState
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from effitrain import optim

warnings.filterwarnings("ignore")
OPTIMIZERS = ("adamw", "adafactor", "adafactor-hf", "came")
REPEATS = 7


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])


def step_ms(model: torch.nn.Module, optimizer, state: PartialState | None) -> float:
    batch = torch.randn(8, 1024)
    times = []
    for _ in range(REPEATS):
        model(batch).pow(2).mean().backward()
        if state is not None:
            state.wait_for_everyone()
        start = time.perf_counter()
        optimizer.step()
        if state is not None:
            state.wait_for_everyone()
        times.append(time.perf_counter() - start)
        optimizer.zero_grad()
    return statistics.median(times[1:]) * 1e3  # the first step creates the state


def main() -> None:
    torch.set_num_threads(1)
    state = PartialState(cpu=True)
    mesh = init_device_mesh("cpu", (state.num_processes,))
    rows = []
    for name in OPTIMIZERS:
        model = make_model()
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        spec = optim.for_sharding(optim.get_spec(name), True)
        sharded = step_ms(model, spec.factory([{"params": list(model.parameters())}], 1e-3), state)
        one = None
        if state.is_main_process:  # the other rank waits at the next barrier
            model = make_model()
            library = optim.get_spec(name).factory([{"params": list(model.parameters())}], 1e-3)
            one = step_ms(model, library, None)
        state.wait_for_everyone()
        rows.append({"optimizer": name, "fsdp2_step_ms": sharded, "one_process_step_ms": one})
    if state.is_main_process:
        out = Path(os.environ["FSDP_FACTS_DIR"]) / "step-time.json"
        out.write_text(json.dumps(rows))
    state.wait_for_everyone()
    state.destroy_process_group()


if __name__ == "__main__":
    main()
