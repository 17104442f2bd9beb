"""Activation offload (``--activation-offload``): the tensors autograd saves for backward go to
pinned host memory in forward and come back for backward.

The implementation is trl's ``get_act_offloading_ctx_manager`` (a maintained copy of torchtune's
``OffloadActivations``), not ``torch.autograd.graph.save_on_cpu``: trl copies on a side CUDA
stream, so the copies overlap with compute in both directions, and it leaves on the GPU what
would cost more to move than to keep: parameters (a weight saved by a linear layer is not an
activation), tensors under 1 KiB, a storage already offloaded, and the output head's inputs
(used again at once by the loss). ``save_on_cpu`` copies every saved tensor, weights included,
and waits for each copy. trl's dependencies are effitrain's own.

With ``--gradient-checkpointing`` (non-reentrant) only the checkpoints move (unsloth's offloaded
checkpoints): the saved tensors inside a checkpointed layer never reach the outer hooks (the
checkpoint keeps each layer's input and recomputes the rest in backward), so the device keeps one
layer's activations at a time and the host the checkpoints. What a backward recomputes with grad
on outside a checkpoint (the chunked loss's logits, chunk by chunk) is used at once: it stays on
the device (:func:`_in_backward`).

:class:`HostBytes` counts what was offloaded: the most pinned host bytes alive at once, for the
memory table and the metrics JSON (``activation_offload_host_bytes``). ``effitrain estimate``
models the same choice on fake tensors (:func:`fake_offload`) and counts those bytes in the host
figure (``host_peak_bytes``), not in the device's peak.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from effitrain.config import MEMORY_LEVERS, OptionGroup, option_field
from effitrain.errors import EffitrainError
from effitrain.levers.gradient_checkpointing import GradientCheckpointingOptions
from effitrain.levers.spec import Lever, Search
from effitrain.results import MemoryRow

if TYPE_CHECKING:
    import torch

    from effitrain.config import TrainConfig
    from effitrain.distributed import Launch
    from effitrain.memory.step import StepMemory
    from effitrain.parts import RunParts

MIN_OFFLOAD_BYTES = 1024
"""trl's default: smaller saved tensors stay on the GPU."""


class HostBytes:
    """Host bytes of the offloaded activations: ``current`` and ``peak`` (over the run), and
    ``moved``: bytes copied either way in the latest micro-batch (each offloaded tensor twice:
    out in forward, back in backward)."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self.moved = 0

    def add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        self.moved += nbytes

    def remove(self, nbytes: int) -> None:
        self.current -= nbytes
        self.moved += nbytes


def _nbytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size()


def _in_backward() -> bool:
    """Whether autograd is running a backward on this thread: a tensor saved then (a recompute
    with grad on inside a backward) is unpacked before that backward ends, so copying it out
    and straight back would only cost time."""
    import torch

    return torch._C._current_graph_task_id() != -1


def counted(context: Any, counter: HostBytes) -> Any:
    """Wrap a trl ``OffloadActivations`` context's pack and unpack hooks so that ``counter``
    follows the host tensors it holds (its ``tracker`` maps each saved tensor's id to
    ``(tensor, offloaded, …)``; an offloaded one is a host copy); what is saved inside a
    backward is kept as it is, never seen by trl (:func:`_in_backward`)."""
    import torch

    pack, unpack = context.pack_hook, context.unpack_hook
    sizes: dict[int, int] = {}

    def counting_pack(tensor: Any) -> Any:
        if _in_backward():
            return tensor
        tensor_id = pack(tensor)
        kept, offloaded = context.tracker[tensor_id][:2]
        if offloaded:
            sizes[tensor_id] = _nbytes(kept)
            counter.add(sizes[tensor_id])
        return tensor_id

    def counting_unpack(tensor_id: Any) -> Any:
        if isinstance(tensor_id, torch.Tensor):  # kept by counting_pack
            return tensor_id
        counter.remove(sizes.pop(tensor_id, 0))
        return unpack(tensor_id)

    context.pack_hook, context.unpack_hook = counting_pack, counting_unpack
    return context


def offload_context(model: torch.nn.Module, counter: HostBytes) -> Any:
    """trl's activation-offloading context for ``model`` (prepared or not), counted.

    Raises:
        EffitrainError: trl is not installed.
    """
    try:
        from trl.models.activation_offloading import get_act_offloading_ctx_manager
    except ImportError:
        raise EffitrainError(
            "--activation-offload needs trl's offloading context: pip install 'effitrain[offload]'"
        ) from None
    context = get_act_offloading_ctx_manager(
        model, min_offload_size=MIN_OFFLOAD_BYTES, warn_if_no_head=False
    )
    return counted(context, counter)


@contextmanager
def fake_offload(model: torch.nn.Module, counter: HostBytes) -> Iterator[None]:
    """``effitrain estimate``'s model of :func:`offload_context` on fake tensors: the same
    choice of what moves (not a parameter, at least :data:`MIN_OFFLOAD_BYTES`, not the output
    head's input, each storage once, nothing saved inside a backward), moved to the meta
    device (no device memory, so the step's tracker sees it leave) and brought back as a new
    device tensor in backward."""
    import torch

    parameters = {p.untyped_storage()._cdata for p in model.parameters()}
    output_embeddings = getattr(model, "get_output_embeddings", None)
    head = output_embeddings() if output_embeddings is not None else None
    in_head = [False]
    # Storages moved, by address, while a tensor of theirs lives: a freed storage's address can
    # be reused by a new tensor, which must not pass for one already moved.
    seen: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()

    def pack(tensor: Any) -> Any:
        storage = tensor.untyped_storage()._cdata
        if (
            in_head[0]
            or _in_backward()
            or isinstance(tensor, torch.nn.Parameter)
            or storage in parameters
            or storage in seen
            or _nbytes(tensor) < MIN_OFFLOAD_BYTES
        ):
            return tensor
        seen[storage] = tensor
        counter.add(_nbytes(tensor))
        return (tensor.device, torch.empty_like(tensor, device="meta"))

    def unpack(packed: Any) -> Any:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        counter.remove(_nbytes(host))
        return torch.empty_like(host, device=device)

    handles = []
    if head is not None:
        handles.append(head.register_forward_pre_hook(lambda *_: in_head.__setitem__(0, True)))
        handles.append(head.register_forward_hook(lambda *_: in_head.__setitem__(0, False)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        for handle in handles:
            handle.remove()


class OffloadContext:
    """The context a step enters around each micro-batch's forward and backward, made anew
    each time by ``make`` (trl's is one reusable object; the estimate's model is a generator),
    and the :class:`HostBytes` it counts into."""

    def __init__(self, make: Callable[[], AbstractContextManager[Any]], host_bytes: HostBytes):
        self._make = make
        self._current: AbstractContextManager[Any] | None = None
        self.host_bytes = host_bytes

    def __enter__(self) -> Any:
        self.host_bytes.moved = 0
        self._current = self._make()
        return self._current.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        current, self._current = self._current, None
        return current.__exit__(*exc) if current is not None else None


@dataclass
class ActivationOffloadOptions(OptionGroup):
    """``--activation-offload``."""

    activation_offload: bool = option_field(
        False,
        "CUDA: keep the tensors saved for backward in pinned host memory, copied back for "
        "backward on a side stream (with --gradient-checkpointing: offloaded checkpoints, only "
        "each layer's input).",
        panel=MEMORY_LEVERS,
    )


class ActivationOffload(Lever):
    name = "activation-offload"
    options = ActivationOffloadOptions
    removes = (
        "the tensors saved for backward, from the GPU (to pinned host memory; with "
        "checkpointing, the offloaded checkpoints)"
    )
    packages = ("trl",)
    install = "pip install 'effitrain[offload]'"
    devices = ("cuda",)
    search = Search((False, True), order=60, offload_per_example=True)
    time_cost = "host copies on a side stream, overlapped with compute; bound by host bandwidth"

    def is_on(self, config: TrainConfig) -> bool:
        return ActivationOffloadOptions.of(config).activation_offload

    def check_launch(self, config: TrainConfig, launch: Launch) -> None:
        if launch.device_type != "cuda":
            raise EffitrainError(
                "--activation-offload moves activations from the GPU to host memory; this "
                f"run's device is {launch.device_words}: drop --activation-offload"
            )

    def step_context(
        self, config: TrainConfig, model: torch.nn.Module, estimating: bool
    ) -> OffloadContext:
        counter = HostBytes()
        if estimating:
            return OffloadContext(lambda: fake_offload(model, counter), counter)
        context = offload_context(model, counter)
        return OffloadContext(lambda: context, counter)

    def counter(self, run: RunParts) -> HostBytes:
        """What its step context counted in ``run``."""
        context = run.lever_contexts[self.name]
        assert isinstance(context, OffloadContext)  # made by step_context
        return context.host_bytes

    def step_cost(self, run: RunParts, micro_batches: int) -> dict[str, int]:
        moved = self.counter(run).moved
        return {"offload_bytes_per_step": moved * micro_batches}

    def banner(self, config: TrainConfig, model: torch.nn.Module) -> str:
        how = "trl's OffloadActivations, copies on a side CUDA stream"
        if GradientCheckpointingOptions.of(config).gradient_checkpointing:
            return (
                "offloaded checkpoints: each layer's input waits in pinned host memory until "
                f"its recompute ({how})"
            )
        return f"activation offload: tensors saved for backward wait in pinned host memory ({how})"

    def metrics(self, run: RunParts) -> dict[str, Any]:
        return {"activation_offload_host_bytes": self.counter(run).peak}

    def memory_rows(self, metrics: dict[str, Any], step: StepMemory | None) -> list[MemoryRow]:
        host = metrics.get("activation_offload_host_bytes")
        if host is None:
            return []
        return [MemoryRow("offloaded activations (host, most at once)", host)]

    def host_step_bytes(self, fields: dict[str, Any]) -> int:
        return fields.get("activation_offload_host_bytes") or 0

    def estimate_notes(self, config: TrainConfig) -> list[str]:
        return [
            "--activation-offload: trl's choice of what moves is modeled (not parameters, not "
            "under 1 KiB, not the output head's inputs, each storage once), moved at once: its "
            "copies in flight (up to 5 behind compute) are not"
        ]
