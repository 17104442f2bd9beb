"""``--gradient-checkpointing``: recompute each layer's activations in backward instead of
keeping them, with the model's own (transformers') non-reentrant activation checkpointing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from effitrain.config import MEMORY_LEVERS, OptionGroup, option_field
from effitrain.errors import EffitrainError
from effitrain.levers.spec import Lever, Search

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from effitrain.config import TrainConfig


@dataclass
class GradientCheckpointingOptions(OptionGroup):
    """``--gradient-checkpointing``."""

    gradient_checkpointing: bool = option_field(
        False,
        "Recompute activations in backward instead of keeping them (the model's own "
        "activation checkpointing, non-reentrant).",
        panel=MEMORY_LEVERS,
    )


class GradientCheckpointing(Lever):
    name = "gradient-checkpointing"
    options = GradientCheckpointingOptions
    removes = "most activations (each layer's are recomputed in backward)"
    search = Search((False, True), order=40)
    time_cost = "one more forward of every layer per step (about a third more compute)"

    def is_on(self, config: TrainConfig) -> bool:
        return GradientCheckpointingOptions.of(config).gradient_checkpointing

    def apply_to_model(
        self, model: torch.nn.Module, config: TrainConfig, device: torch.device | None
    ) -> torch.nn.Module:
        enable(model)
        return model

    def banner(self, config: TrainConfig, model: torch.nn.Module) -> str:
        return "gradient checkpointing (non-reentrant: activations recomputed in backward)"


def _recompute_contexts() -> tuple[Any, Any]:
    """``torch.utils.checkpoint``'s contexts: none around the forward, ``Recompute`` around the
    recompute."""
    from contextlib import nullcontext

    from effitrain.cost import Recompute

    return nullcontext(), Recompute()


def enable(model: torch.nn.Module) -> None:
    """Recompute each layer's activations in backward: the model's own (transformers'
    ``activation_checkpointing_enable``, formerly ``gradient_checkpointing_enable``),
    non-reentrant implementation (the reentrant one needs inputs that require grad and breaks
    with frozen embeddings).

    Raises:
        EffitrainError: the architecture has no gradient checkpointing.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise EffitrainError(
            f"--gradient-checkpointing: {type(model).__name__} does not support gradient "
            "checkpointing in transformers; drop the option or choose another model"
        )
    # The recompute runs inside effitrain.cost.Recompute, so that its FLOPs are told apart.
    kwargs = {"use_reentrant": False, "context_fn": _recompute_contexts}
    pretrained = cast("PreTrainedModel", model)  # the task's: no lever before it wraps it
    if hasattr(pretrained, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        pretrained.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        pretrained.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
