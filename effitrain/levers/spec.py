"""What a memory lever is: one :class:`Lever` spec per lever, registered in
:data:`effitrain.levers.LEVERS` as the optimizers are in ``effitrain.optim.OPTIMIZERS``.

A spec says everything about its lever in one place: its options (the config fields it owns),
its checks (alone, with the other levers, with the optimizer, with the task, with the launch),
what it does at each moment of building and running (loading, the model, the loss, the
optimizer, the step), what it adds to the banner, the metrics JSON and the memory table, what
``effitrain estimate`` models in its place, what it keeps in a checkpoint, and what a planner may
search over and what that costs. Its methods default to doing nothing: a lever overrides the
moments it acts at. The registry's functions (:mod:`effitrain.levers`) call every lever that is
on, in registry order.

A spec is one object for every run: what a lever keeps for one run (an offload's byte counter)
is what its :meth:`Lever.step_context` returns, kept by the run (``Run.lever_contexts``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from effitrain.config import option
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
    from effitrain.report import Reporter
    from effitrain.results import MemoryRow

OptimizerBuilder = Callable[["ParamGroups", "OptimizerSpec", float], Any]
"""How a lever builds the optimizer around a spec's factory: ``(groups, spec, lr) ->
optimizer`` (one optimizer per parameter in backward hooks, or an offloaded one)."""


class BuiltRun(Protocol):
    """What a lever reads of a built run (:class:`effitrain.run.Run` is one)."""

    config: TrainConfig
    accelerator: Any
    model: torch.nn.Module
    optimizer: Any
    loss: Any
    lever_contexts: dict[str, Any]
    tokenizer: Any
    data: Any
    train_loader: Any
    eval_loader: Any


class Lever:
    """One memory lever. Subclasses set the class attributes and override the moments they act
    at; every method has the signature the registry calls it with."""

    name: str = ""
    """Its name in the metrics JSON's ``levers`` and the memory table's title."""
    fields: tuple[str, ...] = ()
    """The TrainConfig fields it owns: its options (``--lora-rank``, ``--lora-alpha`` …)."""
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
    unclippable = False
    """The update runs before the gradients could be clipped together: ``--max-grad-norm``
    defaults to 0 with it, and a positive value is refused."""
    strict_load = True
    """A checkpoint's model loads with every key checked by Accelerate (False: the lever checks
    the keys itself, :meth:`check_checkpoint`)."""
    search: tuple[Any, ...] = ()
    """Values a planner may try for its first field, the lever's "off" value first (empty: a
    planner leaves the option as the user gave it)."""
    time_cost: str = ""
    """What it costs in time per step, in words, until a planner measures it."""
    packages: tuple[str, ...] = ()
    """The modules it imports that effitrain's own dependencies do not bring (peft)."""
    install: str = ""
    """What installs :attr:`packages`."""

    # -- on or off -------------------------------------------------------------------------

    def is_on(self, config: TrainConfig) -> bool:
        """Whether the options turn it on."""
        raise NotImplementedError

    def in_use(self, run: BuiltRun) -> bool:
        """Whether it is on in the built run (a lever chosen at build time may turn out off)."""
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

    def check_task(self, config: TrainConfig, task: str) -> None:
        """Refuse the lever under a task that cannot take it (:attr:`task`)."""
        takes = (self.task,) if isinstance(self.task, str) else self.task
        if takes is not None and task not in takes:
            raise EffitrainError(
                f"{option(self.fields[0])} needs --task {' or '.join(takes)} (this run is "
                f"{task}); drop it"
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
    ) -> Any:
        """Turn it on in the loaded model (on the meta device for an estimate); return the
        model to train (a lever may wrap it). ``device``: where the run trains."""
        return model

    def finish_model(self, model: torch.nn.Module, config: TrainConfig) -> None:
        """After every lever applied to the model (e.g. what a wrapper added needs a dtype)."""

    def for_launch(self, model: torch.nn.Module, config: TrainConfig, launch: Launch) -> None:
        """What ``launch`` needs changed in the model (levers applied) before the optimizer is
        built and Accelerate prepares it (FSDP2 shards floating-point parameters only)."""

    # -- the loss, the optimizer, the step ------------------------------------------------------

    def loss_options(self, config: TrainConfig) -> dict[str, Any]:
        """Options for the task's loss (``Task.loss_function``)."""
        return {}

    def optimizer_spec(self, spec: OptimizerSpec, config: TrainConfig) -> OptimizerSpec:
        """The optimizer spec to build in place of ``spec`` (a variant for bf16 weights)."""
        return spec

    def optimizer_builder(self, config: TrainConfig, estimating: bool) -> OptimizerBuilder | None:
        """How to build the optimizer, where the lever builds it (at most one lever does);
        ``estimating``: for fake tensors, where the real one cannot run."""
        return None

    def after_prepare(self, run: BuiltRun) -> None:
        """Once Accelerate prepared the model and optimizer."""

    def step_context(
        self, config: TrainConfig, model: torch.nn.Module, estimating: bool
    ) -> AbstractContextManager[Any] | None:
        """A context around each micro-batch's forward and backward (``model``: unwrapped);
        what it returns is kept as ``run.lever_contexts[name]``."""
        return None

    def step_cost(self, run: BuiltRun, micro_batches: int) -> dict[str, int]:
        """What it adds to the cost of an optimizer step of ``micro_batches`` micro-batches that
        no operator shows (host<->device copies, a step on the host), once the step ran: fields
        of :class:`effitrain.cost.StepCost` (``offload_bytes_per_step``,
        ``host_step_elements``)."""
        return {}

    def finish_steps(self, run: BuiltRun) -> None:
        """After the last measured step, before memory is summed up (an estimate's stand-in
        completes what it left out of the step)."""

    # -- what is shown -------------------------------------------------------------------------

    def banner(self, config: TrainConfig, model: torch.nn.Module) -> str | None:
        """Its banner line (``model``: unwrapped, levers applied)."""
        return None

    def metrics(self, run: BuiltRun) -> dict[str, Any]:
        """Its fields of the metrics JSON (and of an estimate's), measured."""
        return {}

    def memory_rows(self, metrics: dict[str, Any], step: StepMemory | None) -> list[MemoryRow]:
        """Its rows of the memory table, from :meth:`metrics`' fields and the measured step
        (None: not measured)."""
        return []

    def fake_tensor(self, original: Any, empty: Any) -> Any | None:
        """``effitrain estimate``: the fake tensor that stands for ``original`` (a meta
        parameter this lever made), given ``empty``, a fake tensor of its shape and dtype; None
        where a plain one will do."""
        return None

    def estimate_notes(self, config: TrainConfig) -> list[str]:
        """What ``effitrain estimate`` models in its place, or leaves out."""
        return []

    # -- checkpoints -----------------------------------------------------------------------------

    def check_checkpoint(self, run: BuiltRun, checkpoint: Path) -> None:
        """Before resuming from ``checkpoint``: what only this lever can check.

        Raises:
            EffitrainError: the checkpoint cannot continue this run.
        """

    def after_final_save(self, run: BuiltRun, reporter: Reporter) -> None:
        """After the final model was saved and the results summed up (every process)."""
