"""Safe reading of optimizer state from checkpoint files, and what is inside it.

``effitrain inspect-state`` is often pointed at files from elsewhere, so loading follows strict
rules:

- only ``torch.save`` zip archives are read; plain pickles (``custom_checkpoint_*.pkl``, legacy
  ``torch.save`` files) are refused, because unpickling them can run code;
- ``torch.serialization.get_unsafe_globals_in_checkpoint`` lists what the pickle inside would
  import *before* anything is loaded; any global outside torch's weights-only allowlist is
  refused, and there is no fallback to a full unpickle;
- ``torch.load(..., weights_only=True, mmap=True)``, explicitly: ``weights_only`` because an
  environment variable can flip the default, ``mmap`` so a large file is measured without being
  read into memory (sizes come from storage metadata; the data pages are never touched).

Pure data: nothing here prints. Accounting reuses :func:`effitrain.memory.ledger.optimizer_state_ledger`.
"""

from __future__ import annotations

import json
import pickle
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from effitrain.checkpoint import (
    METADATA_FILE,
    list_checkpoints,
    param_group_hyperparameters,
    read_metadata,
)
from effitrain.errors import EffitrainError, first_line
from effitrain.memory import ledger
from effitrain.results import ParamState, StateReport

ZIP_MAGIC = b"PK\x03\x04"
PICKLE_PROTO = b"\x80"
_ACCELERATE_OPTIMIZER = re.compile(r"^optimizer(?:_(\d+))?\.bin$")


# --------------------------------------------------------------------------------------------
# Loading one file safely
# --------------------------------------------------------------------------------------------


def _check_container(path: Path) -> None:
    """Refuse what is not a complete torch.save zip archive, before torch sees it."""
    if not path.exists():
        raise EffitrainError(f"no such file or folder: {path}")
    size = path.stat().st_size
    if size == 0:
        raise EffitrainError(
            f"{path} is empty (0 bytes): not a checkpoint, or a save that never finished"
        )
    with path.open("rb") as handle:
        head = handle.read(4)
    if head != ZIP_MAGIC:
        if head.startswith(PICKLE_PROTO):
            raise EffitrainError(
                f"{path} is a plain pickle, refused: unpickling it could run code "
                "(effitrain reads torch.save zip files only)"
            )
        raise EffitrainError(f"{path} is not a PyTorch checkpoint (not a torch.save zip archive)")
    if not zipfile.is_zipfile(path):
        raise EffitrainError(
            f"{path} is truncated or corrupt (incomplete zip archive, {size:,} bytes)"
        )


def safe_load(path: str | Path) -> Any:
    """Load a ``torch.save`` file without ever executing code from it.

    Raises:
        EffitrainError: missing, empty, truncated, not a torch checkpoint, a plain pickle, or
            a pickle that would import anything outside torch's weights-only allowlist.
    """
    path = Path(path)
    _check_container(path)
    import torch

    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as exc:
        raise EffitrainError(
            f"{path} is not a readable PyTorch checkpoint ({first_line(exc)})"
        ) from None
    allowed = _torchao_state_classes(unsafe, path)
    unsafe = [name for name in unsafe if name not in {_full_name(c) for c in allowed}]
    if unsafe:
        shown = ", ".join(unsafe[:5]) + (", ..." if len(unsafe) > 5 else "")
        raise EffitrainError(
            f"{path} refused: loading it would import {shown}, which could run code; "
            "effitrain never unpickles with code execution"
        )
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise EffitrainError(
            f"{path} refused by the weights-only loader: {first_line(exc)}"
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError) as exc:
        raise EffitrainError(f"{path} is truncated or corrupt ({first_line(exc)})") from None


def _full_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _torchao_state_classes(names: list[str], path: Path) -> list[type]:
    """torchao's optimizer-state tensor subclasses among ``names``: the only classes outside
    torch's allowlist that effitrain lets the weights-only loader build (plain tensor
    containers: codes, scales, a lookup table). torchao is imported only when it is needed.

    Raises:
        EffitrainError: the checkpoint holds torchao state and torchao is not installed.
    """
    from effitrain.optim.low_bit import STATE_CLASSES, state_classes

    if not any(name in STATE_CLASSES for name in names):
        return []
    classes = [c for c in state_classes() if _full_name(c) in names]
    if not classes:
        raise EffitrainError(
            f"{path} holds torchao's low-bit optimizer state; reading it needs torchao: "
            "pip install 'effitrain[ao]'  (torchao)"
        )
    return classes


# --------------------------------------------------------------------------------------------
# Which files, which format
# --------------------------------------------------------------------------------------------


@dataclass
class Source:
    """Where the optimizer state comes from."""

    format: str
    files: list[Path]
    step: int | None = None
    metadata: dict[str, Any] | None = None


def _accelerate_files(folder: Path) -> list[Path]:
    found = []
    for child in folder.iterdir():
        match = _ACCELERATE_OPTIMIZER.match(child.name)
        if match and child.is_file():
            found.append((int(match.group(1) or 0), child))
    return [path for _, path in sorted(found)]


def _trainer_step(folder: Path) -> int | None:
    state_file = folder / "trainer_state.json"
    try:
        step = json.loads(state_file.read_text()).get("global_step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def _folder_source(folder: Path) -> Source | None:
    if (folder / METADATA_FILE).exists():
        meta = read_metadata(folder)  # checks every file's size: a truncated one is named
        files = _accelerate_files(folder)
        if not files:
            _refuse_sharded(folder)
        return Source("effitrain checkpoint", files, meta.get("global_step"), meta)
    files = _accelerate_files(folder)
    if files:
        return Source("accelerate save_state folder", files)
    if (folder / "optimizer.pt").is_file():
        return Source(
            "transformers Trainer checkpoint", [folder / "optimizer.pt"], _trainer_step(folder)
        )
    return None


def _refuse_sharded(folder: Path) -> None:
    """One line for torch.distributed.checkpoint's folders (FSDP's SHARDED_STATE_DICT)."""
    sharded = any(folder.glob("*.distcp")) or any(
        child.is_dir() and child.name.startswith("optimizer") and any(child.glob("*.distcp"))
        for child in folder.iterdir()
    )
    if sharded:
        raise EffitrainError(
            f"{folder} holds sharded optimizer state (torch.distributed.checkpoint, FSDP's "
            "SHARDED_STATE_DICT), which inspect-state cannot read safely (its .metadata is a "
            "pickle); save with fsdp_state_dict_type: FULL_STATE_DICT for an optimizer.bin it reads"
        )


def find_source(path: str | Path) -> Source:
    """Decide what ``path`` is and which files hold optimizer state.

    Raises:
        EffitrainError: nothing with optimizer state at ``path``.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise EffitrainError(f"no such file or folder: {path}")
    if path.is_file():
        return Source("torch.save file", [path])
    if not path.is_dir():  # a FIFO, a socket, a device: reading it could block or mean nothing
        raise EffitrainError(f"{path} is neither a file nor a folder: not a checkpoint")
    source = _folder_source(path)
    if source is not None:
        return source
    for _, child in reversed(list_checkpoints(path)):
        try:
            source = _folder_source(child)
        except EffitrainError:
            continue  # an incomplete checkpoint: look at the one before
        if source is not None:
            source.format += f" ({child.name}, the newest in {path})"
            return source
    for folder in [path, *(child for _, child in reversed(list_checkpoints(path)))][:2]:
        _refuse_sharded(folder)
    raise EffitrainError(
        f"no optimizer state in {path}: expected {METADATA_FILE}, optimizer.bin (accelerate), "
        "optimizer.pt (Trainer) or checkpoint-* folders"
    )


def _is_state_dict(obj: Any) -> bool:
    return (
        isinstance(obj, Mapping) and isinstance(obj.get("state"), Mapping) and "param_groups" in obj
    )


def extract_state_dict(obj: Any, path: Path) -> tuple[dict[str, Any], str | None]:
    """The optimizer ``state_dict`` in a loaded file: the object itself or one nested in a dict.

    Returns the state dict and the key path it was found under (None at the top level).

    Raises:
        EffitrainError: no optimizer state dict in the file.
    """
    if _is_state_dict(obj):
        return obj, None
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            if _is_state_dict(value):
                return value, str(key)
        for key, value in obj.items():
            if isinstance(value, Mapping):
                for inner_key, inner in value.items():
                    if _is_state_dict(inner):
                        return inner, f"{key}.{inner_key}"
        keys = ", ".join(str(k) for k in list(obj)[:8])
        raise EffitrainError(f"{path} holds no optimizer state_dict (top-level keys: {keys})")
    raise EffitrainError(f"{path} holds a {type(obj).__name__}, not an optimizer state_dict")


# --------------------------------------------------------------------------------------------
# What each parameter's state says
# --------------------------------------------------------------------------------------------


def _flat_entry(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter's state with bitsandbytes' nested quantization state lifted to the top."""
    flat = {}
    for key, value in entry.items():
        if key == ledger.BNB_QUANT_STATE_KEY:
            if isinstance(value, (list, tuple)) and value and isinstance(value[0], Mapping):
                value = value[0]
            if isinstance(value, Mapping):
                flat.update(value)
        else:
            flat[str(key)] = value
    return flat


def _shape(value: Any) -> list[int] | None:
    shape = getattr(value, "shape", None)
    return [int(d) for d in shape] if shape is not None else None


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def infer_parameter(entry: Mapping[str, Any]) -> tuple[list[int] | None, str]:
    """The parameter's shape and how its second moment is stored, from its state alone.

    - ``exp_avg`` / ``exp_avg_sq`` / ``momentum_buffer`` / ``variance`` / bitsandbytes ``state1``:
      these have the parameter's shape;
    - torch Adafactor ``row_var`` (…, m, 1) and ``col_var`` (…, 1, n): the parameter is (…, m, n);
    - transformers Adafactor ``exp_avg_sq_row`` (…, m) and ``exp_avg_sq_col`` (…, n): (…, m, n);
    - Adam-mini ``m`` (see ``_adam_mini_parameter``), with ``vmean`` per head, per row or one
      value, or a full ``v``.
      CAME too (with ``exp_avg_res_row/col``, factored alike); schedule-free ``z``: the shape.

    The second moment is ``factored`` (row + column statistics), ``full`` (one value per
    element), ``8-bit`` (bitsandbytes' quantized ``state2``), ``8-bit|4-bit|fp8 (torchao)`` (its
    state subclasses, whose shape is the parameter's) or ``-`` (none kept).
    """
    flat = _flat_entry(entry)
    row, col = flat.get("row_var"), flat.get("col_var")
    if row is not None and col is not None:
        shape = _shape(row)[:-1] + _shape(col)[-1:]
        return shape, f"factored ({_shape(row)[-2]:,} + {_shape(col)[-1]:,} values)"
    row, col = flat.get("exp_avg_sq_row"), flat.get("exp_avg_sq_col")
    if row is not None and col is not None:
        shape = _shape(row) + _shape(col)[-1:]
        kind = f"factored ({_shape(row)[-1]:,} + {_shape(col)[-1]:,} values)"
        if "exp_avg_res_row" in flat:  # CAME: its confidence term is factored the same way
            kind = f"factored ({_shape(row)[-1]:,} + {_shape(col)[-1]:,} values, twice)"
        return shape, kind
    if "m" in flat and ("vmean" in flat or "v" in flat):  # Adam-mini (v: its Adam blocks)
        return _adam_mini_parameter(flat)
    projector = flat.get("projector")
    ortho = _shape(projector.get("ortho_matrix")) if isinstance(projector, Mapping) else None
    low = _shape(flat.get("exp_avg"))
    if ortho is not None and low is not None and len(ortho) == len(low) == 2:
        # GaLore/APOLLO 'std': a tall (m, n) gradient is projected on the right,
        # G (m, n) @ P.T (n, r) = (m, r); a wide one on the left, P.T (r, m) @ G = (r, n).
        if ortho[0] == low[1] and low[0] >= ortho[1]:
            shape = [low[0], ortho[1]]
        else:
            shape = [ortho[0], low[1]]
        return shape, f"projected (rank {min(ortho)}: {_numel(low):,} values)"
    for key in ("exp_avg", "exp_avg_sq", "variance", "state1", "momentum_buffer", "z"):
        shape = _shape(flat.get(key))
        if shape is not None:
            break
    second = flat.get("exp_avg_sq", flat.get("variance", flat.get("state2")))
    if second is None:
        kind = "-"
    elif _torchao_kind(second):
        kind = f"{_torchao_kind(second)} (torchao)"
    elif str(getattr(second, "dtype", "")) == "torch.uint8":
        kind = "8-bit"
    else:
        kind = "full"
    return shape, kind


def _adam_mini_parameter(flat: Mapping[str, Any]) -> tuple[list[int] | None, str]:
    """Adam-mini's ``m`` has the parameter's shape, except for query/key weights, whose ``m`` is
    stored as (heads, head size): the shape given is then that view (same element count)."""
    if "vmean" not in flat:
        return _shape(flat["m"]), "full"
    blocks = _numel(_shape(flat["vmean"]))
    if "head_per_gpu" in flat:
        kind = f"per head ({blocks:,} values)"
    elif "neuron_per_gpu" in flat:
        kind = f"per row ({blocks:,} values)"
    else:
        kind = "one value"
    return _shape(flat["m"]), kind


def _torchao_kind(value: Any) -> str | None:
    """'8-bit', '4-bit' or 'fp8' for torchao's optimizer-state subclasses, else None."""
    from effitrain.optim.low_bit import STATE_CLASSES

    return STATE_CLASSES.get(f"{type(value).__module__}.{type(value).__qualname__}")


def infer_optimizer(state_dict: Mapping[str, Any]) -> str:
    """A best guess at the optimizer class from its state keys and hyperparameters."""
    from effitrain.optim.low_bit import OPTIMIZER_OF_STATE

    keys: set[str] = set()
    for entry in state_dict["state"].values():
        if isinstance(entry, Mapping):
            keys.update(_flat_entry(entry))
            for value in entry.values():
                if _torchao_kind(value):  # its keys are Adam's: the state's type tells
                    return OPTIMIZER_OF_STATE[type(value).__name__]
    groups = state_dict.get("param_groups") or [{}]
    if {"state1", "qmap1"} <= keys:
        return (
            "bitsandbytes 8-bit optimizer (AdamW8bit/Adam8bit)"
            if "state2" in keys
            else "bitsandbytes 8-bit optimizer (one state: Lion8bit, Momentum8bit…)"
        )
    if keys & {"row_var", "col_var", "variance"}:
        return "torch.optim.Adafactor"
    # CAME keeps Adafactor's exp_avg_sq_row/col plus a factored confidence term, and three
    # betas (1-D parameters only: no exp_avg_res_*, but still the three betas).
    if "exp_avg_res_row" in keys or ("RMS" in keys and len(groups[0].get("betas", ())) == 3):
        return "CAME (pytorch_optimizer.CAME)"
    if keys & {"exp_avg_sq_row", "exp_avg_sq_col", "RMS"}:
        return "transformers.optimization.Adafactor"
    if "projector" in keys:  # GaLore/APOLLO (optim.split.keep_projectors_in_state_dict)
        if {"seed", "scaled_grad"} & keys:
            return "apollo_torch.APOLLOAdamW (APOLLO)"
        return "pytorch_optimizer.GaLore (GaLore)"
    muon = any("ns_steps" in g for g in groups)
    if muon and {"exp_avg", "exp_avg_sq"} <= keys:
        return "torch.optim.Muon + torch.optim.AdamW (Muon + AdamW)"
    if muon:
        return "torch.optim.Muon"
    if {"exp_avg", "exp_avg_sq"} <= keys:
        decoupled = groups[0].get("decoupled_weight_decay")
        return {True: "torch.optim.AdamW", False: "torch.optim.Adam"}.get(
            decoupled, "torch.optim.Adam/AdamW"
        )
    if "momentum_buffer" in keys:
        return "torch.optim.SGD"
    if "vmean" in keys and keys & {"head_per_gpu", "neuron_per_gpu"}:
        return "adam_mini.Adam_mini"
    if {"z", "exp_avg_sq"} <= keys:
        return "schedulefree.AdamWScheduleFree"
    if keys == {"exp_avg"}:
        return "Lion (lion_pytorch.Lion)"
    if "state1" in keys:  # bitsandbytes' 32-bit one-state optimizers (tensors < 4096 elements)
        return "bitsandbytes optimizer (one state: Lion8bit, Lion, Momentum…)"
    return "unknown"


def _step_of(state_dict: Mapping[str, Any]) -> int | None:
    for entry in state_dict["state"].values():
        if isinstance(entry, Mapping) and "step" in entry:
            step = entry["step"]
            try:
                return int(step.item() if hasattr(step, "item") else step)
            except (TypeError, ValueError):
                return None
    return None


# --------------------------------------------------------------------------------------------
# The whole report
# --------------------------------------------------------------------------------------------


def _param_states(
    state_dicts: list[Mapping[str, Any]], names: list[str] | None
) -> list[ParamState]:
    rows = []
    for file_index, state_dict in enumerate(state_dicts):
        for pid, entry in state_dict["state"].items():
            if not isinstance(entry, Mapping) or not entry:
                continue
            if (
                names is not None
                and len(state_dicts) == 1
                and isinstance(pid, int)
                and pid < len(names)
            ):
                label = names[pid]
            else:
                label = f"#{pid}" if len(state_dicts) == 1 else f"#{file_index}.{pid}"
            shape, second = infer_parameter(entry)
            rows.append(
                ParamState(
                    parameter=label,
                    shape=shape,
                    elements=_numel(shape) if shape is not None else None,
                    bytes=ledger.optimizer_state_ledger({pid: entry}).bytes,
                    keys=list(_flat_entry(entry)),
                    second_moment=second,
                )
            )
    return sorted(rows, key=lambda row: row.bytes, reverse=True)


def inspect_state(path: str | Path) -> StateReport:
    """Read the optimizer state at ``path`` (safely) and measure it.

    Raises:
        EffitrainError: see :func:`find_source` and :func:`safe_load`.
    """
    source = find_source(path)
    state_dicts, where = [], []
    for file in source.files:
        state_dict, key = extract_state_dict(safe_load(file), file)
        state_dicts.append(state_dict)
        where.append(f"{file}" + (f" (key '{key}')" if key else ""))
    if not state_dicts:
        raise EffitrainError(f"no optimizer file in {path}")
    combined = {
        (i, pid): entry for i, sd in enumerate(state_dicts) for pid, entry in sd["state"].items()
    }
    state_ledger = ledger.optimizer_state_ledger(combined)
    meta = source.metadata or {}
    saved_optimizer = meta.get("optimizer", {})
    names = saved_optimizer.get("param_names")
    params = _param_states(state_dicts, names if isinstance(names, list) else None)
    known = [p.elements for p in params if p.elements is not None]
    adamw_elements, adamw_bytes = ledger.adamw_state_size(known)
    groups = [g for sd in state_dicts for g in param_group_hyperparameters(sd["param_groups"])]
    step = source.step if source.step is not None else _step_of(state_dicts[0])
    return StateReport(
        path=str(path),
        format=source.format,
        files=where,
        optimizer_name=saved_optimizer.get("name"),
        optimizer_class=saved_optimizer.get("class") or infer_optimizer(state_dicts[0]),
        optimizer_inferred=not saved_optimizer,
        step=step,
        param_groups=groups,
        ledger=state_ledger,
        params=params,
        adamw_equivalent_elements=adamw_elements,
        adamw_equivalent_bytes=adamw_bytes,
        params_without_shape=len(params) - len(known),
    )
