"""What a built run holds in memory, by part: :func:`memory_record`, called on a trained run by
``effitrain train`` and on a run of fake tensors by ``effitrain estimate``, so the estimate is
the run's own measurement, made by the same code."""

from __future__ import annotations

from typing import TYPE_CHECKING

import effitrain.levers as levers
from effitrain.memory import ledger
from effitrain.memory.step import StepMemory
from effitrain.results import Baseline, MemoryRecord

if TYPE_CHECKING:
    from effitrain.progress import TrainingProgress
    from effitrain.run import Run


def memory_record(run: Run, progress: TrainingProgress) -> MemoryRecord:
    """The parameters, gradients and optimizer state from their storage now, the measured
    step's breakdown (``progress.step_memory``), the levers' own fields and rows, and the fp32
    AdamW baseline of the same model."""
    model, optimizer = run.model, run.optimizer
    step = StepMemory.from_dict(progress.step_memory)
    lever_fields = levers.metrics(run)
    original = levers.original_parameters(run.accelerator.unwrap_model(model))
    return MemoryRecord(
        optimizer_state=ledger.optimizer_state_ledger(optimizer),
        parameter_bytes=ledger.parameter_bytes(model),
        trainable_parameters=ledger.trainable_parameter_count(model),
        trainable_parameter_bytes=ledger.trainable_parameter_bytes(model),
        # With the step measured by kind: the gradients' own peak (the optimizer step in
        # backward frees them one by one); else what existed after the first backward.
        gradient_bytes=(
            step.kind_peaks.get("gradients", progress.gradient_bytes)
            if step
            else progress.gradient_bytes
        ),
        adamw_equivalent_bytes=ledger.adamw_equivalent_bytes(model),
        adamw_equivalent_elements=ledger.adamw_equivalent_elements(model),
        baseline=Baseline(**ledger.fp32_adamw_baseline(original)),
        levers=levers.in_use(run),
        loss=run.loss.to_dict(),
        step_memory=step,
        generation_memory=StepMemory.from_dict(progress.generation_memory),
        lever_fields=lever_fields,
        lever_rows=levers.memory_rows(lever_fields, step),
    )
