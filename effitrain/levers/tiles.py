"""Position-wise modules recomputed in backward, tile by tile: the one autograd Function behind
``--tiled-mlp``, ``--tiled-norm`` and ``--lean-lora``.

A position-wise module (an MLP, an RMSNorm, a Linear) computes each position's output from that
position's input alone, so it can run over tiles of the sequence (dimension 1) and give the same
numbers. :func:`recomputed` runs it without grad, keeps only its input (and its trained
parameters, which are inputs of the Function), and in backward recomputes one tile at a time
with grad, takes that tile's gradients at once (``torch.autograd.grad``) and frees it before the
next: what the module would have kept for backward is never alive for more than one tile.

Each trained parameter's gradient is returned once per backward, summed over the tiles: it is
accumulated once per step, as DDP's reducer hooks expect. The random number generator is
replayed in backward as it ran in forward (LoRA's dropout draws the same masks), and autocast is
re-entered as it was. The recompute is counted as recompute FLOPs
(:class:`effitrain.cost.Recompute`). Outer saved-tensor hooks (the activation offload's) do not
see a tile's tensors, which live only until its gradients are taken.

On fake tensors (``effitrain estimate``) tiles that start from the same tensors alive and have
the same width are interchangeable: one of them runs, counted for all
(:func:`effitrain.cost.one_of_each_kind`), so the estimate's time does not grow with the tile
count and its peak, bytes and FLOPs are those of every tile run (:func:`runs`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from effitrain.errors import EffitrainError

if TYPE_CHECKING:
    import torch

    from effitrain.distributed import Launch

Forward = Callable[["torch.Tensor"], "torch.Tensor"]


def recomputed(
    forward: Forward,
    tiles: int,
    hidden_states: torch.Tensor,
    trained: Sequence[torch.Tensor],
    option: str,
) -> torch.Tensor:
    """``forward(hidden_states)`` (batch x length x ...) over ``tiles`` tiles of the sequence,
    keeping only ``hidden_states`` and ``trained`` for backward, which recomputes it tile by tile
    (without grad enabled: the tiles run once, nothing is kept). ``option`` names the lever in
    its refusals."""
    import torch

    if not torch.is_grad_enabled():  # evaluation: nothing to recompute
        return run_tiles(forward, hidden_states, tiles, option)
    output: torch.Tensor = _function().apply(forward, tiles, option, hidden_states, *trained)
    return output


def tile_count(length: int, hidden_size: int, given: int | None) -> int:
    """How many tiles a sequence of ``length`` runs in: ``given``, else ceil(length /
    hidden size); at least 1, at most one a position."""
    wanted = given if given is not None else math.ceil(length / hidden_size)
    return max(1, min(wanted, length))


def refuse_sharded(option: str, launch: Launch) -> None:
    """Refuse a lever recomputed through :mod:`effitrain.levers.tiles` under a sharded launch.

    Raises:
        EffitrainError: the launch shards parameters or gradients.
    """
    if launch.sharding.sharded:
        # Not run: FSDP gathers a layer's parameters, and ZeRO reduces gradients, by hooks
        # that the recompute in backward has not been checked against.
        raise EffitrainError(
            f"{option} is not supported under {launch.sharding.description} (effitrain has not "
            f"run its recompute where parameters or gradients are sharded); drop {option}, or "
            "use one process or DDP"
        )


def spans(length: int, tiles: int) -> list[tuple[int, int]]:
    """(start, length) of ``tiles`` tiles of ``length`` positions: ceil(length / tiles) wide but
    the first, which takes what is left (narrower where ``tiles`` does not divide ``length``),
    so the tiles after it are of one width (on fake tensors, one kind: :func:`runs`); where
    that would leave the first no position, widths within one of each other."""
    width = -(-length // tiles)
    first = length - (tiles - 1) * width
    if first >= 1:
        widths = [first] + [width] * (tiles - 1)
    else:
        size, extra = divmod(length, tiles)
        widths = [size + (index < extra) for index in range(tiles)]
    found, start = [], 0
    for width in widths:
        found.append((start, width))
        start += width
    return found


SETTLED_FORWARD = 1
"""From the second tile on, forward's tiles start from the same tensors alive: the output (made
at the first tile)."""
SETTLED_BACKWARD = 1
"""From the second tile on, backward's tiles start from the same tensors alive: the gradients'
sums (the first tile's gradients; each later tile's are added in and freed before the next
tile's recompute)."""


def runs(hidden_states: torch.Tensor, tiles: int, settled: int) -> list[tuple[int, int, int]]:
    """(start, width, times) of the tiles to run over ``hidden_states``, in order: each once on
    real tensors, one of each kind on fake ones (:func:`effitrain.cost.one_of_each_kind`;
    ``settled``: :data:`SETTLED_FORWARD` or :data:`SETTLED_BACKWARD`)."""
    from torch._subclasses.fake_tensor import is_fake

    from effitrain.cost import one_of_each_kind

    found = spans(hidden_states.shape[1], tiles)
    return one_of_each_kind(found, settled, bool(is_fake(hidden_states)))


def run_tiles(
    forward: Forward, hidden_states: torch.Tensor, tiles: int, option: str
) -> torch.Tensor:
    """``forward`` over each tile (:func:`runs`), without grad, written into one output."""
    import torch

    from effitrain.cost import Repeated

    output: torch.Tensor | None = None
    # Detached: a view made without grad of an input that requires it would still say it
    # requires grad, with no grad_fn (module hooks, the memory probe's, would trip on it).
    detached = hidden_states.detach()
    for start, width, times in runs(hidden_states, tiles, SETTLED_FORWARD):
        with Repeated(times):
            part = forward(detached.narrow(1, start, width))
            if not isinstance(part, torch.Tensor) or part.shape[:-1] != (
                hidden_states.shape[0],
                width,
            ):
                raise EffitrainError(
                    f"{option}: a module returned {type(part).__name__}, not one tensor per "
                    f"position (a mixture of experts?); drop {option}"
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
    from torch.utils.checkpoint import get_device_states

    from effitrain.cost import Recompute, Repeated

    class TiledFunction(torch.autograd.Function):
        """forward(module_forward, tiles, option, hidden_states, *trained_parameters): the
        module's output, keeping only its input; backward recomputes and differentiates one
        tile at a time."""

        @staticmethod
        def forward(
            ctx: Any,
            forward: Forward,
            tiles: int,
            option: str,
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
            return run_tiles(forward, hidden_states, tiles, option)

        @staticmethod
        def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            hidden_states, *trained = ctx.saved_tensors
            wants_input = ctx.needs_input_grad[3]
            grad_input = torch.empty_like(hidden_states) if wants_input else None
            sums: list[torch.Tensor | None] = [None] * len(trained)
            enabled, dtype = ctx.autocast
            with _replaying(ctx):
                # Each tile a view of one detached input: not a leaf, which module hooks that
                # watch gradients (FlopCounterMode's, the memory probe's) refuse in autograd.grad.
                source = hidden_states.detach().requires_grad_(wants_input)
                for start, width, times in runs(hidden_states, ctx.tiles, SETTLED_BACKWARD):
                    with Repeated(times):  # one of its kind, on fake tensors
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
                        _add_into(sums, grads)
                        del grads  # freed before the next tile's recompute (see SETTLED_BACKWARD)
            return (None, None, None, grad_input, *sums)

    return TiledFunction


def _add_into(sums: list[torch.Tensor | None], grads: Sequence[torch.Tensor | None]) -> None:
    """Each tile's gradient of a trained parameter added into its sum: the first tile's is the
    sum; a later one (a new tensor, a matmul's) is added in place and no longer referenced here
    (a loop variable would keep the last one alive into the next tile)."""
    for index, grad in enumerate(grads):
        if grad is not None:
            total = sums[index]
            sums[index] = grad if total is None else total.add_(grad)


@contextlib.contextmanager
def _replaying(ctx: Any) -> Iterator[None]:
    """Backward's recompute as forward ran: the random state forward drew from (LoRA's dropout
    draws the same masks), restored after; outer saved-tensor hooks (the activation offload's)
    off, as they are not for a tile's tensors, which live only until its gradients are taken."""
    import torch
    from torch.utils.checkpoint import set_device_states

    with (
        torch.random.fork_rng(devices=ctx.devices, device_type=ctx.device_type),
        torch.autograd.graph.saved_tensors_hooks(_same, _same),
    ):
        torch.set_rng_state(ctx.cpu_rng)
        set_device_states(ctx.devices, ctx.device_rng, device_type=ctx.device_type)
        yield


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
