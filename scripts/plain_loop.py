"""A minimal, plain Accelerate training loop: the baseline that scripts/bench.py measures effitrain against.

Same model (the tiny preset's DistilBERT config), same demo data, same tokenization, batch size
and optimizer as ``effitrain train``; none of effitrain's loop, reporting or accounting. This is
the loop from the course: forward, backward, step, schedule, zero_grad, evaluate each epoch.

    python scripts/plain_loop.py --optim adamw --epochs 3 --batch-size 32 --lr 5e-4 --out plain.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optim", default="adamw", choices=["adamw", "adafactor", "adamw-8bit"])
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--out", required=True, help="write seconds_per_step, peak RSS, accuracy here"
    )
    args = parser.parse_args()

    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from sklearn.metrics import accuracy_score, f1_score
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
    train_dl = DataLoader(
        data["train"], batch_size=args.batch_size, shuffle=True, collate_fn=collator
    )
    eval_dl = DataLoader(data["validation"], batch_size=2 * args.batch_size, collate_fn=collator)

    config = DistilBertConfig(**tiny_model_config(), num_labels=2)  # vocab_size: the tokenizer's
    model = DistilBertForSequenceClassification(config)
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    decay = [p for p in model.parameters() if p.ndim >= 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    if args.optim == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=args.lr)
    elif args.optim == "adafactor":
        optimizer = torch.optim.Adafactor(groups, lr=args.lr)
    else:
        import bitsandbytes as bnb

        optimizer = bnb.optim.AdamW8bit(groups, lr=args.lr)
    total = len(train_dl) * args.epochs
    lr_scheduler = get_scheduler(
        "linear", optimizer, num_warmup_steps=int(0.06 * total), num_training_steps=total
    )
    model, optimizer, train_dl, eval_dl, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, lr_scheduler
    )

    step_seconds = []
    for _epoch in range(args.epochs):
        model.train()
        last = time.perf_counter()
        for batch in train_dl:
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            now = time.perf_counter()
            step_seconds.append(now - last)
            last = now
        model.eval()
        preds, refs = [], []
        for batch in eval_dl:
            with torch.no_grad():
                logits = model(**batch).logits
            p, r = accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"]))
            preds.append(p)
            refs.append(r)
        y_pred, y_true = torch.cat(preds).numpy(), torch.cat(refs).numpy()
        accuracy = accuracy_score(y_true, y_pred)
        f1 = f1_score(y_true, y_pred)
        print(f"epoch {_epoch + 1}: loss {loss.item():.4f} accuracy {accuracy:.4f} f1 {f1:.4f}")

    result = {
        "seconds_per_step": statistics.median(step_seconds[1:]),
        "global_steps": len(step_seconds),
        "peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "eval": {"accuracy": float(accuracy), "f1": float(f1)},
    }
    with open(args.out, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
