"""Adafactor over bf16 weights: the library's own update in fp32, rounded back stochastically.

Each step, one parameter at a time: the bf16 weight and its gradient are upcast to fp32, the
library's Adafactor (torch's or transformers') updates the fp32 copy as it would an fp32 weight,
and the result is rounded to bf16 stochastically: up or down to the two nearest bf16 values,
with probabilities that make the rounding exact in expectation. A step far below bf16's spacing
(1/256 of the weight) still moves the weight on average, where rounding to nearest would drop it
every time. Adafactor's factored state is made from the fp32 gradient, so it is fp32 (it is
tiny).

The fp32 copies and the update's own temporaries are the step's memory. A weight of up to
:data:`ROW_BLOCK_ELEMENTS` is updated whole, by the library's ``step``; a larger one (an
embedding, an output layer) block by block of rows of at most :data:`BLOCK_ELEMENTS`, by the
same update that runs on FSDP2's ranks' rows
(:meth:`effitrain.optim.fsdp2._Sharded.row_blocked_update`: the column factors and the norms
summed over the blocks first), so its temporaries are one block's.

The rounding is the bit trick of torchao's ``_fp32_to_bf16_sr`` (which its
``_AdamW(bf16_stochastic_round=True)`` uses) in the form of pytorch-optimizer's
``copy_stochastic``: add 16 random bits below bf16's last bit, then truncate. Neither takes a
``torch.Generator`` (both draw from the process's global RNG), so it is written out here
(:func:`round_stochastic_`) with one: each parameter has its own generator, seeded from the run
seed and its position, and its state is kept in the optimizer state (``rounding_generator``).
So a checkpoint resumes bit-exactly, dropout's random stream is the one a fp32 run has, and
processes that start from the same seed round the same way (DDP replicas stay identical).

Imports torch and transformers at module level: imported only when the optimizer is built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from effitrain.optim import fsdp2

ROW_BLOCK_ELEMENTS = 2**27
"""The most elements a block of the bf16 step holds (512 MiB in fp32): a larger weight is updated
in the fewest blocks of rows that hold no more. A weight in blocks takes three to four times as
long to update (:meth:`~effitrain.optim.fsdp2._Sharded.row_blocked_update` runs each block's
update again for each reduction), so a block is as large as the largest transformer-layer
weights of 7-14B models (Qwen2.5-7B's and Gemma-7B's MLP weights: 68-76M elements), which keep
the one-shot step: only embeddings and output layers, whose whole-tensor step set the peak, pay
the time. The step's fp32 temporaries are then at most three (torch's rule: 1.5 GiB) or four
(transformers': 2 GiB) fp32 copies of the largest weight updated whole."""

BLOCK_ELEMENTS = 2**25
"""The most elements in one block of a weight updated in blocks (128 MiB in fp32): its
temporaries are three or four fp32 copies of a block (384-512 MiB), not of a block as large as
:data:`ROW_BLOCK_ELEMENTS`. Smaller blocks cost no time of their own (a blocked weight's update
runs once per reduction whatever the number of blocks), and the peak is the embedding's or the
output layer's update: 1.3 GiB of temporaries in blocks of :data:`ROW_BLOCK_ELEMENTS` for a
1.78B model's 233M-element embedding, 0.4 GiB in these (``benchmarks/loading``). Tests lower
:data:`ROW_BLOCK_ELEMENTS` to make small weights blocked: the block is the smaller of the two."""

GENERATOR_KEY = "rounding_generator"
"""The state key of a parameter's generator state (uint8, on the host: 5056 bytes for the CPU's
Mersenne Twister, 16 for CUDA's Philox)."""


def round_stochastic_(
    target: torch.Tensor,
    value: torch.Tensor,
    generator: torch.Generator,
    scratch: torch.Tensor | None = None,
) -> None:
    """Write fp32 ``value`` into bf16 ``target``, rounded stochastically.

    bf16 is fp32's upper 16 bits. Adding a uniform 16-bit integer to the lower 16 bits carries
    into the upper ones with probability (lower bits) / 2**16, the distance to the next bf16
    value (away from zero) in units of bf16's spacing; the sum truncated to its upper 16 bits is
    then exactly a bf16 value, so the final copy does not round again.

    Args:
        scratch: a 4-byte tensor of ``value``'s shape, on ``generator``'s device, that may be
            overwritten (the random bits go there); None: a new one.
    """
    if scratch is None:
        noise = torch.empty(value.shape, dtype=torch.int32, device=generator.device)
    else:
        noise = scratch.view(torch.int32)
    noise.random_(0, 1 << 16, generator=generator)
    noise.add_(value.view(torch.int32)).bitwise_and_(-65536)  # -65536 == 0xFFFF0000
    target.copy_(noise.view(torch.float32))


def rows_per_block(shape: torch.Size) -> int | None:
    """How many rows (dim 0) of a bf16 weight of ``shape`` one block of its step holds: the
    fewest blocks of at most :data:`BLOCK_ELEMENTS` (or one row), their rows evened out.
    None: the weight is updated whole (no larger than :data:`ROW_BLOCK_ELEMENTS`, or one
    row)."""
    if shape.numel() <= ROW_BLOCK_ELEMENTS or shape[0] < 2:
        return None
    block = min(BLOCK_ELEMENTS, ROW_BLOCK_ELEMENTS)
    fit = max(1, block // (shape.numel() // shape[0]))
    blocks = -(-shape[0] // fit)
    return -(-shape[0] // blocks)


def _generator(device: torch.device, seed: int, saved: torch.Tensor | None) -> torch.Generator:
    generator = torch.Generator(device=device)
    if saved is None:
        generator.manual_seed(seed)
    else:
        generator.set_state(saved.cpu())
    return generator


class StochasticRounding:
    """Mixin for an :mod:`effitrain.optim.fsdp2` optimizer class (first in the bases): bf16
    parameters are updated in fp32, one parameter at a time, by the base class's own ``step``
    (or block by block of rows, by its :meth:`~effitrain.optim.fsdp2._Sharded.row_blocked_update`)
    and rounded back with :func:`round_stochastic_`; other parameters are stepped as the base
    class steps them.

    Args:
        params, *args, **kwargs: the base optimizer's.
        seeds: one generator seed per parameter, in parameter-group order.
    """

    state: Any
    param_groups: list[dict[str, Any]]
    row_blocked_update: Callable[..., None]

    def __init__(self, params: Any, *args: Any, seeds: Sequence[int], **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)  # type: ignore[call-arg]
        ordered = [p for group in self.param_groups for p in group["params"]]
        self._seeds = dict(zip(ordered, seeds, strict=True))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        try:
            for group in groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    # The base class sees one parameter: its step updates that one alone.
                    self.param_groups = [{**group, "params": [param]}]
                    if param.dtype == torch.bfloat16:
                        self._step_bf16(param)
                    else:
                        super().step()  # type: ignore[misc]
        finally:
            self.param_groups = groups
        return loss

    def _step_bf16(self, param: torch.Tensor) -> None:
        state = self.state[param]
        # Out of the update's way (a row-blocked update would split it with the rows).
        saved = state.pop(GENERATOR_KEY, None)
        generator = _generator(param.device, self._seeds[param], saved)
        rows = rows_per_block(param.shape)
        if rows is None:
            self._step_whole(param, generator)
        else:

            def round_into(block_rows: slice, block: torch.Tensor) -> None:
                # The block's fp32 gradient is spent: the random bits reuse its memory.
                round_stochastic_(param.data[block_rows], block, generator, scratch=block.grad)

            self.row_blocked_update(self.param_groups[0], param, rows, round_into)
        state[GENERATOR_KEY] = generator.get_state()

    def _step_whole(self, param: torch.Tensor, generator: torch.Generator) -> None:
        weight, grad = param.data, param.grad
        # The grad must leave before the data changes dtype (torch checks that they match).
        param.grad = None
        param.data = weight.float()
        param.grad = grad.float()
        try:
            super().step()  # type: ignore[misc]
            # The fp32 gradient is spent: the random bits reuse its memory.
            round_stochastic_(weight, param.data, generator, scratch=param.grad)
        finally:
            param.grad = None
            param.data = weight
            param.grad = grad

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """As the base class loads it, but every state tensor keeps its saved dtype (torch casts
        floating state to the parameter's dtype, which would round the fp32 factors to bf16 and
        break an exact resume) and the generator states stay on the host."""
        super().load_state_dict(state_dict)  # type: ignore[misc]
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, param in zip(saved_ids, params, strict=True):
            saved = state_dict["state"].get(saved_id, {})
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    device = "cpu" if key == GENERATOR_KEY else param.device
                    self.state[param][key] = value.to(device=device)


class Adafactor(StochasticRounding, fsdp2.Adafactor):
    """``torch.optim.Adafactor`` over bf16 weights, rounded stochastically."""


class AdafactorHF(StochasticRounding, fsdp2.AdafactorHF):
    """transformers' ``Adafactor`` over bf16 weights, rounded stochastically."""
