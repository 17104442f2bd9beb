"""What every layer reads of a built run: :class:`RunParts`, its prepared components, and
:class:`Loss`, how a task's loss looks to the run.

Why one type, extended rather than nested: the levers (their moments, metrics, checkpoint
checks), the tasks (evaluation, a loss's moments) and the loop all read the same components. The
levers and the tasks sit below ``effitrain.run`` in docs/architecture.md's layers, so the
components are one frozen dataclass here, below both; :class:`effitrain.run.Run` extends it with
what only the loop reads (the task, the plan, the hyperparameters, the trackers). A run *is* its
parts: the loop reads ``run.model`` as before, and a lever or a task is handed the run itself,
typed as the parts it may read. The loss's protocol lives here too: the parts hold one, and its
moments take the parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from contextlib import AbstractContextManager
    from pathlib import Path

    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import PreTrainedTokenizerBase

    from effitrain.config import TrainConfig
    from effitrain.distributed import Launch
    from effitrain.report.live import Reporter


@dataclass(frozen=True)
class RunParts:
    """The prepared components of one run, each resolved once."""

    config: TrainConfig
    accelerator: Accelerator
    launch: Launch
    """How the run is launched (processes, sharding, device)."""
    data: Any
    """The task's raw data, as its ``load_data`` returned it (``classification.LoadedData`` or
    ``lm_data.LMData``, types of the tasks' layer, above this one; None for an estimate of a
    causal LM, whose shapes need no data)."""
    tokenizer: PreTrainedTokenizerBase | None
    model: torch.nn.Module
    """Prepared by Accelerate (``accelerator.unwrap_model`` gives the model itself)."""
    loss: Loss
    """How a micro-batch's loss is computed (the task's)."""
    optimizer: torch.optim.Optimizer
    """Prepared by Accelerate (its ``.optimizer`` is the one the registry built)."""
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    train_loader: DataLoader[Any]
    """Prepared by Accelerate (an estimate's: a list of fake batches standing in)."""
    eval_loader: DataLoader[Any]
    lever_contexts: dict[str, AbstractContextManager[Any]]
    """What each lever runs each micro-batch's forward and backward in, by lever name."""


class Loss(Protocol):
    """How a task computes a micro-batch's loss."""

    # Read-only: a class attribute or a property will do.
    @property
    def token_weighted(self) -> bool:
        """Whether the loss is a sum that the loop weighs by the step's labelled tokens."""
        ...

    @property
    def name(self) -> str:
        """In the metrics JSON (``loss.implementation``)."""
        ...

    @property
    def chunked(self) -> bool:
        """Whether it computes the logits chunk by chunk, never all at once (the chunked loss)."""
        ...

    @property
    def generates(self) -> bool:
        """Whether :meth:`step_batches` generates with the model (GRPO): the step's memory is
        then measured in two phases, generation and training."""
        ...

    def __call__(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor: ...

    def describe(self) -> list[str]: ...

    def to_dict(self) -> dict[str, Any]: ...

    def window_metrics(self, accelerator: Accelerator) -> dict[str, float]:
        """Its own means since the last log line, on all processes (a preference loss's
        rewards; a collective under several processes); empties its window. Most have none."""
        ...

    def after_prepare(self, run: RunParts) -> None:
        """Once Accelerate prepared the run, before any resume: build what the loss holds
        besides the model (DPO's reference: the model as it starts is copied here)."""
        ...

    def before_training(self, run: RunParts, reporter: Reporter) -> None:
        """After the build and any resume, before the first step of ``fit``: work that a
        checkpoint keeps the result of (DPO's precomputed reference pass); ``reporter`` says
        what it does. Not called by ``effitrain estimate``."""
        ...

    def step_tensors(self) -> list[torch.nn.Module | torch.Tensor]:
        """Modules and tensors it holds through every step (a frozen reference copy): the step
        probe tracks them, so that they are in the measured peak."""
        ...

    def step_batches(
        self,
        run: RunParts,
        batches: list[dict[str, Any]],
        generating: Callable[[], AbstractContextManager[None]],
    ) -> Iterator[list[dict[str, Any]]]:
        """The micro-batches of each optimizer step that one step's read batches make, as the
        loss trains on them, each made before its step's first forward (GRPO: each batch of
        prompts becomes its scored completions inside ``generating``, the context that measures
        the generation phase, and is trained on ``--num-iterations`` times)."""
        ...

    def histories(self) -> dict[str, list[float]]:
        """Per-step series it adds to the metrics JSON (GRPO's ``reward_history``)."""
        ...

    def save_extra(self, run: RunParts, folder: Path) -> None:
        """Write what it keeps in a checkpoint folder besides Accelerate's state (every
        process calls it)."""
        ...

    def load_extra(self, run: RunParts, folder: Path) -> None:
        """Read back what :meth:`save_extra` wrote."""
        ...
