"""One run per output folder: ``DIR/.effitrain.lock`` names the run that owns ``DIR`` (its PID,
host and start time) from before anything is written there until the run ends, however it ends.

The lock file is created with ``O_CREAT | O_EXCL``, so of two runs starting together one gets
it. A lock left by a run that died (same host, its PID gone) is taken over with a note; a lock
from another host cannot be checked from here and is refused with the way to remove it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from effitrain.errors import EffitrainError

LOCK_FILE = ".effitrain.lock"


@contextmanager
def output_lock(output_dir: str | Path | None, note: Callable[[str], None]) -> Iterator[None]:
    """Hold ``output_dir``'s lock for the block (nothing without a folder); ``note`` says when
    a dead run's lock is taken over. Released at the block's end, on an error and on the
    exception a signal raises; a folder the lock created and nothing else filled is removed.

    Raises:
        EffitrainError: another run holds the folder (one line naming it).
    """
    if not output_dir:
        yield
        return
    folder = Path(output_dir)  # as the checkpoints are written: no ~ expansion of its own
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise EffitrainError(f"--output-dir {output_dir} is not a folder") from None
    except OSError as exc:
        raise EffitrainError(
            f"--output-dir {output_dir}: cannot create it ({exc.strerror})"
        ) from None
    mine = _acquire(folder / LOCK_FILE, note)
    try:
        yield
    finally:
        _release(folder / LOCK_FILE, mine)
        if created and not any(folder.iterdir()):
            folder.rmdir()


def _record() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _acquire(path: Path, note: Callable[[str], None]) -> dict[str, Any]:
    """Create the lock file holding this run's record, taking over a dead run's lock."""
    record = _record()
    for _ in range(3):  # a stale lock removed, or another run's removal raced with ours
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(path)
            if holder is None:
                continue  # removed between our open and our read
            if not _dead_here(holder):
                raise EffitrainError(_refusal(path, holder)) from None
            if _remove_if_unchanged(path, holder):
                note(
                    f"{path.parent}: took over the lock of {_describe(holder)}, which is no "
                    "longer running"
                )
            continue
        with os.fdopen(fd, "w") as file:
            file.write(json.dumps(record) + "\n")
        return record
    raise EffitrainError(f"{path.parent}: could not take its lock ({path}); try again")


def _read(path: Path) -> dict[str, Any] | None:
    """The lock's record; ``{}`` for one being written or not ours to read; None: gone."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        holder = json.loads(text)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _dead_here(holder: dict[str, Any]) -> bool:
    """The holder ran on this host and its process is gone."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _describe(holder: dict[str, Any]) -> str:
    return (
        f"PID {holder.get('pid', '?')} on {holder.get('host', '?')}, "
        f"since {holder.get('since', '?')}"
    )


def _refusal(path: Path, holder: dict[str, Any]) -> str:
    folder = path.parent
    if not holder:
        return (
            f"--output-dir {folder} is in use by another effitrain run that is starting; wait "
            "for it to end or choose another --output-dir"
        )
    if holder.get("host") != socket.gethostname():
        return (
            f"--output-dir {folder} is in use by an effitrain run on another host "
            f"({_describe(holder)}); if that run is no longer running, delete {path}"
        )
    return (
        f"--output-dir {folder} is in use by another effitrain run ({_describe(holder)}); "
        "wait for it to end or choose another --output-dir"
    )


def _remove_if_unchanged(path: Path, holder: dict[str, Any]) -> bool:
    """Remove the lock if it still holds ``holder``'s record: moved aside first (atomic), so a
    lock that another run took in between is put back instead of deleted."""
    aside = path.with_name(f"{path.name}.{os.getpid()}")
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return False
    if _read(aside) == holder:
        aside.unlink()
        return True
    with contextlib.suppress(OSError):  # yet another run holds it now: then theirs stays
        os.link(aside, path)
    aside.unlink()
    return False


def _release(path: Path, mine: dict[str, Any]) -> None:
    """Remove the lock if it is still this run's."""
    if _read(path) == mine:
        path.unlink(missing_ok=True)
