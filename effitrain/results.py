"""The records the commands produce: what a run is about to do, each log line, what a step held
in memory, what a run measured, what an estimate predicts, what a checkpoint's optimizer state
holds.

A leaf of plain dataclasses: training, ``effitrain estimate`` and ``inspect-state`` fill them in,
:mod:`effitrain.report` renders them, and each one's ``to_dict`` is its JSON (the metrics JSON's
field names, flat, as they have always been).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from effitrain.cost import StepCost
    from effitrain.memory.ledger import OptimizerStateLedger
    from effitrain.memory.step import StepMemory


@dataclass
class RunInfo:
    """What a run is about to do, for the banner."""

    model: str
    model_class: str
    parameters: int
    """All of the model's weights (a 4-bit one counted as its original shape's)."""
    trainable_parameters: int
    """Those that train (fewer than ``parameters`` where a lever freezes the model's: LoRA)."""
    dataset: str
    train_examples: int
    validation_examples: int
    validation_source: str
    data_line: str
    """What the data became, in the task's words (columns and labels, or format and packing)."""
    optimizer: str
    optimizer_class: str
    lr: float
    lr_note: str
    """Why this lr, when it was not given (e.g. 'adafactor default for fine-tuning')."""
    scheduler: str
    warmup_steps: int
    schedule_note: str
    total_steps: int
    epochs: int
    steps_per_epoch: int
    global_batch_size: int
    device: str
    num_processes: int
    mixed_precision: str
    levers: list[str] = field(default_factory=list)
    """One banner line per memory lever that is on, and the loss's lines."""
    task: str = "sequence-classification"
    speed_unit: str = "samples"
    """What throughput counts: ``samples`` or ``tokens`` (the task's)."""
    optimizer_split: str = ""
    """How the optimizer splits the parameters (Muon, GaLore, APOLLO: hidden matrices vs the
    rest, ``effitrain.optim.split``); empty for one update rule everywhere."""
    peak_unknown: str = ""
    """The device's name where its peak FLOP/s is not known (no MFU is reported); else empty."""


@dataclass
class StepLog:
    """One periodic training log line (numbers averaged over the window since the last one)."""

    step: int
    total_steps: int
    epoch: int
    loss: float
    lr: float
    samples_per_second: float
    eta_seconds: float
    tokens_per_second: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    """The loss's own means over the window (a preference loss's ``rewards/accuracies`` …)."""


@dataclass(frozen=True)
class MemoryRow:
    """A lever's row of the memory table (``effitrain.levers.spec.Lever.memory_rows``)."""

    label: str
    measured: int
    part_of: str | None = None
    """Listed under this part of the step (``parameters``); None: host memory, in a section of
    its own, not in the device's peak."""
    at_peak: int | None = None
    """Its bytes when the measured step's tensors peaked, within its part's (None: not known)."""


@dataclass(frozen=True)
class Baseline:
    """The same model trained whole in fp32 with fp32 AdamW and no levers."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def step_peak(training: int, generation: int | None) -> int:
    """A step's peak over its phases: its training phase's, or its generation phase's where
    that is higher (GRPO's completions sampled before the step's first forward)."""
    return max(training, generation or 0)


def peak_phase(training: int, generation: int | None) -> str | None:
    """``generation`` or ``training``: the phase of :func:`step_peak`'s peak (None: the step
    has no generation phase)."""
    if generation is None:
        return None
    return "generation" if generation > training else "training"


@dataclass
class MemoryRecord:
    """What a training step holds, by part, measured from storage: a run's (real tensors) and
    an estimate's (fake tensors) alike, by the same function (``effitrain.measure``)."""

    optimizer_state: OptimizerStateLedger
    parameter_bytes: int
    trainable_parameters: int
    trainable_parameter_bytes: int
    """Bytes of the parameters that train; ``parameter_bytes`` minus this is frozen (LoRA)."""
    gradient_bytes: int
    adamw_equivalent_bytes: int
    adamw_equivalent_elements: int
    baseline: Baseline
    levers: list[str] = field(default_factory=list)
    """The memory levers in use (``effitrain.levers.in_use``)."""
    loss: dict[str, Any] = field(default_factory=dict)
    """How the loss was computed: ``implementation`` (model, torch, liger, cce or off: full
    logits), ``weighting`` (tokens or micro-batch mean), and ``why`` a chunked loss was not."""
    step_memory: StepMemory | None = None
    """The measured step's tensor memory by kind (None: not measured); with a generation phase,
    its training phase."""
    generation_memory: StepMemory | None = None
    """The measured step's generation phase (GRPO: the step's completions sampled before its
    first forward), by kind; None where the loss generates nothing."""
    lever_fields: dict[str, Any] = field(default_factory=dict)
    """The levers' own metrics fields (the 4-bit weights' bytes, where the offloaded state
    lives …), each written and read by its lever (``Lever.metrics``, ``Lever.memory_rows``)."""
    lever_rows: list[MemoryRow] = field(default_factory=list)
    """The levers' rows of the memory table."""

    @property
    def activation_bytes(self) -> int | None:
        """Peak bytes of what forward allocated and kept, in the measured step."""
        return self.step_memory.kind_peaks.get("activations") if self.step_memory else None

    @property
    def peak_tensor_bytes(self) -> int | None:
        """Most live tensor bytes at once in the measured step, its generation phase included
        (None: not measured)."""
        if self.step_memory is None:
            return None
        return step_peak(self.step_memory.peak_tensor_bytes, self.generation_peak_bytes)

    @property
    def generation_peak_bytes(self) -> int | None:
        """The generation phase's peak (None: no generation phase)."""
        return self.generation_memory.peak_tensor_bytes if self.generation_memory else None

    @property
    def generation_bytes(self) -> int | None:
        """What generating held at its phase's peak besides the weights and the optimizer
        state: the KV cache, the logits, sampling's tensors (None: no generation phase)."""
        if self.generation_memory is None:
            return None
        held = ("parameters", "buffers", "optimizer_state", "gradients")
        at_peak = self.generation_memory.at_peak
        return sum(v for kind, v in at_peak.items() if kind not in held)

    @property
    def peak_phase(self) -> str | None:
        """``generation`` or ``training``: the phase of the step's peak (None: no generation
        phase, or not measured)."""
        if self.step_memory is None:
            return None
        return peak_phase(self.step_memory.peak_tensor_bytes, self.generation_peak_bytes)

    def phases(self) -> dict[str, Any]:
        """The metrics JSON's fields of the two phases (empty without a generation phase)."""
        if self.generation_memory is None:
            return {}
        return {
            "generation_memory": self.generation_memory.to_dict(),
            "generation_bytes": self.generation_bytes,
            "generation_peak_bytes": self.generation_peak_bytes,
            "training_peak_bytes": self.step_memory.peak_tensor_bytes if self.step_memory else None,
            "peak_phase": self.peak_phase,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "optimizer_state": self.optimizer_state.to_dict(),
            "parameter_bytes": self.parameter_bytes,
            "trainable_parameters": self.trainable_parameters,
            "trainable_parameter_bytes": self.trainable_parameter_bytes,
            "gradient_bytes": self.gradient_bytes,
            "adamw_equivalent_bytes": self.adamw_equivalent_bytes,
            "adamw_equivalent_elements": self.adamw_equivalent_elements,
            "activation_bytes": self.activation_bytes,
            "peak_tensor_bytes": self.peak_tensor_bytes,
            "step_memory": self.step_memory.to_dict() if self.step_memory else {},
            **self.phases(),
            "levers": list(self.levers),
            "loss": dict(self.loss),
            "baseline": self.baseline.to_dict(),
            **self.lever_fields,
        }


@dataclass
class TrainResult:
    """What a run measured; ``to_dict`` is the ``--metrics-json`` object."""

    optimizer: str
    optimizer_class: str
    lr: float
    global_steps: int
    epochs: int
    train_loss: float
    eval: dict[str, float]
    eval_history: list[dict[str, float]]
    memory: MemoryRecord
    peak_memory_bytes: int
    peak_memory_kind: str
    seconds_per_step: float
    samples_per_second: float
    train_seconds: float
    num_processes: int
    mixed_precision: str
    device: str
    config: dict[str, Any] = field(default_factory=dict)
    task: str = "sequence-classification"
    speed_unit: str = "samples"
    tokens_per_second: float = 0.0
    """Non-padding input tokens per second of training, all processes."""
    last_checkpoint: str | None = None
    """The newest checkpoint this run wrote (None when it wrote none)."""
    final_model_dir: str | None = None
    """Where save_pretrained wrote the model and tokenizer (``--output-dir``/final)."""
    sharding: dict[str, Any] = field(default_factory=dict)
    """How Accelerate distributed the run (``distributed.Sharding``)."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """Per process: rank, optimizer_state_bytes, parameter_bytes, peak memory, checksum."""
    ranks_total: dict[str, int] = field(default_factory=dict)
    """The per-rank byte counts summed over all processes."""
    loss_history: list[dict[str, float]] = field(default_factory=list)
    """The training loss at every log line: ``{"step", "loss"}`` (``--log-every``), and the
    loss's window metrics (a preference loss's ``rewards/accuracies`` …)."""
    train_metrics: dict[str, float] = field(default_factory=dict)
    """The loss's window metrics at the last log line (empty for most losses)."""
    histories: dict[str, list[float]] = field(default_factory=dict)
    """The loss's per-step series, each a top-level key of the JSON (GRPO's
    ``reward_history``; none for most losses)."""
    flops_per_step: int | None = None
    """FLOPs of one optimizer step on this device, counted on the run's first step
    (``effitrain.cost``; None: not counted)."""
    recompute_flops: int | None = None
    """The part of ``flops_per_step`` that is gradient checkpointing's recompute."""
    achieved_tflops: float | None = None
    """``flops_per_step`` per ``seconds_per_step``, in TFLOP/s, per device."""
    mfu: float | None = None
    """Model FLOPs utilization: the FLOPs without the recompute per second over the device's
    bf16 dense peak (None where the peak is not known: CPUs, GPUs not in the table)."""
    peak_tflops: float | None = None
    """The device's bf16 dense peak that ``mfu`` is measured against."""
    device_name: str = ""
    """The GPU's name (``torch.cuda.get_device_name``), or the device type."""

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        del data["memory"], data["speed_unit"], data["histories"]
        return {**data, **self.histories, **self.memory.to_dict()}


@dataclass(frozen=True)
class EstimateSettings:
    """How an estimate was made: the batch it assumed and the step it measured."""

    model: str
    batch_size: int
    max_length: int
    grad_accum: int
    mixed_precision: str
    measured_step: int
    method: str = "fake tensors (torch FakeTensorMode) through the real training step"
    sequences_per_example: int = 1
    """2 for preference pairs (a chosen and a rejected sequence each)."""


@dataclass(frozen=True)
class PerDevice:
    """Each process's share of an estimate under a launch's sharding."""

    num_processes: int
    sharding: str
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    activation_bytes: int | None
    peak_tensor_bytes: int | None
    modeled: str
    """How the split was modeled."""


@dataclass(frozen=True)
class CheckpointFacts:
    """What a checkpoint holds on disk, read from its safetensors headers (or its config)."""

    bytes: int
    elements: int
    dtype: str
    """The dtype of most of its bytes (torch's name: ``bfloat16``)."""
    source: str
    """Where the facts come from (the headers, the index, the config)."""


@dataclass(frozen=True)
class HostMemory:
    """The host memory (resident set) one machine needs for a run, modeled
    (``effitrain.memory.host``): the libraries of each process, the checkpoint as it is read by
    each copy, and each process's step on the host (on a GPU: what the offloads hold there)."""

    host_peak_bytes: int
    peak_at: str
    """``loading`` or ``the training step``: when the host holds the most."""
    processes: int
    copies: int
    """Processes on the machine that read the checkpoint (1 where the others receive it)."""
    received_bytes: int
    """Per other process, where they receive the main process's weights: what it holds then."""
    library_bytes: int
    """Per process: Python, torch, transformers, the pipeline."""
    checkpoint: CheckpointFacts | None
    """What is read (None: a preset, built in the dtype it trains in)."""
    read_dtype: str
    read_onto: str
    """``host``, or the device the weights go to as they are read."""
    mapped_bytes: int
    """Per copy: the checkpoint's pages resident while it loads."""
    weights_bytes: int
    """Per copy: the weights made from them (cast or quantized; a view of the file owns none)."""
    quantize_buffer_bytes: int
    """Per copy: quantizing's working memory (the largest weight's fp32 copy, the loader's)."""
    load_peak_bytes: int
    """Per copy: mapped + weights + buffer."""
    step_bytes: int
    """Per process: on the CPU the estimated step's peak tensors; on a GPU what the offload
    levers hold on the host (pinned copies, the host optimizer's state)."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["host_peak_bytes"]
        return data


@dataclass
class Estimate:
    """What ``effitrain estimate`` predicts ``effitrain train`` would measure; ``to_dict`` has
    the metrics JSON's field names, plus ``estimate`` (how), ``per_device`` and ``notes``."""

    optimizer: str
    optimizer_class: str
    lr: float
    memory: MemoryRecord
    settings: EstimateSettings
    per_device: PerDevice | None = None
    notes: list[str] = field(default_factory=list)
    host: HostMemory | None = None
    """The host memory of one machine (``host_peak_bytes``), beside the device's step."""
    cost: StepCost | None = None
    """The measured step's FLOPs and offload traffic (``effitrain.cost``); None: not counted."""

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "optimizer": self.optimizer,
            "optimizer_class": self.optimizer_class,
            "lr": self.lr,
            **self.memory.to_dict(),
            **(self.cost.to_dict() if self.cost is not None else {}),
            "estimate": asdict(self.settings),
            "notes": list(self.notes),
        }
        if self.host is not None:
            data["host_peak_bytes"] = self.host.host_peak_bytes
            data["host_memory"] = self.host.to_dict()
        if self.per_device is not None:
            data["per_device"] = asdict(self.per_device)
        return data


@dataclass
class ParamState:
    """One parameter's optimizer state, as ``inspect-state`` reads it."""

    parameter: str
    """Its name when the checkpoint records it, else ``#<index in the state dict>``."""
    shape: list[int] | None
    """The parameter's shape, inferred from the state (``inspection.infer_parameter``)."""
    elements: int | None
    bytes: int
    keys: list[str]
    second_moment: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StateReport:
    """What ``effitrain inspect-state`` shows; ``to_dict`` is its ``--json`` object."""

    path: str
    format: str
    files: list[str]
    optimizer_name: str | None
    optimizer_class: str
    optimizer_inferred: bool
    step: int | None
    param_groups: list[dict[str, Any]]
    ledger: OptimizerStateLedger
    params: list[ParamState] = field(default_factory=list)
    """Every parameter's state, largest first."""
    adamw_equivalent_elements: int = 0
    adamw_equivalent_bytes: int = 0
    params_without_shape: int = 0
    """Parameters whose shape could not be inferred (left out of the AdamW equivalent)."""

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "files": self.files,
            "optimizer": {
                "name": self.optimizer_name,
                "class": self.optimizer_class,
                "inferred": self.optimizer_inferred,
            },
            "step": self.step,
            "param_groups": self.param_groups,
            "optimizer_state": self.ledger.to_dict(),
            "adamw_equivalent_bytes": self.adamw_equivalent_bytes,
            "adamw_equivalent_elements": self.adamw_equivalent_elements,
            "params_without_shape": self.params_without_shape,
            "largest": [p.to_dict() for p in self.params[:top]],
        }


@dataclass
class PlanCandidate:
    """One configuration ``effitrain plan`` found to fit; ``to_dict`` is its JSON."""

    args: list[str]
    """The options the plan chose (optimizer, levers, batch split), as ``effitrain train``
    arguments, to append to the user's own."""
    command: str
    optimizer: str
    levers: dict[str, str]
    """Each lever in it, with why."""
    batch_size: int
    grad_accum: int
    peak_tensor_bytes: int
    """Per device: verified by a full estimate where ``verified``, else screened."""
    peak_phase: str | None
    """Where a step has two phases (GRPO): ``generation`` or ``training``, the one of the
    peak; else None."""
    host_peak_bytes: int | None
    """The host RAM one machine needs (``Estimate.host``), where a full estimate verified the
    candidate; None for a screened one."""
    flops_per_step: int | None
    step_seconds: float | None
    """Modeled seconds per optimizer step on a nominal device (``effitrain.cost``)."""
    relative_step_time: float
    """``step_seconds`` over the best candidate's."""
    full_parameter: bool
    verified: bool
    optimizer_class: str | None = None
    """The class the run builds (a lever can change it: bf16 weights), where verified."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PlanResult:
    """What ``effitrain plan`` found: the candidates that fit, best first."""

    budget_bytes: int
    margin_bytes: int
    device_type: str
    candidates: list[PlanCandidate]
    screened: int
    """Candidates screened (optimizer x levers x batch split)."""
    estimates: int
    """Fake-tensor estimates made (screens on cut models, and full verifications)."""
    seconds: float
    notes: list[str] = field(default_factory=list)
    not_verified: list[PlanCandidate] = field(default_factory=list)
    """Configurations the screens say fit that no full estimate checked: not answers."""
    longest: int | None = None
    """``plan --max-length longest``: the longest sequence (tokens) its candidates fit at."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["candidates"] = [c.to_dict() for c in self.candidates]
        data["not_verified"] = [c.to_dict() for c in self.not_verified]
        return data
