"""The typed training configuration: defaults, YAML loading, CLI overrides, validation.

One flat dataclass keeps the mapping between CLI options, YAML keys and code obvious: the YAML key
``batch_size`` (or ``batch-size``) is the option ``--batch-size`` is the field ``batch_size``.
A YAML file only overrides defaults; explicit CLI options override the YAML file. Unknown keys and
values of the wrong type are errors that name the key.

Each field declares its option once, beside it (:func:`option_field`): help, help panel, the off
flag of an on/off setting, metavar, allowed values, the default --help shows and its names in
other tools. A lever declares its own options so, in its module; registering it adds them
(:func:`add_options`). :data:`OPTIONS` holds them all by field; the CLI builds its options from them, :meth:`TrainConfig.validate` checks the allowed
values, and :func:`to_arguments` spells values back as ``effitrain train`` arguments.

A leaf: it imports nothing of effitrain but its error type, so that every other module may read
a config. Checks that need the presets, the optimizer registry or the levers run where the run
is built (:func:`effitrain.build.check_config`).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effitrain.errors import EffitrainError

SCHEDULERS = ("linear", "cosine", "constant")
MIXED_PRECISION = ("no", "fp16", "bf16")
DEFAULT_CAUSAL_MODEL = "tiny-llama"
"""The model of ``--task causal-lm`` when none is given (the causal-LM demo's preset)."""
DECODER_TASKS = ("causal-lm", "preference", "grpo")
"""The tasks that train a ``*ForCausalLM`` (its presets)."""
SAVE_STRATEGIES = ("steps", "epoch", "no")
PREFERENCE_LOSSES = ("dpo", "orpo", "simpo")
"""``--preference-loss`` (effitrain.tasks.preference_loss): DPO needs a reference model, ORPO
and SimPO do not."""
GRPO_LOSSES = ("dapo", "grpo", "dr_grpo", "bnpo")
"""``--grpo-loss`` (effitrain.tasks.grpo_loss), TRL's loss_type names; dapo is TRL's default."""
SCALE_REWARDS = ("group", "batch", "none")
"""``--scale-rewards``: what divides the advantages, as TRL's scale_rewards."""
TRACKERS = (
    "tensorboard",
    "wandb",
    "mlflow",
    "trackio",
    "comet_ml",
    "aim",
    "clearml",
    "dvclive",
    "swanlab",
)
"""Accelerate's experiment trackers (``accelerate.utils.LoggerType``), for ``--report-to``."""
REPORT_TO = ("none", "all", *TRACKERS)
"""``--report-to``'s names: no tracker, every installed one, or one of :data:`TRACKERS`."""

HELP_PANELS = (
    "Model and data",
    "Preference tuning",
    "Online RL (GRPO)",
    "Optimizer",
    "Loop",
    "Memory levers",
    "Output",
)
"""The panels of ``effitrain train --help``, in order; every field names its own."""
MODEL_AND_DATA, PREFERENCE, GRPO, OPTIMIZER, LOOP, MEMORY_LEVERS, OUTPUT = HELP_PANELS
PER_OPTIMIZER = "per optimizer, see effitrain optimizers"
"""The default --help shows for options whose default depends on the optimizer and on
fine-tuning versus training from scratch."""


@dataclass(frozen=True)
class Option:
    """How a config field is spelled on the command line, declared beside the field (``_opt``).

    The flag is the field's name (``batch_size`` -> ``--batch-size``); an on/off setting also
    has a flag that turns it off (``--no-packing``, ``--full-loss``).
    """

    name: str
    help: str
    panel: str
    off: str | None = None
    """The flag that sets an on/off field to False, where False is not simply its default."""
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    """The values it takes (each item, for a list); none: any value of its type."""
    default_text: str | None = None
    """What --help shows as the default, where the value alone misleads."""
    elsewhere: tuple[str, ...] = ()
    """Its names in transformers' TrainingArguments and TRL's configs: a YAML key spelled so is
    answered with this option's name."""

    def __post_init__(self) -> None:
        assert self.panel in HELP_PANELS, f"{self.name}: unknown help panel {self.panel!r}"

    @property
    def flag(self) -> str:
        return option(self.name)

    @property
    def declaration(self) -> str:
        """The flag, with its off flag where it has one: ``--packing/--no-packing``."""
        return f"{self.flag}/{self.off}" if self.off else self.flag

    @property
    def value_text(self) -> str | None:
        """What a value looks like: the declared metavar, else the choices (``a|b|c``)."""
        return self.metavar or ("|".join(self.choices) if self.choices else None)

    def check_choice(self, value: Any) -> None:
        """Refuse a value (or a list's item) that is not one of the choices; None is the default.

        Raises:
            EffitrainError: ``unknown --scheduler 'x'; choose one of: linear, cosine, constant``.
        """
        if not self.choices or value is None:
            return
        for item in value if isinstance(value, list) else [value]:
            if item not in self.choices:
                raise EffitrainError(
                    f"unknown {self.flag} '{item}'; choose one of: {', '.join(self.choices)}"
                )


def option_field(
    default: Any,
    help: str,
    *,
    panel: str,
    off: str | None = None,
    metavar: str | None = None,
    choices: tuple[str, ...] = (),
    default_text: str | None = None,
    elsewhere: tuple[str, ...] = (),
) -> Any:
    """A config field with its option: the keyword arguments of :class:`Option` but its name.
    ``help`` is the field's one-line doc and the option's help text. TrainConfig's own fields
    and each lever's options (``Lever.options``, added by :func:`add_options`) are declared so."""
    option_fields = {
        "help": help,
        "panel": panel,
        "off": off,
        "metavar": metavar,
        "choices": choices,
        "default_text": default_text,
        "elsewhere": elsewhere,
    }
    return field(default=default, metadata=option_fields)


def default_for(name: str) -> Any:
    """The default value of a config field."""
    return next(f.default for f in dataclasses.fields(TrainConfig) if f.name == name)


@dataclass
class TrainConfig:
    """Everything one ``effitrain train`` run needs. Field docs are shown by ``effitrain train --help``."""

    # --- model and data ---
    task: str | None = option_field(
        None,
        "sequence-classification, causal-lm, preference or grpo. Default: causal-lm for a causal-LM "
        "preset, or a *ForCausalLM model with no label column in the data; else "
        "sequence-classification.",
        panel=MODEL_AND_DATA,
        metavar="NAME",
    )
    model: str = option_field(
        "tiny",
        "Built-in preset name, a hub id, or a local folder saved with save_pretrained.",
        panel=MODEL_AND_DATA,
        metavar="NAME|DIR",
        elsewhere=("model_name_or_path",),
    )
    dataset: str = option_field(
        "demo",
        "'demo' (built-in, offline), a hub dataset id, or a local file/folder (csv, json, jsonl, parquet).",
        panel=MODEL_AND_DATA,
        metavar="NAME|PATH",
    )
    dataset_config: str | None = option_field(
        None,
        "Hub dataset configuration name, e.g. 'mrpc' for glue.",
        panel=MODEL_AND_DATA,
        metavar="NAME",
    )
    train_file: str | None = option_field(
        None,
        "Local training file (csv/json/jsonl/parquet); used instead of --dataset.",
        panel=MODEL_AND_DATA,
        metavar="FILE",
    )
    validation_file: str | None = option_field(
        None,
        "Local validation file; without it the dataset's validation split (or 10% of train) is used.",
        panel=MODEL_AND_DATA,
        metavar="FILE",
    )
    text_columns: list[str] | None = option_field(
        None,
        "One or two text columns; auto-detected when not given. Comma-separated: "
        "sentence1,sentence2.",
        panel=MODEL_AND_DATA,
        metavar="COL[,COL]",
    )
    label_column: str | None = option_field(
        None, "Label column; auto-detected when not given.", panel=MODEL_AND_DATA, metavar="COL"
    )
    max_length: int = option_field(
        128,
        "Truncate inputs to this many tokens (causal-lm: the length of packed blocks).",
        panel=MODEL_AND_DATA,
        elsewhere=("max_seq_length",),
    )
    beyond_positions: bool = option_field(
        False,
        "Let --max-length pass the model's positions (its max_position_embeddings, its "
        "tokenizer's model_max_length), which cut sequences otherwise: rotary (RoPE) models "
        "compute any position, but were not trained past theirs (the run teaches them). "
        "Refused for a learned table of positions (GPT-2, BERT).",
        panel=MODEL_AND_DATA,
    )
    packing: bool | None = option_field(
        None,
        "causal-lm: concatenate examples into --max-length blocks (attention kept inside each "
        "example) instead of padding each one. Default: on for plain text, off for "
        "instruction and chat data.",
        panel=MODEL_AND_DATA,
        off="--no-packing",
        default_text="per data format",
    )
    completion_only_loss: bool | None = option_field(
        None,
        "causal-lm: compute the loss on completions (assistant turns) only, not on prompts. "
        "Default: on for prompt/completion, instruction and chat data.",
        panel=MODEL_AND_DATA,
        off="--full-loss",
        default_text="per data format",
    )
    sample_prompt: str | None = option_field(
        None,
        "causal-lm: after each evaluation, print a short greedy continuation of this prompt.",
        panel=MODEL_AND_DATA,
        metavar="TEXT",
    )

    # --- preference tuning (--task preference) ---
    preference_loss: str = option_field(
        "dpo",
        "preference: dpo (against a reference model, see --reference), orpo or simpo (no "
        "reference).",
        panel=PREFERENCE,
        metavar="NAME",
        choices=PREFERENCE_LOSSES,
    )
    beta: float | None = option_field(
        None,
        "preference: the loss's beta (dpo 0.1, orpo 0.1, simpo 2.0 as TRL's defaults); grpo: "
        "the KL penalty's (0, TRL's default: no reference model; see --reference).",
        panel=PREFERENCE,
        metavar="BETA",
        default_text="per loss",
    )
    label_smoothing: float = option_field(
        0.0,
        "preference, dpo: the share of pairs assumed mislabeled (conservative DPO), from 0 to 0.5.",
        panel=PREFERENCE,
        metavar="EPS",
    )
    simpo_gamma: float = option_field(
        0.5,
        "preference, simpo: the target reward margin gamma (TRL's simpo_gamma; the log-prob "
        "margin is gamma / beta).",
        panel=PREFERENCE,
        metavar="GAMMA",
    )

    # --- online RL (--task grpo) ---
    num_generations: int = option_field(
        8,
        "grpo: completions generated per prompt, a group (TRL's num_generations); --batch-size "
        "counts completions, so each micro-batch holds batch-size / G prompts.",
        panel=GRPO,
        metavar="G",
    )
    max_completion_length: int | None = option_field(
        None,
        "grpo: the most tokens generated per completion (TRL's default 512).",
        panel=GRPO,
        default_text="512; the demo 16",
    )
    temperature: float = option_field(
        1.0,
        "grpo: the sampling temperature (log-probs are of logits / T, as TRL's).",
        panel=GRPO,
        metavar="T",
    )
    top_p: float = option_field(
        1.0, "grpo: nucleus sampling's probability mass.", panel=GRPO, metavar="P"
    )
    reward: list[str] | None = option_field(
        None,
        "grpo: reward functions, called as TRL calls them; comma-separated or repeated. Default: the "
        "built-in demo reward (effitrain.tasks.grpo_rewards).",
        panel=GRPO,
        metavar="FILE.py:FUNCTION[,...]",
        elsewhere=("reward_funcs",),
    )
    reward_weights: list[float] | None = option_field(
        None,
        "grpo: one weight per --reward, comma-separated or repeated (default: 1 each).",
        panel=GRPO,
        metavar="W[,W...]",
    )
    grpo_loss: str = option_field(
        "dapo",
        "grpo: TRL's loss_type: dapo (a token mean over the step), grpo (a mean of sequence "
        "means), dr_grpo (over completions x max completion length) or bnpo (a token mean over "
        "the micro-batch).",
        panel=GRPO,
        metavar="NAME",
        choices=GRPO_LOSSES,
        elsewhere=("loss_type",),
    )
    scale_rewards: str = option_field(
        "group",
        "grpo: divide each advantage by its group's reward std (group), the batch's (batch) or "
        "nothing (none), as TRL's scale_rewards.",
        panel=GRPO,
        choices=SCALE_REWARDS,
    )
    epsilon: float = option_field(
        0.2,
        "grpo: the clipped ratio's lower bound, 1 - epsilon (TRL's).",
        panel=GRPO,
        metavar="EPS",
    )
    epsilon_high: float | None = option_field(
        None,
        "grpo: the clipped ratio's upper bound, 1 + epsilon_high (TRL's; default: --epsilon).",
        panel=GRPO,
        metavar="EPS",
    )
    num_iterations: int = option_field(
        1,
        "grpo: optimizer steps on each step's generated completions (TRL's num_iterations, mu); "
        "above 1 the ratio to the log-probs at generation is clipped, and an epoch is as many "
        "times longer.",
        panel=GRPO,
        metavar="N",
    )

    # --- optimizer and schedule ---
    optim: str = option_field(
        "adamw",
        "Optimizer name from `effitrain optimizers`.",
        panel=OPTIMIZER,
        metavar="NAME",
        elsewhere=("optimizer",),
    )
    lr: float | None = option_field(
        None,
        "Learning rate. Default: the optimizer's, for fine-tuning (a hub id or folder) or for "
        "training a preset from scratch (see `effitrain optimizers`).",
        panel=OPTIMIZER,
        metavar="LR",
        default_text=PER_OPTIMIZER,
        elsewhere=("learning_rate",),
    )
    weight_decay: float = option_field(
        0.01,
        "Decoupled weight decay for >=2-D weights (biases and norms get none).",
        panel=OPTIMIZER,
        metavar="RATE",
    )
    scheduler: str | None = option_field(
        None,
        "Learning-rate schedule after warmup: linear, cosine or constant. Default: the "
        "optimizer's, like --lr.",
        panel=OPTIMIZER,
        choices=SCHEDULERS,
        default_text=PER_OPTIMIZER,
        elsewhere=("lr_scheduler_type",),
    )
    warmup_ratio: float | None = option_field(
        None,
        "Fraction of optimizer steps spent warming up (ignored if warmup_steps is set). "
        "Default: the optimizer's, like --lr.",
        panel=OPTIMIZER,
        metavar="FRACTION",
        default_text=PER_OPTIMIZER,
    )
    warmup_steps: int | None = option_field(
        None, "Number of warmup steps (overrides warmup_ratio).", panel=OPTIMIZER
    )
    max_grad_norm: float | None = option_field(
        None,
        "Clip the global gradient norm to this value; 0 disables clipping.",
        panel=OPTIMIZER,
        metavar="NORM",
        default_text="1.0; 0 with --optimizer-in-backward or --optimizer-offload",
    )
    fp32_embedding_state: bool = option_field(
        False,
        "adamw-8bit, lion-8bit: keep 32-bit optimizer state for embedding weights, as the "
        "Trainer does (4x their 8-bit state; bitsandbytes advises it for stability).",
        panel=OPTIMIZER,
    )

    # --- loop ---
    epochs: int = option_field(
        5, "Number of passes over the training set.", panel=LOOP, elsewhere=("num_train_epochs",)
    )
    max_steps: int | None = option_field(
        None, "Stop after this many optimizer steps (overrides epochs).", panel=LOOP
    )
    batch_size: int = option_field(
        16,
        "Training micro-batch size per process.",
        panel=LOOP,
        elsewhere=("per_device_train_batch_size",),
    )
    eval_batch_size: int | None = option_field(
        None,
        "Evaluation batch size per process (default: 2 x batch size).",
        panel=LOOP,
        elsewhere=("per_device_eval_batch_size",),
    )
    grad_accum: int = option_field(
        1,
        "Micro-batches per optimizer step (gradient accumulation).",
        panel=LOOP,
        elsewhere=("gradient_accumulation_steps",),
    )
    mixed_precision: str = option_field(
        "no", "Passed to Accelerator: no, fp16 or bf16.", panel=LOOP, choices=MIXED_PRECISION
    )
    seed: int = option_field(42, "Seed for model init, data order and dropout.", panel=LOOP)
    log_every: int = option_field(
        10, "Update the shown loss every this many optimizer steps.", panel=LOOP
    )
    max_memory: str | None = option_field(
        None,
        "Memory budget per device (24GiB, 24GB = 24 x 10^9 bytes, 512MiB): the run is estimated "
        "first and refused if it cannot fit; after its first optimizer step, a measured peak "
        "above it (CPU: tensors; CUDA: reserved) saves a checkpoint and stops. As effitrain plan "
        "--memory.",
        panel=LOOP,
        metavar="SIZE",
    )

    # --- outputs ---
    output_dir: str | None = option_field(
        None,
        "Folder for checkpoints (checkpoint-<step>/) and the final model (final/).",
        panel=OUTPUT,
        metavar="DIR",
    )
    save_every: int | None = option_field(
        None,
        "Save a checkpoint every this many optimizer steps (needs --output-dir).",
        panel=OUTPUT,
    )
    save_strategy: str = option_field(
        "steps",
        "'steps': checkpoints every --save-every steps; 'epoch': also after each epoch's "
        "evaluation; 'no': none (a stop by signal still saves one).",
        panel=OUTPUT,
        choices=SAVE_STRATEGIES,
    )
    save_total_limit: int | None = option_field(
        None,
        "Keep at most this many checkpoints; the oldest are deleted after a save succeeds.",
        panel=OUTPUT,
    )
    resume: str | None = option_field(
        None,
        "Continue from 'latest' (newest complete checkpoint in --output-dir) or a checkpoint folder.",
        panel=OUTPUT,
        metavar="latest|DIR",
    )
    metrics_json: str | None = option_field(
        None,
        "Write the run's metrics as one JSON object to this file.",
        panel=OUTPUT,
        metavar="FILE",
    )
    report_to: list[str] | None = option_field(
        None,
        "Experiment trackers to log to, through Accelerate: none, all (every installed one), or "
        f"{', '.join(TRACKERS)}. TensorBoard writes to --output-dir/runs (else ./runs/<time>). "
        "Comma-separated: tensorboard,wandb.",
        panel=OUTPUT,
        metavar="NAME[,NAME]",
        choices=REPORT_TO,
    )
    memory_breakdown: bool = option_field(
        True,
        "Measure one optimizer step's memory by kind (activations, gradients, state, peak "
        "tensors). That step (one of the last two) runs several times slower and is left out "
        "of the time per step; --no-memory-breakdown skips it.",
        panel=OUTPUT,
        off="--no-memory-breakdown",
        default_text="on",
    )
    quiet: bool = option_field(
        False, "Only print the final results (no progress, no per-epoch lines).", panel=OUTPUT
    )

    def validate(self) -> TrainConfig:
        """Check values that types alone cannot; raise EffitrainError naming the option."""
        positive = {
            "batch_size": self.batch_size,
            "epochs": self.epochs,
            "grad_accum": self.grad_accum,
            "max_length": self.max_length,
            "log_every": self.log_every,
        }
        for f in dataclasses.fields(self):  # inf and nan pass every comparison below
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise EffitrainError(f"{option(f.name)} must be a finite number (got {value})")
        if not 0 <= self.seed < 2**32:
            raise EffitrainError(f"--seed must be from 0 to 2**32 - 1 (got {self.seed})")
        for name in ("lr", "max_steps", "eval_batch_size"):
            if getattr(self, name) is not None:
                positive[name] = getattr(self, name)
        for name, value in positive.items():
            if not value > 0:
                raise EffitrainError(f"{option(name)} must be greater than 0 (got {value})")
        for name in ("weight_decay", "max_grad_norm", "warmup_ratio"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise EffitrainError(
                    f"{option(name)} must be 0 or more (got {getattr(self, name)})"
                )
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise EffitrainError(f"--warmup-steps must be 0 or more (got {self.warmup_steps})")
        if self.warmup_ratio is not None and self.warmup_ratio >= 1:
            raise EffitrainError(f"--warmup-ratio must be below 1 (got {self.warmup_ratio})")
        for spec in OPTIONS.values():
            spec.check_choice(getattr(self, spec.name))
        if self.text_columns is not None and not 1 <= len(self.text_columns) <= 2:
            raise EffitrainError(
                f"--text-columns takes one or two column names (got {len(self.text_columns)})"
            )
        if self.max_memory is not None:
            parse_size(self.max_memory, "--max-memory")
        self._validate_checkpointing()
        self._validate_report_to()
        return self

    def _validate_report_to(self) -> None:
        names = self.report_to or []
        if "none" in names and len(names) > 1:
            raise EffitrainError(
                f"--report-to none contradicts {','.join(n for n in names if n != 'none')}; "
                "drop one of them"
            )

    def _validate_checkpointing(self) -> None:
        for name in ("save_every", "save_total_limit"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise EffitrainError(f"{option(name)} must be greater than 0 (got {value})")
        if self.save_strategy == "no" and self.save_every is not None:
            raise EffitrainError("--save-every contradicts --save-strategy no; drop one of them")
        if self.wants_periodic_checkpoints and not self.output_dir:
            raise EffitrainError("checkpoints need a folder: add --output-dir DIR")
        if self.resume == "latest" and not self.output_dir:
            raise EffitrainError(
                "--resume latest needs --output-dir (the folder with the checkpoints)"
            )

    @property
    def wants_periodic_checkpoints(self) -> bool:
        """Whether the options ask for periodic checkpoints (every N steps or every epoch)."""
        return self.save_every is not None or self.save_strategy == "epoch"

    @property
    def saves_checkpoints(self) -> bool:
        """Whether periodic checkpoints are on (a signal saves one whenever --output-dir is set)."""
        return bool(self.output_dir) and self.wants_periodic_checkpoints

    @property
    def uses_builtin_data(self) -> bool:
        """The built-in data of the task: ``--dataset demo`` and no ``--train-file``."""
        return self.dataset == "demo" and self.train_file is None

    @property
    def trackers(self) -> list[str]:
        """The trackers ``--report-to`` names, for Accelerate's ``log_with`` ([] for none)."""
        return [name for name in self.report_to or [] if name != "none"]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def option(field_name: str) -> str:
    """The CLI spelling of a config field: ``batch_size`` -> ``--batch-size``."""
    return "--" + field_name.replace("_", "-")


SIZE_UNITS = {
    "b": 1,
    **{f"{p}b": 1000**i for i, p in enumerate("kmgt", start=1)},
    **{f"{p}ib": 1024**i for i, p in enumerate("kmgt", start=1)},
}
"""Byte units of a size: KB, MB, GB, TB are powers of 1000 (as cards and disks are sold), KiB,
MiB, GiB, TiB powers of 1024; case does not matter."""


def parse_size(text: str, flag: str) -> int:
    """Bytes of a size such as ``24GiB``, ``24GB`` (10^9 bytes), ``1.5 GiB`` or ``512MiB``.

    Raises:
        EffitrainError: one line naming the flag and the accepted units.
    """
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in SIZE_UNITS or float(match.group(1)) <= 0:
        raise EffitrainError(
            f"{flag} '{text}': not a size; write a positive number and a unit, e.g. 24GiB or "
            "24GB (units: B, KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = of 1024)"
        )
    size = int(float(match.group(1)) * SIZE_UNITS[unit])
    if size < 1:  # 0.0000001KiB would be a budget of 0 B
        raise EffitrainError(f"{flag} '{text}': less than one byte; write at least 1B")
    return size


OPTIONS: dict[str, Option] = {
    f.name: Option(f.name, **f.metadata) for f in dataclasses.fields(TrainConfig)
}
"""Every field's option, by field name: TrainConfig's own in declaration order, then each lever's
(:func:`add_options`) in the order the levers were registered."""


Group = typing.TypeVar("Group", bound="OptionGroup")


@dataclass
class OptionGroup:
    """Options declared outside TrainConfig, as a dataclass of :func:`option_field` fields: a
    lever's (``Lever.options``). :func:`add_options` makes them TrainConfig fields; :meth:`of`
    reads them back, typed, from a config."""

    @classmethod
    def of(cls: type[Group], config: TrainConfig) -> Group:
        """The group's values in ``config``."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


def add_options(*groups: type[OptionGroup]) -> None:
    """Make the fields of each dataclass in ``groups`` (declared with :func:`option_field`)
    fields of TrainConfig and entries of :data:`OPTIONS`: a lever's options (``Lever.options``),
    declared in its own module, become CLI options, YAML keys, config fields and resume
    arguments like TrainConfig's own. TrainConfig is extended in place, so that every reference
    to it sees them.

    Raises:
        ValueError: a field that TrainConfig already has (a programming error, not user input).
    """
    new = [f for group in groups for f in dataclasses.fields(group)]
    names = [f.name for f in (*dataclasses.fields(TrainConfig), *new)]
    if len(set(names)) < len(names):
        taken = sorted({name for name in names if names.count(name) > 1})
        raise ValueError(f"options declared twice: {', '.join(taken)}")
    for group in groups:
        hints = typing.get_type_hints(group)
        for f in dataclasses.fields(group):
            f.type = hints[f.name]
    fields = [(f.name, f.type, f) for f in (*dataclasses.fields(TrainConfig), *new)]
    extended = dataclasses.make_dataclass("TrainConfig", fields, namespace={})
    for name in ("__init__", "__repr__", "__eq__", "__dataclass_fields__", "__match_args__"):
        setattr(TrainConfig, name, getattr(extended, name))
    TrainConfig.__annotations__.update({f.name: f.type for f in new})
    OPTIONS.update({f.name: Option(f.name, **f.metadata) for f in new})


def to_arguments(values: Mapping[str, Any]) -> list[str]:
    """The ``effitrain train`` arguments that give these config values: the inverse of parsing.

    ``{"batch_size": 8, "packing": False, "text_columns": ["a", "b"]}`` -> ``--batch-size 8
    --no-packing --text-columns a,b``. None is left out (it is the default, or stands for it),
    as is False for an option without an off flag (off is its default).

    Raises:
        KeyError: a name that is not a config field.
    """
    arguments: list[str] = []
    for name, value in values.items():
        spec = OPTIONS[name]
        if value is None:
            continue
        if isinstance(value, bool):
            if value:
                arguments.append(spec.flag)
            elif spec.off:
                arguments.append(spec.off)
            continue
        if isinstance(value, (list, tuple)):
            value = ",".join(str(item) for item in value)
        arguments += [spec.flag, str(value)]
    return arguments


def _field_types() -> dict[str, Any]:
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


def _coerce(key: str, value: Any, annotation: Any, source: str) -> Any:
    """Check ``value`` against the field's type; convert only where it is lossless and obvious."""
    args = typing.get_args(annotation)
    is_optional = (
        typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args
    )
    if is_optional:
        if value is None:
            return None
        annotation = next(a for a in args if a is not type(None))

    def wrong(expected: str) -> EffitrainError:
        return EffitrainError(
            f"{source}: '{key}' must be {expected}, got {type(value).__name__} {value!r}"
        )

    if annotation is bool:
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong("an integer")
        return value
    if annotation is float:
        if isinstance(value, bool):
            raise wrong("a number")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            # PyYAML reads 3e-4 (no dot) as a string; accept it as the number it plainly is.
            try:
                return float(value)
            except ValueError:
                raise wrong("a number") from None
        raise wrong("a number")
    if annotation is str:
        if not isinstance(value, str):
            raise wrong("a string")
        return value
    if typing.get_origin(annotation) is list:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if typing.get_args(annotation) == (float,) and isinstance(value, list):
            return [_coerce(key, v, float, source) for v in value]  # --reward-weights
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise wrong("a list of strings")
        return value
    raise AssertionError(f"unhandled config type {annotation!r} for {key}")  # a bug, not user input


def _close_key(key: str, names: list[str]) -> str | None:
    """The option an unknown key most likely meant (a typo of one, or another tool's name)."""
    import difflib

    elsewhere = {alias: name for name, spec in OPTIONS.items() for alias in spec.elsewhere}
    candidates = {**elsewhere, **{name: name for name in names}}
    found = difflib.get_close_matches(key, list(candidates), n=1)
    return candidates[found[0]] if found else None


def merge(base: dict[str, Any], overrides: dict[str, Any], source: str) -> dict[str, Any]:
    """Return ``base`` updated with ``overrides`` after checking each key and type."""
    types_by_name = _field_types()
    merged = dict(base)
    for raw_key, value in overrides.items():
        key = str(raw_key).replace("-", "_")
        if key not in types_by_name:
            guess = _close_key(key, list(types_by_name))
            hint = (
                f"did you mean '{guess}'?"
                if guess
                else "the keys are the options of effitrain train --help (batch_size: 16)"
            )
            raise EffitrainError(f"unknown key '{raw_key}' in {source}; {hint}")
        merged[key] = _coerce(key, value, types_by_name[key], source)
    return merged


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a training YAML file into a plain dict (top level must be a mapping)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise EffitrainError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise EffitrainError(f"{path}: not valid YAML{where}: {exc.__class__.__name__}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise EffitrainError(f"{path}: the top level must be a mapping of option: value")
    return data


def build_config(
    config_file: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> TrainConfig:
    """Defaults <- YAML file <- explicit overrides (CLI options), then validate.

    Args:
        config_file: optional YAML file whose keys are TrainConfig field names.
        overrides: values given explicitly on the command line (None values are ignored).

    Raises:
        EffitrainError: unknown key, wrong type, or invalid value; the message names the key.
    """
    values = dataclasses.asdict(TrainConfig())
    cli = {k: v for k, v in (overrides or {}).items() if v is not None}
    if config_file is not None:
        # What the command line overrides is not read (plan's max_length: longest).
        from_file = load_yaml(config_file)
        from_file = {k: v for k, v in from_file.items() if str(k).replace("-", "_") not in cli}
        values = merge(values, from_file, source=str(config_file))
    values = merge(values, cli, source="command line")
    if values["task"] in DECODER_TASKS and values["model"] == default_for("model"):
        given = {k.replace("-", "_") for k in (load_yaml(config_file) if config_file else {})}
        if "model" not in given | set(cli):
            values["model"] = DEFAULT_CAUSAL_MODEL
    return TrainConfig(**values).validate()


__all__ = [
    "OPTIONS",
    "OptionGroup",
    "add_options",
    "Option",
    "TrainConfig",
    "build_config",
    "load_yaml",
    "merge",
    "option",
    "option_field",
    "parse_size",
    "to_arguments",
]
