"""When the loop saves (:class:`CheckpointPolicy`) and the component that saves for it
(:class:`Checkpointer`): the loop asks at three moments and computes no flags of its own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from effitrain.checkpoint.metadata import build_metadata, step_counters
from effitrain.checkpoint.saving import save_checkpoint
from effitrain.optim import set_train_mode

if TYPE_CHECKING:
    from accelerate import Accelerator

    from effitrain.config import TrainConfig
    from effitrain.progress import TrainingProgress


@dataclass(frozen=True)
class CheckpointPolicy:
    """When the loop saves: it asks at three moments and computes no flags of its own.

    - after an optimizer step: every ``--save-every`` steps, except at an epoch's last step (or
      the run's), whose checkpoint waits for the evaluation so that a resume does not evaluate
      that epoch again;
    - after an evaluation: at the end of every epoch with ``--save-strategy epoch``, at the end
      of the run, and at a ``--save-every`` step that the rule above postponed;
    - on a stop signal: whenever there is an ``--output-dir``, even with ``--save-strategy no``.
    """

    periodic: bool
    """Checkpoints during the run (``--save-every`` or ``--save-strategy epoch``, with a folder)."""
    on_stop: bool
    """A stop signal saves one (there is an ``--output-dir``)."""
    save_every: int | None
    every_epoch: bool
    total_steps: int
    steps_per_epoch: int

    @classmethod
    def from_config(
        cls, config: TrainConfig, total_steps: int, steps_per_epoch: int
    ) -> CheckpointPolicy:
        return cls(
            periodic=config.saves_checkpoints,
            on_stop=bool(config.output_dir),
            save_every=config.save_every,
            every_epoch=config.save_strategy == "epoch",
            total_steps=total_steps,
            steps_per_epoch=steps_per_epoch,
        )

    def _every(self, step: int) -> bool:
        return bool(self.save_every) and step % self.save_every == 0

    def save_after_step(self, step: int, step_in_epoch: int) -> bool:
        at_boundary = step_in_epoch >= self.steps_per_epoch or step >= self.total_steps
        return self.periodic and self._every(step) and not at_boundary

    def save_after_evaluation(self, step: int) -> bool:
        due = self.every_epoch or step >= self.total_steps or self._every(step)
        return self.periodic and due


class Checkpointer:
    """Saves the run's checkpoints when its :class:`CheckpointPolicy` says so.

    Every process calls its methods (saving is a collective); each save is written by
    :func:`save_checkpoint`, with the optimizer's identity and the model's parameter names and
    shapes in ``effitrain.json``.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        config: TrainConfig,
        policy: CheckpointPolicy,
        optimizer: Any,
        optimizer_name: str,
        optimizer_class: str,
        param_names: list[str],
        parameter_shapes: dict[str, list[int]],
        lr_scheduler: Any = None,
        schedule: dict[str, Any] | None = None,
        save_extra: Callable[[Path], None] | None = None,
    ) -> None:
        self.accelerator = accelerator
        self.config = config
        self.policy = policy
        self.optimizer = optimizer
        self.optimizer_name = optimizer_name
        self.optimizer_class = optimizer_class
        self.param_names = param_names
        self.parameter_shapes = parameter_shapes
        self.lr_scheduler = lr_scheduler
        self.schedule = schedule or {}
        """The run's lr schedule (lr, scheduler, warmup and total steps), recorded for resumes."""
        self.save_extra = save_extra
        """Writes what the loss keeps in a checkpoint besides Accelerate's state (DPO's
        precomputed reference)."""
        self.last_saved_step = -1
        """A resumed run starts with its checkpoint's step: that one is not written again."""
        self.last_path: Path | None = None

    def save(self, progress: TrainingProgress) -> Path:
        """Write ``checkpoint-<global step>`` now (all processes).

        Always in the optimizer's train mode (schedule-free), whatever it was in: a resumed run
        continues from the very weights and state that the uninterrupted run trains on."""
        set_train_mode(self.optimizer, True)
        metadata = build_metadata(
            config=self.config,
            progress=progress.state_dict(),
            optimizer_name=self.optimizer_name,
            optimizer_class=self.optimizer_class,
            param_groups=self.optimizer.param_groups,
            param_names=self.param_names,
            parameter_shapes=self.parameter_shapes,
            world_size=self.accelerator.num_processes,
            mixed_precision=self.accelerator.mixed_precision,
            counters=step_counters(self.optimizer, self.lr_scheduler),
            schedule=self.schedule,
        )
        path = save_checkpoint(
            self.accelerator,
            self.config.output_dir,
            metadata,
            self.config.save_total_limit,
            self.save_extra,
        )
        self.last_saved_step, self.last_path = progress.global_step, path
        return path

    def after_step(self, progress: TrainingProgress) -> Path | None:
        if self.policy.save_after_step(progress.global_step, progress.step_in_epoch):
            return self.save(progress)
        return None

    def after_evaluation(self, progress: TrainingProgress) -> Path | None:
        step = progress.global_step
        if self.policy.save_after_evaluation(step) and self.last_saved_step != step:
            return self.save(progress)
        return None

    def on_stop(self, progress: TrainingProgress) -> Path | None:
        return self.save(progress) if self.policy.on_stop else None
