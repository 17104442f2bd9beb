"""What a memory lever is: one :class:`Lever` spec per lever, registered in
:data:`effitrain.levers.LEVERS` as the optimizers are in ``effitrain.optim.OPTIMIZERS``.

A lever is one module: its options (an ``OptionGroup`` of ``option_field`` fields, which
registering it adds to the option table) and its spec, which says everything else about it in
one place: its checks (alone, with the other levers, with the optimizer, with the task, with
the launch), what it does at each moment of building and running (loading, the model, the
loss, the optimizer, the step), what it adds to the banner, the metrics JSON and the memory table, what
``effitrain estimate`` models in its place, what it checks of a checkpoint, and what a planner
may search over (:class:`Search`). Its methods default to doing nothing: a lever overrides the
moments it acts at (each has two implementers or says why it has one). The registry's
functions (:mod:`effitrain.levers`) call every lever that is on, in registry order.

A spec is one object for every run: what a lever keeps for one run (an offload's byte counter)
is what its :meth:`Lever.step_context` returns, kept by the run (``Run.lever_contexts``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from effitrain.config import OptionGroup, option
from effitrain.errors import EffitrainError

if TYPE_CHECKING:
    from contextlib import AbstractContextManager
    from pathlib import Path

    import torch

    from effitrain.config import TrainConfig
    from effitrain.distributed import Launch
    from effitrain.memory.step import StepMemory
    from effitrain.models import LoadOptions
    from effitrain.optim import OptimizerSpec, ParamGroups
    from effitrain.parts import RunParts
    from effitrain.report.live import Reporter
    from effitrain.results import MemoryRow

OptimizerBuilder = Callable[["ParamGroups", "OptimizerSpec", float], Any]
"""How a lever builds the optimizer around a spec's factory: ``(groups, spec, lr) ->
optimizer`` (one optimizer per parameter in backward hooks, or an offloaded one)."""


@dataclass(frozen=True)
class Search:
    """What a planner (``effitrain plan``) may try of a lever: a lever that declares one is
    planned. The lever that trains adapters is a mode of its own (full fine-tuning or adapters);
    the others are added one at a time, in :attr:`order`."""

    values: tuple[Any, ...]
    """Values to try for the lever's first field, its "off" value first."""
    order: int = 0
    """Its place in the order levers are added in: the cheapest in time first."""
    costs_time: bool = True
    """False: tried even where enough fits without it, as it costs no time or saves some."""
    removes_only_update: bool = False
    """It removes only gradients and optimizer state: not tried where those are a small share of
    the peak (LoRA's adapters)."""
    steps_when_on: bool = False
    """Its next values are tried even where it is on (the offload's state, then state+grads)."""
    offload_per_example: bool = False
    """Its host copies (``StepCost.offload_bytes_per_step``) grow with the examples of a step."""


@dataclass(frozen=True)
class LossOptions:
    """What the memory levers ask of a task's loss (``Lever.loss_options``)."""

    chunked: str = "off"
    """The chunked loss's implementation wanted (``--chunked-loss``: auto, torch, liger, cce),
    or off: the model's own output layer and loss."""


class Lever:
    """One memory lever. Subclasses set the class attributes and override the moments they act
    at; every method has the signature the registry calls it with."""

    name: str = ""
    """Its name in the metrics JSON's ``levers`` and the memory table's title."""
    options: type[OptionGroup]
    """Its options, declared in its module (``--lora-rank``, ``--lora-alpha`` …): a dataclass of
    ``option_field`` fields, which registering the lever makes TrainConfig fields, CLI options
    and YAML keys (``effitrain.config.add_options``); ``options.of(config)`` reads them typed.
    The first is the one a planner searches over."""
    save_only: tuple[str, ...] = ()
    """Those of its fields that change only what is saved, not what a step holds (``effitrain
    estimate`` does not list them; ``effitrain compare`` does not pass them on)."""
    removes: str = ""
    """What memory it removes, in words (docs, ``effitrain plan``'s reasons)."""
    task: str | tuple[str, ...] | None = None
    """The task or tasks that take it (the chunked loss: causal-lm and preference); None: every
    task."""
    devices: tuple[str, ...] = ()
    """The device types it runs on (the offloads: cuda); empty: any. ``effitrain estimate``
    estimates for such a device unless told another (``check_launch`` refuses that one)."""
    trains_adapters = False
    """Its trained parameters are new adapters: the optimizer's LoRA defaults apply."""
    in_backward: Literal["update", "gradients"] | None = None
    """What of the optimizer step runs inside backward, from a hook on each gradient: the
    ``"update"`` itself (done before the step's guard sees the loss), or ``"gradients"``: only
    each gradient's copy off the device (the update follows backward). Either way they cannot be
    clipped together: ``--max-grad-norm`` defaults to 0 with it, and a positive value is refused
    (:func:`effitrain.levers.updates_in_backward`, :func:`effitrain.levers.max_grad_norm`)."""
    strict_load = True
    """A checkpoint's model loads with every key checked by Accelerate (False: the lever checks
    the keys itself, :meth:`check_checkpoint`)."""
    search: Search | None = None
    """What a planner may try of it (None: a planner leaves its options as the user gave them)."""
    time_cost: str = ""
    """What it costs in time per step, in words, until a planner measures it."""
    packages: tuple[str, ...] = ()
    """The modules it imports that effitrain's own dependencies do not bring (peft)."""
    install: str = ""
    """What installs :attr:`packages`."""

    @property
    def fields(self) -> tuple[str, ...]:
        """The TrainConfig fields it owns: its options' names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(self.options))

    # -- on or off -------------------------------------------------------------------------

    def is_on(self, config: TrainConfig) -> bool:
        """Whether the options turn it on."""
        raise NotImplementedError

    def in_use(self, run: RunParts) -> bool:
        """Whether it is on in the built run (a lever chosen at build time may turn out off).
        One override (the chunked loss, whose ``auto`` keeps the full logits where it must)."""
        return self.is_on(run.config)

    def missing_install(self) -> str | None:
        """What to install where one of :attr:`packages` is missing, else None."""
        import importlib.util

        missing = any(importlib.util.find_spec(name) is None for name in self.packages)
        return self.install if missing else None

    # -- before anything is built ------------------------------------------------------------

    def check(self, config: TrainConfig) -> None:
        """Refuse values that cannot work, alone, with the other levers or with the optimizer.

        Raises:
            EffitrainError: one line naming the options and what to use instead.
        """

    def takes(self, task: str) -> bool:
        """Whether ``task`` can take the lever (:attr:`task`): the run's check and the plan's
        search ask the same."""
        return self.task is None or task in self._tasks()

    def _tasks(self) -> tuple[str, ...]:
        return (self.task,) if isinstance(self.task, str) else self.task or ()

    def check_task(self, config: TrainConfig, task: str) -> None:
        """Refuse the lever under a task that cannot take it (:meth:`takes`). No lever
        overrides it: :attr:`task` is the data it reads; a lever with a subtler rule would."""
        if not self.takes(task):
            raise EffitrainError(
                f"{option(self.fields[0])} needs --task {' or '.join(self._tasks())} (this run "
                f"is {task}); drop it"
            )

    def check_launch(self, config: TrainConfig, launch: Launch) -> None:
        """Refuse what the launch (processes, sharding, device) rules out; ``launch`` is the
        one a run reads from Accelerate, or the one ``effitrain estimate`` is told about."""

    # -- loading and the model ---------------------------------------------------------------

    def load_options(self, config: TrainConfig, options: LoadOptions) -> LoadOptions:
        """What it changes in how the checkpoint is read (the dtype it is read in, quantizing
        while reading, where the weights go): the options to load with."""
        return options

    def apply_to_model(
        self, model: torch.nn.Module, config: TrainConfig, device: torch.device | None
    ) -> torch.nn.Module:
        """Turn it on in the loaded model (on the meta device for an estimate); return the
        model to train (a lever may wrap it). ``device``: where the run trains."""
        return model

    def finish_model(self, model: torch.nn.Module, config: TrainConfig) -> None:
        """After every lever applied to the model (e.g. what a wrapper added needs a dtype).
        One implementer (bf16 weights: LoRA's head copies back to fp32), a moment of its own
        because it must follow the wrapper whatever the registry's order."""

    def for_launch(self, model: torch.nn.Module, config: TrainConfig, launch: Launch) -> None:
        """What ``launch`` needs changed in the model (levers applied) before the optimizer is
        built and Accelerate prepares it (FSDP2 shards floating-point parameters only). One
        implementer (QLoRA's codes stored as bf16): the only lever whose tensors a launch
        cannot take as they are."""

    # -- the loss, the optimizer, the step ------------------------------------------------------

    def loss_options(self, config: TrainConfig, options: LossOptions) -> LossOptions:
        """What it asks of the task's loss (``Task.loss_function``): ``options`` with its own
        changes. One implementer (the chunked loss): the only lever that changes how a task
        computes its loss; the task, not the lever, owns that code."""
        return options

    def optimizer_spec(self, spec: OptimizerSpec, config: TrainConfig) -> OptimizerSpec:
        """The optimizer spec to build in place of ``spec``. One implementer (bf16 weights'
        Kahan or stochastic-rounding variant); apart from :meth:`optimizer_builder`, which
        builds around whichever spec this leaves."""
        return spec

    def optimizer_builder(self, config: TrainConfig, estimating: bool) -> OptimizerBuilder | None:
        """How to build the optimizer, where the lever builds it (at most one lever does);
        ``estimating``: for fake tensors, where the real one cannot run."""
        return None

    def after_prepare(self, run: RunParts) -> None:
        """Once Accelerate prepared the model and optimizer."""

    def step_context(
        self, config: TrainConfig, model: torch.nn.Module, estimating: bool
    ) -> AbstractContextManager[Any] | None:
        """A context around each micro-batch's forward and backward (``model``: unwrapped);
        what it returns is kept as ``run.lever_contexts[name]``. One implementer (the
        activation offload's saved-tensor hooks), the moment any hook on saved tensors needs."""
        return None

    def batch_context(
        self, run: RunParts, batch: dict[str, Any]
    ) -> AbstractContextManager[Any] | None:
        """A context around one micro-batch's forward and backward that needs the batch, made
        anew for each, inside the :meth:`step_context` ones. One implementer (context
        parallelism, which cuts the batch's tensors to this rank's share of the sequence)."""
        return None

    def step_cost(self, run: RunParts, micro_batches: int) -> dict[str, int]:
        """What it adds to the cost of an optimizer step of ``micro_batches`` micro-batches that
        no operator shows (host<->device copies, a step on the host), once the step ran: fields
        of :class:`effitrain.cost.StepCost` (``offload_bytes_per_step``,
        ``host_step_elements``)."""
        return {}

    def finish_steps(self, run: RunParts) -> None:
        """After the last measured step, before memory is summed up (an estimate's stand-in
        completes what it left out of the step). One implementer (the optimizer offload's
        host step, which fake tensors cannot run inside the step)."""

    # -- what is shown -------------------------------------------------------------------------

    def banner(self, config: TrainConfig, model: torch.nn.Module) -> str | None:
        """Its banner line (``model``: unwrapped, levers applied)."""
        return None

    def metrics(self, run: RunParts) -> dict[str, Any]:
        """Its fields of the metrics JSON (and of an estimate's), measured."""
        return {}

    def memory_rows(self, metrics: dict[str, Any], step: StepMemory | None) -> list[MemoryRow]:
        """Its rows of the memory table, from :meth:`metrics`' fields and the measured step
        (None: not measured)."""
        return []

    def host_step_bytes(self, fields: dict[str, Any]) -> int:
        """What it holds in host memory through a step on a GPU, from its :meth:`metrics`
        fields: the offloads' pinned copies and host optimizer state, counted in the host
        figure (``host_peak_bytes``), not in the device's peak. Two implementers (the
        offloads)."""
        return 0

    def fake_tensor(self, original: Any, empty: Any) -> Any | None:
        """``effitrain estimate``: the fake tensor that stands for ``original`` (a meta
        parameter this lever made), given ``empty``, a fake tensor of its shape and dtype; None
        where a plain one will do. One implementer (QLoRA's packed codes and quant state):
        the only lever whose parameters are not plain tensors."""
        return None

    def estimate_notes(self, config: TrainConfig) -> list[str]:
        """What ``effitrain estimate`` models in its place, or leaves out."""
        return []

    # -- checkpoints -----------------------------------------------------------------------------

    def check_checkpoint(self, run: RunParts, checkpoint: Path) -> None:
        """Before resuming from ``checkpoint``: what only this lever can check.

        Raises:
            EffitrainError: the checkpoint cannot continue this run.
        """

    def after_final_save(self, run: RunParts, reporter: Reporter) -> None:
        """After the final model was saved and the results summed up (every process). One
        implementer (LoRA's merged copy, which changes the model in place: nothing may read it
        after)."""
