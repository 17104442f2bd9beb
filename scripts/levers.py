"""Benchmark of the memory levers: what each one removes, measured, and what it costs in time.

The distilbert-base preset's shape (65.8M parameters, random init), batch 8 x 128 tokens, on
synthetic texts long enough to fill 128 tokens. Rows: fp32 AdamW with no levers (the baseline),
each lever alone, then all levers on together with adafactor-hf (torch's adafactor
cannot train LoRA's zero-initialised adapters, and is refused with LoRA). Every run is a fresh
``effitrain train`` process; with --repeats N the rows run in turn, N times (A B C … A B C …), so
machine noise hits every row alike. Per row: each memory part of one optimizer step (effitrain's
breakdown: parameters, gradients at their peak, optimizer state, activations at their peak, peak
tensor memory), peak RSS (CPU) or CUDA peak, median seconds per step (first step excluded; the
median over repeats), and each as a ratio to the baseline.

    python scripts/levers.py --repeats 2 --json levers.jsonl
    python scripts/levers.py --rows baseline gradient-checkpointing --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ROWS = {
    "baseline": [],
    "gradient-checkpointing": ["--gradient-checkpointing"],
    "optimizer-in-backward": ["--optimizer-in-backward"],
    "bf16-weights": ["--weights-dtype", "bf16"],
    "lora": ["--lora-rank", "8"],
    "all (adafactor-hf)": [
        "--optim",
        "adafactor-hf",
        "--gradient-checkpointing",
        "--optimizer-in-backward",
        "--weights-dtype",
        "bf16",
        "--lora-rank",
        "8",
    ],
}
"""Row name -> ``effitrain train`` options on top of the common ones (fp32 AdamW otherwise)."""

PARTS = (
    ("parameters", "parameter_bytes"),
    ("gradients", "gradient_bytes"),
    ("optimizer state", None),
    ("activations", "activation_bytes"),
    ("peak tensors", "peak_tensor_bytes"),
    ("peak RSS", "peak_memory_bytes"),
)


def write_data(folder: Path, rows: int) -> tuple[Path, Path]:
    """Texts of 200 words (so every example fills 128 tokens), two labels."""
    rng = random.Random(0)
    words = [
        "the",
        "committee",
        "approved",
        "budget",
        "report",
        "was",
        "board",
        "rejected",
        "plan",
        "a",
        "new",
    ]
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, n in (("train", rows), ("validation", 16)):
        path = folder / f"{name}.csv"
        lines = ["text,label"]
        for _ in range(n):
            lines.append(f"{' '.join(rng.choices(words, k=200))},{rng.randint(0, 1)}")
        path.write_text("\n".join(lines) + "\n")
        paths.append(path)
    return paths[0], paths[1]


def run(name: str, options: list[str], common: list[str], tmp: Path, index: int) -> dict:
    out = tmp / f"{index}.json"
    cmd = [sys.executable, "-m", "effitrain", "train", "--quiet", *common, *options]
    cmd += ["--metrics-json", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"{name}: run failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    data = json.loads(out.read_text())
    data["optimizer_state_bytes"] = data["optimizer_state"]["bytes"]
    return data


def summarize(name: str, runs: list[dict]) -> dict:
    """Bytes are the same in every repeat (checked); time is the median over repeats."""
    first = runs[0]
    row = {"row": name, "levers": first["levers"], "optimizer": first["optimizer"]}
    for _, key in PARTS:
        key = key or "optimizer_state_bytes"
        values = [r[key] for r in runs]
        row[key] = statistics.median(values) if key == "peak_memory_bytes" else values[0]
    row["seconds_per_step"] = statistics.median(r["seconds_per_step"] for r in runs)
    row["eval_accuracy"] = first["eval"]["accuracy"]
    row["peak_memory_kind"] = first["peak_memory_kind"]
    row["repeats"] = len(runs)
    return row


def table(rows: list[dict]) -> str:
    base = rows[0]
    mib = 2**20
    head = "| row | " + " | ".join(label for label, _ in PARTS) + " | s/step |"
    lines = [head, "|---" * (len(PARTS) + 2) + "|"]
    for row in rows:
        cells = []
        for _, key in (*PARTS, (None, "seconds_per_step")):
            key = key or "optimizer_state_bytes"
            value, ref = row[key], base[key]
            shown = f"{value:.2f}" if key == "seconds_per_step" else f"{value / mib:,.1f} MiB"
            ratio = f" ({value / ref:.2f}×)" if ref and row is not base else ""
            cells.append(shown + ratio)
        lines.append(f"| {row['row']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--model", default="distilbert-base")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--json", type=Path, help="append one JSON line per row here")
    parser.add_argument("extra", nargs="*", help="more `effitrain train` options, after --")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        train, validation = write_data(tmp / "data", rows=args.batch_size * args.steps)
        common = [
            "--model", args.model,
            "--train-file", str(train),
            "--validation-file", str(validation),
            "--batch-size", str(args.batch_size),
            "--max-length", str(args.max_length),
            "--max-steps", str(args.steps),
            "--log-every", "1",
            *args.extra,
        ]  # fmt: skip
        runs: dict[str, list[dict]] = {name: [] for name in args.rows}
        index = 0
        for repeat in range(args.repeats):
            for name in args.rows:
                index += 1
                data = run(name, ROWS[name], common, tmp, index)
                runs[name].append(data)
                print(
                    f"[{repeat + 1}/{args.repeats}] {name}: peak tensors "
                    f"{data['peak_tensor_bytes'] / 2**20:,.1f} MiB, "
                    f"{data['seconds_per_step']:.2f} s/step",
                    file=sys.stderr,
                )
    rows = [summarize(name, runs[name]) for name in args.rows]
    if args.json:
        with args.json.open("a") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
