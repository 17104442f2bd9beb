"""Which parameters get which settings: weight decay on >=2-D weights only, and bitsandbytes'
32-bit state for the embeddings (``--fp32-embedding-state``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from effitrain.optim.optimizer_spec import ParamGroups


def param_groups(model: torch.nn.Module, weight_decay: float) -> ParamGroups:
    """Two groups: >=2-D weights decay, biases and norm weights (1-D) do not (as in nanoGPT)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


_BNB_OVERRIDES: set[int] = set()
"""``id()`` of the parameters whose bitsandbytes config effitrain overrode (see below)."""


def embedding_weights(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable weights of ``model``'s ``nn.Embedding`` modules, each once (tied ones too)."""
    import torch

    found = {
        id(module.weight): module.weight
        for module in model.modules()
        if isinstance(module, torch.nn.Embedding) and module.weight.requires_grad
    }
    return list(found.values())


def keep_embeddings_32bit(model: torch.nn.Module | None) -> int:
    """Make bitsandbytes' 8-bit optimizers keep 32-bit state for ``model``'s embedding weights.

    This is what ``Trainer.create_optimizer`` does for every bitsandbytes 8-bit optimizer, and
    what bitsandbytes recommends for stable NLP training. Its ``GlobalOptimManager`` is one per
    process and keyed by ``id(parameter)``, and it reads the override at every step, so the
    overrides of an earlier build in this process are removed first (a freed parameter's id can
    be reused). ``None``: only that removal. Returns the number of parameters overridden.
    """
    from bitsandbytes.optim import GlobalOptimManager

    manager = GlobalOptimManager.get_instance()
    for key in _BNB_OVERRIDES:
        manager.pid2config.pop(key, None)
    _BNB_OVERRIDES.clear()
    if model is None:
        return 0
    weights = embedding_weights(model)
    for weight in weights:
        manager.override_config(weight, "optim_bits", 32)
        _BNB_OVERRIDES.add(id(weight))
    return sum(weight.numel() for weight in weights)
