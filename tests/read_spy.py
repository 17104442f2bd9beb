"""``effitrain`` with every safetensors file it opens recorded, per rank: a test harness.

    accelerate launch ... tests/read_spy.py train ...     (READ_SPY_DIR=<folder> in the env)

Each ``safetensors.safe_open`` call (what transformers' ``from_pretrained`` and
``safetensors.torch.load_file`` read weights through) appends ``{"tag", "path"}`` to
``<folder>/reads-rank<RANK>.jsonl`` before the file is opened; ``READ_SPY_TAG`` names the run.
Installed before anything imports safetensors' ``safe_open``; otherwise this is ``python -m
effitrain``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def install(folder: str | Path) -> None:
    """Record every ``safetensors.safe_open`` of this process under ``folder``."""
    import safetensors

    opened = safetensors.safe_open
    log = Path(folder) / f"reads-rank{os.environ.get('RANK', '0')}.jsonl"

    def safe_open(filename, *args, **kwargs):  # type: ignore[no-untyped-def]
        entry = {"tag": os.environ.get("READ_SPY_TAG", ""), "path": str(filename)}
        with log.open("a") as handle:
            handle.write(json.dumps(entry) + "\n")
        return opened(filename, *args, **kwargs)

    safetensors.safe_open = safe_open


def reads(folder: str | Path, rank: int, tag: str = "") -> list[str]:
    """The files rank ``rank`` opened (in run ``tag``)."""
    log = Path(folder) / f"reads-rank{rank}.jsonl"
    entries = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return [entry["path"] for entry in entries if entry["tag"] == tag]


if __name__ == "__main__":
    import runpy
    import sys

    install(os.environ["READ_SPY_DIR"])
    sys.argv[0] = "effitrain"
    runpy.run_module("effitrain", run_name="__main__", alter_sys=True)
