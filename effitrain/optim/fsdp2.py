"""The factored optimizers on FSDP2's sharded parameters: torch's Adafactor, transformers'
Adafactor (the Trainer's ``optim="adafactor"``) and pytorch-optimizer's CAME.

FSDP2 hands the optimizer DTensor parameters, each split on dim 0 (``Shard(0)``, the last ranks'
shards shorter or empty when the rows do not divide). The libraries crash there: torch's
Adafactor squares a partial norm in place, which DTensor refuses; transformers' and CAME's
create plain-tensor state and mix it with DTensor gradients.

Each class here is the library's own class (its ``__init__``, defaults, checks and state keys).
With plain parameters its ``step`` is the library's. With DTensor parameters it runs the same
update, line for line, on each rank's local shard, and reduces across ranks only where the maths
needs a global value:

- a factor that averages over dim 0 (the column factor of a 2-D weight): summed over every
  rank's rows, divided by the global row count; it is small (one value per column) and each
  rank keeps all of it, the same values everywhere;
- the mean of a row factor over its rows (the factored estimate's normaliser) and the RMS of a
  weight or an update (the relative step size, update clipping): sums over all ranks.

Everything else is local: the row factor and every gradient-shaped tensor keep only the rank's
rows; a >= 3-D weight's two factors both keep dim 0, so both are sharded. Each parameter's update
is a generator that yields its local sums; the updates of a bucket of parameters run side by
side, so a step makes four all-reduces per bucket (six for CAME), each a flat tensor of column
sums and numbers, instead of four per parameter. The alternative, writing the maths in DTensor
operations, is refused by DTensor itself (in-place ops on partial results) and would hide the
communication in its dispatcher.

The state is stored as DTensors with those placements (row factors sharded like the parameter,
the column factors of 2-D weights replicated), so each rank's ledger counts its own share, and
torch's distributed checkpointing (Accelerate's ``save_state`` under FSDP2) saves and restores
it. Equal to the library: with one process op for op (tests/test_fsdp2_optim.py); with two
processes, to a one-process run on the same batch, within fp32 rounding
(tests/fsdp2_factored.py).

The same updates also run in one process on blocks of a weight's rows
(:meth:`_Sharded.row_blocked_update`, the bf16 step of :mod:`.stochastic_rounding`), so that the
step's fp32 temporaries are one block's, not the whole weight's: each block stands where a rank's
shard stands, and its sums are added up over the blocks instead of over ranks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers.optimization import Adafactor as _AdafactorHF

from effitrain.distributed import FACTORED_OPTIMIZERS
from effitrain.distributed import replicated_under_fsdp2 as replicated

Reduction = Generator[torch.Tensor, torch.Tensor, torch.Tensor]
"""A computation that yields local sums and gets them back summed over the ranks."""
Update = Generator[torch.Tensor, torch.Tensor, None]
"""One parameter's update, yielding its local sums (:func:`_lockstep` runs many side by side)."""


class ShardingError(RuntimeError):
    """A DTensor placement other than FSDP2's ``Shard(0)`` (or ``Replicate``)."""


def sharded_mesh_dim(placements: Any) -> int | None:
    """The mesh dim over which a parameter's dim 0 is split (None: replicated everywhere).

    Raises:
        ShardingError: a placement FSDP2 does not make (``Shard(1)``, ``Partial``, dim 0 split
            over several mesh dims).
    """
    sharded = [i for i, p in enumerate(placements) if not isinstance(p, Replicate)]
    if any(type(placements[i]) is not Shard or placements[i].dim != 0 for i in sharded):
        raise ShardingError(
            f"factored optimizers support FSDP2's Shard(0) placement, not {tuple(placements)}"
        )
    if len(sharded) > 1:
        raise ShardingError(f"dim 0 is split over several mesh dims: {tuple(placements)}")
    return sharded[0] if sharded else None


@dataclass(frozen=True)
class _Layout:
    """How one parameter is split: plain (``mesh`` None) or a DTensor sharded on dim 0."""

    shape: torch.Size
    """The global shape."""
    mesh: Any = None
    placements: tuple[Any, ...] = ()
    group: Any = None
    """The process group over which dim 0 is split (:data:`ROW_BLOCKS`: one process's blocks of
    rows); None: nothing to reduce."""

    @staticmethod
    def of(param: torch.Tensor) -> _Layout:
        if not isinstance(param, DTensor):
            return _Layout(param.shape)
        dim = sharded_mesh_dim(param.placements)
        group = param.device_mesh.get_group(dim) if dim is not None else None
        return _Layout(param.shape, param.device_mesh, tuple(param.placements), group)

    # -- reductions: generators that yield a local sum to add up over the ranks ---------------
    # (`x = yield from layout.mean(...)`; :func:`_lockstep` sends back the sums over the ranks,
    # one all-reduce for a whole bucket of parameters. Plain tensors never yield.)

    def all_sum(self, t: torch.Tensor) -> Reduction:
        """``t`` summed over the ranks that share this parameter."""
        if self.group is None:
            return t
        return (yield t)

    def norm(self, t: torch.Tensor) -> Reduction:
        """The 2-norm of the whole (global) tensor whose local shard is ``t``."""
        if self.group is None:
            return t.norm(2)
        return (yield from self.all_sum(t.norm(2).square())).sqrt()

    def rms(self, t: torch.Tensor) -> Reduction:
        """RMS of the whole tensor, as the libraries write it: norm / sqrt(numel)."""
        return (yield from self.norm(t)) / math.sqrt(self.shape.numel())

    def mean(self, t: torch.Tensor, dim: int, keepdim: bool = False) -> Reduction:
        """``t.mean(dim)`` of a sharded tensor whose dim 0 is the parameter's dim 0."""
        if self.group is None or dim % t.dim() != 0:
            return t.mean(dim=dim, keepdim=keepdim)
        return (yield from self.all_sum(t.sum(dim=dim, keepdim=keepdim))).div_(self.shape[0])

    def norm_sq_mean(self, t: torch.Tensor, dim: int) -> Reduction:
        """torch's Adafactor's ``torch.norm(t, dim, keepdim=True).square_().div_(size)``."""
        if self.group is None or dim % t.dim() != 0:
            return torch.norm(t, dim=dim, keepdim=True).square_().div_(t.size(dim))
        sums = torch.norm(t, dim=dim, keepdim=True).square_()
        return (yield from self.all_sum(sums)).div_(self.shape[0])

    # -- state -------------------------------------------------------------------------------

    def zeros(self, like: torch.Tensor, key: str, global_shape: Any, local_shape: Any) -> Any:
        """Zero state ``key`` of ``global_shape``: whole on every rank where it is replicated,
        else ``local_shape`` (the rank's rows)."""
        local = global_shape if replicated(key, len(self.shape)) else local_shape
        return self.state(like.new_zeros(local), key, global_shape)

    def state(self, local: torch.Tensor, key: str = "", global_shape: Any = None) -> torch.Tensor:
        """``local`` as this parameter's state: a DTensor sharded like it, or replicated."""
        if self.mesh is None:
            return local
        shape = torch.Size(global_shape if global_shape is not None else self.shape)
        if replicated(key, len(self.shape)):
            placements: tuple[Any, ...] = tuple(Replicate() for _ in self.placements)
        else:
            placements = self.placements
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            local, self.mesh, placements, run_check=False, shape=shape, stride=stride
        )


ROW_BLOCKS = "blocks of rows"
"""The :class:`_Layout` group of a weight updated block by block of rows in one process
(:meth:`_Sharded.row_blocked_update`): its reductions yield each block's sums, which are added
up over the blocks as FSDP2's are over ranks."""


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def _has_dtensors(optimizer: torch.optim.Optimizer) -> bool:
    return any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])


BUCKET_ELEMENTS = 2**24
"""The least a bucket of lock-step updates may hold (global elements: 64 MiB of fp32)."""


def _lockstep(updates: list[tuple[Update, Any]]) -> None:
    """Run parameter updates side by side: each round, every update's local sums (its next
    yield) go into one flat all-reduce per process group and dtype, and each gets its share
    back. All ranks run the same updates in the same order, so the rounds line up."""
    running: list[tuple[Update, Any, torch.Tensor]] = []

    def advance(update: Update, group: Any, value: torch.Tensor | None) -> None:
        try:
            local = update.send(value)  # type: ignore[arg-type]
        except StopIteration:
            return
        running.append((update, group, local))

    for update, group in updates:
        advance(update, group, None)
    while running:
        batches: dict[tuple[int, torch.dtype, torch.device], list] = {}
        for item in running:
            batches.setdefault((id(item[1]), item[2].dtype, item[2].device), []).append(item)
        running = []
        for batch in batches.values():
            flat = torch.cat([local.reshape(-1) for _, _, local in batch])
            dist.all_reduce(flat, group=batch[0][1])
            sums = flat.split([local.numel() for _, _, local in batch])
            for (update, group, local), total in zip(batch, sums, strict=True):
                advance(update, group, total.view_as(local))


class _Sharded:
    """Mixin: the library's step for plain parameters, :meth:`_sharded_param` for DTensors."""

    force_sharded_step = False
    """Run the sharded step on plain parameters too (the one-process equality tests)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if not (self.force_sharded_step or _has_dtensors(self)):  # type: ignore[arg-type]
            return super().step(closure)  # type: ignore[misc]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:  # type: ignore[attr-defined]
            self._sharded_group(group)
        return loss

    def _sharded_group(self, group: dict[str, Any]) -> None:
        """The group's parameters in buckets, each bucket's updates in lock step. A bucket holds
        up to the largest parameter's elements (at least :data:`BUCKET_ELEMENTS`): the
        temporaries of its updates, alive together, are then no more than the library's own for
        the largest parameter (or, for small models, a few times BUCKET_ELEMENTS floats)."""
        params = [p for p in group["params"] if p.grad is not None]
        sizes = [p.numel() for p in params]  # global sizes: every rank cuts the same buckets
        cap, bucket, filled = max([BUCKET_ELEMENTS, *sizes]), [], 0
        for p, size in zip(params, sizes, strict=True):
            if bucket and filled + size > cap:
                _lockstep(bucket)
                bucket, filled = [], 0
            layout = _Layout.of(p)
            bucket.append((self._sharded_param(group, p, self.state[p], layout), layout.group))
            filled += size
        _lockstep(bucket)

    def _sharded_param(
        self, group: dict[str, Any], p: Any, state: dict[str, Any], layout: _Layout
    ) -> Update:
        """``p``'s update: ``p`` is a DTensor or a plain tensor holding the rows that this rank
        or block updates (its ``.grad`` theirs too), ``state`` its state (its rows of the row-split
        tensors), ``layout`` the whole weight's shape and how its rows are split."""
        raise NotImplementedError

    def row_blocked_update(
        self,
        group: dict[str, Any],
        p: torch.Tensor,
        rows_per_block: int,
        write: Callable[[slice, torch.Tensor], None],
    ) -> None:
        """Plain parameter ``p``'s update in ``group``, in fp32, block by block of
        ``rows_per_block`` rows (dim 0): the update FSDP2's ranks run on their rows, with the
        blocks in place of the ranks, so equal to the whole-tensor update within fp32 rounding.

        A reduction needs every block's sums before any block can go on, and a block's
        temporaries must be freed before the next block's are made: so each round, every block's
        update runs again from the start, on fp32 copies of its rows and state, up to its next
        reduction, and only its sum is kept; a last pass, given all the sums, updates the state
        and hands over the blocks. Running time: about one update per reduction (four for the
        Adafactors) on top of the last, for a step whose temporaries are one block's fp32
        weight, gradient and update, not the whole weight's.

        Args:
            write: called with each block's rows and its updated fp32 copy, in order, to put it
                into ``p``'s rows (``p`` itself is not written); the copy's ``.grad``, the
                block's fp32 gradient, is spent and may be overwritten. The state is updated
                once the last block has been written.
        """
        layout = _Layout(p.shape, group=ROW_BLOCKS)
        state, ndim = self.state[p], p.dim()
        blocks = [slice(i, i + rows_per_block) for i in range(0, p.shape[0], rows_per_block)]

        def update(rows: slice, block_state: dict[str, Any]) -> tuple[torch.Tensor, Update]:
            block = p.detach()[rows].to(torch.float32, copy=True)
            block.grad = p.grad[rows].to(torch.float32, copy=True)
            return block, self._sharded_param(group, block, block_state, layout)

        sums: list[torch.Tensor] = []
        while True:
            total = None
            for rows in blocks:
                # Only the update holds this block's copies: they go when it is closed.
                local = _replay(update(rows, _block_state(state, rows, ndim, copy=True))[1], sums)
                if local is None:  # no reduction left: the last pass follows
                    break
                total = local.clone() if total is None else total.add_(local)
            if total is None:
                break
            sums.append(total)

        first = len(state) == 0
        kept: dict[str, Any] = {}

        def last_pass(rows: slice) -> None:  # its block is freed on return, before the next
            block_state = _block_state(state, rows, ndim, copy=False)
            block, last = update(rows, block_state)
            _replay(last, sums)
            for key, value in block_state.items():
                if not _split_with_rows(key, value, ndim):
                    kept[key] = value  # every block's copy: the same values
                elif first:  # made by this block's update: its rows of the whole
                    if key not in kept:
                        kept[key] = value.new_empty((p.shape[0], *value.shape[1:]))
                    kept[key][rows].copy_(value)
            write(rows, block)

        for rows in blocks:
            last_pass(rows)
        state.update(kept)


def _replay(update: Update, sums: list[torch.Tensor]) -> torch.Tensor | None:
    """Run ``update``, given the totals of its first reductions: its next local sum (the update
    is then closed), or None when it has run to its end."""
    try:
        local = next(update)
        for total in sums:
            local = update.send(total.clone())  # the update may divide what it gets in place
    except StopIteration:
        return None
    update.close()
    return local


def _split_with_rows(key: str, value: Any, param_ndim: int) -> bool:
    """Whether state ``value`` is split on dim 0 like its parameter (else each rank or block
    holds all of it: a number, a step count, a 2-D weight's column factor)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and not replicated(key, param_ndim)


def _block_state(state: dict[str, Any], rows: slice, ndim: int, copy: bool) -> dict[str, Any]:
    """A block's view of its parameter's state: its ``rows`` of each row-split tensor (copies
    with ``copy``), and its own copy of each other tensor (every block updates the column
    factors and the step count, as every rank updates its replica)."""
    block = {}
    for key, value in state.items():
        if _split_with_rows(key, value, ndim):
            value = value[rows].clone() if copy else value[rows]
        elif isinstance(value, torch.Tensor):
            value = value.clone()
        block[key] = value
    return block


class Adafactor(_Sharded, torch.optim.Adafactor):
    """``torch.optim.Adafactor`` that also steps FSDP2's sharded parameters."""

    def _sharded_param(
        self, group: dict[str, Any], p: Any, state: dict[str, Any], layout: _Layout
    ) -> Update:
        # torch/optim/_adafactor.py::_single_tensor_adafactor, on local shards.
        if torch.is_complex(p) or p.grad.is_sparse:
            raise RuntimeError("Adafactor does not support complex parameters or sparse gradients")
        param, grad = _local(p), _local(p.grad)
        grad = -grad if group["maximize"] else grad
        numel = layout.shape.numel()
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if p.dim() > 1:
                shape, local = layout.shape, grad.shape
                state["row_var"] = layout.zeros(grad, "row_var", [*shape[:-1], 1], [*local[:-1], 1])
                state["col_var"] = layout.zeros(
                    grad, "col_var", [*shape[:-2], 1, shape[-1]], [*local[:-2], 1, local[-1]]
                )
            else:
                state["variance"] = layout.state(torch.zeros_like(grad))
        eps1, eps2 = group["eps"]
        if eps1 is None:
            eps1 = torch.finfo(param.dtype).eps
        lr = float(group["lr"])
        step_t = state["step"]
        step_t += 1
        step_float = step_t.item()
        one_minus_beta2_t = step_float ** group["beta2_decay"]
        rho_t = min(lr, 1 / (step_float**0.5))
        alpha = max(eps2, (yield from layout.norm(param)).item() / (numel**0.5)) * rho_t
        if group["weight_decay"] != 0:
            param.mul_(1 - lr * group["weight_decay"])
        if grad.dim() > 1:
            row_var, col_var = _local(state["row_var"]), _local(state["col_var"])
            row_var.lerp_((yield from layout.norm_sq_mean(grad, -1)), one_minus_beta2_t)
            col_var.lerp_((yield from layout.norm_sq_mean(grad, -2)), one_minus_beta2_t)
            var_estimate = row_var @ col_var
            var_estimate.div_((yield from layout.mean(row_var, -2, keepdim=True)).clamp_(min=eps1))
        else:
            variance = _local(state["variance"])
            variance.lerp_(grad * grad, one_minus_beta2_t)
            var_estimate = variance.clone()
        update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
        update.mul_(grad)
        denom = max(1.0, (yield from layout.norm(update)).item() / ((numel**0.5) * group["d"]))
        param.add_(update, alpha=-alpha / denom)


def _approx_sq_grad(layout: _Layout, row: torch.Tensor, col: torch.Tensor) -> Reduction:
    """transformers' and CAME's ``approximate_sq_grad``: the row factor's mean is global for a
    2-D weight (its rows are sharded)."""
    r_factor = (row / (yield from layout.mean(row, -1, keepdim=True))).rsqrt_().unsqueeze(-1)
    c_factor = col.unsqueeze(-2).rsqrt()
    return torch.mul(r_factor, c_factor)


def _factor_zeros(layout: _Layout, grad: torch.Tensor, key: str) -> torch.Tensor:
    """A zero row (``..._row``: shape[:-1]) or column (``..._col``: shape[:-2] + shape[-1:])
    factor for ``grad``'s local shard, as state."""
    shape, local = layout.shape, grad.shape
    if key.endswith("_row"):
        return layout.zeros(grad, key, shape[:-1], local[:-1])
    return layout.zeros(grad, key, shape[:-2] + shape[-1:], local[:-2] + local[-1:])


class AdafactorHF(_Sharded, _AdafactorHF):
    """transformers' ``Adafactor`` that also steps FSDP2's sharded parameters."""

    def _sharded_param(
        self, group: dict[str, Any], p: Any, state: dict[str, Any], layout: _Layout
    ) -> Update:
        # transformers/optimization.py::Adafactor.step, on local shards.
        grad = _local(p.grad)
        if grad.dtype in {torch.float16, torch.bfloat16}:
            grad = grad.float()
        factored, use_first_moment = self._get_options(group, layout.shape)
        if len(state) == 0:
            state["step"] = 0
            if use_first_moment:
                state["exp_avg"] = layout.state(torch.zeros_like(grad))
            if factored:
                state["exp_avg_sq_row"] = _factor_zeros(layout, grad, "exp_avg_sq_row")
                state["exp_avg_sq_col"] = _factor_zeros(layout, grad, "exp_avg_sq_col")
            else:
                state["exp_avg_sq"] = layout.state(torch.zeros_like(grad))
            state["RMS"] = 0
        p_data_fp32 = _local(p)
        if p.dtype in {torch.float16, torch.bfloat16}:
            p_data_fp32 = p_data_fp32.float()
        state["step"] += 1
        state["RMS"] = yield from layout.rms(p_data_fp32)
        lr = self._get_lr(group, state)
        beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])
        update = (grad**2) + group["eps"][0]
        if factored:
            row, col = _local(state["exp_avg_sq_row"]), _local(state["exp_avg_sq_col"])
            row.mul_(beta2t).add_(update.mean(dim=-1), alpha=(1.0 - beta2t))
            col.mul_(beta2t).add_((yield from layout.mean(update, -2)), alpha=(1.0 - beta2t))
            update = yield from _approx_sq_grad(layout, row, col)
            update.mul_(grad)
        else:
            exp_avg_sq = _local(state["exp_avg_sq"])
            exp_avg_sq.mul_(beta2t).add_(update, alpha=(1.0 - beta2t))
            update = exp_avg_sq.rsqrt().mul_(grad)
        update.div_(((yield from layout.rms(update)) / group["clip_threshold"]).clamp_(min=1.0))
        update.mul_(lr)
        if use_first_moment:
            exp_avg = _local(state["exp_avg"])
            exp_avg.mul_(group["beta1"]).add_(update, alpha=(1 - group["beta1"]))
            update = exp_avg
        if group["weight_decay"] != 0:
            p_data_fp32.add_(p_data_fp32, alpha=(-group["weight_decay"] * lr))
        p_data_fp32.add_(-update)
        if p.dtype in {torch.float16, torch.bfloat16}:
            _local(p).copy_(p_data_fp32)


def _came_update(
    optimizer: Any, group: dict[str, Any], p: Any, state: dict[str, Any], layout: _Layout
) -> Update:
    # pytorch_optimizer/optimizer/came.py::CAME.step (its per-parameter loop), on local shards.
    if p.grad.is_sparse or torch.is_complex(p):
        raise RuntimeError("CAME does not support sparse gradients or complex parameters")
    param, grad = _local(p), _local(p.grad)
    factored = optimizer.get_options(layout.shape)
    if len(state) == 0:
        state["exp_avg"] = layout.state(torch.zeros_like(param))
        if factored:
            for key in ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_res_row", "exp_avg_res_col"):
                state[key] = _factor_zeros(layout, grad, key)
        else:
            state["exp_avg_sq"] = layout.state(torch.zeros_like(grad))
        if group["ams_bound"]:
            state["exp_avg_sq_hat"] = layout.state(torch.zeros_like(grad))
        state["RMS"] = 0.0
    beta1, beta2, beta3 = group["betas"]
    optimizer.maximize_gradient(grad, maximize=optimizer.maximize)
    state["RMS"] = yield from layout.rms(param)
    optimizer.apply_weight_decay(
        p=param,
        grad=grad,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        weight_decouple=group["weight_decouple"],
        fixed_decay=group["fixed_decay"],
    )
    update = torch.mul(grad, grad).add_(optimizer.eps1)
    if factored:
        row, col = _local(state["exp_avg_sq_row"]), _local(state["exp_avg_sq_col"])
        row.mul_(beta2).add_(update.mean(dim=-1), alpha=1.0 - beta2)
        col.mul_(beta2).add_((yield from layout.mean(update, -2)), alpha=1.0 - beta2)
        update = yield from _approx_sq_grad(layout, row, col)
    else:
        exp_avg_sq = _local(state["exp_avg_sq"])
        exp_avg_sq.mul_(beta2).add_(update, alpha=1.0 - beta2)
        torch.rsqrt(exp_avg_sq, out=update)
    if group["ams_bound"]:
        exp_avg_sq_hat = _local(state["exp_avg_sq_hat"])
        torch.max(exp_avg_sq_hat, 1 / update, out=exp_avg_sq_hat)
        torch.rsqrt(exp_avg_sq_hat / beta2, out=update)
    update.mul_(grad)
    update.div_(((yield from layout.rms(update)) / optimizer.clip_threshold).clamp_(min=1.0))
    exp_avg = _local(state["exp_avg"])
    exp_avg.lerp_(update, weight=1.0 - beta1)
    res = update - exp_avg
    res.pow_(2).add_(optimizer.eps2)
    if factored:
        res_row, res_col = _local(state["exp_avg_res_row"]), _local(state["exp_avg_res_col"])
        res_row.mul_(beta3).add_(res.mean(dim=-1), alpha=1.0 - beta3)
        res_col.mul_(beta3).add_((yield from layout.mean(res, -2)), alpha=1.0 - beta3)
        update = yield from _approx_sq_grad(layout, res_row, res_col)
        update.mul_(exp_avg)
    else:
        update = exp_avg
    param.add_(update, alpha=-group["lr"])


@functools.cache
def _came_class() -> type[torch.optim.Optimizer]:
    from pytorch_optimizer import CAME as _CAME  # the 'came' extra: imported when asked for

    class CAME(_Sharded, _CAME):
        """pytorch-optimizer's ``CAME`` that also steps FSDP2's sharded parameters."""

        def _sharded_group(self, group: dict[str, Any]) -> None:
            if "step" not in group:
                group["step"] = 0
            group["step"] += 1
            super()._sharded_group(group)

        def _sharded_param(
            self, group: dict[str, Any], p: Any, state: dict[str, Any], layout: _Layout
        ) -> Update:
            return _came_update(self, group, p, state, layout)

    return CAME


def sharded_class(name: str) -> type[torch.optim.Optimizer]:
    """The FSDP2-aware class of the registry's factored optimizer ``name``."""
    if name not in FACTORED_OPTIMIZERS:
        raise ValueError(f"no FSDP2-aware class for --optim {name}")
    return {"adafactor": Adafactor, "adafactor-hf": AdafactorHF}.get(name) or _came_class()


def build(
    name: str, library_factory: Callable[..., Any], groups: list[dict[str, Any]], lr: float
) -> torch.optim.Optimizer:
    """``name``'s FSDP2-aware class with exactly the hyperparameters that ``library_factory``
    (the registry's) gives the library's optimizer."""
    library = library_factory([dict(group) for group in groups], lr)
    return sharded_class(name)(groups, **library.defaults)
