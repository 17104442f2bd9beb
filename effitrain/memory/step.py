"""Tensor memory of one optimizer step, by kind: parameters, gradients, optimizer state,
activations, temporaries, and their peak.

Measured once per run, over one optimizer step (every micro-batch of it; one of the run's last
two, see ``effitrain.build.Plan.measured_step``), with PyTorch's ``MemTracker``
(``torch.distributed._tools.mem_tracker``, torch >= 2.5). It is a ``TorchDispatchMode``: it sees
every tensor an operator creates, keeps a weak reference to its storage, and knows when the storage
dies, so it counts live tensor bytes on every device, **CPU included**, without the libraries
that make up most of a CPU process's RSS. It files each storage under a kind: parameters
and buffers (given to it), gradients (found through gradient hooks), optimizer state (created
inside ``optimizer.step()``: what the optimizer keeps, per
:func:`effitrain.memory.ledger.optimizer_state_ledger`, is its state, the rest the step's working tensors,
``optimizer_temporaries``), activations (created in forward) and temporaries (created in backward).
Storages count once (deduplicated by storage, like :mod:`effitrain.memory.ledger`).

Why this and not the alternatives: the profiler's memory events give sizes but no kinds and
miss what existed before profiling; ``saved_tensors_hooks`` see what autograd saves but not
when backward frees it, nor what gradient checkpointing recomputes; peak RSS mixes everything
with the library baseline. ``MemTracker`` gives the peak and its parts in one pass.

- ``peak_tensor_bytes``: the most live tensor bytes at any moment of the step (on CUDA:
  ``torch.cuda.max_memory_allocated`` over the step); ``at_peak``: what they were, by kind, at
  that moment (they add up to the tracker's peak exactly; on CUDA, compare the two).
- ``kind_peaks``: each kind's own maximum during the step; ``activations`` is the peak of what
  forward allocated and is still alive (saved for backward, plus the outputs), ``gradients``
  the most gradient bytes alive at once (with the optimizer step in backward: a few tensors).

Tensors created before the step and not owned by the model or the optimizer (the batch, RNG
states) are not counted: they are a few KiB. What a lever holds through every step besides them
(DPO's frozen reference copy, its precomputed table) is given to the probe (``extra``) and counted.

Where the loss generates before the step's first forward (GRPO's completions), that generation is
measured apart, by the same tracker, as the step's generation phase
(:meth:`StepMemoryProbe.generation`).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from effitrain.memory import ledger

KINDS = (
    "parameters",
    "buffers",
    "gradients",
    "optimizer_state",
    "optimizer_temporaries",
    "activations",
    "temporaries",
    "other",
)
_TRACKER_KINDS = {
    "Parameter": "parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "other",
}
"""MemTracker's ``_MemRefType`` values -> our kind names."""


@dataclass
class StepMemory:
    """What one optimizer step held in tensors (bytes, this process)."""

    peak_tensor_bytes: int
    """The tracker's peak; on CUDA, ``cuda_max_allocated``."""
    at_peak: dict[str, int] = field(default_factory=dict)
    """By kind, at the moment of the tracker's peak (they sum to it)."""
    kind_peaks: dict[str, int] = field(default_factory=dict)
    """Each kind's own maximum within the step."""
    method: str = "torch MemTracker"
    cuda_max_allocated: int | None = None
    """``torch.cuda.max_memory_allocated`` over the same step (CUDA only)."""
    cuda_max_reserved: int | None = None
    """``torch.cuda.max_memory_reserved`` over the same step: what the caching allocator held
    (CUDA only)."""
    quantized_at_peak: int | None = None
    """Of ``at_peak``'s parameters: the 4-bit weights, packed codes and quant states (None: the
    model has none). They are tracked from the step's start and still alive at its end, so
    all of them were alive at its peak."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> StepMemory | None:
        return cls(**data) if data else None


def available() -> bool:
    """Whether this torch has ``MemTracker`` (torch >= 2.5 with distributed support)."""
    try:
        from torch.distributed._tools.mem_tracker import MemTracker  # noqa: F401
    except ImportError:
        return False
    return True


def compiles_step(optimizer: Any) -> bool:
    """torchao's optimizers ``torch.compile(fullgraph=True)`` their step, which refuses to run
    under a ``TorchDispatchMode`` such as ``MemTracker``: their step is not measured by kind,
    nor counted (``effitrain.cost.StepCounter`` is one too)."""
    return type(optimizer).__module__.startswith("torchao.")


class StepMemoryProbe:
    """Measures one optimizer step: ``start()`` before its first micro-batch, ``stop()`` after
    ``optimizer.step()``.

    A probe that cannot run (old torch) returns None from ``stop()``; the memory table then says
    the breakdown was not measured. Use it as a context manager around the loop, so that an
    error mid-step leaves no tracker (a dispatch mode) active.
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        device: Any,
        compiled_step: bool | None = None,
        extra: list[Any] | tuple[Any, ...] = (),
    ):
        self.model = model
        self.extra = list(extra)
        """Modules and tensors the step holds besides the model and the optimizer (a frozen
        reference copy: its parameters count as parameters; a tensor as other)."""
        # accelerate's AcceleratedOptimizer keeps the real one as .optimizer.
        self.optimizer = ledger.unwrap_prepared(optimizer)
        self.device = device
        self._tracker: Any = None
        self._warnings: Callable[[], None] | None = None
        """Restores the warning filters once the tracked step is over."""
        self.compiled_step = (
            compiles_step(self.optimizer) if compiled_step is None else compiled_step
        )
        """Its step is torch.compile'd (torchao): not measured (``effitrain estimate`` runs it
        without the compiled update and says False)."""

    done = False
    """It measured its step (or could not): it does not start again."""

    @property
    def running(self) -> bool:
        return self._tracker is not None

    def __enter__(self) -> StepMemoryProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._tracker is not None:  # stopped mid-step: leave no dispatch mode behind
            self._tracker.__exit__(None, None, None)
            self._tracker = None
        self._restore_warnings()

    def _restore_warnings(self) -> None:
        if self._warnings is not None:
            self._warnings()
            self._warnings = None

    def start(self) -> None:
        self.done = True
        if not available() or self.compiled_step:
            return
        self._warnings = _quiet_tracker_warnings()
        self._tracker = self._started()

    def next_micro_batch(self) -> None:
        """Another forward of the same step (gradient accumulation): MemTracker keeps per-module
        statistics for one forward only; the totals it keeps are not affected."""
        if self._tracker is not None:
            self._tracker.reset_mod_stats()

    @contextmanager
    def generation(self) -> Iterator[None]:
        """Measures what runs inside it as the generation phase of the step about to be
        measured (GRPO samples a whole step's completions before its first forward), into
        :attr:`generation_memory`: the weights and optimizer state, and what generating holds
        (the KV cache, the logits, sampling's tensors), by the same tracker as the step."""
        if not available() or self.compiled_step:
            yield
            return
        self._warnings = _quiet_tracker_warnings()
        tracker = self._started()
        try:
            yield
        finally:
            tracker.__exit__(None, None, None)
            self._restore_warnings()
        self.generation_memory = self._measured(tracker)

    generation_memory: StepMemory | None = None
    """The measured step's generation phase (None: the loss does not generate, or it was not
    measured)."""

    def _started(self) -> Any:
        """A tracker of the model, the optimizer and ``extra``, entered, with the device's peak
        reset (on the CPU: the heap's free pages given back first)."""
        tracker = _make_tracker()
        tracker.track_external(self.model, self.optimizer, *self.extra)
        if getattr(self.device, "type", str(self.device)) == "cuda":
            ledger.reset_cuda_peak(self.device)  # this step's peak; the run's is kept
        else:
            return_freed_heap()
        tracker.__enter__()
        return tracker

    def stop(self) -> StepMemory | None:
        """The step's :class:`StepMemory` (None when it could not be measured)."""
        tracker, self._tracker = self._tracker, None
        if tracker is None:
            return None
        tracker.__exit__(None, None, None)
        self._restore_warnings()
        return self._measured(tracker)

    def _measured(self, tracker: Any) -> StepMemory:
        """What ``tracker`` (exited) saw, by kind, and on CUDA the allocator's peak since it
        started."""
        import torch

        snapshot = _device_snapshot(tracker.get_tracker_snapshot("peak"), self.device)
        at_peak = {kind: snapshot.get(kind, 0) for kind in KINDS}
        peaks = _device_snapshot(getattr(tracker, "kind_peaks", {}), self.device)
        # The tracker files everything optimizer.step() allocates as optimizer state; what the
        # optimizer keeps is its state, the rest were the step's working tensors.
        kept = ledger.optimizer_state_ledger(self.optimizer).bytes
        for counts in (at_peak, peaks):
            total = counts.get("optimizer_state", 0)
            counts["optimizer_state"] = min(total, kept)
            counts["optimizer_temporaries"] = total - counts["optimizer_state"]
        quantized = [p for p in self.model.parameters() if ledger.is_4bit(p)]
        cuda_peak = cuda_reserved = None
        if getattr(self.device, "type", str(self.device)) == "cuda":
            torch.cuda.synchronize(self.device)
            cuda_peak = int(torch.cuda.max_memory_allocated(self.device))
            cuda_reserved = int(torch.cuda.max_memory_reserved(self.device))
        return StepMemory(
            # On CUDA, the allocator's own count (it also sees what the tracker cannot: cuBLAS
            # workspaces, allocator rounding); the parts come from the tracker either way.
            peak_tensor_bytes=cuda_peak if cuda_peak is not None else sum(at_peak.values()),
            at_peak=at_peak,
            kind_peaks={kind: max(peaks.get(kind, 0), at_peak[kind]) for kind in KINDS},
            cuda_max_allocated=cuda_peak,
            cuda_max_reserved=cuda_reserved,
            quantized_at_peak=ledger.parameter_bytes(quantized) if quantized else None,
        )


def return_freed_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim(0)``; a no-op
    elsewhere), once, just before the tracked step on CPU.

    The tracked step is one of the run's last, when the heap has grown over the earlier steps
    (freed tensors leave pages resident in it, in any training loop), and the tracker's own
    bookkeeping (a Python object per storage and module event) comes on top of that at the step's
    peak. Returning the free pages first leaves room for the bookkeeping within what the step
    would have held anyway. It is cheap; that one step faults its pages back in, and it is left
    out of the time per step.
    """
    import contextlib
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl): nothing to trim
        ctypes.CDLL(None).malloc_trim(0)


def _device_snapshot(snapshot: dict[Any, dict[Any, int]], device: Any) -> dict[str, int]:
    """MemTracker's ``{device: {ref type: bytes}}`` for our device, keyed by our kind names."""
    import torch

    wanted = torch.device(device)
    for dev, by_type in snapshot.items():
        dev = torch.device(dev)
        if dev.type == wanted.type and (wanted.index is None or dev.index in (None, wanted.index)):
            return {
                _TRACKER_KINDS[_type_name(key)]: int(value)
                for key, value in by_type.items()
                if _type_name(key) in _TRACKER_KINDS
            }
    return {}


def _type_name(key: Any) -> str:
    return str(getattr(key, "value", key))


TRACKER_WARNINGS = (
    # The hooks of a module that was garbage-collected, and a gradient that is None (the
    # optimizer step in backward frees each one): nothing the step's totals miss.
    "Module is None. Skipping",
    "Expected a tensor or a traceable wrapper-subclass of tensor, but got <class 'NoneType'>",
    # ModTracker's module nesting under gradient checkpointing (a module re-entered in
    # recomputation); only its per-module statistics could suffer, and they are not used.
    "The module hierarchy tracking maybe be messed up",
)
"""Warnings MemTracker and ModTracker give about what they track; effitrain reads only the
step's totals by kind, which they do not affect."""


def _quiet_tracker_warnings() -> Callable[[], None]:
    """Ignore :data:`TRACKER_WARNINGS` until the returned function is called.

    ModTracker also replaces ``warnings.formatwarning`` for good when it warns; the returned
    function puts the original back.
    """
    scope = warnings.catch_warnings()
    scope.__enter__()
    formatwarning = warnings.formatwarning
    for message in TRACKER_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=UserWarning)

    def restore() -> None:
        scope.__exit__(None, None, None)
        warnings.formatwarning = formatwarning

    return restore


def _make_tracker() -> Any:
    """A MemTracker that also keeps each kind's own maximum (MemTracker keeps only the
    composition at the overall peak)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

    class KindPeakTracker(MemTracker):
        def __init__(self) -> None:
            super().__init__()
            self.kind_peaks: dict[Any, dict[Any, int]] = {}

        def _track_module_params_and_buffers(
            self, module: Any, install_grad_hooks: bool = True
        ) -> tuple[int, int]:
            # MemTracker hooks every parameter's gradient, and a frozen one (LoRA's base
            # weights) refuses hooks: hook only the parameters that train.
            counted = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            # A 4-bit weight's quant state (absmax, codes, nested absmax) is neither a parameter
            # nor a buffer of its module: tracked as part of the parameter it belongs to.
            for param in module.parameters():
                for tensor in ledger.quant_state_tensors(param):
                    self._update_and_maybe_create_winfos(tensor, _MemRefType.PARAM)
            if install_grad_hooks:
                for param in module.parameters():
                    if param.requires_grad and param not in self._param_to_grad_hook_handles:
                        self._param_to_grad_hook_handles[param] = (
                            param.register_hook(self._track_gradient),
                            param.register_post_accumulate_grad_hook(
                                lambda p: self._track_gradient(p.grad)
                            ),
                        )
            return counted

        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            # The model called twice in one micro-batch (DPO's reference: the same model with
            # its adapters switched off), which MemTracker takes for the next iteration and
            # refuses: only its per-module statistics would suffer, and they are not read.
            tracker = self._mod_tracker
            root = set(tracker.parents) - {tracker.get_known_fqn(module)} == {"Global"}
            if root and module in self.memory_tracking and not tracker.is_bw:
                self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

        def _post_fw_hook(self, module: Any, inputs: Any, outputs: Any) -> None:
            if module in self.memory_tracking:  # else dropped by the reset above
                super()._post_fw_hook(module, inputs, outputs)

        def _pre_bw_hook(self, module: Any, args: Any) -> None:
            if module is None or module in self.memory_tracking:
                super()._pre_bw_hook(module, args)

        def _post_bw_hook(self, module: Any, args: Any) -> None:
            if module is None or module in self.memory_tracking:
                super()._post_bw_hook(module, args)

        def _track_gradient(self, grad: Any) -> None:
            self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

        def _update_peak_stats(self, peak_state: Any) -> None:
            # Only the step's peak is read, never the per-module peaks, whose upkeep walks
            # every module at every operator: most of an LLM-sized estimate's time.
            for dev, by_type in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < by_type[_TOTAL_KEY]:
                    self._peak_mem[dev] = by_type[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(by_type)

        def _update_snap(self, *args: Any, **kwargs: Any) -> None:
            super()._update_snap(*args, **kwargs)
            for dev, by_type in self._curr_mem_snap.items():
                peaks = self.kind_peaks.setdefault(dev, {})
                for key, value in by_type.items():
                    if value > peaks.get(key, 0):
                        peaks[key] = value

    return KindPeakTracker()
