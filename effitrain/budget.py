"""``effitrain train --max-memory``: the run's estimate against the budget before any weight is
read, with the plan's margin, and what fits instead where it does not (the plan's best
configuration, :func:`effitrain.planning.plan`). The measured step's check is the loop's
(:func:`effitrain.loop.check_measured_budget`)."""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import effitrain.levers as lever_registry
from effitrain.config import TrainConfig
from effitrain.distributed import Launch
from effitrain.errors import EffitrainError
from effitrain.estimation import estimate
from effitrain.memory.ledger import format_bytes
from effitrain.plan_screens import device_peak
from effitrain.planning import margin_bytes, plan

QUICK_PLAN_BYTES = 2**29
"""A refused run gets the plan's best configuration where its parameters are at most this many
bytes (the plan then takes seconds); a larger one gets the plan's command to run."""


def check_budget(config: TrainConfig, launch: Launch, budget: int) -> int:
    """``effitrain train --max-memory``: the run's estimate, before any weight is read, against
    ``budget`` with the plan's margin. Returns the estimated peak per device.

    Raises:
        EffitrainError: it will not fit: one line with the overshoot and what fits instead.
    """
    text = config.max_memory or format_bytes(budget).replace(" ", "")
    config = dataclasses.replace(config, max_memory=None)  # the steps, as a plain run takes them
    with _as_one_process():
        result = estimate(config, launch)
    peak = device_peak(result)
    margin = margin_bytes(budget, launch.device_type)
    if peak + margin <= budget:
        return peak
    over = (
        f"{format_bytes(peak)} + {format_bytes(margin)} margin, "
        f"{format_bytes(peak + margin - budget)} over"
    )
    advice = f"find one that fits: effitrain plan --memory {text} (same options)"
    if result.memory.parameter_bytes <= QUICK_PLAN_BYTES:
        # A resume keeps the checkpoint's optimizer (its class: bf16 weights change it) and
        # parameters: only what keeps them, and one answer (with one optimizer, the screens
        # rank alike what the full plan's three verifications would re-rank).
        adapters = lever_registry.trains_adapters(config)
        keep: dict[str, Any] = (
            {
                "optimizers": [config.optim],
                "full_parameter": not adapters,
                "optimizer_class": result.optimizer_class,
                "answers": 1,
            }
            if config.resume
            else {}
        )
        try:
            found = plan(config, launch, budget, workers=0, **keep).candidates
        except EffitrainError:
            found = []
        if found:
            best = found[0]
            advice = (
                f"this fits (peak {format_bytes(best.peak_tensor_bytes)}): {shlex.join(best.args)}"
            )
        else:
            advice = "nothing the plan tries fits it either" + (
                " with the checkpoint's optimizer" if config.resume else ""
            )
    raise EffitrainError(f"--max-memory {text}: the estimated peak per device is {over}; {advice}")


LAUNCH_VARIABLES = (
    *("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    *("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"),
)
"""What ``accelerate launch`` tells its processes that Accelerate reads when it starts."""


@contextmanager
def _as_one_process() -> Iterator[None]:
    """Inside a launched process, the estimate as ``effitrain estimate`` makes it: in one
    process, for the launch it is given (with the launch's variables, the estimate's own
    Accelerator would join the launch's process group, with fake tensors)."""
    saved = {name: os.environ.pop(name) for name in LAUNCH_VARIABLES if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)
