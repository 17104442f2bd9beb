"""``--tiled-norm``: every RMSNorm keeps only its input for backward and is recomputed there,
tile by tile (liger-kernel's and unsloth's fused RMSNorm saves the same, in PyTorch).

transformers' RMSNorms (Llama's, Qwen's, Mistral's …) upcast their input to fp32, scale it and
cast it back: autograd keeps the fp32 copy and the scaled bf16 one (3 x hidden x 2 bytes a token
in bf16, per norm, two norms a layer), and their backward makes about five fp32 tensors of the
whole sequence at once. At long lengths under gradient checkpointing these are the largest part
of one layer's recompute. Here each norm runs without grad, keeps its input (the layer's
residual stream, in the model's dtype), and backward recomputes it over tiles
(:func:`effitrain.levers.tiles.recomputed`): one tile's fp32 tensors alive at a time.

A norm is position-wise, so the numbers are the same: the output and the input's gradient
exactly, a trained norm's weight gradient within rounding (summed over tiles). The norms are
found generically: every module whose class name ends in ``RMSNorm`` and whose input is
batch x length x hidden (Qwen3's per-head q/k norms, 4-D, run as they are). The tile count is
ceil(length / hidden size), as ``--tiled-mlp``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from effitrain.config import DECODER_TASKS, MEMORY_LEVERS, OptionGroup, option_field
from effitrain.errors import EffitrainError
from effitrain.levers.spec import Lever, Search
from effitrain.levers.tiles import recomputed, refuse_sharded, tile_count

if TYPE_CHECKING:
    import torch

    from effitrain.config import TrainConfig
    from effitrain.distributed import Launch

UNTILED = "untiled_forward"
"""The attribute a tiled norm keeps its own forward in."""


@dataclass
class TiledNormOptions(OptionGroup):
    """``--tiled-norm``."""

    tiled_norm: bool = option_field(
        False,
        "causal-lm: each RMSNorm keeps only its input and is recomputed tile by tile in "
        "backward, instead of keeping its fp32 copies (a fused RMSNorm's memory, in PyTorch).",
        panel=MEMORY_LEVERS,
    )


class TiledNorm(Lever):
    name = "tiled-norm"
    options = TiledNormOptions
    removes = "the RMSNorms' fp32 copies (3 x hidden a token per norm in bf16) but one tile's"
    task = DECODER_TASKS
    search = Search((False, True), order=42)
    time_cost = "one more forward of every RMSNorm per step (elementwise: about 1 %)"

    def is_on(self, config: TrainConfig) -> bool:
        return TiledNormOptions.of(config).tiled_norm

    def check_launch(self, config: TrainConfig, launch: Launch) -> None:
        refuse_sharded("--tiled-norm", launch)

    def apply_to_model(
        self, model: torch.nn.Module, config: TrainConfig, device: torch.device | None
    ) -> torch.nn.Module:
        tile_norms(model)
        return model

    def banner(self, config: TrainConfig, model: torch.nn.Module) -> str:
        return (
            f"tiled norm: {len(norm_modules(model))} RMSNorms keep their input only, recomputed "
            "per tile in backward"
        )


def norm_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module of ``model`` whose class name ends in ``RMSNorm``."""
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


def tile_norms(model: torch.nn.Module) -> None:
    """Run every RMSNorm of ``model`` through :func:`recomputed` (its ``forward`` replaced on
    the instance, as ``--tiled-mlp`` replaces the MLPs').

    Raises:
        EffitrainError: the model has no RMSNorm.
    """
    import types

    norms = norm_modules(model)
    if not norms:
        raise EffitrainError(
            f"--tiled-norm: {type(model).__name__} has no RMSNorm (a LayerNorm keeps only its "
            "input already); drop --tiled-norm"
        )
    for norm in norms:
        # Bound to the norm: a deep copy (DPO's reference) runs the copy's weight.
        setattr(norm, UNTILED, norm.forward)
        norm.forward = types.MethodType(_tiled_forward, norm)


def _tiled_forward(norm: torch.nn.Module, hidden_states: torch.Tensor, *args: Any) -> Any:
    """``norm``'s forward, recomputed per tile in backward where its input is batch x length x
    hidden; as it is otherwise."""
    forward = getattr(norm, UNTILED)
    if args or hidden_states.dim() != 3:
        return forward(hidden_states, *args)
    count = tile_count(hidden_states.shape[1], hidden_states.shape[-1], None)
    trained = [p for p in norm.parameters() if p.requires_grad]
    return recomputed(forward, count, hidden_states, trained, "--tiled-norm")
