"""True storage accounting of optimizer state, parameters, gradients and peak memory.

Everything here is measured from the storages that really exist, never assumed from shapes:

- Storages are deduplicated by ``(data_ptr, device)`` over a whole measurement, so tensors that
  share memory (bitsandbytes' ``qmap1``/``qmap2``, tied weights, views) count once. A view of a
  larger tensor counts the whole storage behind it, once.
- DTensors (FSDP2) count their local shard (``to_local()``), not the global shape.
- Traceable tensor subclasses (torchao's low-bit optimizer state, …) are unwrapped with
  ``__tensor_flatten__`` and their inner tensors are counted instead of the subclass's claimed
  ``numel() * element_size()``.

Pure data: nothing here prints or logs. ``torch`` is imported inside the functions only, so
``import effitrain.memory.ledger`` stays cheap.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "BNB_QUANT_STATE_KEY",
    "PYTHON_SCALAR_BYTES",
    "SHARDED_QUANT_STATE",
    "OptimizerStateLedger",
    "StateKeyUsage",
    "adamw_equivalent_bytes",
    "adamw_equivalent_elements",
    "adamw_state_size",
    "format_bytes",
    "fp32_adamw_baseline",
    "gradient_bytes",
    "is_4bit",
    "local_logical_numel",
    "logical_numel",
    "optimizer_state_ledger",
    "parameter_bytes",
    "peak_memory_bytes",
    "quant_state_tensors",
    "tensor_storage",
    "trainable_parameter_bytes",
    "parameter_count",
    "trainable_parameter_count",
    "unwrap_optimizer",
    "unwrap_prepared",
]

BNB_QUANT_STATE_KEY = "__bnb_optimizer_quant_state__"
"""Key under which bitsandbytes' ``state_dict()`` nests a parameter's state tensors."""

PYTHON_SCALAR_BYTES = 8
"""Bytes charged for a Python ``int``/``float``/``bool`` state value (its value width, not the
size of the Python object). Negligible, but visible in the ledger."""

StorageKey = tuple[Any, Any]
"""``(storage data_ptr, device)``: identifies one real storage within the process; for a fake
tensor (no memory behind it), ``("fake", storage handle)``."""


# --------------------------------------------------------------------------------------------
# Ledger data classes
# --------------------------------------------------------------------------------------------


@dataclass
class StateKeyUsage:
    """What one state key (``exp_avg``, ``state1``, ``qmap1`` …) holds over all parameters."""

    tensors: int = 0
    """Distinct tensors whose storage was counted here (a shared tensor counts once, ledger-wide)."""
    elements: int = 0
    """Elements of the real storages (plus one per Python scalar)."""
    bytes: int = 0
    dtypes: list[str] = field(default_factory=list)
    """Sorted dtype names seen under this key: ``"float32"``, ``"uint8"``, ``"python int"`` …"""

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensors": self.tensors,
            "elements": self.elements,
            "bytes": self.bytes,
            "dtypes": list(self.dtypes),
        }


@dataclass
class OptimizerStateLedger:
    """Measured optimizer state. Totals equal the sums over ``by_key``."""

    tensors: int = 0
    elements: int = 0
    bytes: int = 0
    by_key: dict[str, StateKeyUsage] = field(default_factory=dict)
    """Per state key, in the order keys were first seen."""
    params_with_state: int = 0
    """Number of parameters whose state entry is non-empty."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensors": self.tensors,
            "elements": self.elements,
            "bytes": self.bytes,
            "params_with_state": self.params_with_state,
            "by_key": {key: usage.to_dict() for key, usage in self.by_key.items()},
        }


# --------------------------------------------------------------------------------------------
# Real storages behind one tensor
# --------------------------------------------------------------------------------------------


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _is_dtensor(t: Any) -> bool:
    if type(t).__name__ == "DTensor":
        return True
    if "torch.distributed.tensor" not in sys.modules:
        return False  # nobody can have built a DTensor without importing it
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


def _is_fake(t: Any) -> bool:
    if "torch._subclasses.fake_tensor" not in sys.modules:
        return False  # nobody can have made a fake tensor without importing it
    from torch._subclasses.fake_tensor import is_fake

    return bool(is_fake(t))


def _dtensor_local(t: Any) -> Any:
    local = getattr(t, "_local_tensor", None)
    if local is not None:
        return local
    import torch

    with torch.no_grad():
        return t.to_local()


def _inner_tensors(t: Any) -> list[Any] | None:
    """Inner tensors of a traceable wrapper subclass, or None when ``t`` is not one."""
    import torch

    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return None
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None or not hasattr(t, "__tensor_unflatten__"):
        return None
    try:
        names, _ctx = flatten()
    except Exception:  # a subclass whose flatten fails: fall back to the plain path
        return None
    inner = [getattr(t, name, None) for name in names]
    return [x for x in inner if isinstance(x, torch.Tensor)]


def tensor_storage(t: torch.Tensor) -> list[tuple[StorageKey | None, int, int, str]]:
    """The real storages behind ``t``: a list of ``(storage_key, nbytes, elements, dtype)``.

    - plain tensor: one entry for ``t.untyped_storage()``; ``nbytes`` is the whole storage
      (a view of a bigger tensor reports the bigger storage) and ``elements`` is
      ``nbytes // element_size``;
    - DTensor: the storages of its local shard (a 4-bit weight sharded by FSDP2: its packed
      codes' shard, and the whole ``QuantState``, which every rank holds);
    - traceable wrapper subclass (torchao ``OptimState8bit`` …): the storages of its inner
      tensors, recursively;
    - bitsandbytes 4-bit weight (``Params4bit``, ``--load-in-4bit``): the packed codes and
      every tensor of its ``QuantState`` (:func:`quant_state_tensors`);
    - meta tensors and zero-byte storages: one entry with key ``None``, 0 bytes, 0 elements
      (there is nothing to deduplicate).

    ``storage_key`` is ``(data_ptr, device)``; callers deduplicate on it.
    """
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    if _is_dtensor(t):
        out = tensor_storage(_dtensor_local(t))
        for x in quant_state_tensors(t):
            out.extend(tensor_storage(x))
        return out
    inner = _inner_tensors(t)
    if inner is not None:
        out: list[tuple[StorageKey | None, int, int, str]] = []
        for x in inner:
            out.extend(tensor_storage(x))
        return out

    quant_state = quant_state_tensors(t)
    if quant_state:
        out = tensor_storage(t.as_subclass(torch.Tensor))
        for x in quant_state:
            out.extend(tensor_storage(x))
        return out
    dtype = _dtype_name(t.dtype)
    if t.device.type == "meta":
        return [(None, 0, 0, dtype)]
    try:
        storage = t.untyped_storage()
        nbytes = int(storage.nbytes())
        ptr = 0 if _is_fake(t) else int(storage.data_ptr())
    except (RuntimeError, NotImplementedError):
        # A subclass without a real storage that we do not know how to unwrap: the best
        # we can do is what it claims.
        nbytes = t.numel() * t.element_size()
        return [(None, nbytes, t.numel(), dtype)]
    if ptr == 0 and nbytes > 0 and _is_fake(t):
        # FakeTensorMode (``effitrain estimate``): no memory behind it, but a real size, and
        # one storage object per storage (views share it) to deduplicate on.
        return [(("fake", storage._cdata), nbytes, nbytes // max(t.element_size(), 1), dtype)]
    if nbytes == 0 or ptr == 0:
        return [(None, 0, 0, dtype)]
    return [((ptr, str(t.device)), nbytes, nbytes // max(t.element_size(), 1), dtype)]


SHARDED_QUANT_STATE = "sharded_quant_state"
"""The attribute under which a 4-bit weight sharded by FSDP2 (a DTensor of its packed codes,
which lost the ``Params4bit`` and its ``quant_state``) carries its module's ``QuantState``
(``effitrain.levers.qlora_bnb``). Not ``quant_state``: bitsandbytes would then save the quant state
in the sharded checkpoint too."""


def is_4bit(tensor: Any) -> bool:
    """A bitsandbytes 4-bit weight: a ``Params4bit`` (two 4-bit codes per byte of its storage
    dtype), any tensor that carries a ``quant_state`` as it does (``effitrain estimate``'s fake
    stand-in), or its FSDP2 shard (:data:`SHARDED_QUANT_STATE`)."""
    return (
        type(tensor).__name__ == "Params4bit"
        or hasattr(tensor, "quant_state")
        or hasattr(tensor, SHARDED_QUANT_STATE)
    )


def _quant_state(t: Any) -> Any:
    return getattr(t, "quant_state", None) or getattr(t, SHARDED_QUANT_STATE, None)


def quant_state_tensors(t: Any) -> list[torch.Tensor]:
    """The tensors of a 4-bit weight's ``QuantState``: absmax, code, offset, and with double
    quantization the nested absmax and code (``state2``); [] for any other tensor or a 4-bit
    weight not yet quantized."""
    import torch

    state = _quant_state(t) if is_4bit(t) else None
    tensors: list[torch.Tensor] = []
    while state is not None:
        tensors += [v for v in vars(state).values() if isinstance(v, torch.Tensor)]
        state = getattr(state, "state2", None) if getattr(state, "nested", False) else None
    return tensors


def logical_numel(param: Any) -> int:
    """The weights a parameter stands for: a quantized 4-bit one, its original shape's (it
    stores two per byte); any other, ``numel()``."""
    import math

    state = _quant_state(param) if is_4bit(param) else None
    return math.prod(state.shape) if state is not None else param.numel()


def local_logical_numel(param: Any) -> int:
    """:func:`logical_numel` of this rank's share: a DTensor's local shard (a sharded 4-bit
    weight's: two weights per byte of its local codes)."""
    if not _is_dtensor(param):
        return logical_numel(param)
    local = _dtensor_local(param)
    return 2 * local.numel() * local.element_size() if is_4bit(param) else local.numel()


class _Dedup:
    """Counts each real storage once over one whole measurement."""

    def __init__(self) -> None:
        self.seen: set[Hashable] = set()

    def add(self, t: torch.Tensor) -> tuple[bool, int, int, set[str]]:
        """Returns (contributed anything new, new bytes, new elements, dtypes)."""
        new = False
        nbytes = 0
        elements = 0
        dtypes: set[str] = set()
        for key, b, e, dtype in tensor_storage(t):
            dtypes.add(dtype)
            if key is None:
                new = True
            elif key in self.seen:
                continue
            else:
                self.seen.add(key)
                new = True
            nbytes += b
            elements += e
        return new, nbytes, elements, dtypes


# --------------------------------------------------------------------------------------------
# Optimizer state ledger
# --------------------------------------------------------------------------------------------


def unwrap_prepared(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that Accelerate's ``prepare`` wrapped (its ``AcceleratedOptimizer`` keeps
    it as ``.optimizer``); ``optimizer`` itself when it is not wrapped. One layer only, so under
    DeepSpeed it is DeepSpeed's optimizer; :func:`unwrap_optimizer` goes on to the state."""
    return getattr(optimizer, "optimizer", optimizer)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer inside wrappers that keep it as ``.optimizer`` (Accelerate's
    ``AcceleratedOptimizer`` and similar); ``optimizer`` itself when it is not wrapped."""
    for _ in range(8):
        inner = unwrap_prepared(optimizer)
        if inner is optimizer or not hasattr(inner, "state"):
            break
        optimizer = inner
    return optimizer


def _state_mapping(optimizer_or_state: Any) -> Mapping[Any, Any]:
    obj = optimizer_or_state
    if isinstance(obj, Mapping):
        # A whole optimizer state_dict ({"state": ..., "param_groups": ...}) is accepted too.
        if "state" in obj and "param_groups" in obj and isinstance(obj["state"], Mapping):
            return obj["state"]
        return obj
    state = getattr(unwrap_optimizer(obj), "state", None)
    if not isinstance(state, Mapping):
        raise TypeError(
            f"expected a torch optimizer or a state mapping, got {type(optimizer_or_state).__name__}"
        )
    return state


def _python_scalar_dtype(value: Any) -> str | None:
    if isinstance(value, bool):
        return "python bool"
    if isinstance(value, int):
        return "python int"
    if isinstance(value, float):
        return "python float"
    return None


def optimizer_state_ledger(optimizer_or_state: Any) -> OptimizerStateLedger:
    """Measure optimizer state from the storages that really exist.

    ``optimizer_or_state`` is a torch optimizer (wrappers with ``.optimizer``, such as
    accelerate's ``AcceleratedOptimizer``, are unwrapped), its ``state`` mapping
    ``{param_or_id: {key: value}}``, ``state_dict()["state"]``, or a whole ``state_dict()``.

    Rules for the values of a parameter's state entry:

    - tensor: its real storages (see :func:`tensor_storage`), each storage counted once over
      the whole ledger, under the key that saw it first. ``tensors`` counts a tensor only if it
      brought at least one storage not counted before (so bitsandbytes' shared ``qmap1`` is one
      tensor of 256 float32 = 1024 bytes in all, not one per parameter);
    - Python ``int``/``float``/``bool`` (bitsandbytes' and transformers Adafactor's ``step``):
      ``tensors`` 0, ``elements`` 1, ``bytes`` :data:`PYTHON_SCALAR_BYTES`, dtype
      ``"python int"`` / ``"python float"`` / ``"python bool"``;
    - dict: recursed into. bitsandbytes' ``state_dict()`` nests everything under
      ``"__bnb_optimizer_quant_state__"``; that level is flattened (children keep their own
      names, so a saved bnb checkpoint shows the same keys as the live optimizer:
      ``state1``, ``qmap1`` …). Any other nested dict gives keys joined as ``"parent.child"``;
    - list/tuple: each item counted under the same key;
    - a plain Python object (GaLore's and APOLLO's ``projector``, which holds the projection
      matrix ``ortho_matrix``): its attributes (``vars``), as a dict: ``"projector.ortho_matrix"``,
      ``"projector.rank"`` … (the keys a saved checkpoint has, see
      :func:`effitrain.optim.split.keep_projectors_in_state_dict`);
    - anything else (``None``, strings): ignored.

    When several state tensors are views into one flat buffer, the whole buffer is charged to
    the first key that reaches it; totals stay exact.
    """
    walk = _StateWalk()
    for entry in _state_mapping(optimizer_or_state).values():
        if isinstance(entry, Mapping):
            walk.add_entry(entry)
    return walk.finish()


class _StateWalk:
    """Fills one :class:`OptimizerStateLedger` by the rules of :func:`optimizer_state_ledger`,
    each storage counted once over the whole walk."""

    def __init__(self) -> None:
        import torch

        self._tensor_type = torch.Tensor
        self.ledger = OptimizerStateLedger()
        self._dedup = _Dedup()
        self._dtypes: dict[str, set[str]] = {}

    def add_entry(self, entry: Mapping[Any, Any]) -> None:
        """One parameter's state entry."""
        self.ledger.params_with_state += len(entry) > 0
        for key, value in entry.items():
            self._visit(str(key), value)

    def finish(self) -> OptimizerStateLedger:
        """The ledger, with its dtypes sorted and its totals summed over the keys."""
        ledger = self.ledger
        for key, usage in ledger.by_key.items():
            usage.dtypes = sorted(self._dtypes[key])
            ledger.tensors += usage.tensors
            ledger.elements += usage.elements
            ledger.bytes += usage.bytes
        return ledger

    def _usage(self, key: str) -> StateKeyUsage:
        if key not in self.ledger.by_key:
            self.ledger.by_key[key] = StateKeyUsage()
            self._dtypes[key] = set()
        return self.ledger.by_key[key]

    def _visit(self, key: str, value: Any) -> None:
        if isinstance(value, self._tensor_type):
            self._add_tensor(key, value)
        elif (scalar := _python_scalar_dtype(value)) is not None:
            usage = self._usage(key)
            self._dtypes[key].add(scalar)
            usage.elements += 1
            usage.bytes += PYTHON_SCALAR_BYTES
        elif isinstance(value, Mapping):
            for child_key, child in value.items():
                child_name = str(child_key)
                if key and key != BNB_QUANT_STATE_KEY:
                    child_name = f"{key}.{child_name}"
                self._visit(child_name, child)
        elif isinstance(value, (list, tuple)):
            for item in value:
                self._visit(key, item)
        else:
            attributes = getattr(value, "__dict__", None)
            if isinstance(attributes, dict) and not isinstance(value, type) and not callable(value):
                self._visit(key, attributes)

    def _add_tensor(self, key: str, tensor: torch.Tensor) -> None:
        usage = self._usage(key)
        new, nbytes, elements, seen_dtypes = self._dedup.add(tensor)
        self._dtypes[key].update(seen_dtypes)
        if new:
            usage.tensors += 1
        usage.bytes += nbytes
        usage.elements += elements


# --------------------------------------------------------------------------------------------
# Parameters and gradients
# --------------------------------------------------------------------------------------------


def _parameters(model_or_params: Any) -> list[torch.Tensor]:
    """Parameters of a module (each Parameter object once), or of an iterable of tensors or
    of param-group dicts (``{"params": [...]}``)."""
    import torch

    if isinstance(model_or_params, torch.nn.Module):
        return list(model_or_params.parameters())
    if isinstance(model_or_params, torch.Tensor):
        return [model_or_params]
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    items: Iterable[Any] = model_or_params
    for item in items:
        group = item["params"] if isinstance(item, Mapping) else [item]
        if isinstance(group, torch.Tensor):
            group = [group]
        for p in group:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return _dtensor_local(t) if _is_dtensor(t) else t


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    dedup = _Dedup()
    return sum(dedup.add(t)[1] for t in tensors)


def parameter_bytes(model: Any) -> int:
    """Bytes of the real storages behind all parameters; tied/shared storages count once.

    DTensor parameters count their local shard; quantized subclasses their inner tensors.
    """
    return _storage_bytes(_parameters(model))


def _view_identity(t: torch.Tensor) -> Hashable:
    """Same value for two Parameter objects that are the same view of the same storage."""
    try:
        ptr = 0 if _is_fake(t) else t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        ptr = 0
    if type(t).__name__ == "DTensor" or ptr == 0:
        return ("id", id(t))
    return (ptr, str(t.device), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def parameter_count(model: Any, trainable_only: bool = False) -> int:
    """The weights of all parameters (``trainable_only``: of those with ``requires_grad``);
    tied parameters count once.

    This is the logical count: a DTensor parameter counts its global shape, a 4-bit weight its
    original shape (:func:`logical_numel`).
    """
    seen: set[Hashable] = set()
    total = 0
    for p in _parameters(model):
        if trainable_only and not p.requires_grad:
            continue
        ident = _view_identity(p)
        if ident in seen:
            continue
        seen.add(ident)
        total += logical_numel(p)
    return total


def trainable_parameter_count(model: Any) -> int:
    """:func:`parameter_count` of the parameters with ``requires_grad``."""
    return parameter_count(model, trainable_only=True)


def gradient_bytes(model: Any) -> int:
    """Bytes of the ``.grad`` tensors that exist now (shared storages once); 0 when all are None."""
    grads = [p.grad for p in _parameters(model) if p.grad is not None]
    return _storage_bytes(grads)


def _trainable_local_numels(model_or_params: Any) -> list[int]:
    # One entry per trainable Parameter *object*: that is what an optimizer keeps state for
    # (HF ties weights by sharing the Parameter object, which ``_parameters`` yields once).
    return [_local(p).numel() for p in _parameters(model_or_params) if p.requires_grad]


def adamw_state_size(numels: Iterable[int]) -> tuple[int, int]:
    """``(elements, bytes)`` that fp32 ``torch.optim.AdamW`` keeps after one step for parameter
    tensors of these sizes: per tensor ``exp_avg`` and ``exp_avg_sq`` (``numel`` float32 each) and
    one float32 ``step``.

    This is the reference the user compares against. ``torch.optim.AdamW`` really keeps its
    moments in the *parameter* dtype (bf16 params -> bf16 moments); the reference is
    deliberately "AdamW with fp32 state", the usual mixed-precision setup.
    """
    sizes = list(numels)
    return sum(2 * n + 1 for n in sizes), sum(2 * n * 4 + 4 for n in sizes)


def adamw_equivalent_elements(model_or_params: Any) -> int:
    """Elements fp32 AdamW would keep for these trainable parameters (:func:`adamw_state_size`).

    A Parameter object shared by several modules (tied weights) counts once, as the optimizer
    sees it once; DTensor parameters count their local shard, like the measured ledger does.
    """
    return adamw_state_size(_trainable_local_numels(model_or_params))[0]


def adamw_equivalent_bytes(model_or_params: Any) -> int:
    """Bytes fp32 AdamW would keep for these trainable parameters (:func:`adamw_state_size`)."""
    return adamw_state_size(_trainable_local_numels(model_or_params))[1]


def trainable_parameter_bytes(model: Any) -> int:
    """Bytes of the real storages behind the parameters that train (``requires_grad``)."""
    return _storage_bytes(p for p in _parameters(model) if p.requires_grad)


def fp32_adamw_baseline(model: Any) -> dict[str, int]:
    """What the same model would hold trained whole, in fp32, with fp32 AdamW and no levers:
    every parameter 4 bytes, a gradient for each, and AdamW's state for each (local shards; a
    4-bit weight counts the weights it stands for)."""
    numels = [local_logical_numel(p) for p in _parameters(model)]
    return {
        "parameter_bytes": 4 * sum(numels),
        "gradient_bytes": 4 * sum(numels),
        "optimizer_state_bytes": adamw_state_size(numels)[1],
    }


# --------------------------------------------------------------------------------------------
# Peak memory
# --------------------------------------------------------------------------------------------


def _peak_rss() -> tuple[int, str]:
    try:
        import resource
    except ImportError:  # Windows
        import psutil

        info = psutil.Process().memory_info()
        peak = getattr(info, "peak_wset", None)
        if peak is not None:
            return int(peak), "peak_rss"
        return int(info.rss), "rss"
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if sys.platform == "darwin":
        return int(maxrss), "peak_rss"  # bytes on macOS
    return int(maxrss) * 1024, "peak_rss"  # KiB on Linux and the BSDs


_CUDA_PEAK_BEFORE_RESET: dict[int, int] = {}
"""Per CUDA device index: the most ``max_memory_allocated`` had reached before
:func:`reset_cuda_peak` cleared it (the run's peak must not forget what came before)."""


def _cuda_index(device: Any) -> int:
    import torch

    return device.index if device.index is not None else torch.cuda.current_device()


def reset_cuda_peak(device: Any) -> None:
    """``torch.cuda.reset_peak_memory_stats`` for measuring one stretch (the tracked step),
    keeping the peak so far for :func:`peak_memory_bytes`, which reports the whole run's."""
    import torch

    device = torch.device(device)
    torch.cuda.synchronize(device)
    so_far, _ = peak_memory_bytes(device)
    _CUDA_PEAK_BEFORE_RESET[_cuda_index(device)] = so_far
    torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: Any = None) -> tuple[int, str]:
    """Peak memory of this process and what kind of number it is.

    - CUDA: ``torch.cuda.max_memory_allocated(device)``, kind ``"cuda_peak_allocated"``
      (tensors only; the caching allocator's reserve and the CUDA context are not included),
      over the whole run: a :func:`reset_cuda_peak` in between is undone;
    - XPU: ``torch.xpu.max_memory_allocated(device)``, kind ``"xpu_peak_allocated"``;
    - otherwise (CPU, MPS, which has no peak counter): peak resident set size of the process,
      kind ``"peak_rss"`` (everything: Python, libraries, tensors).

    ``device=None`` picks CUDA, then XPU, when available and torch is already imported.
    """
    torch_mod = sys.modules.get("torch")
    if device is None and torch_mod is None:
        return _peak_rss()
    import torch

    if device is None:
        if torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        elif hasattr(torch, "xpu") and torch.xpu.is_available():
            device = torch.device("xpu", torch.xpu.current_device())
        else:
            return _peak_rss()
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        before_reset = _CUDA_PEAK_BEFORE_RESET.get(_cuda_index(device), 0)
        peak = max(int(torch.cuda.max_memory_allocated(device)), before_reset)
        return peak, "cuda_peak_allocated"
    if device.type == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
        return int(torch.xpu.max_memory_allocated(device)), "xpu_peak_allocated"
    return _peak_rss()


# --------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int) -> str:
    """Binary units: ``812 B``, ``1.0 KiB``, ``502.0 MiB``, ``1.5 GiB``."""
    n = int(n)
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    if value < 1024:
        return f"{sign}{abs(n)} B"
    unit = _UNITS[0]
    for unit in _UNITS:
        value /= 1024.0
        if value < 1024 or unit == _UNITS[-1]:
            break
    if f"{value:.1f}" == "1024.0" and unit != _UNITS[-1]:
        value /= 1024.0
        unit = _UNITS[_UNITS.index(unit) + 1]
    return f"{sign}{value:.1f} {unit}"
