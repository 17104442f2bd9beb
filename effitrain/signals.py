"""Stopping on SIGINT / SIGTERM: finish the step, keep it, leave with 128 + the signal number.

The handler only sets a flag (:class:`StopRequest`); the loop's step guard reads it before each
update, all processes agree on it in the same all-reduce as the non-finite check, and the loop
saves a checkpoint (with ``--output-dir``) and raises :class:`TrainingStopped`. Before the loop
(the build, DPO's reference pass) and after it (the final evaluation and save) there is no step
to finish: inside :meth:`StopRequest.at_once` a signal raises :class:`StoppedAtOnce` where the
code is.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType


class StopRequest:
    """Set by SIGINT/SIGTERM (or :meth:`request`); the loop checks it at each optimizer step.

    The first signal only sets the flag; a second one aborts at once (KeyboardInterrupt).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._at_once = False

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or 0)

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask the loop to stop after the current step, as the signal ``signum`` would."""
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    @contextmanager
    def at_once(self) -> Iterator[None]:
        """In this block a first signal raises :class:`StoppedAtOnce` at once."""
        self._at_once = True
        try:
            yield
        finally:
            self._at_once = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._at_once and self.signum is None:
            self.signum = signum
            raise StoppedAtOnce(signum)
        self.request(signum)


@contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """Route SIGINT and SIGTERM to a :class:`StopRequest` for the duration of the block.

    Outside the main thread (where Python cannot install handlers) nothing is installed.
    """
    import threading

    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, request._handle)
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class TrainingStopped(Exception):
    """A signal stopped the run after a complete step (and a checkpoint, with --output-dir)."""

    def __init__(self, exit_code: int, checkpoint_path: Path | None):
        super().__init__(f"stopped (exit code {exit_code})")
        self.exit_code = exit_code
        self.checkpoint_path = checkpoint_path


class StoppedAtOnce(BaseException):
    """A signal arrived outside the loop (:meth:`StopRequest.at_once`). A BaseException, as
    KeyboardInterrupt is: library code that catches Exception must not swallow it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + signum
