"""Saving: checkpoints that are complete or absent (a temporary folder, fsynced, renamed into
place; old ones rotated only after), and the final model, never replaced by an earlier one."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from effitrain.checkpoint.metadata import (
    CHECKPOINT_PREFIX,
    FINAL_DIR,
    METADATA_FILE,
    TMP_PREFIX,
    TRASH_PREFIX,
    complete_checkpoints,
    find_latest,
    list_checkpoints,
)
from effitrain.errors import EffitrainError, first_line

if TYPE_CHECKING:
    from accelerate import Accelerator


def _fsync_path(path: Path) -> None:
    """Flush a file or a folder entry to disk (best effort where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def clean_leftovers(output_dir: Path) -> list[Path]:
    """Delete temporary folders left by failed or killed saves; return what was removed."""
    removed = []
    if not output_dir.is_dir():
        return removed
    for child in output_dir.iterdir():
        if child.is_dir() and child.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def _file_sizes(folder: Path) -> dict[str, int]:
    return {
        child.name: child.stat().st_size
        for child in sorted(folder.iterdir())
        if child.is_file() and child.name != METADATA_FILE
    }


def _install(tmp: Path, final: Path) -> None:
    """Rename a complete temporary folder into place (replacing a stale folder of that name)."""
    if final.exists():
        trash = final.with_name(f"{TRASH_PREFIX}{final.name}")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_path(final.parent)


def rotate(output_dir: Path, keep: int, newest: Path) -> list[Path]:
    """Delete the oldest complete checkpoints so that ``keep`` remain; never ``newest``.

    Incomplete ``checkpoint-*`` folders are left alone (they are ignored by resume, and a human
    may want to look at them). A checkpoint that is a symbolic link counts as one and is rotated
    as a link: the link goes, what it points to is left whole (it is not this folder's).
    Returns the deleted folders and links.
    """
    complete = [path for path in complete_checkpoints(output_dir) if path != newest]
    surplus = len(complete) + 1 - keep
    deleted = []
    for path in complete[: max(surplus, 0)]:
        if path.is_symlink():
            path.unlink()
        else:
            shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    return deleted


def _all_ok(accelerator: Accelerator, ok: bool) -> bool:
    """True when every process succeeded (a collective: all processes must call it)."""
    if accelerator.num_processes == 1:
        return ok
    import torch

    failures = torch.tensor(0.0 if ok else 1.0, device=accelerator.device)
    return float(accelerator.reduce(failures, "sum")) == 0.0


def save_checkpoint(
    accelerator: Accelerator,
    output_dir: str | Path,
    metadata: dict[str, Any],
    keep: int | None,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write a complete checkpoint ``output_dir/checkpoint-<step>`` or nothing at all.

    Called by every process. Steps: the main process prepares ``.tmp-checkpoint-<step>``;
    everyone writes into it with ``accelerator.save_state``; the main process writes
    ``effitrain.json`` (with every file's size), fsyncs, renames the folder into place, and
    only then deletes the oldest checkpoints beyond ``keep``. ``extra(folder)`` writes what
    the levers keep besides Accelerate's state (every process, into the temporary folder).

    Raises:
        EffitrainError: the save failed (a full disk, permissions), in one line naming the cause
            and the newest checkpoint that is intact; the temporary folder is removed.
    """
    output_dir = Path(output_dir)
    step = int(metadata["global_step"])
    final = output_dir / f"{CHECKPOINT_PREFIX}{step}"
    tmp = output_dir / f"{TMP_PREFIX}{final.name}"
    error: BaseException | None = None
    if accelerator.is_main_process:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            clean_leftovers(output_dir)
            tmp.mkdir()
        except OSError as exc:
            error = exc
    accelerator.wait_for_everyone()
    if error is None and tmp.is_dir():
        try:
            accelerator.save_state(str(tmp))
            if extra is not None:
                extra(tmp)
        except Exception as exc:  # torch and safetensors raise their own types for a full disk
            error = exc
    if _all_ok(accelerator, error is None) and accelerator.is_main_process:
        try:
            metadata = {**metadata, "files": _file_sizes(tmp)}
            (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
            for child in tmp.iterdir():
                _fsync_path(child)
            _fsync_path(tmp)
            _install(tmp, final)
        except OSError as exc:
            error = exc
    ok = _all_ok(accelerator, error is None)
    if not ok:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        accelerator.wait_for_everyone()
        reason = (
            write_failure(error, output_dir)
            if error is not None
            else "it failed on another process"
        )
        previous = find_latest(output_dir)
        kept = f"; {previous.name} is intact" if previous else "; no earlier checkpoint exists"
        raise EffitrainError(f"{reason} while saving {final.name} in {output_dir}{kept}")
    if keep is not None and accelerator.is_main_process:
        rotate(output_dir, keep, final)
    accelerator.wait_for_everyone()
    return final


LOW_SPACE_BYTES = 64 * 2**20
"""Free bytes below which a failed write is put down to a full disk."""


def write_failure(error: BaseException, folder: Path) -> str:
    """What stopped a write, in words: a full disk (``ENOSPC``, or torch's and safetensors'
    own errors with the disk nearly full), permissions, or the library's first line."""
    import errno

    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return "no space left on device"
    try:
        free = shutil.disk_usage(folder if folder.exists() else folder.parent).free
    except OSError:
        free = None
    if free is not None and free < LOW_SPACE_BYTES:
        return "no space left on device"
    if isinstance(error, OSError) and error.strerror:
        return f"could not write ({error.strerror.lower()})"
    return f"could not write ({first_line(error)[:160]})"


FINAL_FORMAT = "effitrain-final"


def final_step(output_dir: str | Path) -> int | None:
    """The step whose weights ``output_dir/final`` holds (its ``effitrain.json``), or None:
    no final model, or one saved by an effitrain that did not record it."""
    path = Path(output_dir) / FINAL_DIR / METADATA_FILE
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    step = meta.get("global_step") if isinstance(meta, dict) else None
    return step if isinstance(step, int) and meta.get("format") == FINAL_FORMAT else None


def check_final(output_dir: str | Path, last_step: int) -> None:
    """``final/`` is never replaced by the weights of an earlier step than the ones it holds.

    Raises:
        EffitrainError: this run would end at ``last_step``, before the final model's step.
    """
    final = Path(output_dir) / FINAL_DIR
    held, what = final_step(output_dir), "holds the model of step"
    if held is None and final.exists():
        # Unstamped (its effitrain.json deleted, or an older effitrain's): the newest checkpoint
        # beside it is the latest step it can hold.
        held = max((step for step, _ in list_checkpoints(output_dir)), default=None)
        what = "holds a model of unknown step, as late as checkpoint step"
    if held is not None and last_step < held:
        raise EffitrainError(
            f"{final} {what} {held}, and this run ends at step {last_step}: it would be replaced "
            f"by an earlier model; train to step {held} or more (--max-steps), or use another "
            "--output-dir"
        )


def final_state_dict(accelerator: Accelerator, model: Any) -> dict[str, Any]:
    """What ``final/`` is written from, on the main process (a collective: every process calls
    it). A peft model under FSDP2 saves its adapters only, so only the trained parameters are
    gathered, one at a time: gathering the frozen base too would put the whole model on the
    main process's host, a 70B's for a QLoRA run that sharded it to fit."""
    unwrapped = accelerator.unwrap_model(model)
    if getattr(unwrapped, "peft_config", None) is None or not getattr(
        accelerator, "is_fsdp2", False
    ):
        return accelerator.get_state_dict(model)
    state_dict: dict[str, Any] = {}
    for name, param in unwrapped.named_parameters():
        if not param.requires_grad:
            continue
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        if accelerator.is_main_process:
            state_dict[name] = full.detach().cpu()
    return state_dict


def save_final(
    accelerator: Accelerator,
    model: Any,
    tokenizer: Any,
    output_dir: str | Path,
    global_step: int,
    folder: str = FINAL_DIR,
) -> Path:
    """Save model and tokenizer with ``save_pretrained`` (safetensors) to ``output_dir/final``
    (or ``folder``), with an ``effitrain.json`` naming the step (:func:`check_final`). A peft
    model saves its adapters (``adapter_model.safetensors``).

    Written to a temporary folder and renamed into place, like a checkpoint. Every process calls
    this (``get_state_dict`` gathers sharded weights); the main process writes.

    Raises:
        EffitrainError: an earlier step than ``final/`` holds, or the write failed (one line:
            the cause, and that the previous folder is intact).
    """
    output_dir = Path(output_dir)
    final = output_dir / folder
    tmp = output_dir / f"{TMP_PREFIX}{folder}"
    check_final(output_dir, global_step)
    state_dict = final_state_dict(accelerator, model)
    if accelerator.is_main_process:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict)
            tokenizer.save_pretrained(tmp)
            stamp = {"format": FINAL_FORMAT, "global_step": global_step}
            (tmp / METADATA_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
            for child in tmp.iterdir():
                _fsync_path(child)
            _install(tmp, final)
        except Exception as exc:  # torch and safetensors raise their own types for a full disk
            shutil.rmtree(tmp, ignore_errors=True)
            kept = f"; the previous {folder}/ is intact" if final.exists() else ""
            raise EffitrainError(
                f"{write_failure(exc, output_dir)} while saving {final}{kept}"
            ) from exc
    accelerator.wait_for_everyone()
    return final
