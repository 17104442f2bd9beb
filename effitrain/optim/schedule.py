"""The lr schedule over a run's steps: warmup, then linear, cosine or constant.

The factors are transformers' (``get_scheduler``'s linear, cosine and constant-with-warmup
lambdas, in a ``LambdaLR``: the same values and the same checkpointed state), written here
because importing ``transformers.optimization`` imports its Trainer's utilities, which import
peft, bitsandbytes and torchao where installed: about a second of every run's start.
``tests/test_schedule.py`` checks them against transformers' at every step.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def build_scheduler(
    optimizer: torch.optim.Optimizer, name: str, total_steps: int, warmup_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """Warmup, then ``name`` ('linear', 'cosine' or 'constant') over ``total_steps`` steps."""
    from torch.optim.lr_scheduler import LambdaLR

    factor = functools.partial(_factor, name, warmup_steps, total_steps)
    return LambdaLR(optimizer, factor)


def _factor(name: str, warmup: int, total: int, step: int) -> float:
    """The lr's factor at ``step``: rising linearly from 0 over ``warmup`` steps, then 1
    (constant), falling linearly to 0 at ``total`` (linear), or along half a cosine (cosine)."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if name == "constant":
        return 1.0
    if name == "linear":
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
