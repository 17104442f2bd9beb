"""``--tiled-mlp``: each decoder layer's MLP runs over tiles of the sequence and is recomputed
tile by tile in backward, so that one tile's intermediates are alive at a time (Arctic Long
Sequence Training's tiled MLP, arXiv 2506.13996).

An MLP is position-wise: its output at a position depends on that position's input alone, so
running it over tiles of the sequence computes the same numbers. The forward runs every tile
without keeping anything but the MLP's input; the backward recomputes one tile with grad, takes
its gradients at once (``torch.autograd.grad``) and frees it before the next. The MLP's
intermediates (the gate, the up projection, the activation and their product: about 4 x tokens
x intermediate size per layer) shrink to one tile's.

The trainable parameters of the MLP (all of them; LoRA's adapters only; QLoRA's adapters on
bitsandbytes' 4-bit layers, the same generic path, CUDA only) are inputs of the autograd
Function, and backward returns their gradients summed over the tiles: each parameter's gradient
is accumulated once per step, as DDP's reducer hooks expect. The random number generator is
replayed in backward as it ran in forward (LoRA's dropout draws the same masks), and autocast
is re-entered as it was. The recompute is counted as recompute FLOPs
(:class:`effitrain.cost.Recompute`). Under ``--gradient-checkpointing`` (non-reentrant) the
checkpoint's recompute of the layer runs the tiled forward once more: the MLP runs three times.

The MLPs are found generically: every module's ``mlp`` attribute (the decoder layers' of
``*ForCausalLM`` models). The tile count is ``--mlp-tiles``, else ceil(length / hidden size)
per batch, as ALST and DeepSpeed's TiledMLP choose: a tile's intermediates are then about as
large as a few of the MLP's weight matrices.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from effitrain.config import DECODER_TASKS, MEMORY_LEVERS, OptionGroup, option_field
from effitrain.errors import EffitrainError
from effitrain.levers.spec import Lever, Search

if TYPE_CHECKING:
    import torch

    from effitrain.config import TrainConfig
    from effitrain.distributed import Launch

MLPForward = Callable[["torch.Tensor"], "torch.Tensor"]
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
        if launch.sharding.sharded:
            # Not run: FSDP gathers a layer's parameters, and ZeRO reduces gradients, by hooks
            # that this Function's recompute in backward has not been checked against.
            raise EffitrainError(
                f"--tiled-mlp is not supported under {launch.sharding.description} (effitrain "
                "has not run its recompute where parameters or gradients are sharded); drop "
                "--tiled-mlp, or use one process or DDP"
            )

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


def tile_count(length: int, hidden_size: int, given: int | None) -> int:
    """How many tiles a sequence of ``length`` runs in: ``given``, else ceil(length /
    hidden size); at least 1, at most one a position."""
    wanted = given if given is not None else math.ceil(length / hidden_size)
    return max(1, min(wanted, length))


def _spans(length: int, tiles: int) -> list[tuple[int, int]]:
    """(start, length) of ``tiles`` tiles of ``length`` positions, their sizes within one."""
    size, extra = divmod(length, tiles)
    spans, start = [], 0
    for index in range(tiles):
        width = size + (index < extra)
        spans.append((start, width))
        start += width
    return spans


def _tiled_forward(
    mlp: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """``mlp``'s forward over tiles of the sequence (dimension 1 of its input)."""
    import torch

    if args or kwargs or hidden_states.dim() != 3:
        raise EffitrainError(
            f"--tiled-mlp: {type(mlp).__name__} takes more than the hidden states "
            "(batch x length x hidden) and cannot be tiled; drop --tiled-mlp"
        )
    forward: MLPForward = getattr(mlp, UNTILED)
    count = tile_count(hidden_states.shape[1], hidden_states.shape[-1], getattr(mlp, TILES))
    if not torch.is_grad_enabled():  # evaluation: nothing to recompute
        return _run_tiles(forward, hidden_states, count)
    trained = [p for p in mlp.parameters() if p.requires_grad]
    output: torch.Tensor = _function().apply(forward, count, hidden_states, *trained)
    return output


def _run_tiles(forward: MLPForward, hidden_states: torch.Tensor, tiles: int) -> torch.Tensor:
    """``forward`` over each tile, without grad, written into one output."""
    import torch

    output: torch.Tensor | None = None
    # Detached: a view made without grad of an input that requires it would still say it
    # requires grad, with no grad_fn (module hooks, the memory probe's, would trip on it).
    detached = hidden_states.detach()
    for start, width in _spans(hidden_states.shape[1], tiles):
        part = forward(detached.narrow(1, start, width))
        if not isinstance(part, torch.Tensor) or part.shape[:-1] != (
            hidden_states.shape[0],
            width,
        ):
            raise EffitrainError(
                f"--tiled-mlp: an MLP returned {type(part).__name__}, not one tensor per "
                "position (a mixture of experts?); drop --tiled-mlp"
            )
        if output is None:
            output = part.new_empty((*hidden_states.shape[:-1], part.shape[-1]))
        output.narrow(1, start, width).copy_(part)
        del part  # freed before the next tile's
    assert output is not None  # a sequence has at least one tile
    return output


@functools.cache
def _function() -> type[torch.autograd.Function]:
    """The autograd Function (made on first use: torch is not imported with the levers)."""
    import torch
    from torch.utils.checkpoint import get_device_states, set_device_states

    from effitrain.cost import Recompute

    class TiledMLPFunction(torch.autograd.Function):
        """forward(mlp_forward, tiles, hidden_states, *trained_parameters): the MLP's output,
        keeping only its input; backward recomputes and differentiates one tile at a time."""

        @staticmethod
        def forward(
            ctx: Any,
            forward: MLPForward,
            tiles: int,
            hidden_states: torch.Tensor,
            *trained: torch.Tensor,
        ) -> torch.Tensor:
            device_type = hidden_states.device.type
            ctx.forward, ctx.tiles, ctx.device_type = forward, tiles, device_type
            ctx.cpu_rng = torch.get_rng_state()
            ctx.devices, ctx.device_rng = get_device_states(hidden_states)
            ctx.autocast = (
                torch.is_autocast_enabled(device_type),
                torch.get_autocast_dtype(device_type),
            )
            ctx.save_for_backward(hidden_states, *trained)
            return _run_tiles(forward, hidden_states, tiles)

        @staticmethod
        def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            hidden_states, *trained = ctx.saved_tensors
            wants_input = ctx.needs_input_grad[2]
            grad_input = torch.empty_like(hidden_states) if wants_input else None
            sums: list[torch.Tensor | None] = [None] * len(trained)
            enabled, dtype = ctx.autocast
            with (
                torch.random.fork_rng(devices=ctx.devices, device_type=ctx.device_type),
                # Outer saved-tensor hooks (the activation offload's) are not for a tile's
                # tensors, which live only until its gradients are taken.
                torch.autograd.graph.saved_tensors_hooks(_same, _same),
            ):
                # The tiles draw the random numbers they drew in forward (LoRA's dropout).
                torch.set_rng_state(ctx.cpu_rng)
                set_device_states(ctx.devices, ctx.device_rng, device_type=ctx.device_type)
                # Each tile a view of one detached input: not a leaf, which module hooks that
                # watch gradients (FlopCounterMode's, the memory probe's) refuse in autograd.grad.
                source = hidden_states.detach().requires_grad_(wants_input)
                for start, width in _spans(hidden_states.shape[1], ctx.tiles):
                    with (
                        torch.enable_grad(),
                        torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled),
                        Recompute(),
                    ):
                        part = source.narrow(1, start, width)
                        output = ctx.forward(part)
                    inputs = [part, *trained] if wants_input else trained
                    grads = list(
                        torch.autograd.grad(
                            output,
                            inputs,
                            grad_output.narrow(1, start, width),
                            allow_unused=True,
                        )
                    )
                    del output  # this tile's intermediates go with its graph
                    if wants_input:
                        assert grad_input is not None
                        grad_input.narrow(1, start, width).copy_(grads.pop(0))
                    for index, grad in enumerate(grads):
                        # A weight's gradient is a new tensor (a matmul's): added in place.
                        if grad is not None:
                            total = sums[index]
                            sums[index] = grad if total is None else total.add_(grad)
            return (None, None, grad_input, *sums)

    return TiledMLPFunction


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
