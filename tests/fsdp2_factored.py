"""Run by test_fsdp2_optim.py under ``accelerate launch`` with two CPU processes (gloo).

The factored optimizers of :mod:`effitrain.optim.fsdp2` on real torch FSDP2 (``fully_shard``;
Accelerate itself only enables FSDP on GPUs), against the library's own optimizer in one
process on the same global batch:

- a small transformer whose dim 0 sizes do not divide by two (11, 5, 3 and 1 rows: the second
  rank's shard of the 1-row weight is empty), with 1-D, 2-D and 3-D parameters;
- each rank trains on its half of every batch; FSDP2 averages the gradients;
- after every step: the largest difference between the gathered parameters and the reference's,
  and between the gathered optimizer state and the reference's;
- each rank's optimizer-state bytes by the ledger;
- a checkpoint after two steps, saved and loaded by Accelerate's FSDP2 functions (sharded, with
  torch.distributed.checkpoint, and full), then two more steps: the weights are compared with
  the run that was never interrupted.

Each rank writes its facts as JSON to ``$FSDP_FACTS_DIR/factored-rank-<N>.json``, after running
``fsdp_facts.py``'s checks in the same launch (``rank-<N>.json``): one launch for both.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from types import SimpleNamespace

import fsdp_facts  # this folder: the scripts run as files
import torch
from accelerate import PartialState
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from effitrain import optim
from effitrain.memory import ledger

warnings.filterwarnings("ignore")

STEPS = 4
BATCH = 8


class Tiny(torch.nn.Module):
    """Embedding 11 x 6, one encoder layer (in_proj 18 x 6, feed-forward 10 x 6 and 6 x 10),
    a 5 x 6 head with a bias, a 3-D 3 x 5 x 6 mixer and a 1 x 6 offset.

    The layer has no biases: attention's key bias gets a gradient that is zero but for
    rounding, which transformers' Adafactor and CAME (eps 1e-30) divide by its own square
    root, so the result is rounding noise magnified to O(1) on one process as on two."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.layer = torch.nn.TransformerEncoderLayer(
            6, 2, dim_feedforward=10, dropout=0.0, batch_first=True, bias=False
        )
        self.head = torch.nn.Linear(6, 5)
        self.mix = torch.nn.Parameter(torch.randn(3, 5, 6) * 0.3)
        self.offset = torch.nn.Parameter(torch.randn(1, 6) * 0.3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.layer(self.embed(ids) + self.offset)
        return self.head(x) + torch.einsum("btd,khd->bth", x, self.mix)


def make_model() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, 11, (BATCH, 7), generator=generator)
    targets = torch.randint(0, 5, (BATCH, 7), generator=generator)
    return ids, targets


def loss_of(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten())


def build(name: str, model: torch.nn.Module, sharded: bool) -> torch.optim.Optimizer:
    """The registry's optimizer (its hyperparameters), or its FSDP2-aware class."""
    params = [{"params": list(model.parameters()), "weight_decay": 0.01}]
    return optim.for_sharding(optim.get_spec(name), sharded).factory(params, 1e-2)


def shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    fully_shard(model.layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(model, optimizer, steps, rank: int | None, n: int, after_step=None) -> None:
    for step in steps:
        ids, targets = batch(step)
        if rank is not None:  # this rank's half of the global batch
            ids, targets = ids.chunk(n)[rank], targets.chunk(n)[rank]
        loss_of(model, ids, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step(step)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def max_diff(a, b) -> float:
    return max(
        float((full(x) - y).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b, strict=True)
    )


def state_diff(sharded, reference, model, ref_model) -> float:
    worst = 0.0
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        mine, theirs = sharded.state[p], reference.state[q]
        assert mine.keys() == theirs.keys(), (sorted(mine), sorted(theirs))
        for key, value in theirs.items():
            if torch.is_tensor(value):
                worst = max(worst, float((full(mine[key]) - value).abs().max()))
    return worst


def expected_rank_bytes(reference, ref_model, rank: int, n: int) -> int:
    """The reference's state bytes, with every tensor that FSDP2 shards cut to this rank's rows
    (``torch.chunk``'s split) and the 2-D weights' column factors whole."""
    from effitrain.optim.fsdp2 import replicated

    total = ledger.optimizer_state_ledger(reference).bytes
    for q in ref_model.parameters():
        rows = q.shape[0]
        chunk = -(-rows // n)
        mine = max(0, min(chunk, rows - rank * chunk))
        for key, value in reference.state[q].items():
            if torch.is_tensor(value) and value.dim() and not replicated(key, q.dim()):
                total -= value.numel() * value.element_size() * (rows - mine) // rows
    return total


def estimated_rank0_bytes(name: str, reference, ref_model, n: int) -> int:
    from effitrain.estimation import fsdp2_layout, per_device
    from effitrain.results import Baseline, MemoryRecord

    state = ledger.optimizer_state_ledger(reference)
    memory = MemoryRecord(
        optimizer_state=state,
        parameter_bytes=0,
        trainable_parameters=0,
        trainable_parameter_bytes=0,
        gradient_bytes=0,
        adamw_equivalent_bytes=0,
        adamw_equivalent_elements=0,
        baseline=Baseline(parameter_bytes=0, gradient_bytes=0, optimizer_state_bytes=0),
    )
    layout = fsdp2_layout(ref_model, reference)
    return per_device(memory, name, n, "fsdp", layout).optimizer_state_bytes


def checkpoint_facts(name: str, mesh, state: PartialState, kind: str) -> dict:
    """Two steps, a checkpoint through Accelerate's FSDP2 functions, two more steps, against
    the four uninterrupted steps."""
    from accelerate.utils.fsdp_utils import load_fsdp_optimizer, save_fsdp_optimizer
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import StateDictType

    rank, n = state.process_index, state.num_processes
    plugin = SimpleNamespace(
        fsdp_version=2,
        state_dict_type=getattr(StateDictType, kind),
        state_dict_config=SimpleNamespace(offload_to_cpu=False, rank0_only=False),
        optim_state_dict_config=SimpleNamespace(rank0_only=False),
    )
    accelerator = SimpleNamespace(process_index=rank, wait_for_everyone=state.wait_for_everyone)
    model = shard(make_model(), mesh)
    optimizer = build(name, model, sharded=True)
    train(model, optimizer, range(2), rank, n)
    # In the test's own folder, which pytest cleans up; not the system's temp folder.
    scratch = os.environ["FSDP_FACTS_DIR"]
    directory = tempfile.mkdtemp(prefix="fsdp2-ckpt-", dir=scratch) if rank == 0 else None
    directory = broadcast_str(state, directory)
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, directory)
    state.wait_for_everyone()
    weights = get_model_state_dict(model)

    resumed = shard(make_model(), mesh)
    set_model_state_dict(resumed, weights)
    resumed_optimizer = build(name, resumed, sharded=True)
    load_fsdp_optimizer(plugin, accelerator, resumed_optimizer, resumed, directory)
    train(model, optimizer, range(2, STEPS), rank, n)
    train(resumed, resumed_optimizer, range(2, STEPS), rank, n)
    same = all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(model.parameters(), resumed.parameters(), strict=True)
    )
    return {"bit_identical": same, "files": sorted(os.listdir(directory))}


def broadcast_str(state: PartialState, value: str | None) -> str:
    from accelerate.utils import broadcast_object_list

    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


def facts_for(name: str, mesh, state: PartialState) -> dict:
    rank, n = state.process_index, state.num_processes
    ref_model = make_model()
    reference = build(name, ref_model, sharded=False)
    model = shard(make_model(), mesh)
    optimizer = build(name, model, sharded=True)
    diffs: list[float] = []
    reference_weights: list[list[torch.Tensor]] = []

    def record(step: int) -> None:
        diffs.append(max_diff(list(model.parameters()), reference_weights[step]))

    def keep(step: int) -> None:
        reference_weights.append([p.detach().clone() for p in ref_model.parameters()])

    train(ref_model, reference, range(STEPS), None, n, after_step=keep)
    initial = [p.detach().clone() for p in make_model().parameters()]
    train(model, optimizer, range(STEPS), rank, n, after_step=record)
    return {
        "param_max_diff_per_step": diffs,
        "moved": max_diff(list(model.parameters()), initial),
        "state_max_diff": state_diff(optimizer, reference, model, ref_model),
        "state_keys": sorted({k for s in optimizer.state.values() for k in s}),
        "rank_state_bytes": ledger.optimizer_state_ledger(optimizer).bytes,
        "expected_rank_state_bytes": expected_rank_bytes(reference, ref_model, rank, n),
        "one_process_state_bytes": ledger.optimizer_state_ledger(reference).bytes,
        # what `effitrain estimate --num-processes 2 --sharding fsdp` says of rank 0
        "estimated_rank0_state_bytes": estimated_rank0_bytes(name, reference, ref_model, n),
        "local_rows": {name: p.to_local().shape[0] for name, p in model.named_parameters()},
        "checkpoint": {
            kind: checkpoint_facts(name, mesh, state, kind)
            for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
        },
        "hsdp_max_diff": {
            f"{replicas}x{shards}": hsdp_max_diff(name, (replicas, shards), rank, n, ref_model)
            for replicas, shards in ((1, n), (n, 1))
        },
    }


def hsdp_max_diff(name: str, shape: tuple[int, int], rank: int, n: int, reference) -> float:
    """HSDP: a 2-D mesh (replicas x shards), FSDP2 sharding on its second dim; the largest
    difference from the one-process reference after all steps."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    model = shard(make_model(), mesh)
    train(model, build(name, model, sharded=True), range(STEPS), rank, n)
    return max_diff(list(model.parameters()), [p.detach() for p in reference.parameters()])


def main() -> None:
    from effitrain.optim import fsdp2

    # Buckets of the largest parameter (108 elements), not of 2**24: several per step, so the
    # lock-step rounds are checked across buckets too (effitrain train's tiny run has one).
    fsdp2.BUCKET_ELEMENTS = 1
    state = PartialState(cpu=True)
    mesh = init_device_mesh("cpu", (state.num_processes,))
    fsdp_facts.write(f"rank-{state.process_index}.json", fsdp_facts.gather(state, mesh))
    names = os.environ.get("FSDP_FACTORED", "adafactor,adafactor-hf,came").split(",")
    facts = {"rank": state.process_index, "optimizers": {}}
    for name in names:
        facts["optimizers"][name] = facts_for(name, mesh, state)
    fsdp_facts.write(f"factored-rank-{state.process_index}.json", facts)
    # Leave no gloo thread running at exit: once (CI, 2026-12-04) a rank aborted there
    # ("terminate called without an active exception", SIGABRT), most likely at exit.
    state.wait_for_everyone()
    state.destroy_process_group()


if __name__ == "__main__":
    main()
