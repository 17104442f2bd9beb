"""``python -m effitrain ARGS`` in this process, then the torch thread counts added to the run's
metrics JSON: the Trainer's side records its own, so the benchmark can check that both sides
used the same threads (the metrics JSON does not have them).

    python -m benchmarks.vs_trainer.effitrain_child train --quiet ... --metrics-json m.json
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    metrics = Path(argv[argv.index("--metrics-json") + 1])
    sys.argv = ["effitrain", *argv]
    try:
        runpy.run_module("effitrain", run_name="__main__", alter_sys=True)
    finally:
        torch = sys.modules.get("torch")
        if torch is not None and metrics.exists():
            data = json.loads(metrics.read_text())
            data["torch_threads"] = torch.get_num_threads()
            data["interop_threads"] = torch.get_num_interop_threads()
            metrics.write_text(json.dumps(data))


if __name__ == "__main__":
    main(sys.argv[1:])
