"""What one optimizer step costs in work, and a nominal model of its time.

:class:`StepCost` is counted on the step itself, by :class:`StepCounter` (a dispatch mode that
sees every operator the step runs): ``effitrain estimate`` counts its fake step (on fake tensors,
every operator still runs with its real shapes) and ``effitrain train`` its first real one, by
the same code (:func:`effitrain.loop.train_steps`). FLOPs are counted by PyTorch's own formulas
(``torch.utils.flop_counter``'s registry, the one ``FlopCounterMode`` uses: matrix products,
convolutions, attention), with :func:`extra_flop_formulas` for what it lacks, so a count equals
``FlopCounterMode``'s given those on the same step; elementwise work (activations, norms, the optimizer's update) is not in the FLOPs, as in the usual MFU
convention (6 x parameters x tokens), but its bytes are counted apart, for the time model.

:func:`modeled_step_seconds` turns a cost into seconds on a nominal device of a type. The
absolute value is nominal; what it is for is comparing candidate configurations of one model by
the ratios of their modeled times (``effitrain plan``). docs/cost.md describes the model and how
it was checked against measured times (``benchmarks/cost``).

:func:`peak_flops` is the bf16 dense peak of the GPUs whose peak is known, for MFU.
:func:`format_flops` writes a count of FLOPs in its unit, for every table that shows one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class StepCost:
    """The work of one optimizer step, per device."""

    flops_per_step: int
    """Forward + backward (+ checkpointing's recompute) + optimizer FLOPs of one optimizer step,
    all micro-batches, per device: the matrix products, convolutions and attention PyTorch's FLOP
    counter knows (elementwise work is in :attr:`elementwise_bytes` instead)."""
    recompute_flops: int
    """The part of ``flops_per_step`` that is gradient checkpointing's recompute (0 without)."""
    offload_bytes_per_step: int
    """Bytes moved host<->device per optimizer step by the offload levers (0 without)."""
    half_precision_flops: int = 0
    """The part of ``flops_per_step`` computed in bf16 or fp16 (bf16 weights, autocast)."""
    elementwise_bytes: int = 0
    """Bytes written by the step's other operators (elementwise, reductions, copies; views and
    empty allocations left out): its memory-bound work."""
    operator_calls: int = 0
    """Operators the step ran that compute or copy (not views, metadata, allocations): what it
    pays per operator (dispatch, a kernel launch)."""
    host_step_elements: int = 0
    """Parameter elements whose optimizer update runs on the host (optimizer offload)."""

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def format_flops(flops: float) -> str:
    """FLOPs in the largest unit that keeps a number >= 1 (``313.4 GFLOP``)."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if flops >= scale:
            return f"{flops / scale:,.1f} {unit}"
    return f"{flops:,.0f} FLOP"


@dataclass(frozen=True)
class NominalDevice:
    """The rates :func:`modeled_step_seconds` assumes for a device type: round, sustained (not
    peak) figures of a typical part, so that ratios between candidates mean something."""

    fp32_flops: float
    """Matrix FLOP/s in fp32."""
    half_flops: float
    """Matrix FLOP/s in bf16/fp16."""
    memory_bandwidth: float
    """Bytes/s the device's memory sustains for elementwise work."""
    seconds_per_operator: float
    """Eager PyTorch's cost of one operator call (dispatch, launch)."""
    host_bandwidth: float
    """Bytes/s between host and device (pinned, PCIe 4 x16)."""
    host_seconds_per_element: float
    """The host's optimizer update of one parameter element (AdamW in fp32, a few cores)."""
    overlapped: bool
    """The device runs behind the host's dispatch (CUDA), so compute, memory traffic and
    operator calls overlap; on the CPU they add up."""


NOMINAL = {
    # An H100-class GPU: 989 bf16 TFLOP/s peak, 67 fp32 (no TF32 by default), 3.35 TB/s HBM;
    # sustained about 60-75 % of each.
    "cuda": NominalDevice(45e12, 600e12, 2.5e12, 8e-6, 20e9, 2e-9, overlapped=True),
    # A few server cores with AVX-512 (BF16): fp32 about 100 GFLOP/s sustained on 2 cores.
    "cpu": NominalDevice(100e9, 200e9, 10e9, 10e-6, 0.0, 0.0, overlapped=False),
}


def modeled_step_seconds(cost: StepCost, device_type: str) -> float:
    """Seconds one optimizer step of ``cost`` takes on a nominal device of ``device_type``
    (``cuda``, ``cpu``; others are modeled as ``cuda``): matrix FLOPs at the device's fp32 or
    half-precision rate, the other operators' bytes at its memory bandwidth, each operator call
    at its dispatch cost (on CUDA these overlap: the slowest of the three; on the CPU they add
    up), plus what the offload levers serialize: their bytes at the host link's bandwidth and
    the host's optimizer update. Compare candidates by ratios of it; the absolute value is
    nominal (docs/cost.md)."""
    device = NOMINAL.get(device_type, NOMINAL["cuda"])
    full = cost.flops_per_step - cost.half_precision_flops
    compute = full / device.fp32_flops + cost.half_precision_flops / device.half_flops
    memory = cost.elementwise_bytes / device.memory_bandwidth
    calls = cost.operator_calls * device.seconds_per_operator
    seconds = max(compute + memory, calls) if device.overlapped else compute + memory + calls
    if cost.offload_bytes_per_step and device.host_bandwidth:
        seconds += cost.offload_bytes_per_step / device.host_bandwidth
    return seconds + cost.host_step_elements * device.host_seconds_per_element


# -- counting -------------------------------------------------------------------------------


class Recompute:
    """Whether gradient checkpointing is recomputing a forward now: the checkpoint's recompute
    context (``torch.utils.checkpoint``'s ``context_fn``, set by the lever) enters it, so the
    FLOPs counted meanwhile are the recompute's. A depth: checkpoints can nest."""

    depth = 0

    def __enter__(self) -> Recompute:
        Recompute.depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        Recompute.depth -= 1


class Repeated:
    """What runs inside it stands for ``times`` runs of the same work: a shortcut that runs one
    of several identical pieces (:func:`one_of_each_kind`) counts the others' FLOPs, bytes and
    operator calls this way. Nested, the factors multiply."""

    times = 1

    def __init__(self, times: int) -> None:
        self.factor = times
        self.outer = 1

    def __enter__(self) -> Repeated:
        self.outer = Repeated.times
        Repeated.times *= self.factor
        return self

    def __exit__(self, *exc: object) -> None:
        Repeated.times = self.outer


def one_of_each_kind(
    pieces: list[tuple[int, int]], settled: int, fake: bool
) -> list[tuple[int, int, int]]:
    """(start, width, times) of the ``pieces`` (start, width) of a sequence that a loop runs in
    order (tiles, chunks), to run: each once (times 1) where ``fake`` is False; on fake tensors
    (the estimate) one of each kind, standing for the ``times`` pieces of its kind, to run in
    :class:`Repeated` (times). A kind is a width and which piece it is before the
    ``settled``-th, from which on each piece starts from the same tensors alive (what the
    pieces before it left): pieces of a kind allocate, free and count the same, so their peak
    is their first's."""
    if not fake:
        return [(start, width, 1) for start, width in pieces]
    kinds: dict[tuple[int, int], list[int]] = {}
    for index, (start, width) in enumerate(pieces):
        kinds.setdefault((min(index, settled), width), [start, width, 0])[2] += 1
    return [(start, width, times) for start, width, times in kinds.values()]


class StepCounter:
    """Counts the FLOPs, bytes and operator calls of what runs inside it (real or fake tensors),
    with PyTorch's FLOP formulas; ``cost(...)`` is the :class:`StepCost`. A plain dispatch mode,
    not ``FlopCounterMode`` itself: that one also tracks the module tree with hooks on every
    module's inputs and outputs, which would keep gradients alive in a step whose memory is
    measured; the counts are the same (tests/test_cost.py)."""

    def __init__(self) -> None:
        self.flops = self.recompute_flops = self.half_flops = 0
        self.elementwise_bytes = self.operator_calls = 0
        self._mode: Any = None

    def __enter__(self) -> StepCounter:
        self._mode = _counting_mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        mode, self._mode = self._mode, None
        mode.__exit__(*exc)

    def cost(self, offload_bytes_per_step: int = 0, host_step_elements: int = 0) -> StepCost:
        """What was counted, with the levers' parts no operator shows (``Lever.step_cost``)."""
        return StepCost(
            flops_per_step=self.flops,
            recompute_flops=self.recompute_flops,
            offload_bytes_per_step=offload_bytes_per_step,
            half_precision_flops=self.half_flops,
            elementwise_bytes=self.elementwise_bytes,
            operator_calls=self.operator_calls,
            host_step_elements=host_step_elements,
        )


def extra_flop_formulas() -> dict[Any, Any]:
    """FLOP formulas (of shapes) for the matrix work PyTorch's registry lacks: the CPU's fused
    attention (counted as the GPU's fused attention is: the estimate's fake tensors live on the
    CPU) and bitsandbytes' 4-bit matmul (QLoRA's forward, on every device), where it is loaded.
    Pass it as ``FlopCounterMode``'s ``custom_mapping`` to count as :class:`StepCounter` does."""
    import contextlib
    import math

    import torch
    from torch.utils import flop_counter

    # The registry's formulas are wrapped to take tensors; __wrapped__ takes shapes.
    formulas = {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: (
            flop_counter.sdpa_flop.__wrapped__
        ),
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: (
            flop_counter.sdpa_backward_flop.__wrapped__
        ),
    }

    def gemm_4bit(a_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return 2 * math.prod(a_shape) * out_shape[-1]  # (..., K) @ (K, N): 2 K N per row

    with contextlib.suppress(AttributeError, RuntimeError):  # not loaded: no 4-bit weights
        formulas[torch.ops.bitsandbytes.gemm_4bit] = gemm_4bit
    return formulas


def _flop_formulas() -> dict[Any, Any]:
    """PyTorch's FLOP formulas by operator (each takes the operator's arguments and
    ``out_val``), with :func:`extra_flop_formulas`."""
    from torch.utils import flop_counter

    extra = extra_flop_formulas()
    return {
        **flop_counter.flop_registry,
        **{op: flop_counter.shape_wrapper(f) for op, f in extra.items()},
    }


def _tensors(value: Any) -> list[Any]:
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


NO_WORK = ("empty", "detach", "lift_fresh", "alias", "_local_scalar_dense", "set_", "resize_")
"""Operators that move no data (allocations, aliases, reading a scalar back)."""


def _does_work(func: Any) -> bool:
    """An operator that computes or copies (aten's, or a library's: bitsandbytes' dequantize):
    not a view, not metadata (``prim``), not the profiler's markers, not :data:`NO_WORK`."""
    if func.namespace in ("prim", "profiler") or func.is_view:
        return False
    return not func.__name__.split(".")[0].startswith(NO_WORK)


def _counting_mode(counter: StepCounter) -> Any:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    formulas = _flop_formulas()
    half = (torch.bfloat16, torch.float16)

    class CountingMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            formula = formulas.get(func._overloadpacket)
            times = Repeated.times
            if formula is not None:
                counter.operator_calls += times
                flops = formula(*args, **kwargs, out_val=out) * times
                counter.flops += flops
                if Recompute.depth:
                    counter.recompute_flops += flops
                inputs = _tensors(args)
                if inputs and inputs[0].dtype in half:
                    counter.half_flops += flops
            elif _does_work(func):
                counter.operator_calls += times
                counter.elementwise_bytes += times * sum(
                    t.numel() * t.element_size() for t in _tensors(out)
                )
            return out

    return CountingMode()


# -- peaks, for MFU ---------------------------------------------------------------------------

BF16_DENSE_PEAK_TFLOPS = (
    # (part of torch.cuda.get_device_name, bf16 dense TFLOP/s: no sparsity, fp32 accumulation).
    # Sources, NVIDIA's datasheets unless said: A100 SXM/PCIe 312; H100 SXM 989 and H200 989 (the
    # sheets' 1,979 is with sparsity); H100 PCIe 756; H100 NVL 835; B200 2,250 (DGX B200 sheet);
    # L4 121 (242 with sparsity); L40S 362 (733 with sparsity); L40 181; A10 and AWS's A10G 125
    # (250 with sparsity); RTX 4090 165.2 (Ada whitepaper, fp32 accumulation; 330 is fp16
    # accumulation); RTX 3090 71 (GA102 whitepaper, fp32 accumulation).
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10G", 125.0),
    ("A10", 125.0),
    ("RTX 4090", 165.2),
    ("RTX 3090", 71.0),
)
"""The longest name that matches wins ("H100 PCIe" over "H100", "A100" over "A10")."""


def peak_flops(device_name: str) -> float | None:
    """The bf16 dense peak, in FLOP/s, of a GPU named ``device_name`` (what
    ``torch.cuda.get_device_name`` says); None where it is not in the table."""
    matches = [(key, tflops) for key, tflops in BF16_DENSE_PEAK_TFLOPS if key in device_name]
    if not matches:
        return None
    return max(matches, key=lambda match: len(match[0]))[1] * 1e12


def device_name(device: Any) -> str:
    """What a device is called: the GPU's name (``torch.cuda.get_device_name``), else its
    type (``cpu``)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def throughput(cost: StepCost | None, seconds_per_step: float, name: str) -> dict[str, Any]:
    """A run's ``flops_per_step`` and ``recompute_flops`` (per device), ``achieved_tflops``
    (every FLOP the device ran, recompute included, per second of a typical step), ``mfu`` (the
    model FLOPs, recompute left out as PaLM's MFU does, per second, over the bf16 dense
    ``peak_tflops`` of the GPU called ``name``; None where that peak is not known) and
    ``device_name``: the metrics JSON's fields."""
    peak = peak_flops(name)
    fields: dict[str, Any] = {
        "flops_per_step": None,
        "recompute_flops": None,
        "achieved_tflops": None,
        "mfu": None,
        "peak_tflops": peak / 1e12 if peak else None,
        "device_name": name,
    }
    if cost is None:
        return fields
    fields["flops_per_step"] = cost.flops_per_step
    fields["recompute_flops"] = cost.recompute_flops
    if seconds_per_step > 0:
        fields["achieved_tflops"] = cost.flops_per_step / seconds_per_step / 1e12
        if peak:
            model_flops = cost.flops_per_step - cost.recompute_flops
            fields["mfu"] = model_flops / seconds_per_step / peak
    return fields
