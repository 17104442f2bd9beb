"""A minimal, plain Accelerate training loop: the baseline that effitrain's loop is measured against.

Same model (the tiny preset's DistilBERT config), same demo data, tokenization, batch size,
optimizer, lr, schedule and clipping as ``effitrain train``; none of effitrain's loop, reporting
or accounting. This is Accelerate's example loop: forward, backward, step, schedule, zero_grad,
evaluate each epoch. It takes the options the benchmark gives ``effitrain train`` and writes
``seconds_per_step`` (median, first step excluded), ``peak_memory_bytes`` and ``eval`` to
``--metrics-json``.

    python -m benchmarks.loop_overhead.plain_loop --optim adamw --lr 5e-4 --epochs 2 \\
        --metrics-json plain.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optim", default="adamw", choices=["adamw", "adafactor", "adamw-8bit"])
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, help="stop after this many steps (trials)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--metrics-json", required=True, help="where the numbers go")
    return parser.parse_args(argv)


def build(args: argparse.Namespace):
    """The accelerator, the prepared model, optimizer, loaders and schedule."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader
    from transformers import (
        DataCollatorWithPadding,
        DistilBertConfig,
        DistilBertForSequenceClassification,
        get_scheduler,
    )

    from effitrain.demo import build_demo_dataset, build_tokenizer, tiny_model_config

    accelerator = Accelerator()
    set_seed(args.seed)
    tokenizer = build_tokenizer()
    raw = build_demo_dataset()

    def encode(batch):
        out = tokenizer(
            batch["sentence1"], batch["sentence2"], truncation=True, max_length=args.max_length
        )
        out["labels"] = batch["label"]
        return out

    data = raw.map(encode, batched=True, remove_columns=raw["train"].column_names)
    collator = DataCollatorWithPadding(tokenizer)
    train = DataLoader(data["train"], batch_size=args.batch_size, shuffle=True, collate_fn=collator)
    evaluation = DataLoader(data["validation"], batch_size=2 * args.batch_size, collate_fn=collator)
    model = DistilBertForSequenceClassification(
        DistilBertConfig(**tiny_model_config(), num_labels=2)
    )
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    if args.optim == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=args.lr)
    elif args.optim == "adafactor":
        optimizer = torch.optim.Adafactor(groups, lr=args.lr)
    else:
        import bitsandbytes as bnb

        optimizer = bnb.optim.AdamW8bit(groups, lr=args.lr)
    total = len(train) * args.epochs
    if args.max_steps:
        total = min(total, args.max_steps)
    schedule = get_scheduler(
        "linear", optimizer, num_warmup_steps=int(0.06 * total), num_training_steps=total
    )
    return accelerator, *accelerator.prepare(model, optimizer, train, evaluation, schedule), total


def evaluate(accelerator, model, loader) -> dict[str, float]:
    import torch
    from sklearn.metrics import accuracy_score, f1_score

    model.eval()
    predictions, references = [], []
    for batch in loader:
        with torch.no_grad():
            logits = model(**batch).logits
        p, r = accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"]))
        predictions.append(p)
        references.append(r)
    model.train()
    y_pred, y_true = torch.cat(predictions).numpy(), torch.cat(references).numpy()
    return {
        "accuracy": float(accuracy_score(y_true, y_pred)),
        "f1": float(f1_score(y_true, y_pred)),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    accelerator, model, optimizer, train, evaluation, schedule, total = build(args)
    step_seconds: list[float] = []
    scores: dict[str, float] = {}
    for epoch in range(args.epochs):
        model.train()
        last = time.perf_counter()
        for batch in train:
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            now = time.perf_counter()
            step_seconds.append(now - last)
            last = now
            if len(step_seconds) == total:
                break
        scores = evaluate(accelerator, model, evaluation)
        print(f"epoch {epoch + 1}: loss {loss.item():.4f} accuracy {scores['accuracy']:.4f}")
        if len(step_seconds) == total:
            break
    result = {
        "seconds_per_step": statistics.median(step_seconds[1:] or step_seconds),
        "global_steps": len(step_seconds),
        "peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "eval": scores,
    }
    with open(args.metrics_json, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(sys.argv[1:])
