"""Benchmark: effitrain's loop against a minimal plain Accelerate loop (scripts/plain_loop.py).

Both train the same model on the same data with the same batch size, optimizer and lr, in fresh
processes, alternating (A B A B ...) so machine noise hits both alike. Reported: the median over
runs of each run's median time per optimizer step (first step excluded), the median peak RSS, and
the ratios effitrain / plain. Targets: time ratio <= 1.03, peak-memory ratio <= 1.05.

    python scripts/bench.py --repeats 5 --optim adamw --epochs 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str], out: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"benchmark run failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--optim", default="adamw")
    parser.add_argument("--lr", type=float, default=None, help="default: effitrain's for --optim")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from effitrain.optim import get_spec

    lr = args.lr if args.lr is not None else get_spec(args.optim).scratch.lr
    common = [
        "--optim",
        args.optim,
        "--lr",
        str(lr),
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--max-length",
        str(args.max_length),
    ]
    results: dict[str, list[dict]] = {"effitrain": [], "plain": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for name in ("effitrain", "plain"):
                out = Path(tmp) / f"{name}-{i}.json"
                if name == "effitrain":
                    cmd = [
                        sys.executable,
                        "-m",
                        "effitrain",
                        "train",
                        "--quiet",
                        *common,
                        "--metrics-json",
                        str(out),
                    ]
                else:
                    cmd = [
                        sys.executable,
                        str(ROOT / "scripts" / "plain_loop.py"),
                        *common,
                        "--out",
                        str(out),
                    ]
                data = run(cmd, out)
                results[name].append(data)
                print(
                    f"run {i + 1}/{args.repeats} {name:9s} {data['seconds_per_step'] * 1000:7.2f} ms/step "
                    f"peak {data['peak_memory_bytes'] / 2**20:7.1f} MiB  accuracy {data['eval']['accuracy']:.4f}",
                    flush=True,
                )

    summary = {}
    for name, runs in results.items():
        summary[name] = {
            "seconds_per_step": statistics.median(r["seconds_per_step"] for r in runs),
            "peak_memory_bytes": statistics.median(r["peak_memory_bytes"] for r in runs),
        }
    time_ratio = summary["effitrain"]["seconds_per_step"] / summary["plain"]["seconds_per_step"]
    memory_ratio = summary["effitrain"]["peak_memory_bytes"] / summary["plain"]["peak_memory_bytes"]
    print()
    print(
        f"| loop ({args.optim}, batch {args.batch_size}, {args.repeats} runs each) | median ms/step | median peak RSS |"
    )
    print("|---|---:|---:|")
    for name in ("plain", "effitrain"):
        s = summary[name]
        print(
            f"| {name} | {s['seconds_per_step'] * 1000:.2f} | {s['peak_memory_bytes'] / 2**20:.1f} MiB |"
        )
    print(
        f"| ratio effitrain / plain | {time_ratio:.3f} (target <= 1.03) | {memory_ratio:.3f} (target <= 1.05) |"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "summary": summary,
                    "time_ratio": time_ratio,
                    "memory_ratio": memory_ratio,
                    "runs": results,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
