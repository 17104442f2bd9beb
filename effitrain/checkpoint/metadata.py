"""Checkpoint metadata (``effitrain.json``, readable without torch) and finding checkpoints:
what was saved, whether a folder is complete, which is the newest."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from effitrain.errors import EffitrainError
from effitrain.memory.ledger import unwrap_prepared

if TYPE_CHECKING:
    from effitrain.config import TrainConfig

METADATA_FILE = "effitrain.json"
METADATA_FORMAT = "effitrain-checkpoint"
METADATA_VERSION = 1
"""Checkpoints of version 1 without ``counters`` and ``schedule`` (older effitrains) are still
read: what they lack is not checked."""
CHECKPOINT_PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
FINAL_DIR = "final"
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


def _json_value(value: Any) -> Any:
    """Hyperparameters as JSON: tuples become lists, tensors numbers, unknown objects strings."""
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if hasattr(value, "numel") and hasattr(value, "tolist") and value.numel() == 1:
        return _json_value(value.tolist())  # a 0-d tensor lr (capturable optimizers)
    return str(value)


def param_group_hyperparameters(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Param groups as JSON: every hyperparameter, and ``params`` replaced by their count."""
    groups = []
    for group in param_groups:
        entry = {k: _json_value(v) for k, v in group.items() if k != "params"}
        entry["params"] = len(group.get("params", []))
        groups.append(entry)
    return groups


def library_versions() -> dict[str, str]:
    """Versions of the libraries that shape a checkpoint (installed ones only)."""
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in ("effitrain", "torch", "transformers", "accelerate", "bitsandbytes", "peft"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            continue
    return versions


def build_metadata(
    *,
    config: TrainConfig,
    progress: dict[str, Any],
    optimizer_name: str,
    optimizer_class: str,
    param_groups: list[dict[str, Any]],
    param_names: list[str],
    parameter_shapes: dict[str, list[int]],
    world_size: int,
    mixed_precision: str,
    counters: dict[str, int | None] | None = None,
    schedule: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON written beside the tensors (``files`` is added when the save is complete).

    ``progress`` is the loop's ``TrainingProgress.state_dict()`` (its keys go at the top level);
    ``param_names`` are the optimizer's parameters in state-dict order (ids 0, 1, …), so
    ``inspect-state`` can name them; ``parameter_shapes`` are the model's, checked on resume;
    ``counters`` the steps the scheduler and the optimizer count themselves
    (:func:`step_counters`) and ``schedule`` the lr schedule the run used (lr, scheduler,
    warmup and total steps), both checked on resume.
    """
    return {
        "format": METADATA_FORMAT,
        "version": METADATA_VERSION,
        **progress,
        "optimizer": {
            "name": optimizer_name,
            "class": optimizer_class,
            "param_groups": param_group_hyperparameters(param_groups),
            "param_names": param_names,
        },
        "parameters": parameter_shapes,
        "world_size": world_size,
        "mixed_precision": mixed_precision,
        "counters": counters or {},
        "schedule": schedule or {},
        "config": config.to_dict(),
        "versions": library_versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def read_metadata(checkpoint: str | Path) -> dict[str, Any]:
    """Read and check a checkpoint's ``effitrain.json``, and that every listed file is whole.

    Raises:
        EffitrainError: missing folder, not an effitrain checkpoint, corrupt JSON, a value of
            the wrong type (naming the key), or a file
            missing or of the wrong size (an incomplete or truncated checkpoint).
    """
    path = Path(checkpoint)
    if not path.exists():
        raise EffitrainError(f"checkpoint not found: {path}")
    if not path.is_dir():
        raise EffitrainError(f"{path} is not a checkpoint folder (expected DIR/checkpoint-N)")
    meta_path = path / METADATA_FILE
    if not meta_path.is_file():
        raise EffitrainError(
            f"{path} is not a complete effitrain checkpoint (no {METADATA_FILE}); "
            "pick another one or use --resume latest"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise EffitrainError(
            f"{meta_path} is corrupt ({type(exc).__name__}); pick another checkpoint"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != METADATA_FORMAT:
        raise EffitrainError(f"{meta_path} is not effitrain checkpoint metadata")
    if meta.get("version") != METADATA_VERSION:
        raise EffitrainError(
            f"{path} has checkpoint format version {meta.get('version')}; this effitrain reads "
            f"version {METADATA_VERSION}"
        )
    problem = _type_problem(meta)
    if problem:
        raise EffitrainError(f"{meta_path}: {problem} (edited?); pick another checkpoint")
    problem = _file_problem(path, meta.get("files"))
    if problem:
        raise EffitrainError(f"checkpoint {path} is incomplete or corrupt: {problem}")
    return meta


_COUNT = (int,)
_NUMBER = (int, float)
METADATA_TYPES: dict[str, tuple[type, ...]] = {
    "global_step": _COUNT,
    "epoch": _COUNT,
    "step_in_epoch": _COUNT,
    "total_loss": _NUMBER,
    "total_batches": _NUMBER,
    "total_samples": _NUMBER,
    "total_tokens": _NUMBER,
    "gradient_bytes": _COUNT,
    "eval_history": (list,),
    "loss_history": (list,),
    "step_memory": (dict,),
    "window": (list,),
    "optimizer": (dict,),
    "parameters": (dict,),
    "world_size": _COUNT,
    "mixed_precision": (str,),
    "counters": (dict,),
    "schedule": (dict,),
    "schedule.lr": _NUMBER,
    "schedule.scheduler": (str,),
    "schedule.warmup_steps": _COUNT,
    "schedule.total_steps": _COUNT,
    "config": (dict,),
    "files": (dict,),
    "optimizer.name": (str,),
    "optimizer.class": (str,),
    "optimizer.param_groups": (list,),
    "optimizer.param_names": (list,),
}
"""The JSON type of each key that a resume reads (a key left out is checked where it is read;
``a.b``: key ``b`` of the object at ``a``)."""
METADATA_ITEM_TYPES: dict[str, tuple[type, ...]] = {"window": _NUMBER}
"""The JSON type of every item of these lists (the running sums a resume adds to)."""
_JSON_NAMES = {int: "an integer", float: "a number", list: "a list", dict: "an object"}


def _type_problem(meta: dict[str, Any]) -> str | None:
    """What is wrong with the first key of ``effitrain.json`` whose value has the wrong JSON
    type (None: none)."""
    for key, types in METADATA_TYPES.items():
        *parents, name = key.split(".")
        holder = meta
        for parent in parents:  # an object already checked above, or absent
            holder = holder.get(parent) or {}
        value = holder.get(name)
        if name in holder and (isinstance(value, bool) or not isinstance(value, types)):
            wanted = _JSON_NAMES.get(types[-1], "a string")
            return f"{key} is {json.dumps(value)[:40]}, not {wanted}"
    for key, types in METADATA_ITEM_TYPES.items():
        items = meta.get(key) or []
        if any(isinstance(item, bool) or not isinstance(item, types) for item in items):
            return f"{key} is {json.dumps(items)[:40]}, not a list of numbers"
    return None


def _file_problem(path: Path, files: Any) -> str | None:
    """Why the files listed in the metadata do not match the folder (None when they do)."""
    if not isinstance(files, dict) or not files:
        return f"{METADATA_FILE} lists no files"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        actual = file.stat().st_size
        if actual != size:
            return f"{name} has {actual:,} bytes, expected {size:,} (truncated or overwritten)"
    return None


def step_counters(optimizer: Any, lr_scheduler: Any) -> dict[str, int | None]:
    """The steps the scheduler and the optimizer have counted themselves (Accelerate's wrappers
    looked through): ``scheduler_steps`` (the scheduler's ``last_epoch``: once per process per
    optimizer step) and ``optimizer_steps`` (the largest per-parameter ``step`` in its state;
    None for an optimizer that keeps none, SGD's momentum)."""
    scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)
    inner = unwrap_prepared(optimizer)
    steps = [
        float(entry["step"])
        for entry in getattr(inner, "state", {}).values()
        if isinstance(entry, dict) and "step" in entry
    ]
    return {
        "scheduler_steps": int(getattr(scheduler, "last_epoch", 0)),
        "optimizer_steps": int(max(steps)) if steps else None,
    }


def checkpoint_step(path: Path) -> int | None:
    """The global step in a ``checkpoint-<step>`` folder name, else None."""
    match = _CHECKPOINT_NAME.match(path.name)
    return int(match.group(1)) if match else None


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """``checkpoint-<step>`` folders in ``output_dir``, oldest first (complete or not)."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        step = checkpoint_step(child)
        if step is not None and child.is_dir():
            found.append((step, child))
    return sorted(found)


def incomplete(path: Path) -> str | None:
    """Why a checkpoint folder cannot be resumed from (its metadata or a file), else None."""
    try:
        read_metadata(path)
    except EffitrainError as exc:
        return str(exc)
    return None


def is_complete(path: Path) -> bool:
    """A checkpoint whose metadata reads and whose files all have their recorded sizes."""
    return incomplete(path) is None


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``output_dir``, oldest first."""
    return [path for _, path in list_checkpoints(output_dir) if is_complete(path)]


def find_latest(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint in ``output_dir`` (incomplete ones and leftovers skipped)."""
    return latest(output_dir)[0]


def latest(output_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint in ``output_dir`` (None: none), and why each newer one
    was skipped, one line each, naming it (a resume says so: no step is lost unsaid)."""
    skipped = []
    for _, path in reversed(list_checkpoints(output_dir)):
        problem = incomplete(path)
        if problem is None:
            return path, skipped
        skipped.append(problem)
    return None, skipped
