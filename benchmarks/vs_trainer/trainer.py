"""The Trainer's side: train with ``transformers.Trainer`` the way ``effitrain train`` would, and
write the numbers the benchmark compares (same keys as the effitrain side) to --metrics-json.

It takes the options the benchmark gives both sides (``--optim`` is ``TrainingArguments.optim``)
and copies effitrain's choices where the Trainer's differ: the seed before data and model, class
names sorted into label ids, warmup steps rounded up, evaluation after each epoch at twice the
batch, and dropout drawing the same random stream (SameRandomStream).

    python -m benchmarks.vs_trainer.trainer --model DIR --train-file t.csv --validation-file d.csv \\
        --optim adamw_torch --lr 2e-4 ... --metrics-json trainer.json
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import datasets
import numpy as np
import torch
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup"}
"""effitrain's schedules always warm up; transformers' 'constant' does not."""


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vs_trainer.trainer")
    for name in ("--model", "--train-file", "--validation-file", "--optim", "--metrics-json"):
        parser.add_argument(name, required=True)
    for name in ("--lr", "--weight-decay", "--warmup-ratio", "--max-grad-norm"):
        parser.add_argument(name, type=float, required=True)
    for name in ("--epochs", "--batch-size", "--max-length", "--seed"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--scheduler", required=True, choices=list(SCHEDULERS))
    parser.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="no")
    return parser.parse_args(argv)


def load_data(args: argparse.Namespace):
    """Tokenized train/validation splits, the class names and the tokenizer, as effitrain
    builds them (text columns and label column found the same way)."""
    from effitrain.tasks.classification import TEXT_COLUMN_CANDIDATES
    from effitrain.tasks.sources import LABEL_COLUMN_CANDIDATES

    raw = datasets.load_dataset(
        "csv", data_files={"train": args.train_file, "validation": args.validation_file}
    )
    columns = raw["train"].column_names
    text_columns = next(c for c in TEXT_COLUMN_CANDIDATES if all(x in columns for x in c))
    label_column = next(c for c in LABEL_COLUMN_CANDIDATES if c in columns)
    # Labels as effitrain's: class names sorted -> ids 0..K-1, or integer ids.
    values = [v for v in raw["train"].unique(label_column) if v is not None]
    if all(isinstance(v, str) for v in values):
        names = sorted(values)
        raw = raw.cast_column(label_column, datasets.ClassLabel(names=names))
    else:
        names = [str(i) for i in range(int(max(values)) + 1)]
        raw = raw.cast_column(label_column, datasets.Value("int64"))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    max_length = min(args.max_length, tokenizer.model_max_length)

    def encode(batch):
        texts = [["" if t is None else str(t) for t in batch[c]] for c in text_columns]
        encoded = tokenizer(*texts, truncation=True, max_length=max_length)
        encoded["labels"] = batch[label_column]
        return encoded

    return raw.map(encode, batched=True, remove_columns=columns), names, tokenizer


def load_model(args: argparse.Namespace, names: list[str], tokenizer):
    id2label = dict(enumerate(names))
    config = AutoConfig.from_pretrained(
        args.model,
        num_labels=len(names),
        id2label=id2label,
        label2id={name: i for i, name in id2label.items()},
    )
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tokenizer.pad_token_id
    return AutoModelForSequenceClassification.from_pretrained(
        args.model, config=config, ignore_mismatched_sizes=True
    )


class StepTimer(TrainerCallback):
    """Time between optimizer-step ends, as effitrain's stopwatch: evaluation left out."""

    def __init__(self) -> None:
        self.step_seconds: list[float] = []
        self.evaluations: list[dict] = []
        self.last = time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.step_seconds.append(now - self.last)
        self.last = now

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evaluations.append(dict(metrics or {}))
        self.last = time.perf_counter()  # the next step's time starts after evaluation


class SameRandomStream(TrainerCallback):
    """Dropout draws the masks effitrain draws. effitrain seeds once, before the model, and its
    seeded DataLoader generator takes nothing from the global generator; Trainer.__init__ seeds
    again and each epoch's DataLoader iterator draws its base seed from the global generator.
    Undo both, so the two sides train bit for bit alike where the kernels allow (this runs
    before the first step of each epoch: no step time is affected)."""

    def __init__(self, state_after_model: torch.Tensor) -> None:
        self.state_after_model = state_after_model
        self.saved: torch.Tensor | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        torch.set_rng_state(self.state_after_model)

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.saved = torch.get_rng_state()

    def on_step_begin(self, args, state, control, **kwargs):
        if self.saved is not None:
            torch.set_rng_state(self.saved)
            self.saved = None


def training_arguments(args: argparse.Namespace, output_dir: str, warmup_steps: int):
    return TrainingArguments(
        output_dir=output_dir,
        optim=args.optim,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        lr_scheduler_type=SCHEDULERS[args.scheduler],
        warmup_steps=warmup_steps,
        max_grad_norm=args.max_grad_norm,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=2 * args.batch_size,  # effitrain's default
        num_train_epochs=args.epochs,
        seed=args.seed,
        eval_strategy="epoch",  # effitrain evaluates after every epoch
        save_strategy="no",
        logging_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),  # the benchmark hides the GPU for --device cpu
        bf16=args.mixed_precision == "bf16",
        fp16=args.mixed_precision == "fp16",
        disable_tqdm=True,
        log_level="error",
    )


def compute_metrics(names: list[str]):
    from sklearn.metrics import accuracy_score, f1_score

    def metrics(eval_pred):
        logits, labels = eval_pred
        predictions = np.argmax(logits, axis=-1)
        average = "binary" if len(names) == 2 else "macro"
        return {
            "accuracy": float(accuracy_score(labels, predictions)),
            "f1": float(f1_score(labels, predictions, average=average, zero_division=0)),
        }

    return metrics


def state_facts(trainer: Trainer, model, args: argparse.Namespace) -> dict:
    """The optimizer state's ledger, where the two sides' weight-decay groups differ, and the
    parameters whose 8-bit state the Trainer keeps in fp32 (its bitsandbytes override for
    nn.Embedding), counted from the real state."""
    from effitrain import optimizer_memory
    from effitrain.memory.ledger import unwrap_prepared

    ledger = optimizer_memory(trainer.optimizer)
    decay = set(trainer.get_decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    effitrain_decay = {n for n, p in named if p.ndim >= 2}
    fp32_override = 0
    if "bnb" in args.optim and "8bit" in args.optim:
        inner = unwrap_prepared(trainer.optimizer)
        fp32_override = sum(
            p.numel()
            for p, state in inner.state.items()
            if p.numel() >= inner.args.min_8bit_size
            and state.get("state1") is not None
            and state["state1"].dtype == torch.float32
        )
    return {
        "optimizer_state_bytes": ledger.bytes,
        "optimizer_state": ledger.optimizer_state.to_dict(),
        "optimizer_class": ledger.optimizer_class,
        "decay_only_trainer": sorted(decay & {n for n, _ in named} - effitrain_decay),
        "decay_only_effitrain": sorted(effitrain_decay - decay),
        "fp32_override_params": fp32_override,
    }


def main(argv: list[str]) -> None:
    args = parse(argv)
    datasets.disable_progress_bars()
    # As effitrain's build: the seed first, then data, tokenizer, model (the new head's init
    # draws from the seeded generator).
    set_seed(args.seed)
    data, names, tokenizer = load_data(args)
    model = load_model(args, names, tokenizer)
    state_after_model = torch.get_rng_state()
    # effitrain's plan: total = ceil(examples / batch) * epochs, warmup = ceil(total * ratio).
    total_steps = math.ceil(len(data["train"]) / args.batch_size) * args.epochs
    warmup_steps = math.ceil(total_steps * args.warmup_ratio)
    timer = StepTimer()
    with tempfile.TemporaryDirectory(prefix="vs_trainer-") as output_dir:
        trainer = Trainer(
            model=model,
            args=training_arguments(args, output_dir, warmup_steps),
            train_dataset=data["train"],
            eval_dataset=data["validation"],
            data_collator=DataCollatorWithPadding(tokenizer),
            processing_class=tokenizer,
            compute_metrics=compute_metrics(names),
            callbacks=[SameRandomStream(state_after_model), timer],
        )
        output = trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    final = timer.evaluations[-1]
    result = {
        "seconds_per_step": statistics.median(timer.step_seconds[1:] or timer.step_seconds),
        "peak_memory_bytes": peak if sys.platform == "darwin" else peak * 1024,
        "peak_memory_kind": "peak_rss",
        # effitrain's run peak on a GPU: max_memory_allocated over the whole run.
        "cuda_peak_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        "eval": {
            "accuracy": final["eval_accuracy"],
            "f1": final["eval_f1"],
            "loss": final["eval_loss"],
            "examples": len(data["validation"]),
        },  # fmt: skip
        "train_loss": output.training_loss,
        "global_steps": trainer.state.global_step,
        "warmup_steps": warmup_steps,
        "torch_threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "eval_history": timer.evaluations,
        **state_facts(trainer, model, args),
    }
    Path(args.metrics_json).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
