"""The lr schedule over a run's steps: warmup, then linear, cosine or constant."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def build_scheduler(
    optimizer: torch.optim.Optimizer, name: str, total_steps: int, warmup_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """Warmup, then ``name`` ('linear', 'cosine' or 'constant') over ``total_steps`` steps."""
    from transformers import get_scheduler

    # transformers' 'constant' has no warmup; ours always warms up.
    hf_name = {"constant": "constant_with_warmup"}.get(name, name)
    return get_scheduler(
        hf_name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps
    )
