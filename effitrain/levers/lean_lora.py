"""``--lean-lora``: LoRA's adapters keep no copy of their input for backward; each recomputes
its cast, dropout and down-projection there from the adapted layer's own input.

peft computes ``lora_B(lora_A(dropout(x.to(A's dtype))))`` beside the frozen layer: with fp32
adapters on a bf16 model, autograd keeps an fp32 copy of ``x`` per adapted layer, and with
dropout on also its mask and its dropped-out copy (2 x 4 bytes, plus 4, a token per input
feature, for each of q, k, v, o, gate, up and down). At long lengths that is most of one layer's
recompute. Here each adapter's ``lora_A`` runs through :func:`effitrain.levers.tiles.recomputed`
(one tile): it keeps the input as the layer received it (the model's dtype, shared by q, k and
v), and backward recomputes the cast, the dropout (the random state replayed: the same mask)
and the rank-r projection. The numbers are peft's own: the same operations in the same order.

It applies to peft's plain LoRA ``Linear`` layers (bitsandbytes' 4- and 8-bit ones included),
not to DoRA or other variants, and to batch x length x features inputs (other shapes run as
peft runs them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from effitrain.config import MEMORY_LEVERS, OptionGroup, option_field
from effitrain.errors import EffitrainError
from effitrain.levers.lora import adapters_on
from effitrain.levers.spec import Lever, Search
from effitrain.levers.tiles import recomputed, refuse_sharded

if TYPE_CHECKING:
    import torch

    from effitrain.config import TrainConfig
    from effitrain.distributed import Launch

DROPOUT, CASTS = "lean_dropout", "lean_casts_under_autocast"
"""What a lean ``lora_A`` keeps of the layer it belongs to: the dropout's probability (peft's
dropout module is replaced by an identity), and whether peft casts its input to the adapter's
dtype under autocast too (its plain Linear does; its bitsandbytes layers leave that to
autocast)."""


@dataclass
class LeanLoRAOptions(OptionGroup):
    """``--lean-lora``."""

    lean_lora: bool = option_field(
        False,
        "LoRA: the adapters keep no fp32 or dropped-out copy of their input for backward "
        "(peft keeps one or two per adapted layer); they recompute it there.",
        panel=MEMORY_LEVERS,
    )


class LeanLoRA(Lever):
    name = "lean-lora"
    options = LeanLoRAOptions
    removes = "the adapters' copies of their inputs (fp32 casts, dropout masks and outputs)"
    search = Search((False, True), order=35)
    time_cost = "one more cast, dropout and rank-r projection of each adapter's input per step"

    def is_on(self, config: TrainConfig) -> bool:
        return LeanLoRAOptions.of(config).lean_lora

    def check(self, config: TrainConfig) -> None:
        if self.is_on(config) and not adapters_on(config):
            raise EffitrainError(
                "--lean-lora needs --lora-rank R (it changes how LoRA's adapters keep their "
                "inputs); add --lora-rank 16, or drop --lean-lora"
            )

    def check_launch(self, config: TrainConfig, launch: Launch) -> None:
        refuse_sharded("--lean-lora", launch)

    def apply_to_model(
        self, model: torch.nn.Module, config: TrainConfig, device: torch.device | None
    ) -> torch.nn.Module:
        lean(model)
        return model

    def banner(self, config: TrainConfig, model: torch.nn.Module) -> str:
        return (
            f"lean LoRA: {len(_adapted(model))} adapters recompute their inputs' cast and "
            "dropout in backward"
        )


def _adapted(model: torch.nn.Module) -> list[torch.nn.Module]:
    """peft's plain LoRA Linear layers in ``model`` (bitsandbytes' included; not DoRA's)."""
    import torch

    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict)
        and isinstance(getattr(m, "base_layer", None), torch.nn.Linear)
        and not getattr(m, "lora_variant", None)
    ]


def lean(model: torch.nn.Module) -> None:
    """Make every adapter of ``model``'s plain LoRA Linear layers recompute its input in
    backward: peft's cast and dropout move into ``lora_A``'s forward, which runs through
    :func:`recomputed`.

    Raises:
        EffitrainError: the model has no such adapter.
    """
    import types

    import torch

    layers = _adapted(model)
    if not layers:
        raise EffitrainError(
            "--lean-lora: the model has no plain LoRA Linear layer (DoRA and other variants "
            "keep their own); drop --lean-lora"
        )
    for layer in layers:
        casts = not type(layer).__module__.endswith(".bnb")
        # lora_A casts, inside the recompute (peft's _cast_input_dtype reads this flag; set
        # by name: typed as a module, the layer's attributes are tensors or modules).
        setattr(layer, "cast_input_dtype_enabled", False)  # noqa: B010
        downs = cast("torch.nn.ModuleDict", layer.lora_A)
        dropouts = cast("torch.nn.ModuleDict", layer.lora_dropout)
        for adapter, down in downs.items():
            dropout = dropouts[adapter]
            setattr(down, DROPOUT, dropout.p if isinstance(dropout, torch.nn.Dropout) else 0.0)
            setattr(down, CASTS, casts)
            dropouts[adapter] = torch.nn.Identity()
            # Bound to the module: a deep copy (DPO's reference) runs the copy's weight.
            down.forward = types.MethodType(_lean_forward, down)


def _lean_forward(down: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``lora_A(dropout(cast(x)))``, recomputed in backward from ``x``."""
    branch = functools.partial(_branch, down)
    if x.dim() != 3:
        return branch(x)
    trained = [p for p in down.parameters() if p.requires_grad]
    return recomputed(branch, 1, x, trained, "--lean-lora")


def _branch(down: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """What peft computes of an adapter's input before ``lora_B``: the cast to the adapter's
    dtype where peft casts, the dropout, the down-projection."""
    import torch
    import torch.nn.functional as F

    if getattr(down, CASTS) or not torch.is_autocast_enabled(x.device.type):
        x = x.to(down.weight.dtype)
    x = F.dropout(x, getattr(down, DROPOUT), down.training)
    return F.linear(x, down.weight, down.bias)
