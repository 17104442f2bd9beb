"""Run by test_fsdp2_optim.py in its two-process launch (:mod:`tests.launch_runs`, gloo): one
context-parallel rank per process; test_two_cp_ranks_on_gloo reads what each rank saves.

The batch goes through ``sharded_batch`` on a real 2-rank mesh, then a position-wise LM
(embedding, head: no attention, so no ring needed) is trained on the shard with the loop's
token weights; its loss and gradient, averaged as FSDP2 averages, go to
``$CP_RANKS_DIR/rank<R>.pt``.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
from accelerate import PartialState
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel

from effitrain.levers.context_parallel import sharded_batch
from effitrain.tasks.lm_loss import step_scale


def example() -> tuple[torch.Tensor, torch.Tensor, torch.nn.Module, torch.nn.Module]:
    """The batch's token ids and labels (the first row's first 3 tokens a prompt not trained
    on) and the position-wise LM's embedding and head, drawn from seed 0 in that order: each
    rank's, and the one process's that test_two_cp_ranks_on_gloo compares them with."""
    torch.manual_seed(0)
    ids = torch.randint(0, 13, (2, 8))
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels, torch.nn.Embedding(13, 4), torch.nn.Linear(4, 13)


def main() -> None:
    rank = PartialState(cpu=True).process_index  # the launch's gloo group, made or reused
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    ids, labels, embed, head = example()
    batch = {"input_ids": ids.clone(), "labels": labels, "attention_mask": torch.ones_like(ids)}
    batch["document_lengths"] = ((8,), (8,))  # the whole rows', as the collator gives them
    accelerator = SimpleNamespace(
        num_processes=2,
        gradient_accumulation_steps=1,
        reduce=lambda t, _: (dist.all_reduce(t), t)[1],
        parallelism_config=SimpleNamespace(cp_enabled=True, cp_size=2),
        maybe_context_parallel=lambda **kw: context_parallel(mesh, **kw),
    )
    scale = step_scale([batch], accelerator)
    with sharded_batch(accelerator, batch):
        logits = head(embed(batch["input_ids"]))
        losses = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch["shift_labels"].flatten(), reduction="sum"
        )
        (losses * scale).backward()
    grad = head.weight.grad.clone()
    dist.all_reduce(grad)  # FSDP2's reduce-scatter averages over the ranks
    loss = (losses * scale).detach()
    dist.all_reduce(loss)  # the logged loss: summed over processes, over as many micro-batches
    torch.save(
        {
            "ids": batch["input_ids"],
            "positions": batch["position_ids"],
            "shift_labels": batch["shift_labels"],
            "mask": "attention_mask" in batch or "document_lengths" in batch,
            "loss": loss / 2,
            "grad": grad / 2,
        },
        f"{os.environ['CP_RANKS_DIR']}/rank{rank}.pt",
    )


if __name__ == "__main__":
    main()
