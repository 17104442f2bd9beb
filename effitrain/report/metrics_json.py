"""The ``--metrics-json`` file: a run's metrics as one JSON object."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from effitrain.errors import EffitrainError


def write_metrics_json(path: str | Path, metrics: dict[str, Any]) -> None:
    """Write the run's metrics as one JSON object (atomically: no half-written file)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(metrics, indent=2) + "\n")
        tmp.replace(path)
    except OSError as exc:
        raise EffitrainError(f"cannot write --metrics-json {path}: {exc.strerror}") from exc
