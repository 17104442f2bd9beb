"""What an optimizer registry entry says: :class:`OptimizerSpec` (how to build it, what state it
keeps) and its :class:`Defaults` for each regime (:data:`SCRATCH`, :data:`FINE_TUNE`).

Nothing heavy is imported: the table (:mod:`.registry`) is read by ``effitrain optimizers``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ParamGroups = list[dict[str, Any]]

SCRATCH, FINE_TUNE = "training from scratch", "fine-tuning"
"""The two regimes with their own defaults: a built-in preset (random init) or pretrained weights
(a hub id or a folder saved with save_pretrained)."""


@dataclass(frozen=True)
class Defaults:
    """What a run uses when the options leave lr, warmup or schedule open."""

    lr: float
    warmup_ratio: float
    scheduler: str


@dataclass(frozen=True)
class OptimizerSpec:
    """One registry entry."""

    name: str
    class_path: str
    """Dotted path of the optimizer class, e.g. torch.optim.AdamW."""
    module: str
    """Module that must be importable for this optimizer."""
    install: str
    """What to install when ``module`` is missing."""
    scratch: Defaults
    """Defaults for the built-in presets, trained from random init."""
    fine_tune: Defaults
    """Defaults for pretrained weights, chosen on real checkpoints (benchmarks/finetune/)."""
    description: str
    state: str
    """The state it keeps per parameter tensor."""
    factory: Callable[[ParamGroups, float], torch.optim.Optimizer]
    caveat: str = ""
    """Where its defaults are known not to learn (shown by ``effitrain optimizers``)."""
    state_bytes_note: str = ""
    """What explains its measured bytes per parameter (``state_bytes_per_param``), shown beside
    the figure, e.g. 'tensors < 4096 elements keep fp32 state: 8'. Never the figure itself."""
    lora: Defaults | None = None
    """Defaults for LoRA adapters on pretrained weights (``--lora-rank``), where the fine-tuning
    benchmark chose them (benchmarks/finetune/); None: the fine-tuning defaults."""
    model_factory: Callable[[torch.nn.Module, ParamGroups, float], torch.optim.Optimizer] | None = (
        None
    )
    """For optimizers that must see the model, not only its parameter groups (Muon's split of
    hidden matrices from embeddings and head, GaLore's and APOLLO's projected matrices,
    Adam-mini's blocks): ``model_factory(model, groups, lr)`` is used instead of ``factory``.
    Such an optimizer is not per-parameter, so ``--optimizer-in-backward`` refuses it."""

    @property
    def per_parameter(self) -> bool:
        """Whether it can be built over one parameter at a time (``--optimizer-in-backward``)."""
        return self.model_factory is None

    @property
    def takes_fp32_embedding_state(self) -> bool:
        """bitsandbytes' 8-bit optimizers: ``--fp32-embedding-state`` can keep the embeddings'
        state in 32 bits (see ``keep_embeddings_32bit``)."""
        return self.module == "bitsandbytes"

    def is_available(self) -> bool:
        return importlib.util.find_spec(self.module) is not None

    def defaults(self, regime: str) -> Defaults:
        """The defaults for ``SCRATCH`` or ``FINE_TUNE``."""
        return self.scratch if regime == SCRATCH else self.fine_tune
