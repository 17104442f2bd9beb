"""``effitrain inspect-state`` on a distilbert-base-sized AdamW checkpoint (~500 MB): time and memory.

Builds the distilbert-base preset (65.8M parameters, random init, offline), takes one AdamW
step, saves ``optimizer.state_dict()`` with torch.save, then runs ``effitrain inspect-state FILE
--json`` in fresh processes and reports its wall time and peak RSS (the kernel's count for that
process), next to the peak RSS of a process that only imports what inspect-state imports. The
file is read with mmap, so the difference should stay far below the file's size.

    python -m benchmarks.inspect_state.run --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks import common

TOPIC = common.Topic.of(__file__)
SMOKE_ARGS = ["--model", "tiny", "--runs", "1"]
BARE_IMPORT = "import torch, effitrain.inspection, effitrain.cli, rich"


def build_checkpoint(folder: Path, model_name: str) -> Path:
    """One AdamW step on the preset; returns the saved optimizer file."""
    import torch

    from effitrain.models import load_model, load_tokenizer

    model = load_model(model_name, ["a", "b"], load_tokenizer(model_name))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = {
        "input_ids": torch.randint(0, min(1000, model.config.vocab_size), (2, 16)),
        "attention_mask": torch.ones(2, 16, dtype=torch.long),
        "labels": torch.tensor([0, 1]),
    }
    model(**batch).loss.backward()
    optimizer.step()
    path = folder / "optimizer.pt"
    torch.save(optimizer.state_dict(), path)
    return path


def measure(args: argparse.Namespace, device: str) -> common.Run:
    from effitrain.comparison import run_process

    folder = args.work_dir / "checkpoint"
    folder.mkdir(parents=True, exist_ok=True)
    path = build_checkpoint(folder, args.model)
    env = {**os.environ, **common.device_env(device)}
    _, bare = run_process([sys.executable, "-c", BARE_IMPORT], env)
    command = [sys.executable, "-m", "effitrain", "inspect-state", str(path), "--json"]
    runs = []
    for _ in range(args.runs):
        proc, usage = run_process(command, env)
        if proc.returncode != 0:
            raise SystemExit(f"error: inspect-state failed: {proc.stderr.strip()[-500:]}")
        runs.append((usage, json.loads(proc.stdout)))
    report = runs[0][1]
    peak = max(usage["peak_rss_bytes"] for usage, _ in runs)
    row = {
        "file_bytes": path.stat().st_size,
        "state_elements": report["optimizer_state"]["elements"],
        "state_bytes": report["optimizer_state"]["bytes"],
        "wall_seconds": min(usage["wall_seconds"] for usage, _ in runs),
        "wall_seconds_runs": [usage["wall_seconds"] for usage, _ in runs],
        "peak_rss_bytes": peak,
        "bare_import_peak_rss_bytes": bare["peak_rss_bytes"],
        "extra_bytes": peak - bare["peak_rss_bytes"],
    }
    if not args.keep:
        path.unlink()
    return {
        "name": args.name or "cpu",
        "title": f"an AdamW checkpoint of {args.model}, best of {args.runs}",
        "settings": {"model": args.model, "runs": args.runs},
        "rows": [row],
    }


def render(run: common.Run) -> str:
    (row,) = run["rows"]
    lines = [
        ("checkpoint file", common.shown(row.get("file_bytes"), common.mib)),
        ("optimizer state", common.shown(row.get("state_bytes"), common.mib)),
        ("wall time of `effitrain inspect-state FILE --json`", common.shown(row.get("wall_seconds"), "{:.2f} s".format)),
        ("peak RSS", common.shown(row.get("peak_rss_bytes"), common.mib)),
        ("peak RSS of the bare imports", common.shown(row.get("bare_import_peak_rss_bytes"), common.mib)),
        ("extra for reading the file", common.shown(row.get("extra_bytes"), common.mib)),
    ]  # fmt: skip
    columns = [
        common.Column("what", lambda line: line[0], right=False),
        common.Column("measured", lambda line: line[1]),
    ]
    return common.markdown_table(columns, [line for line in lines if line[1] != "–"])


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(TOPIC, __doc__)
    parser.add_argument(
        "--model", default="distilbert-base", help="the preset whose state is saved"
    )
    parser.add_argument("--runs", type=int, default=3, help="inspect-state runs (best wall time)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint in --work-dir")
    args = parser.parse_args(argv)
    return common.main(TOPIC, args, argv, measure, render)


if __name__ == "__main__":
    sys.exit(main())
