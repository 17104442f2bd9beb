"""Benchmark `effitrain inspect-state` on a distilbert-base-sized AdamW checkpoint (~500 MB).

Builds the `distilbert-base` preset (65.8M parameters, random init, offline), takes one AdamW
step, saves `optimizer.state_dict()` with torch.save to a temporary folder, then runs
`effitrain inspect-state FILE --json` in a subprocess and reports its wall time and peak RSS
(``getrusage(RUSAGE_CHILDREN)``), next to the peak RSS of a subprocess that only imports what
inspect-state imports (the baseline). Reading the file with mmap means the difference stays far
below the file size.

    python scripts/bench_inspect_state.py [--keep DIR] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
MiB = 1024 * 1024


def build_checkpoint(folder: Path) -> Path:
    """One AdamW step on the distilbert-base preset; returns the saved optimizer file."""
    import torch

    from effitrain.models import load_model, load_tokenizer

    model = load_model("distilbert-base", ["a", "b"], load_tokenizer("distilbert-base"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = {
        "input_ids": torch.randint(0, 1000, (2, 16)),
        "attention_mask": torch.ones(2, 16, dtype=torch.long),
        "labels": torch.tensor([0, 1]),
    }
    model(**batch).loss.backward()
    optimizer.step()
    path = folder / "optimizer.pt"
    torch.save(optimizer.state_dict(), path)
    return path


def run_child(args: list[str]) -> tuple[float, int, str]:
    """Run a child process; return (wall seconds, its peak RSS in bytes, stdout).

    ``RUSAGE_CHILDREN`` reports the largest peak among waited-for children, so each measurement
    runs in its own short-lived parent (this function is called through ``_measure``).
    """
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, env=ENV)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(args)}\n{proc.stderr}")
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, peak_kib * 1024, proc.stdout


def _measure(args: list[str]) -> dict:
    """Measure ``args`` from a fresh parent, so RUSAGE_CHILDREN sees only that child."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); "
        "from bench_inspect_state import run_child; "
        "wall, peak, out = run_child(sys.argv[2:]); "
        "print(json.dumps({'wall': wall, 'peak': peak, 'stdout': out}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent), *args],
        capture_output=True,
        text=True,
        env=ENV,
    )
    if proc.returncode != 0:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="build the checkpoint here and keep it")
    parser.add_argument("--runs", type=int, default=3, help="inspect-state runs (best wall time)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        path = build_checkpoint(folder)
        size = path.stat().st_size
        command = [sys.executable, "-m", "effitrain", "inspect-state", str(path), "--json"]
        baseline = _measure(
            [sys.executable, "-c", "import torch, effitrain.memory.inspection, effitrain.cli, rich"]
        )
        runs = [_measure(command) for _ in range(args.runs)]
        report = json.loads(runs[0]["stdout"])
        best = min(runs, key=lambda r: r["wall"])
        peak = max(r["peak"] for r in runs)
        print(f"checkpoint       {path} ({size / MiB:.1f} MiB)")
        print(
            f"state measured   {report['optimizer_state']['elements']:,} elements, "
            f"{report['optimizer_state']['bytes'] / MiB:.1f} MiB"
        )
        print(f"command          effitrain inspect-state {path.name} --json")
        walls = ", ".join(f"{r['wall']:.2f}" for r in runs)
        print(f"wall time        {best['wall']:.2f} s (best of {len(runs)}; all: {walls})")
        print(f"peak RSS         {peak / MiB:.1f} MiB")
        print(
            f"baseline RSS     {baseline['peak'] / MiB:.1f} MiB (python + torch + effitrain imports)"
        )
        extra = peak - baseline["peak"]
        print(f"extra for file   {extra / MiB:.1f} MiB ({extra / size:.1%} of the file)")


if __name__ == "__main__":
    main()
