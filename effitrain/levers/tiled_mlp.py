"""``--tiled-mlp``: each decoder layer's MLP runs over tiles of the sequence and is recomputed
tile by tile in backward, so that one tile's intermediates are alive at a time (Arctic Long
Sequence Training's tiled MLP, arXiv 2506.13996).

An MLP is position-wise: its output at a position depends on that position's input alone, so
it runs over tiles of the sequence and is recomputed tile by tile in backward
(:func:`effitrain.levers.tiles.recomputed`: the gradients, the dropout's replay, the FLOPs). The
MLP's intermediates (the gate, the up projection, the activation and their product: about 4 x
tokens x intermediate size per layer) shrink to one tile's. Under ``--gradient-checkpointing``
(non-reentrant) the checkpoint's recompute of the layer runs the tiled forward once more: the
MLP runs three times.

The MLPs are found generically: every module's ``mlp`` attribute (the decoder layers' of
``*ForCausalLM`` models). The tile count is ``--mlp-tiles``, else ceil(length / hidden size)
per batch, as ALST and DeepSpeed's TiledMLP choose: a tile's intermediates are then about as
large as a few of the MLP's weight matrices.
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

UNTILED, TILES = "untiled_forward", "mlp_tiles"
"""The attributes a tiled MLP keeps its own forward and its tile count (None: auto) in."""


@dataclass
class TiledMLPOptions(OptionGroup):
    """``--tiled-mlp, --mlp-tiles``."""

    tiled_mlp: bool = option_field(
        False,
        "causal-lm: run each layer's MLP over tiles of the sequence, recomputed tile by tile "
        "in backward, so one tile's intermediates are alive at a time (ALST's tiled MLP).",
        panel=MEMORY_LEVERS,
    )
    mlp_tiles: int | None = option_field(
        None,
        "Tiles of the sequence for --tiled-mlp (default: length / hidden size, rounded up).",
        panel=MEMORY_LEVERS,
        metavar="N",
    )


class TiledMLP(Lever):
    name = "tiled-mlp"
    options = TiledMLPOptions
    removes = "the MLPs' intermediates (4 x tokens x intermediate size a layer) but one tile's"
    task = DECODER_TASKS
    search = Search((False, True), order=45)
    time_cost = "one more forward of every MLP per step (recomputed per tile in backward)"

    def is_on(self, config: TrainConfig) -> bool:
        return TiledMLPOptions.of(config).tiled_mlp

    def check(self, config: TrainConfig) -> None:
        options = TiledMLPOptions.of(config)
        if options.mlp_tiles is None:
            return
        if not options.tiled_mlp:
            raise EffitrainError(
                "--mlp-tiles needs --tiled-mlp (the MLP is not tiled without it); add "
                "--tiled-mlp, or drop --mlp-tiles"
            )
        if options.mlp_tiles < 1:
            raise EffitrainError(f"--mlp-tiles must be at least 1 (got {options.mlp_tiles})")

    def check_launch(self, config: TrainConfig, launch: Launch) -> None:
        refuse_sharded("--tiled-mlp", launch)

    def apply_to_model(
        self, model: torch.nn.Module, config: TrainConfig, device: torch.device | None
    ) -> torch.nn.Module:
        tile(model, TiledMLPOptions.of(config).mlp_tiles)
        return model

    def banner(self, config: TrainConfig, model: torch.nn.Module) -> str:
        given = TiledMLPOptions.of(config).mlp_tiles
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        if given is not None:
            tiles = f"{given} tiles"
        elif hidden:
            at = tile_count(config.max_length, hidden, None)
            tiles = f"length / {hidden} tiles ({at} at {config.max_length} tokens)"
        else:
            tiles = "length / hidden size tiles"
        return (
            f"tiled MLP: {len(mlp_modules(model))} MLPs over {tiles} of the sequence, each "
            "tile recomputed in backward"
        )


def mlp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers' MLPs: every module's ``mlp`` attribute that is a module, once."""
    import torch

    found = (getattr(module, "mlp", None) for module in model.modules())
    return list(dict.fromkeys(mlp for mlp in found if isinstance(mlp, torch.nn.Module)))


def tile(model: torch.nn.Module, tiles: int | None) -> None:
    """Run every MLP of ``model`` (:func:`mlp_modules`) over ``tiles`` sequence tiles (None:
    :func:`tile_count`'s): each MLP's ``forward`` is replaced on the instance, so its
    parameters, their names and what wraps them later (peft's adapters) stay as they are.

    Raises:
        EffitrainError: the model has no MLP to tile.
    """
    import types

    mlps = mlp_modules(model)
    if not mlps:
        raise EffitrainError(
            f"--tiled-mlp: {type(model).__name__} has no decoder-layer MLP (a module's 'mlp') "
            "to tile; drop --tiled-mlp"
        )
    for mlp in mlps:
        # Methods bound to the MLP, not closures over it: a deep copy of the model (DPO's
        # reference copy) binds them to the copied MLP, which then runs its own weights.
        setattr(mlp, UNTILED, mlp.forward)
        setattr(mlp, TILES, tiles)
        mlp.forward = types.MethodType(_tiled_forward, mlp)


def _tiled_forward(
    mlp: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """``mlp``'s forward over tiles of the sequence (dimension 1 of its input)."""
    if args or kwargs or hidden_states.dim() != 3:
        raise EffitrainError(
            f"--tiled-mlp: {type(mlp).__name__} takes more than the hidden states "
            "(batch x length x hidden) and cannot be tiled; drop --tiled-mlp"
        )
    count = tile_count(hidden_states.shape[1], hidden_states.shape[-1], getattr(mlp, TILES))
    trained = [p for p in mlp.parameters() if p.requires_grad]
    return recomputed(getattr(mlp, UNTILED), count, hidden_states, trained, "--tiled-mlp")
