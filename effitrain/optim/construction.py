"""An optimizer built from its registry entry over a model's trainable parameters: the
parameter groups (:mod:`.groups`), then the spec's factory, or a lever's builder around it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from effitrain.errors import EffitrainError
from effitrain.optim.groups import keep_embeddings_32bit, param_groups
from effitrain.optim.registry import get_spec

if TYPE_CHECKING:
    import torch

    from effitrain.optim.optimizer_spec import OptimizerSpec, ParamGroups


def build_optimizer(
    model: torch.nn.Module,
    spec: OptimizerSpec | str,
    lr: float,
    weight_decay: float,
    *,
    fp32_embedding_state: bool = False,
    builder: Callable[[ParamGroups, OptimizerSpec, float], torch.optim.Optimizer] | None = None,
) -> torch.optim.Optimizer:
    """Build the optimizer ``spec`` (a registry entry or its name) over ``model``'s trainable
    parameters.

    ``weight_decay`` applies to >=2-D weights only (see ``param_groups``).
    ``fp32_embedding_state``: bitsandbytes' 8-bit optimizers keep 32-bit state for embedding
    weights (see ``keep_embeddings_32bit``). ``builder``: how a lever builds the optimizer
    around the spec's factory, ``builder(groups, spec, lr)`` (one per parameter in backward
    hooks, or offloaded: ``effitrain.levers``); such a lever needs a per-parameter spec.

    Raises:
        EffitrainError: unknown optimizer, or its library is not installed.
    """
    spec = get_spec(spec) if isinstance(spec, str) else spec
    if not spec.is_available():
        raise EffitrainError(
            f"optimizer '{spec.name}' needs the '{spec.module}' package, which is not installed: "
            f"{spec.install}"
        )
    groups = param_groups(model, weight_decay)
    kept = 0
    if spec.takes_fp32_embedding_state:  # also clears an earlier build's overrides
        kept = keep_embeddings_32bit(model if fp32_embedding_state else None)
    if builder is not None:
        if spec.model_factory is not None:  # refused with the lever's options; said plainly here
            raise EffitrainError(
                f"--optim {spec.name} is built over the whole model, not one parameter at a time"
            )
        optimizer = builder(groups, spec, lr)
    elif spec.model_factory is not None:
        optimizer = spec.model_factory(model, groups, lr)
    else:
        optimizer = spec.factory(groups, lr)
    if fp32_embedding_state:  # the banner's split line (as Muon's and GaLore's)
        optimizer.split_description = (
            f"32-bit state for the embedding weights ({kept:,} params), 8-bit for the "
            "other tensors of 4096+ elements"
        )
    return optimizer
