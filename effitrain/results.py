"""The records a run produces: what it is about to do, each log line, and what it measured.

A leaf module: plain dataclasses that training fills in and :mod:`effitrain.report` renders.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from effitrain.memory.ledger import OptimizerStateLedger


@dataclass
class RunInfo:
    """What a run is about to do, for the banner."""

    model: str
    model_class: str
    parameters: int
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
    """One banner line per memory lever that is on (``effitrain.levers.describe``)."""
    task: str = "sequence-classification"
    optimizer_split: str = ""
    """How the optimizer splits the parameters (Muon, GaLore, APOLLO: hidden matrices vs the
    rest, ``effitrain.optim.split``); empty for one update rule everywhere."""


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
    optimizer_state: OptimizerStateLedger
    parameter_bytes: int
    trainable_parameters: int
    gradient_bytes: int
    adamw_equivalent_bytes: int
    adamw_equivalent_elements: int
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
    trainable_parameter_bytes: int = 0
    """Bytes of the parameters that train; ``parameter_bytes`` minus this is frozen (LoRA)."""
    activation_bytes: int | None = None
    """Peak bytes of what forward allocated and kept (saved for backward), in the measured step."""
    peak_tensor_bytes: int | None = None
    """Most live tensor bytes at once in the measured step (None: not measured, see step_memory)."""
    step_memory: dict[str, Any] = field(default_factory=dict)
    """The measured step's tensor memory by kind (``effitrain.memory.step.StepMemory``)."""
    levers: list[str] = field(default_factory=list)
    """The memory levers that were on (``effitrain.levers.active``, and ``chunked-loss``)."""
    loss: dict[str, Any] = field(default_factory=dict)
    """How the loss was computed: ``implementation`` (model, torch, liger, cce or off: full
    logits), ``weighting`` (tokens or micro-batch mean), and ``why`` a chunked loss was not."""
    loss_history: list[dict[str, float]] = field(default_factory=list)
    """The training loss at every log line: ``{"step", "loss"}`` (``--log-every``)."""
    quantized_weights: dict[str, int] | None = None
    """--load-in-4bit: the 4-bit base weights (``effitrain.quantize.QuantizedStorage``: weights,
    elements, packed_bytes, quant_state_bytes, bytes), part of ``parameter_bytes``."""
    baseline: dict[str, int] = field(default_factory=dict)
    """The same model trained whole in fp32 with fp32 AdamW and no levers (parameters,
    gradients, optimizer state), for the savings column."""
    activation_offload_host_bytes: int | None = None
    """--activation-offload: the most pinned host bytes its offloaded activations held at once."""
    optimizer_offload: dict[str, int] = field(default_factory=dict)
    """--optimizer-offload: where the optimizer's memory lives (``device_state_bytes``,
    ``host_state_bytes``, ``host_copy_bytes``: :func:`effitrain.optim.offload.offload_ledger`)."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["optimizer_state"] = self.optimizer_state.to_dict()
        return data
