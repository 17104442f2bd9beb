"""A built run: :class:`Run`, every component the loop needs, made in one pass by
:func:`effitrain.build.build_run` (and, on fake tensors, by ``effitrain estimate``), and its
:class:`Plan`, how long it trains. A run is its :class:`~effitrain.parts.RunParts` (what the
levers and the tasks read) and what only the loop reads."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from effitrain.errors import EffitrainError
from effitrain.parts import RunParts

if TYPE_CHECKING:
    from effitrain.config import TrainConfig
    from effitrain.optim import Hyperparameters, OptimizerSpec
    from effitrain.tasks.base import Task
    from effitrain.tracking import Trackers


@dataclass(frozen=True)
class Plan:
    """How long the run is, in optimizer steps on each process."""

    steps_per_epoch: int
    total_steps: int
    epochs: int
    warmup_steps: int
    generation_period: int = 1
    """GRPO's ``--num-iterations`` N: a step whose number is a multiple of N generates, the
    next N - 1 train on its completions again (1: every step is alike)."""

    @classmethod
    def from_config(cls, config: TrainConfig, num_batches: int, warmup_ratio: float) -> Plan:
        """``num_batches``: micro-batches per epoch on this process; ``warmup_ratio``: the
        resolved one (the optimizer's default where not given), used without --warmup-steps.

        Raises:
            EffitrainError: the training set yields no optimizer step.
        """
        from effitrain.tasks.sources import steps_per_epoch

        # GRPO trains on each step's generated completions --num-iterations times (TRL's
        # RepeatSampler makes its epochs as many times longer); 1 for every other task.
        per_epoch = steps_per_epoch(num_batches, config.grad_accum) * config.num_iterations
        if per_epoch == 0:
            raise EffitrainError(
                "the training set yields no batches; check --batch-size and the data"
            )
        total = config.max_steps or per_epoch * config.epochs
        warmup = (
            config.warmup_steps
            if config.warmup_steps is not None
            else math.ceil(total * warmup_ratio)
        )
        return cls(per_epoch, total, math.ceil(total / per_epoch), warmup, config.num_iterations)

    @property
    def measured_step(self) -> int:
        """The optimizer step (0-based) whose memory is broken down by kind: the last, or the one
        before it where the last ends an epoch (its batch can be the epoch's short remainder)
        and the epoch has another, but never the first step of a longer run: optimizers create
        their state in their first step, so its backward runs without it and under-states every
        later step. Why late in the run: ``effitrain.loop.measure_now``. Under
        ``--num-iterations`` N, the same with N steps in place of one, then the step that
        generated them (:meth:`generating`): so both of its phases are measured."""
        n, last = self.generation_period, self.total_steps - 1
        if self.total_steps % self.steps_per_epoch == 0 and self.steps_per_epoch > n and last > n:
            return self.generating(last - n)
        return self.generating(last)

    def generating(self, step: int) -> int:
        """The step at or before ``step`` that generates, unless that is the run's first (where
        the optimizer's state does not exist yet) and ``step`` is later: then ``step``, whose
        generation phase is not measured (a run of N steps or fewer)."""
        start = step // self.generation_period * self.generation_period
        return step if start == 0 < step else start


@dataclass(frozen=True)
class Run(RunParts):
    """The prepared components of one run, each resolved once: its parts, and what only the
    loop reads."""

    task: Task
    plan: Plan
    hyperparameters: Hyperparameters
    """The lr and schedule used: the options', else the optimizer's defaults."""
    optimizer_spec: OptimizerSpec
    """The registry entry built, with the levers' and the sharding's variants in place."""
    max_grad_norm: float
    """The clipping threshold used (0: none)."""
    trackers: Trackers
    weights: str = "read"
    """How this process got the model's weights (``effitrain.distributed.RankMemory.weights``):
    ``read``, or ``from rank 0`` where the launch sent them."""
