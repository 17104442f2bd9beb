"""Optimizer-state offload (``--optimizer-offload state|state+grads``): the optimizer state and
its step live on the host, through torchao's ``CPUOffloadOptimizer``.

torchao keeps a pinned host copy of each parameter of :data:`MINIMAL_SIZE` elements or more and
of its gradient, copies the gradient to the host from a post-accumulate-grad hook (on a side
stream, during backward), runs one host optimizer per such parameter, and copies the updated
parameter back; smaller tensors keep their state and step on the GPU (one more optimizer), as
many small copies would cost more than they save. With ``state+grads`` it also frees each GPU
gradient once its copy is made.

:class:`OffloadedOptimizer` holds torchao's optimizer and *is* the optimizer that Accelerate
prepares, the scheduler drives, checkpoints save and the ledger counts: ``param_groups`` are the
real groups (the scheduler's lr is copied into the host and device optimizers at each step, which
torchao's own ``param_groups`` do not allow), ``state`` is a view of every parameter's state
wherever it lives, and ``state_dict()`` has a normal optimizer's layout, so checkpoints,
``inspect-state`` and exact resume need no special case. :func:`offload_ledger` says where the
state lives: device bytes and host bytes.

Rules (refused before anything is built, by the lever's spec): CUDA only, one process, no clipping (the
gradients reach the host before clipping could scale them), no fp16 loss scaling, no step in
backward, no gradient accumulation with ``state+grads``. Only imported when the lever is on (it
imports torch at module level).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from effitrain.memory.ledger import unwrap_prepared
from effitrain.optim.in_backward import check_saved_groups, numbered_state_dict

ParamGroups = list[dict[str, Any]]

MINIMAL_SIZE = 4096
"""torchao's default: tensors with fewer elements keep their state and step on the GPU."""


class _ParameterStates(Mapping):
    """A read-only view ``{model parameter: its optimizer state}``, host or device."""

    def __init__(self, owner: OffloadedOptimizer):
        self._owner = owner

    def _state_of(self, param: Any) -> Mapping[Any, Any] | None:
        offloaded = self._owner.offloaded
        host_optimizer = offloaded.optim_dict.get(param)
        if host_optimizer is not None:
            return host_optimizer.state.get(offloaded.param_d2h_map[param])
        if offloaded.d_opt is not None:
            return offloaded.d_opt.state.get(param)
        return None

    def __getitem__(self, param: Any) -> Any:
        state = self._state_of(param)
        if not state:
            raise KeyError(param)
        return state

    def __iter__(self) -> Iterator[Any]:
        return (p for p in self._owner.parameters() if self._state_of(p))

    def __len__(self) -> int:
        return sum(1 for _ in self)


class OffloadedOptimizer(torch.optim.Optimizer):
    """torchao's ``CPUOffloadOptimizer`` behind a normal optimizer's interface.

    Args:
        groups: parameter groups as ``optim.param_groups`` makes them (``params`` and
            ``weight_decay``).
        factory: the registry's factory, ``factory(groups, lr) -> optimizer``; it builds each
            host optimizer (one per offloaded parameter) and the device one.
        lr: the initial learning rate.
        offload_gradients: also free each GPU gradient once it is copied to the host.
        torch_adamw: the optimizer is ``torch.optim.AdamW``: torchao then builds it fused,
            the fast form of a host step.
    """

    def __init__(
        self,
        groups: ParamGroups,
        factory: Callable[[ParamGroups, float], torch.optim.Optimizer],
        lr: float,
        offload_gradients: bool,
        torch_adamw: bool = False,
    ) -> None:
        from torchao.optim import CPUOffloadOptimizer

        self.offload_gradients = offload_gradients
        if torch_adamw:
            optimizer_class: Any = torch.optim.AdamW
            kwargs: dict[str, Any] = {"lr": lr}
        else:

            def optimizer_class(param_groups: ParamGroups) -> torch.optim.Optimizer:
                return factory(param_groups, lr)

            kwargs = {}
        # torchao takes each group's "params" out of the dicts it is given: give it copies.
        self.offloaded = CPUOffloadOptimizer(
            [{**group, "params": list(group["params"])} for group in groups],
            optimizer_class,
            offload_gradients=offload_gradients,
            minimal_size=MINIMAL_SIZE,
            **kwargs,
        )
        self._group_index = {
            param: index for index, group in enumerate(groups) for param in group["params"]
        }
        real_groups = []
        for group in groups:
            inner = self._inner_group(group["params"][0]) if group["params"] else {}
            options = {k: v for k, v in inner.items() if k != "params"} or {
                k: v for k, v in group.items() if k != "params"
            }
            real_groups.append({**options, "params": list(group["params"])})
        super().__init__(real_groups, {"lr": lr})

    def _inner_group(self, param: Any) -> dict[str, Any]:
        """The group of the host or device optimizer that updates ``param``."""
        offloaded = self.offloaded
        host_optimizer = offloaded.optim_dict.get(param)
        if host_optimizer is not None:
            return host_optimizer.param_groups[0]
        return next(g for g in offloaded.d_opt.param_groups if any(p is param for p in g["params"]))

    def parameters(self) -> Iterator[Any]:
        """The model parameters it updates, in group order."""
        for group in self.param_groups:
            yield from group["params"]

    # The state lives in torchao's host and device optimizers; torch's __init__ assigns an
    # empty one.
    @property
    def state(self) -> Mapping[Any, Any]:  # type: ignore[override]
        return _ParameterStates(self)

    @state.setter
    def state(self, value: Any) -> None:
        if value:
            raise AttributeError(
                "OffloadedOptimizer.state is a view of torchao's optimizers' states"
            )

    def _sync_lr(self) -> None:
        """The scheduler sets the lr on the real groups; the inner optimizers use it."""
        offloaded = self.offloaded
        for param, host_optimizer in offloaded.optim_dict.items():
            host_optimizer.param_groups[0]["lr"] = self.param_groups[self._group_index[param]]["lr"]
        if offloaded.d_opt is not None:
            for group in offloaded.d_opt.param_groups:
                group["lr"] = self.param_groups[self._group_index[group["params"][0]]]["lr"]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        self._sync_lr()
        return self.offloaded.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # torchao only frees gradients (its host copies are overwritten by the next backward).
        self.offloaded.zero_grad(set_to_none=True)

    def _device_indices(self) -> dict[Any, int]:
        """Each parameter the device optimizer updates -> its index in that optimizer's
        ``state_dict``."""
        d_opt = self.offloaded.d_opt
        if d_opt is None:
            return {}
        params = [p for group in d_opt.param_groups for p in group["params"]]
        return {p: index for index, p in enumerate(params)}

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """A normal optimizer's layout: parameters numbered 0, 1, … in group order."""
        offloaded = self.offloaded
        device_state = offloaded.d_opt.state_dict()["state"] if offloaded.d_opt else {}
        device_index = self._device_indices()

        def entry_of(param: Any) -> Any:
            host_optimizer = offloaded.optim_dict.get(param)
            if host_optimizer is not None:
                return host_optimizer.state_dict()["state"].get(0)
            return device_state.get(device_index[param])

        return numbered_state_dict(self.param_groups, entry_of)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Load what :meth:`state_dict` wrote: each parameter's state into the host or device
        optimizer that updates it (by that optimizer's own ``load_state_dict``, which casts
        and places it), and every group's hyperparameters (the scheduler's lr included).

        Raises:
            ValueError: the groups or their sizes differ from this optimizer's.
        """
        saved_groups = check_saved_groups(self.param_groups, state_dict)
        saved_state = state_dict["state"]
        offloaded = self.offloaded
        device_index = self._device_indices()
        device_state: dict[int, Any] = {}
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            options = {k: v for k, v in saved.items() if k != "params"}
            for param, saved_id in zip(group["params"], saved["params"], strict=True):
                entry = saved_state.get(saved_id)
                host_optimizer = offloaded.optim_dict.get(param)
                if host_optimizer is None:
                    if entry is not None:
                        device_state[device_index[param]] = entry
                    continue
                host_optimizer.load_state_dict(
                    {
                        "state": {} if entry is None else {0: entry},
                        "param_groups": [{**options, "params": [0]}],
                    }
                )
            group.update(options)
        if offloaded.d_opt is not None:
            device_groups = [
                {
                    **{
                        k: v
                        for k, v in self.param_groups[self._group_index[g["params"][0]]].items()
                    },
                    "params": [device_index[p] for p in g["params"]],
                }
                for g in offloaded.d_opt.param_groups
            ]
            offloaded.d_opt.load_state_dict({"state": device_state, "param_groups": device_groups})


def offload_ledger(optimizer: Any) -> dict[str, int]:
    """Where an :class:`OffloadedOptimizer`'s memory lives, in bytes of real storage:
    ``device_state_bytes`` (the small tensors' state, on the GPU), ``host_state_bytes`` and
    ``host_copy_bytes`` (the pinned host copies of the offloaded parameters and gradients).
    Accelerate's wrapper is looked through; an estimate's :class:`EstimatedOffload` gives its
    own account; {} for any other optimizer."""
    from effitrain.memory import ledger

    inner = unwrap_prepared(optimizer)
    if isinstance(inner, EstimatedOffload):
        return dict(inner.placement)
    if not isinstance(inner, OffloadedOptimizer):
        return {}
    offloaded = inner.offloaded
    host_states = {
        offloaded.param_d2h_map[param]: host_optimizer.state.get(offloaded.param_d2h_map[param], {})
        for param, host_optimizer in offloaded.optim_dict.items()
    }
    copies = [t for p in offloaded.param_d2h_map.values() for t in (p, p.grad) if t is not None]
    device = ledger.optimizer_state_ledger(offloaded.d_opt.state) if offloaded.d_opt else None
    return {
        "device_state_bytes": device.bytes if device else 0,
        "host_state_bytes": ledger.optimizer_state_ledger(host_states).bytes,
        "host_copy_bytes": ledger.parameter_bytes(copies),
        "offloaded_parameters": len(offloaded.optim_dict),
    }


def offloaded_parameters(optimizer: Any) -> list[Any]:
    """The device parameters whose state and step live on the host (Accelerate's wrapper looked
    through; an estimate's :class:`EstimatedOffload` too); [] for any other optimizer."""
    inner = unwrap_prepared(optimizer)
    if isinstance(inner, EstimatedOffload):
        return [param for param, _ in inner.offloaded]
    if isinstance(inner, OffloadedOptimizer):
        return list(inner.offloaded.param_d2h_map)
    return []


class EstimatedOffload(torch.optim.Optimizer):
    """``effitrain estimate``'s stand-in for :class:`OffloadedOptimizer` on fake tensors, where
    torchao cannot run (it needs a CUDA device): what stays on the device runs for real (the
    optimizer over the tensors under :data:`MINIMAL_SIZE`; with ``offload_gradients``, the
    offloaded parameters' gradients freed as soon as backward makes them), and the host
    optimizers are built and stepped on fake copies once the measured steps are over
    (:meth:`step_host_optimizers`), so their state is counted on the host and never in the
    device's peak. After that, ``state`` is every parameter's, host and device, as
    :class:`OffloadedOptimizer`'s is.

    Args:
        groups, factory, lr, offload_gradients: as :class:`OffloadedOptimizer`'s.
    """

    def __init__(
        self,
        groups: ParamGroups,
        factory: Callable[[ParamGroups, float], torch.optim.Optimizer],
        lr: float,
        offload_gradients: bool,
    ) -> None:
        self._factory, self._lr = factory, lr
        self.offloaded = [
            (param, {k: v for k, v in group.items() if k != "params"})
            for group in groups
            for param in group["params"]
            if param.numel() >= MINIMAL_SIZE
        ]
        big = {id(param) for param, _ in self.offloaded}
        small = [
            {**group, "params": [p for p in group["params"] if id(p) not in big]}
            for group in groups
        ]
        small = [group for group in small if group["params"]]
        self.device_optimizer = factory(small, lr) if small else None
        self.host_states: dict[Any, Any] = {}
        self.placement: dict[str, int] = {}
        """:func:`offload_ledger`'s fields, once the host optimizers have stepped."""
        if offload_gradients:
            for param, _ in self.offloaded:
                param.register_post_accumulate_grad_hook(_free_gradient)
        super().__init__([{"params": [p for g in groups for p in g["params"]]}], {"lr": lr})

    @property
    def state(self) -> Mapping[Any, Any]:  # type: ignore[override]
        """The device optimizer's state, and the host optimizers' once they have stepped."""
        device = self.device_optimizer.state if self.device_optimizer is not None else {}
        return {**device, **self.host_states}

    @state.setter
    def state(self, value: Any) -> None:
        if value:
            raise AttributeError("EstimatedOffload.state is the device and host optimizers'")

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if self.device_optimizer is not None:
            self.device_optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = None

    def step_host_optimizers(self) -> None:
        """One step of each host optimizer on fake copies of its parameter and gradient: their
        state joins ``state``, and :attr:`placement` says where each part lives."""
        from effitrain.memory import ledger

        device_bytes = ledger.optimizer_state_ledger(self.state).bytes
        copies = []
        for param, options in self.offloaded:
            host = torch.empty_like(param)
            host.grad = torch.zeros_like(param)
            host_optimizer = self._factory([{**options, "params": [host]}], self._lr)
            host_optimizer.step()
            self.host_states[host] = host_optimizer.state[host]
            copies += [host, host.grad]
        self.placement = {
            "device_state_bytes": device_bytes,
            "host_state_bytes": ledger.optimizer_state_ledger(self.state).bytes - device_bytes,
            "host_copy_bytes": ledger.parameter_bytes(copies),
            "offloaded_parameters": len(self.offloaded),
        }


def _free_gradient(param: torch.nn.Parameter) -> None:
    param.grad = None
