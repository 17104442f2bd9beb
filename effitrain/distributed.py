"""Running under ``accelerate launch``: what sharding is in use, what it does to the optimizer,
and what every rank really holds in memory.

effitrain does not invent its own distribution. Accelerate decides (DDP, FSDP1, FSDP2,
DeepSpeed ZeRO) from its config; this module reads that decision and, *before* training starts:

- refuses combinations that cannot work, with one line giving the reason and the alternative
  (FSDP2 + bitsandbytes 8-bit crash on DTensor parameters; FSDP1 without
  ``use_orig_params`` leaves an optimizer built before ``prepare`` holding orphaned parameters,
  so nothing trains; a DeepSpeed config with its own optimizer or scheduler section; ZeRO
  optimizer offload with a client optimizer; processes that were launched together but would
  each train alone);
- warns where a combination works but loses the point (FSDP1 and DeepSpeed hand the optimizer
  flat 1-D shards, so Adafactor keeps a full second moment instead of row/column factors; under
  FSDP2 effitrain builds its own sharding-aware Adafactor and CAME, :mod:`effitrain.optim.fsdp2`);
- sets ``zero_allow_untested_optimizer`` for DeepSpeed, since effitrain always passes its own
  (client) optimizer.

After training, :func:`gather_rank_memory` collects each rank's optimizer-state bytes, parameter
bytes, peak memory and a parameter checksum on every process (all ranks must call it).

The sharding rules read plain attributes of Accelerate's state (``distributed_type``,
``num_processes``, ``backend``, ``fsdp_plugin``, ``deepspeed_plugin``), so they are tested with
stand-in objects; torch and accelerate are imported inside the functions only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from effitrain.errors import EffitrainError
from effitrain.memory import ledger

if TYPE_CHECKING:
    from accelerate import Accelerator


def is_launch_main_process() -> bool:
    """Whether this is the launch's main process, before Accelerate is started: ``accelerate
    launch`` (torchrun) gives every process its global ``RANK``; a plain run has none."""
    return os.environ.get("RANK", "0") in ("", "0")


FACTORED_OPTIMIZERS = frozenset({"adafactor", "adafactor-hf", "came"})
"""Optimizers whose savings come from factoring the second moment of >=2-D weights. Under FSDP2
they run as :mod:`effitrain.optim.fsdp2`'s sharding-aware classes."""

COLUMN_FACTORS = frozenset({"col_var", "exp_avg_sq_col", "exp_avg_res_col"})
"""The factored optimizers' state keys for the factor that averages over dim -2."""


def replicated_under_fsdp2(key: str, param_ndim: int) -> bool:
    """Whether optimizer state ``key`` of a ``param_ndim``-D parameter is held whole by every
    rank under FSDP2: the column factor of a 2-D weight, which averages over the sharded dim 0.
    Every other state tensor with a dim 0 is sharded on it, like its parameter."""
    return key in COLUMN_FACTORS and param_ndim == 2


MATRIX_OPTIMIZERS = {
    "muon": "Muon orthogonalises",
    "galore": "GaLore projects",
    "apollo": "APOLLO projects",
    "apollo-mini": "APOLLO-Mini projects",
}
"""Optimizers that need each hidden matrix whole, as the model's 2-D shape
(:mod:`effitrain.optim.split`)."""

_FLAT_COST = {"came": "8 bytes per parameter with its exp_avg, as much as AdamW, not ~4"}
"""What a factored optimizer keeps on flat 1-D shards, where not Adafactor's 4 bytes."""


def _flat_cost(optim: str) -> str:
    return _FLAT_COST.get(optim, "4 bytes per parameter, half of AdamW, not ~0")


DTENSOR_INCOMPATIBLE = {
    "adamw-8bit": "bitsandbytes' 8-bit AdamW",
    "lion-8bit": "bitsandbytes' 8-bit Lion",
    "adamw-4bit": "torchao's AdamW4bit",
    "adamw-fp8": "torchao's AdamWFp8",
}
"""Optimizers that crash on FSDP2's DTensor parameters (torchao's AdamW8bit trains; 4-bit and FP8
crash in their step). The libraries' Adafactors and CAME crash too, but effitrain replaces them
there (:data:`FACTORED_OPTIMIZERS`). Versions and launches: docs/distributed.md."""

DTENSOR_ALTERNATIVE = {
    "adamw-8bit": "--optim adamw-8bit-ao (torchao's 8-bit AdamW keeps DTensor state)",
    "lion-8bit": "--optim lion (its one state tensor is element-wise)",
}
"""What to use under FSDP2 instead of an optimizer that crashes there."""

TORCHAO_OPTIMIZERS = {"adamw-8bit-ao": 256, "adamw-4bit": 128, "adamw-fp8": 256}
"""torchao's low-bit AdamW and its block size: it quantizes a local tensor only when it has at
least 4096 elements and a multiple of the block size; any other keeps fp32 state."""


def _flat_shard_note(what: str, optim: str) -> list[str]:
    if optim not in TORCHAO_OPTIMIZERS:
        return []
    return [
        f"{what} hands the optimizer flat 1-D shards: {optim} quantizes a shard only when its "
        f"length is a multiple of {TORCHAO_OPTIMIZERS[optim]} (and >= 4096); other shards keep "
        "fp32 state (8 bytes per parameter, as AdamW): the ledger shows what it kept"
    ]


NEEDS_2D_SHARDS = {
    "adam-mini": "Adam-mini's per-row and per-head blocks index 2-D weights (IndexError on 1-D)",
}
"""Optimizers that crash on FSDP1's and DeepSpeed ZeRO's flat 1-D shards (docs/distributed.md);
FSDP2's row-sharded DTensors keep their shapes."""

RANK_FIELDS = ("optimizer_state_bytes", "parameter_bytes", "peak_memory_bytes")
"""Per-rank byte counts that :func:`rank_totals` sums over ranks."""

_ASKED_BY_ENV = {
    "ACCELERATE_USE_FSDP": ("FSDP", ("fsdp1", "fsdp2")),
    "ACCELERATE_USE_DEEPSPEED": ("DeepSpeed", ("deepspeed",)),
}
"""What ``accelerate launch`` asked for (environment variable -> name, sharding kinds)."""

USE_DDP = "DDP (accelerate launch --multi_gpu)"
ON_CPU = "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N"
"""How to ask for DDP, and for cooperating CPU processes (no config file needed)."""


@dataclass(frozen=True)
class Sharding:
    """How Accelerate will distribute this run, as far as the optimizer is concerned."""

    kind: str
    """``single``, ``ddp``, ``fsdp1``, ``fsdp2``, ``deepspeed`` or ``other``."""
    description: str
    """One human line, e.g. ``DDP over 2 processes (gloo)``."""
    num_processes: int
    flat_params: bool = False
    """The optimizer sees flattened 1-D shards (FSDP1, DeepSpeed ZeRO), not the model's shapes."""
    dtensor_params: bool = False
    """The optimizer sees DTensor parameters (FSDP2)."""
    zero_stage: int | None = None

    @property
    def sharded(self) -> bool:
        """Parameters (or their gradients and state) are split across processes."""
        return self.kind in ("fsdp1", "fsdp2", "deepspeed")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
"""How ``effitrain estimate --sharding`` names a launch's strategy (``fsdp``: FSDP2)."""


@dataclass(frozen=True)
class Launch:
    """How a run is launched: its processes and their sharding (:class:`Sharding`), the device
    type it trains on, and Accelerate's state that said so. A run reads it from Accelerate
    (:meth:`of`); ``effitrain estimate`` describes the launch it is told about
    (:meth:`described`), not the machine it runs on. The levers' and the optimizers' launch
    checks read it, so both refuse the same launches."""

    sharding: Sharding
    device_type: str
    """``cpu``, ``cuda``, …"""
    state: Any = field(repr=False, compare=False)
    """Accelerate's ``AcceleratorState``, or a stand-in with the attributes the rules read."""

    @classmethod
    def of(cls, state: Any) -> Launch:
        """The launch Accelerate's ``state`` describes."""
        device = getattr(state, "device", None)
        return cls(detect_sharding(state), str(getattr(device, "type", device or "cpu")), state)

    @classmethod
    def described(cls, num_processes: int, strategy: str, device_type: str) -> Launch:
        """``num_processes`` processes splitting the model by ``strategy`` (one of
        :data:`STRATEGIES`) on ``device_type``.

        Raises:
            EffitrainError: an unknown strategy or device, or fewer than one process.
        """
        if strategy not in STRATEGIES:
            raise EffitrainError(
                f"unknown --sharding '{strategy}'; choose one of: {', '.join(STRATEGIES)}"
            )
        if num_processes < 1:
            raise EffitrainError(f"--num-processes must be 1 or more (got {num_processes})")
        if device_type not in DEVICE_TYPES:
            raise EffitrainError(
                f"unknown --device '{device_type}'; choose one of: {', '.join(DEVICE_TYPES)}"
            )
        n = num_processes
        if n == 1:
            state = SimpleNamespace(distributed_type="NO", num_processes=1)
        elif strategy == "ddp":
            state = SimpleNamespace(
                distributed_type=f"MULTI_{device_type.upper()}", num_processes=n
            )
        elif strategy == "fsdp":
            plugin = SimpleNamespace(fsdp_version=2, reshard_after_forward=True)
            state = SimpleNamespace(distributed_type="FSDP", num_processes=n, fsdp_plugin=plugin)
        else:
            plugin = SimpleNamespace(zero_stage=int(strategy[-1]), deepspeed_config={})
            state = SimpleNamespace(
                distributed_type="DEEPSPEED", num_processes=n, deepspeed_plugin=plugin
            )
        return cls(detect_sharding(state), device_type, state)

    @property
    def num_processes(self) -> int:
        return self.sharding.num_processes

    @property
    def process_index(self) -> int:
        """This process's rank over all machines (0: the main process)."""
        return int(getattr(self.state, "process_index", 0) or 0)

    @property
    def receives_weights(self) -> str | None:
        """How this process gets the model's weights when the launch sends it the main
        process's, so that only the main process reads the checkpoint (one host copy in the whole
        job), in :class:`effitrain.models.LoadOptions`' words: ``"empty"`` under DDP (its wrap
        broadcasts the main process's parameters and buffers), ``"meta"`` under FSDP2 with
        ``fsdp_cpu_ram_efficient_loading`` (Accelerate shards the model on the meta device and
        sends each rank its shard of the main process's state dict). None: this process reads
        them (the main process, one process, FSDP1, DeepSpeed, FSDP2 without that setting)."""
        if self.process_index == 0:
            return None
        if self.sharding.kind == "ddp":
            return "empty"
        plugin = getattr(self.state, "fsdp_plugin", None)
        if self.sharding.kind == "fsdp2" and getattr(plugin, "cpu_ram_efficient_loading", False):
            return "meta"
        return None

    @property
    def single_process(self) -> bool:
        """One process, unsharded: what the levers that update from a gradient hook need."""
        return self.sharding.kind == "single" and self.sharding.num_processes == 1

    @property
    def strategy(self) -> str:
        """What the processes split, in :data:`STRATEGIES`' words (FSDP1 counts as ``fsdp``)."""
        if self.sharding.kind in ("fsdp1", "fsdp2"):
            return "fsdp"
        if self.sharding.kind == "deepspeed" and self.sharding.zero_stage:
            return f"zero{self.sharding.zero_stage}"
        return "ddp"

    @property
    def device_words(self) -> str:
        """The device in a sentence: ``the CPU``, ``cuda``."""
        return "the CPU" if self.device_type == "cpu" else self.device_type

    def optimizer_notes(self, optim: str) -> list[str]:
        """What this launch does to optimizer ``optim`` (:func:`optimizer_notes`)."""
        return optimizer_notes(self.state, optim)


DEVICE_TYPES = ("cpu", "cuda")
"""The devices ``effitrain estimate --device`` describes."""


@dataclass
class RankMemory:
    """What one process holds at the end of training (one entry of ``--metrics-json`` ``ranks``)."""

    rank: int
    optimizer_state_bytes: int
    parameter_bytes: int
    peak_memory_bytes: int
    peak_memory_kind: str
    parameter_checksum: float
    """Sum of this rank's local parameter values in float64: equal on every DDP rank."""
    device: str
    weights: str = "read"
    """How this rank got the model's weights: ``read`` (from the checkpoint, or a preset built
    here) or ``from rank 0`` (built empty and sent the main process's by the launch:
    :attr:`Launch.receives_weights`)."""


WEIGHTS_RECEIVED = "from rank 0"
""":attr:`RankMemory.weights` of a rank that did not read the checkpoint."""


# --------------------------------------------------------------------------------------------
# Before the Accelerator exists
# --------------------------------------------------------------------------------------------


def launched_world_size() -> int:
    """Number of processes the launcher started (``WORLD_SIZE``; 1 when not launched)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def launch_from_environment() -> Launch:
    """The launch ``accelerate launch`` set up for this process, read from its environment
    before Accelerate is started (processes, FSDP or DeepSpeed's stage, the device type)."""
    import torch

    processes = int(os.environ.get("WORLD_SIZE", "1"))
    cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
    device = "cuda" if torch.cuda.is_available() and not cpu else "cpu"
    strategy = "ddp"
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        strategy = "fsdp"
    elif os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        strategy = f"zero{os.environ.get('ACCELERATE_DEEPSPEED_ZERO_STAGE', '2')}"
    return Launch.described(processes, strategy, device)


def _has_distributed_accelerator() -> bool:
    """True when this machine has a device type with a distributed backend (CUDA, XPU, …)."""
    import torch

    try:
        from accelerate.utils import get_distributed_backend, get_torch_accelerator_backend
    except ImportError:  # older accelerate
        return torch.cuda.is_available()
    device_type, _ = get_torch_accelerator_backend()
    return get_distributed_backend(device_type) is not None


def cpu_for_launch() -> bool:
    """Check the launch before the Accelerator exists; return the Accelerator's ``cpu`` argument.

    ``accelerate launch --multi_gpu`` (or a config with ``distributed_type: MULTI_GPU``) on a
    machine without GPUs starts N processes that each train alone, unless
    ``ACCELERATE_USE_CPU=1`` is set; ``use_cpu: true`` in a config file is not passed on to them.
    With several processes and no GPU, CPU processes over gloo are the only meaningful choice,
    so this returns True then.

    Raises:
        EffitrainError: the launch asks for DeepSpeed, which is not installed.
    """
    import importlib.util

    wants_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if wants_deepspeed and importlib.util.find_spec("deepspeed") is None:
        raise EffitrainError(
            "the accelerate config asks for DeepSpeed, which is not installed: pip install deepspeed"
        )
    return launched_world_size() > 1 and not _has_distributed_accelerator()


# --------------------------------------------------------------------------------------------
# What Accelerate decided
# --------------------------------------------------------------------------------------------


def _enum_value(value: Any) -> str:
    return str(getattr(value, "value", value))


def _fsdp1_strategy(plugin: Any) -> str:
    strategy = getattr(plugin, "sharding_strategy", None) or getattr(
        plugin, "reshard_after_forward", None
    )
    return str(getattr(strategy, "name", strategy or "FULL_SHARD"))


def detect_sharding(state: Any) -> Sharding:
    """Read Accelerate's state (an ``AcceleratorState`` or anything with its attributes).

    Reads ``distributed_type``, ``num_processes``, ``backend``, and ``fsdp_plugin``
    (``fsdp_version``, ``use_orig_params``, ``reshard_after_forward``/``sharding_strategy``) or
    ``deepspeed_plugin`` (``zero_stage``).
    """
    kind = _enum_value(getattr(state, "distributed_type", "NO"))
    n = int(getattr(state, "num_processes", 1))
    backend = getattr(state, "backend", None)
    over = f"over {n} process{'es' if n != 1 else ''}" + (f" ({backend})" if backend else "")
    if kind == "NO":
        return Sharding("single", "single process (no sharding)", n)
    if kind == "FSDP":
        plugin = getattr(state, "fsdp_plugin", None)
        version = int(getattr(plugin, "fsdp_version", 1) or 1)
        if version >= 2:
            reshard = getattr(plugin, "reshard_after_forward", True)
            mode = "full shard" if reshard in (True, None) else "no reshard after forward"
            return Sharding("fsdp2", f"FSDP2 {mode} {over}", n, dtensor_params=True)
        orig = bool(getattr(plugin, "use_orig_params", False))
        return Sharding(
            "fsdp1",
            f"FSDP1 {_fsdp1_strategy(plugin)}, use_orig_params={orig} {over}",
            n,
            flat_params=True,
        )
    if kind == "DEEPSPEED":
        stage = getattr(getattr(state, "deepspeed_plugin", None), "zero_stage", None)
        stage = int(stage) if stage is not None else None
        return Sharding(
            "deepspeed",
            f"DeepSpeed ZeRO-{stage} {over}",
            n,
            flat_params=bool(stage),
            zero_stage=stage,
        )
    if kind.startswith("MULTI_"):
        return Sharding("ddp", f"DDP {over}", n)
    return Sharding("other", f"{kind} {over}", n)


# --------------------------------------------------------------------------------------------
# What that means for the optimizer
# --------------------------------------------------------------------------------------------


def _deepspeed_config(state: Any) -> dict[str, Any]:
    config = getattr(getattr(state, "deepspeed_plugin", None), "deepspeed_config", None)
    return config if isinstance(config, dict) else {}


def _offload_device(ds_config: Mapping[str, Any]) -> str:
    zero = ds_config.get("zero_optimization") or {}
    offload = zero.get("offload_optimizer") or {}
    return str(offload.get("device") or "none").lower()


def _check_launch(state: Any, sharding: Sharding) -> None:
    """Processes that were launched together must really work together."""
    launched = launched_world_size()
    if launched > 1 and sharding.num_processes != launched:
        raise EffitrainError(
            f"{launched} processes were launched but each would train alone "
            f"(Accelerate sees {sharding.num_processes}); on a machine without GPUs set "
            f"ACCELERATE_USE_CPU=1 ({ON_CPU} ...)"
        )
    for variable, (name, kinds) in _ASKED_BY_ENV.items():
        if os.environ.get(variable, "false").lower() == "true" and sharding.kind not in kinds:
            raise EffitrainError(
                f"the accelerate config asks for {name}, but this run is {sharding.description} "
                f"({name} needs GPUs); on CPU use plain DDP: {ON_CPU} ..."
            )


def _fsdp_rules(sharding: Sharding, state: Any, optim: str) -> list[str]:
    if sharding.kind == "fsdp2" and optim in DTENSOR_INCOMPATIBLE:
        instead = DTENSOR_ALTERNATIVE.get(optim, "--optim adamw")
        alternative = (
            f"use {instead} with FSDP2, {USE_DDP}, or FSDP1 with fsdp_use_orig_params: true"
        )
        raise EffitrainError(
            f"--optim {optim} cannot run under FSDP2: {DTENSOR_INCOMPATIBLE[optim]} crashes on "
            f"FSDP2's sharded DTensor parameters; {alternative}"
        )
    if sharding.kind != "fsdp1":
        return []
    if not bool(getattr(getattr(state, "fsdp_plugin", None), "use_orig_params", False)):
        raise EffitrainError(
            "FSDP1 with use_orig_params false replaces the parameters that effitrain's optimizer "
            "holds, so nothing would train; set fsdp_use_orig_params: true in the accelerate "
            "config, or use FSDP2 (fsdp_version: 2)"
        )
    if optim in TORCHAO_OPTIMIZERS:
        return _flat_shard_note("FSDP1", optim)
    if optim in FACTORED_OPTIMIZERS:
        return [
            f"FSDP1 hands the optimizer flattened 1-D parameter shards: {optim} cannot factor "
            f"them and keeps a full second moment ({_flat_cost(optim)}); "
            f"for its factored savings use FSDP2 (fsdp_version: 2) or {USE_DDP}"
        ]
    return []


def _deepspeed_rules(sharding: Sharding, state: Any, optim: str) -> list[str]:
    if sharding.kind != "deepspeed":
        return []
    ds_config = _deepspeed_config(state)
    for section in ("optimizer", "scheduler"):
        if section in ds_config:
            raise EffitrainError(
                f"the DeepSpeed config has its own '{section}' section, but effitrain builds the "
                f"{section} from its options (--optim, --scheduler); remove that section"
            )
    if ds_config.get("zero_allow_untested_optimizer") is False:
        raise EffitrainError(
            "the DeepSpeed config sets zero_allow_untested_optimizer: false, but effitrain always "
            f"passes its own optimizer (--optim {optim}); set it to true or remove it"
        )
    offload = _offload_device(ds_config)
    notes = []
    if offload not in ("none", ""):
        if ds_config.get("zero_force_ds_cpu_optimizer", True) is not False:
            raise EffitrainError(
                f"DeepSpeed offload_optimizer to {offload} needs DeepSpeed's own CPU Adam, not "
                f"effitrain's --optim {optim}; remove offload_optimizer from the DeepSpeed config "
                "(or, knowing it runs the optimizer slowly on the CPU, set "
                "zero_force_ds_cpu_optimizer: false)"
            )
        notes.append(f"DeepSpeed offloads the optimizer to {offload}: --optim {optim} runs there")
    if sharding.flat_params:
        notes += _flat_shard_note(f"DeepSpeed ZeRO-{sharding.zero_stage}", optim)
    if sharding.flat_params and optim in FACTORED_OPTIMIZERS:
        notes.append(
            f"DeepSpeed ZeRO-{sharding.zero_stage} hands the optimizer flat 1-D partitions: "
            f"{optim} cannot factor them and keeps a full second moment ({_flat_cost(optim)}); "
            f"for its factored savings use FSDP2 (fsdp_version: 2) or {USE_DDP}"
        )
    return notes


def optimizer_notes(state: Any, optim: str) -> list[str]:
    """What the sharding in ``state`` does to optimizer ``optim``, before anything is built.

    Returns:
        Notes for combinations that work but lose something (empty when all is well).

    Raises:
        EffitrainError: the combination cannot work; the message gives the reason and the
            alternative.
    """
    sharding = detect_sharding(state)
    _check_launch(state, sharding)
    if sharding.flat_params and optim in NEEDS_2D_SHARDS:
        where = "FSDP1" if sharding.kind == "fsdp1" else f"DeepSpeed ZeRO-{sharding.zero_stage}"
        raise EffitrainError(
            f"--optim {optim} cannot run under {where}: it "
            f"hands the optimizer flat 1-D shards, and {NEEDS_2D_SHARDS[optim]}; use FSDP2 "
            f"(fsdp_version: 2) or {USE_DDP}"
        )
    if optim in MATRIX_OPTIMIZERS and sharding.sharded:
        # FSDP1/DeepSpeed hand the optimizer flat 1-D shards; FSDP2 row shards (DTensor) would
        # make every step gather each matrix, and effitrain has not checked it on 2 processes.
        raise EffitrainError(
            f"--optim {optim} cannot run under {sharding.description}: "
            f"{MATRIX_OPTIMIZERS[optim]} each whole 2-D hidden matrix, and the optimizer gets "
            f"shards; use {USE_DDP} or one process"
        )
    return _fsdp_rules(sharding, state, optim) + _deepspeed_rules(sharding, state, optim)


def configure_deepspeed(state: Any, batch_size: int, grad_accum: int) -> None:
    """Let DeepSpeed run effitrain's client optimizer, and fill batch sizes it cannot infer.

    Call before ``prepare(model, optimizer, …)`` when :func:`detect_sharding` says DeepSpeed.
    effitrain prepares the dataloaders apart from the model, so Accelerate cannot fill an
    ``auto`` micro-batch size when it prepares the model; and effitrain always passes its own
    (client) optimizer, which DeepSpeed refuses unless ``zero_allow_untested_optimizer`` is set.
    """
    ds_config = _deepspeed_config(state)
    ds_config["zero_allow_untested_optimizer"] = True
    n = int(getattr(state, "num_processes", 1))
    if ds_config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        ds_config["train_micro_batch_size_per_gpu"] = batch_size
    if ds_config.get("train_batch_size", "auto") == "auto":
        ds_config["train_batch_size"] = batch_size * grad_accum * n


# --------------------------------------------------------------------------------------------
# After training: every rank's memory, on every rank
# --------------------------------------------------------------------------------------------


def _local_parameters(model: Any) -> list[Any]:
    """This rank's parameter storage: DeepSpeed ZeRO-3 keeps it in ``ds_tensor``."""
    return [getattr(p, "ds_tensor", p) for p in model.parameters()]


CHECKSUM_CHUNK = 2**20
"""Elements converted to float64 at a time by :func:`parameter_checksum` (8 MiB)."""


def parameter_checksum(model: Any) -> float:
    """Sum of this rank's local parameter values in float64 (DTensors: the local shard; 4-bit
    weights: their packed bytes, whatever dtype stores them)."""
    import torch

    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for p in _local_parameters(model):
            local = p.to_local() if hasattr(p, "to_local") else p
            if ledger.is_4bit(p):
                local = local.as_subclass(torch.Tensor).view(torch.uint8)
            # In chunks: a whole float64 copy of an embedding is 8 bytes a weight (1.8 GiB
            # for a 1.5B model's, on top of the run's peak).
            for chunk in local.detach().reshape(-1).split(CHECKSUM_CHUNK):
                total += chunk.to(torch.float64).sum().cpu()
    return float(total)


def local_rank_memory(
    accelerator: Accelerator, model: Any, optimizer: Any, weights: str = "read"
) -> RankMemory:
    """Measure what this process holds now (``weights``: how it got them, :class:`RankMemory`)."""
    peak, kind = ledger.peak_memory_bytes(accelerator.device)
    return RankMemory(
        rank=accelerator.process_index,
        optimizer_state_bytes=ledger.optimizer_state_ledger(optimizer).bytes,
        parameter_bytes=ledger.parameter_bytes(_local_parameters(model)),
        peak_memory_bytes=peak,
        peak_memory_kind=kind,
        parameter_checksum=parameter_checksum(model),
        device=str(accelerator.device),
        weights=weights,
    )


def _reshard(model: Any) -> None:
    """FSDP2 leaves the root module's parameters gathered after a forward without backward (the
    last evaluation): shard them again, so each rank counts its own shard, as during training."""
    import sys

    if "torch.distributed.fsdp" not in sys.modules:
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def gather_rank_memory(
    accelerator: Accelerator, model: Any, optimizer: Any, weights: str = "read"
) -> list[dict[str, Any]]:
    """Every rank's :class:`RankMemory` as dicts, sorted by rank, on every process
    (``weights``: how this process got the model's weights).

    A collective: every process must call it.
    """
    from accelerate.utils import gather_object

    _reshard(model)
    mine = [asdict(local_rank_memory(accelerator, model, optimizer, weights))]
    ranks = gather_object(mine) if accelerator.num_processes > 1 else mine
    return sorted(ranks, key=lambda entry: entry["rank"])


def rank_totals(ranks: list[dict[str, Any]]) -> dict[str, int]:
    """Sums of the per-rank byte counts: what the whole job holds."""
    return {name: sum(int(entry[name]) for entry in ranks) for name in RANK_FIELDS}
