"""Optimizer step in backward (``--optimizer-in-backward``): each parameter is updated as soon as
its gradient is accumulated, and that gradient is freed at once, so the full set of gradients
never exists.

One optimizer per parameter, built by the registry's own factory (so every per-parameter
optimizer works), stepped by a ``register_post_accumulate_grad_hook`` that then sets
``p.grad = None``. :class:`InBackwardOptimizer` holds them and *is* the optimizer that
Accelerate prepares, the scheduler drives, checkpoints save and the ledger counts: its
``param_groups`` are the real groups (each hook copies its group's current lr into the
parameter's optimizer), ``step()``/``zero_grad()`` do nothing more, ``state`` is a view of the
per-parameter states, and ``state_dict()`` has a normal optimizer's layout, so checkpoints,
``inspect-state`` and exact resume need no special case (how this differs from torchtune's and
the Trainer's versions: docs/levers.md).

Rules (refused before anything is built, see ``TrainConfig._validate_optimizer_in_backward`` and
``levers.check_launch``): no global-norm clipping, no gradient accumulation, no fp16 loss
scaling, one process only (the hook fires before DDP's all-reduce). Only imported when the
lever is on (it imports torch at module level).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from effitrain.errors import EffitrainError

ParamGroups = list[dict[str, Any]]


def numbered_state_dict(
    param_groups: ParamGroups, entry_of: Callable[[Any], Mapping[str, Any] | None]
) -> dict[str, Any]:
    """A normal optimizer's ``state_dict`` from each parameter's own state entry
    (``entry_of(param)``, None for none): parameters numbered 0, 1, … in group order."""
    state: dict[int, Any] = {}
    groups = []
    index = 0
    for group in param_groups:
        ids = []
        for param in group["params"]:
            entry = entry_of(param)
            if entry is not None:
                state[index] = entry
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def check_saved_groups(param_groups: ParamGroups, state_dict: Mapping[str, Any]) -> list[Any]:
    """The saved ``param_groups``, once they are known to match ``param_groups`` in sizes.

    Raises:
        ValueError: the groups or their sizes differ.
    """
    saved_groups = list(state_dict["param_groups"])
    sizes = [len(g["params"]) for g in param_groups]
    saved_sizes = [len(g["params"]) for g in saved_groups]
    if sizes != saved_sizes:
        raise ValueError(
            f"the saved optimizer has parameter groups of sizes {saved_sizes}, this one {sizes}"
        )
    return saved_groups


class _PerParameterState(Mapping):
    """A read-only view ``{parameter: that parameter's optimizer state}`` (only parameters that
    have state, as in a normal optimizer's ``state``)."""

    def __init__(self, optimizers: dict[torch.nn.Parameter, torch.optim.Optimizer]):
        self._optimizers = optimizers

    def __getitem__(self, param: Any) -> Any:
        optimizer = self._optimizers.get(param)
        if optimizer is None or param not in optimizer.state:
            raise KeyError(param)
        return optimizer.state[param]

    def __iter__(self) -> Iterator[Any]:
        return (p for p, opt in self._optimizers.items() if p in opt.state)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class InBackwardOptimizer(torch.optim.Optimizer):
    """One optimizer per parameter, stepped by a post-accumulate-grad hook inside backward.

    Args:
        groups: parameter groups as ``optim.param_groups`` makes them (``params`` and
            ``weight_decay``).
        factory: the registry's factory, ``factory(groups, lr) -> optimizer``.
        lr: the initial learning rate.
    """

    def __init__(
        self,
        groups: ParamGroups,
        factory: Callable[[ParamGroups, float], torch.optim.Optimizer],
        lr: float,
    ) -> None:
        self.optimizers: dict[torch.nn.Parameter, torch.optim.Optimizer] = {}
        self._group_index: dict[torch.nn.Parameter, int] = {}
        real_groups = []
        for index, group in enumerate(groups):
            options = {k: v for k, v in group.items() if k != "params"}
            hyperparameters = options
            for param in group["params"]:
                inner = factory([{"params": [param], **options}], lr)
                self.optimizers[param] = inner
                self._group_index[param] = index
                # Every hyperparameter the optimizer filled in (betas, eps, …), as a normal
                # optimizer's group would have them.
                hyperparameters = {k: v for k, v in inner.param_groups[0].items() if k != "params"}
            real_groups.append({**hyperparameters, "params": list(group["params"])})
        first = next(iter(self.optimizers.values()), None)
        defaults = dict(first.defaults) if first is not None else {"lr": lr}
        super().__init__(real_groups, defaults)
        self._handles = [
            param.register_post_accumulate_grad_hook(self._step_parameter)
            for param in self.optimizers
        ]

    # The state lives in the per-parameter optimizers; torch's __init__ assigns an empty one.
    @property
    def state(self) -> Mapping[Any, Any]:  # type: ignore[override]
        return _PerParameterState(self.optimizers)

    @state.setter
    def state(self, value: Any) -> None:
        if value:
            raise AttributeError(
                "InBackwardOptimizer.state is a view of the per-parameter optimizers' states"
            )

    @torch.no_grad()
    def _step_parameter(self, param: torch.nn.Parameter) -> None:
        """The hook: this parameter's gradient is complete; update it and free the gradient."""
        inner = self.optimizers[param]
        inner.param_groups[0]["lr"] = self.param_groups[self._group_index[param]]["lr"]
        inner.step()
        param.grad = None

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Nothing to do: each parameter was updated in backward. A closure is evaluated (its
        backward pass does the updates)."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The hooks already freed every gradient; clear any that a backward pass without the
        hooks (none in effitrain) left behind."""
        for param in self.optimizers:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """A normal optimizer's layout: parameters numbered 0, 1, … in group order."""
        return numbered_state_dict(
            self.param_groups, lambda param: self.optimizers[param].state_dict()["state"].get(0)
        )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Load what :meth:`state_dict` wrote: each parameter's state into its own optimizer
        (by that optimizer's own ``load_state_dict``, which casts and places it), and every
        group's hyperparameters (the scheduler's lr included).

        Raises:
            ValueError: the groups or their sizes differ from this optimizer's.
        """
        saved_groups = check_saved_groups(self.param_groups, state_dict)
        saved_state = state_dict["state"]
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            options = {k: v for k, v in saved.items() if k != "params"}
            for param, saved_id in zip(group["params"], saved["params"], strict=True):
                entry = saved_state.get(saved_id)
                self.optimizers[param].load_state_dict(
                    {
                        "state": {} if entry is None else {0: entry},
                        "param_groups": [{**options, "params": [0]}],
                    }
                )
            group.update(options)

    def check_hooked(self, model: torch.nn.Module) -> None:
        """Every trainable parameter of the (prepared) model has its hook.

        Raises:
            EffitrainError: preparing the model replaced parameters (a bug, said plainly).
        """
        missing = [
            name
            for name, param in model.named_parameters()
            if param.requires_grad and param not in self.optimizers
        ]
        if missing:
            raise EffitrainError(
                f"--optimizer-in-backward: {len(missing)} trainable parameter(s) of the prepared "
                f"model (e.g. {missing[0]}) have no update hook; run without the option"
            )

    def remove_hooks(self) -> None:
        """Stop updating in backward (the parameters keep no reference to this optimizer)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
