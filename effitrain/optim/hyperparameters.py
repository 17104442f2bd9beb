"""The lr and schedule a run uses: the options', else its optimizer's defaults for the regime
(from scratch, fine-tuning, LoRA adapters), divided where the task asks (:class:`LrDivisor`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from effitrain.models import is_preset
from effitrain.optim.optimizer_spec import FINE_TUNE, SCRATCH
from effitrain.optim.registry import get_spec

if TYPE_CHECKING:
    from effitrain.config import TrainConfig


@dataclass(frozen=True)
class Hyperparameters:
    """The lr and schedule a run uses: the ones given, else the optimizer's defaults."""

    lr: float
    warmup_ratio: float
    scheduler: str
    lr_note: str
    """Why this lr when it was not given, e.g. 'adafactor default for fine-tuning'."""
    schedule_note: str
    """Why this schedule, when neither it nor the warmup was given."""


@dataclass(frozen=True)
class LrDivisor:
    """A task's own divisor of the optimizer's lr on pretrained weights (the fine-tuning or LoRA
    default; a given ``--lr`` is left alone), with the words the banner's note gives it."""

    divisor: int
    purpose: str
    """For what, e.g. 'preference tuning' (the note: '... / 40 for preference tuning')."""


def resolve_hyperparameters(
    config: TrainConfig, adapters: bool = False, lr_divisor: LrDivisor | None = None
) -> Hyperparameters:
    """``--lr``, ``--scheduler`` and ``--warmup-ratio``, each from the options or, when not
    given, from the optimizer's defaults for this run: a preset trains from scratch, pretrained
    weights fine-tune, and LoRA ``adapters`` on pretrained weights have their own where
    measured; the task's ``lr_divisor`` (its ``Task.lr_divisor``) divides the lr on pretrained
    weights."""
    spec = get_spec(config.optim)
    regime = SCRATCH if is_preset(config.model) else FINE_TUNE
    defaults = spec.defaults(regime)
    why = f"{spec.name} default for {regime}"
    if adapters and regime == FINE_TUNE and spec.lora is not None:
        defaults, why = spec.lora, f"{spec.name} default for LoRA"
    if lr_divisor is not None and regime == FINE_TUNE:
        defaults = dataclasses.replace(defaults, lr=defaults.lr / lr_divisor.divisor)
        why = f"{why} / {lr_divisor.divisor} for {lr_divisor.purpose}"
    schedule_given = (config.scheduler, config.warmup_ratio, config.warmup_steps) != (None,) * 3
    return Hyperparameters(
        lr=config.lr if config.lr is not None else defaults.lr,
        warmup_ratio=(
            config.warmup_ratio if config.warmup_ratio is not None else defaults.warmup_ratio
        ),
        scheduler=config.scheduler if config.scheduler is not None else defaults.scheduler,
        lr_note="" if config.lr is not None else why,
        schedule_note="" if schedule_given else why,
    )
