"""The typed training configuration: defaults, YAML loading, CLI overrides, validation.

One flat dataclass keeps the mapping between CLI options, YAML keys and code obvious: the YAML key
``batch_size`` (or ``batch-size``) is the option ``--batch-size`` is the field ``batch_size``.
A YAML file only overrides defaults; explicit CLI options override the YAML file. Unknown keys and
values of the wrong type are errors that name the key.

A leaf: it imports nothing of effitrain but its error type, so that every other module may read
a config. Checks that need the presets, the optimizer registry or the levers run where the run
is built (:func:`effitrain.build.check_config`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effitrain.errors import EffitrainError

SCHEDULERS = ("linear", "cosine", "constant")
MIXED_PRECISION = ("no", "fp16", "bf16")
DEFAULT_CAUSAL_MODEL = "tiny-llama"
"""The model of ``--task causal-lm`` when none is given (the causal-LM demo's preset)."""
WEIGHTS_DTYPES = ("fp32", "bf16")
CHUNKED_LOSS = ("auto", "torch", "liger", "cce", "off")
"""``--chunked-loss`` (effitrain.tasks.lm_loss): auto picks a fused CUDA kernel, else torch."""
OPTIMIZER_OFFLOAD = ("off", "state", "state+grads")
"""``--optimizer-offload``: nothing, the optimizer state and step, or also the gradients."""
SAVE_STRATEGIES = ("steps", "epoch", "no")
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


def _opt(default: Any, help: str) -> Any:
    """A config field with its one-line doc, which is also the CLI option's help text."""
    return field(default=default, metadata={"help": help})


def default_for(name: str) -> Any:
    """The default value of a config field."""
    return next(f.default for f in dataclasses.fields(TrainConfig) if f.name == name)


def help_for(name: str) -> str:
    """The help text of a config field (shown by ``effitrain train --help``)."""
    return next(f.metadata["help"] for f in dataclasses.fields(TrainConfig) if f.name == name)


@dataclass
class TrainConfig:
    """Everything one ``effitrain train`` run needs. Field docs are shown by ``effitrain train --help``."""

    # --- model and data ---
    task: str | None = _opt(
        None,
        "sequence-classification or causal-lm. Default: causal-lm for a causal-LM preset, or a "
        "*ForCausalLM model with no label column in the data; else sequence-classification.",
    )
    model: str = _opt(
        "tiny", "Built-in preset name, a hub id, or a local folder saved with save_pretrained."
    )
    dataset: str = _opt(
        "demo",
        "'demo' (built-in, offline), a hub dataset id, or a local file/folder (csv, json, jsonl, parquet).",
    )
    dataset_config: str | None = _opt(None, "Hub dataset configuration name, e.g. 'mrpc' for glue.")
    train_file: str | None = _opt(
        None, "Local training file (csv/json/jsonl/parquet); used instead of --dataset."
    )
    validation_file: str | None = _opt(
        None,
        "Local validation file; without it the dataset's validation split (or 10% of train) is used.",
    )
    text_columns: list[str] | None = _opt(
        None, "One or two text columns; auto-detected when not given."
    )
    label_column: str | None = _opt(None, "Label column; auto-detected when not given.")
    max_length: int = _opt(
        128, "Truncate inputs to this many tokens (causal-lm: the length of packed blocks)."
    )
    packing: bool | None = _opt(
        None,
        "causal-lm: concatenate examples into --max-length blocks (attention kept inside each "
        "example) instead of padding each one. Default: on for plain text, off for "
        "instruction and chat data.",
    )
    completion_only_loss: bool | None = _opt(
        None,
        "causal-lm: compute the loss on completions (assistant turns) only, not on prompts. "
        "Default: on for prompt/completion, instruction and chat data.",
    )
    sample_prompt: str | None = _opt(
        None,
        "causal-lm: after each evaluation, print a short greedy continuation of this prompt.",
    )

    # --- optimizer and schedule ---
    optim: str = _opt("adamw", "Optimizer name from `effitrain optimizers`.")
    lr: float | None = _opt(
        None,
        "Learning rate. Default: the optimizer's, for fine-tuning (a hub id or folder) or for "
        "training a preset from scratch (see `effitrain optimizers`).",
    )
    weight_decay: float = _opt(
        0.01, "Decoupled weight decay for >=2-D weights (biases and norms get none)."
    )
    scheduler: str | None = _opt(
        None,
        "Learning-rate schedule after warmup: linear, cosine or constant. Default: the "
        "optimizer's, like --lr.",
    )
    warmup_ratio: float | None = _opt(
        None,
        "Fraction of optimizer steps spent warming up (ignored if warmup_steps is set). "
        "Default: the optimizer's, like --lr.",
    )
    warmup_steps: int | None = _opt(None, "Number of warmup steps (overrides warmup_ratio).")
    max_grad_norm: float | None = _opt(
        None,
        "Clip the global gradient norm to this value; 0 disables clipping.",
    )
    fp32_embedding_state: bool = _opt(
        False,
        "adamw-8bit, lion-8bit: keep 32-bit optimizer state for embedding weights, as the "
        "Trainer does (4x their 8-bit state; bitsandbytes advises it for stability).",
    )

    # --- loop ---
    epochs: int = _opt(5, "Number of passes over the training set.")
    max_steps: int | None = _opt(None, "Stop after this many optimizer steps (overrides epochs).")
    batch_size: int = _opt(16, "Training micro-batch size per process.")
    eval_batch_size: int | None = _opt(
        None, "Evaluation batch size per process (default: 2 x batch size)."
    )
    grad_accum: int = _opt(1, "Micro-batches per optimizer step (gradient accumulation).")
    mixed_precision: str = _opt("no", "Passed to Accelerator: no, fp16 or bf16.")
    seed: int = _opt(42, "Seed for model init, data order and dropout.")
    log_every: int = _opt(10, "Update the shown loss every this many optimizer steps.")

    # --- memory levers (effitrain.levers) ---
    gradient_checkpointing: bool = _opt(
        False,
        "Recompute activations in backward instead of keeping them (the model's own "
        "activation checkpointing, non-reentrant).",
    )
    optimizer_in_backward: bool = _opt(
        False,
        "Update each parameter as soon as its gradient is ready and free that gradient, so the "
        "full set of gradients never exists.",
    )
    weights_dtype: str = _opt(
        "fp32",
        "fp32 or bf16: keep the weights (and gradients, and the optimizer state where it can) "
        "in this dtype. Not autocast: see --mixed-precision.",
    )
    chunked_loss: str | None = _opt(
        None,
        "causal-lm: compute the loss from the last hidden states chunk by chunk, never holding "
        "the full logits: auto (default: liger-kernel or cut-cross-entropy on CUDA where "
        "installed, else torch), torch, liger, cce, or off.",
    )
    activation_offload: bool = _opt(
        False,
        "CUDA: keep the tensors saved for backward in pinned host memory, copied back for "
        "backward on a side stream (with --gradient-checkpointing: only the checkpoints).",
    )
    optimizer_offload: str = _opt(
        "off",
        "CUDA: off, state (the optimizer state and its step on the host, torchao's "
        "CPUOffloadOptimizer) or state+grads (also each gradient, once backward made it).",
    )
    lora_rank: int | None = _opt(
        None, "Train LoRA adapters of this rank (peft) instead of the whole model."
    )
    lora_alpha: float | None = _opt(None, "LoRA scaling alpha (default: 2 x rank).")
    lora_dropout: float | None = _opt(None, "Dropout on the LoRA adapters' inputs (default: 0.05).")
    lora_target_modules: list[str] | None = _opt(
        None,
        "Modules that get adapters, by name, or all-linear (the default: every Linear layer "
        "outside the classification head).",
    )
    lora_merge: bool = _opt(
        False, "The final save also writes the base model with the adapters merged in."
    )
    load_in_4bit: bool = _opt(
        False,
        "QLoRA: store the frozen base model's Linear weights in 4-bit NF4 (bitsandbytes) under "
        "the LoRA adapters; needs --lora-rank.",
    )

    # --- outputs ---
    output_dir: str | None = _opt(
        None, "Folder for checkpoints (checkpoint-<step>/) and the final model (final/)."
    )
    save_every: int | None = _opt(
        None, "Save a checkpoint every this many optimizer steps (needs --output-dir)."
    )
    save_strategy: str = _opt(
        "steps",
        "'steps': checkpoints every --save-every steps; 'epoch': also after each epoch's "
        "evaluation; 'no': none (a stop by signal still saves one).",
    )
    save_total_limit: int | None = _opt(
        None, "Keep at most this many checkpoints; the oldest are deleted after a save succeeds."
    )
    resume: str | None = _opt(
        None,
        "Continue from 'latest' (newest complete checkpoint in --output-dir) or a checkpoint folder.",
    )
    metrics_json: str | None = _opt(
        None, "Write the run's metrics as one JSON object to this file."
    )
    report_to: list[str] | None = _opt(
        None,
        "Experiment trackers to log to, through Accelerate: none, all (every installed one), or "
        f"{', '.join(TRACKERS)}. TensorBoard writes to --output-dir/runs (else ./runs/<time>).",
    )
    memory_breakdown: bool = _opt(
        True,
        "Measure one optimizer step's memory by kind (activations, gradients, state, peak "
        "tensors). That step (one of the last two) runs several times slower and is left out "
        "of the time per step; --no-memory-breakdown skips it.",
    )
    quiet: bool = _opt(False, "Only print the final results (no progress, no per-epoch lines).")

    def validate(self) -> TrainConfig:
        """Check values that types alone cannot; raise EffitrainError naming the option."""
        positive = {
            "batch_size": self.batch_size,
            "epochs": self.epochs,
            "grad_accum": self.grad_accum,
            "max_length": self.max_length,
            "log_every": self.log_every,
        }
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
        if self.scheduler is not None and self.scheduler not in SCHEDULERS:
            raise EffitrainError(
                f"unknown --scheduler '{self.scheduler}'; choose one of: {', '.join(SCHEDULERS)}"
            )
        if self.mixed_precision not in MIXED_PRECISION:
            raise EffitrainError(
                f"unknown --mixed-precision '{self.mixed_precision}'; "
                f"choose one of: {', '.join(MIXED_PRECISION)}"
            )
        if self.text_columns is not None and not 1 <= len(self.text_columns) <= 2:
            raise EffitrainError(
                f"--text-columns takes one or two column names (got {len(self.text_columns)})"
            )
        self._validate_checkpointing()
        self._validate_report_to()
        self._validate_levers()
        return self

    def _validate_levers(self) -> None:
        """The memory levers' values, and the combinations that cannot work (effitrain.levers)."""
        if self.weights_dtype not in WEIGHTS_DTYPES:
            raise EffitrainError(
                f"unknown --weights-dtype '{self.weights_dtype}'; "
                f"choose one of: {', '.join(WEIGHTS_DTYPES)}"
            )
        if self.chunked_loss is not None and self.chunked_loss not in CHUNKED_LOSS:
            raise EffitrainError(
                f"unknown --chunked-loss '{self.chunked_loss}'; "
                f"choose one of: {', '.join(CHUNKED_LOSS)}"
            )
        if self.optimizer_in_backward:
            self._validate_optimizer_in_backward()
        self._validate_optimizer_offload()
        self._validate_lora()
        if self.load_in_4bit:
            self._validate_load_in_4bit()

    def _validate_load_in_4bit(self) -> None:
        """QLoRA: 4-bit frozen base weights under LoRA adapters (effitrain.quantize)."""
        if self.lora_rank is None:
            raise EffitrainError(
                "--load-in-4bit needs --lora-rank R: 4-bit weights are frozen, only LoRA "
                "adapters can train over them; add --lora-rank 8"
            )
        if self.weights_dtype == "bf16":
            raise EffitrainError(
                "--load-in-4bit cannot combine with --weights-dtype bf16: casting the model "
                "would turn the packed 4-bit codes into numbers; drop --weights-dtype (the "
                "adapters train in fp32 either way) and use --mixed-precision bf16 for bf16 compute"
            )
        if self.lora_merge:
            raise EffitrainError(
                "--load-in-4bit cannot combine with --lora-merge: merging into 4-bit weights "
                "re-quantizes them (lossy); keep final/'s adapters and merge them into the "
                "original weights (peft's merge_and_unload on the fp32 model)"
            )

    def _validate_lora(self) -> None:
        """LoRA options: only with --lora-rank, and values peft can use."""
        lora_options = {
            "lora_alpha": self.lora_alpha is not None,
            "lora_dropout": self.lora_dropout is not None,
            "lora_target_modules": self.lora_target_modules is not None,
            "lora_merge": self.lora_merge,
        }
        if self.lora_rank is None:
            given = [option(name) for name, on in lora_options.items() if on]
            if given:
                raise EffitrainError(
                    f"{given[0]} needs --lora-rank R (LoRA is off without it); add --lora-rank 8, "
                    f"or drop {given[0]}"
                )
            return
        if self.lora_rank <= 0:
            raise EffitrainError(f"--lora-rank must be greater than 0 (got {self.lora_rank})")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise EffitrainError(f"--lora-alpha must be greater than 0 (got {self.lora_alpha})")
        if self.lora_dropout is not None and not 0 <= self.lora_dropout < 1:
            raise EffitrainError(
                f"--lora-dropout must be at least 0 and below 1 (got {self.lora_dropout})"
            )
        if self.lora_target_modules is not None and not self.lora_target_modules:
            raise EffitrainError(
                "--lora-target-modules needs at least one module name (or all-linear)"
            )

    def _validate_optimizer_in_backward(self) -> None:
        """Each parameter is updated inside backward, as soon as its own gradient is ready
        (the optimizers it cannot run: :func:`effitrain.levers.check_options`)."""
        if self.max_grad_norm is not None and self.max_grad_norm > 0:
            raise EffitrainError(
                f"--max-grad-norm {self.max_grad_norm:g} clips the global gradient norm, which "
                "needs every gradient at once, but --optimizer-in-backward updates each "
                "parameter as soon as its own is ready; use --max-grad-norm 0 (or leave it out)"
            )
        if self.grad_accum > 1:
            raise EffitrainError(
                f"--grad-accum {self.grad_accum} cannot combine with --optimizer-in-backward, "
                "which updates each parameter in every backward pass (after every "
                "micro-batch); use --grad-accum 1 and a larger --batch-size"
            )
        if self.mixed_precision == "fp16":
            raise EffitrainError(
                "--mixed-precision fp16 cannot combine with --optimizer-in-backward: its loss "
                "scaler must see every gradient before any update (to unscale them and skip "
                "steps that overflow); use --mixed-precision bf16 or no"
            )

    def _validate_optimizer_offload(self) -> None:
        """The optimizer step runs on the host, from gradient copies made inside backward (the
        optimizers it cannot wrap and the launches it cannot run on: :mod:`effitrain.levers`)."""
        if self.optimizer_offload not in OPTIMIZER_OFFLOAD:
            raise EffitrainError(
                f"unknown --optimizer-offload '{self.optimizer_offload}'; "
                f"choose one of: {', '.join(OPTIMIZER_OFFLOAD)}"
            )
        if self.optimizer_offload == "off":
            return
        if self.optimizer_in_backward:
            raise EffitrainError(
                "--optimizer-offload cannot combine with --optimizer-in-backward: both run the "
                "update from a hook on each gradient; choose one"
            )
        if self.max_grad_norm is not None and self.max_grad_norm > 0:
            raise EffitrainError(
                f"--max-grad-norm {self.max_grad_norm:g} cannot combine with --optimizer-offload: "
                "each gradient is copied to the host inside backward, before clipping could "
                "scale it; use --max-grad-norm 0 (or leave it out)"
            )
        if self.mixed_precision == "fp16":
            raise EffitrainError(
                "--mixed-precision fp16 cannot combine with --optimizer-offload: the host "
                "copies of the gradients are made before the loss scaler unscales them; use "
                "--mixed-precision bf16 or no"
            )
        if self.optimizer_offload == "state+grads" and self.grad_accum > 1:
            raise EffitrainError(
                f"--grad-accum {self.grad_accum} cannot combine with --optimizer-offload "
                "state+grads, which frees each gradient on the GPU after every backward pass; "
                "use --optimizer-offload state, or --grad-accum 1 and a larger --batch-size"
            )

    def _validate_report_to(self) -> None:
        names = self.report_to or []
        for name in names:
            if name not in ("none", "all", *TRACKERS):
                raise EffitrainError(
                    f"unknown --report-to '{name}'; choose from: none, all, {', '.join(TRACKERS)}"
                )
        if "none" in names and len(names) > 1:
            raise EffitrainError(
                f"--report-to none contradicts {','.join(n for n in names if n != 'none')}; "
                "drop one of them"
            )

    def _validate_checkpointing(self) -> None:
        if self.save_strategy not in SAVE_STRATEGIES:
            raise EffitrainError(
                f"unknown --save-strategy '{self.save_strategy}'; "
                f"choose one of: {', '.join(SAVE_STRATEGIES)}"
            )
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

    @property
    def effective_max_grad_norm(self) -> float:
        """The clipping threshold actually used: the explicit one, else 1.0 (0, no clipping,
        with --optimizer-in-backward or --optimizer-offload)."""
        return effective_max_grad_norm(
            self.max_grad_norm, self.optimizer_in_backward or self.optimizer_offload != "off"
        )

    @property
    def effective_lora_alpha(self) -> float:
        """LoRA's alpha: the given one, else 2 x rank."""
        if self.lora_alpha is not None:
            return self.lora_alpha
        return 2.0 * (self.lora_rank or 0)

    @property
    def effective_lora_dropout(self) -> float:
        return self.lora_dropout if self.lora_dropout is not None else 0.05

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def effective_max_grad_norm(max_grad_norm: float | None, unclippable: bool) -> float:
    """``--max-grad-norm`` as used: the value given, else 1.0 (0 where the update cannot wait
    for clipping: ``unclippable``, with --optimizer-in-backward or --optimizer-offload)."""
    if max_grad_norm is not None:
        return max_grad_norm
    return 0.0 if unclippable else 1.0


def option(field_name: str) -> str:
    """The CLI spelling of a config field: ``batch_size`` -> ``--batch-size``."""
    return "--" + field_name.replace("_", "-")


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
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise wrong("a list of strings")
        return value
    raise AssertionError(f"unhandled config type {annotation!r} for {key}")  # a bug, not user input


def merge(base: dict[str, Any], overrides: dict[str, Any], source: str) -> dict[str, Any]:
    """Return ``base`` updated with ``overrides`` after checking each key and type."""
    types_by_name = _field_types()
    merged = dict(base)
    for raw_key, value in overrides.items():
        key = str(raw_key).replace("-", "_")
        if key not in types_by_name:
            raise EffitrainError(
                f"{source}: unknown key '{raw_key}'; valid keys: {', '.join(types_by_name)}"
            )
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
    if config_file is not None:
        values = merge(values, load_yaml(config_file), source=str(config_file))
    cli = {k: v for k, v in (overrides or {}).items() if v is not None}
    values = merge(values, cli, source="command line")
    if values["task"] == "causal-lm" and values["model"] == default_for("model"):
        given = {k.replace("-", "_") for k in (load_yaml(config_file) if config_file else {})}
        if "model" not in given | set(cli):
            values["model"] = DEFAULT_CAUSAL_MODEL
    return TrainConfig(**values).validate()


__all__ = ["TrainConfig", "build_config", "help_for", "load_yaml", "merge", "option"]
