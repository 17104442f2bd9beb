"""The plan's verifying worker processes: full estimates side by side in spawned processes that
warm up while the plan screens, end with the plan's process, and hold signals while they spawn."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any

from effitrain.config import TrainConfig
from effitrain.distributed import Launch
from effitrain.errors import EffitrainError
from effitrain.estimation import estimate
from effitrain.plan_screens import cut_to
from effitrain.results import Estimate

if TYPE_CHECKING:
    from concurrent.futures import ProcessPoolExecutor

PARALLEL_FROM_SECONDS = 3.0
"""Verifications run in worker processes, side by side, where one is expected to take longer
than this (the two-layer screen's time times half the depth): a worker's imports and first
estimate take about as long, paid while the plan screens."""


class Verifiers:
    """The worker processes that verify one plan's candidates (none until :meth:`start`).
    ``workers``: how many (None: one per core where a verification is slow; 0: none), each
    first calling ``setup``."""

    def __init__(
        self, launch: Launch, workers: int | None, setup: Callable[[], None] | None
    ) -> None:
        self.launch = launch
        self.workers = workers
        self.setup = setup
        self._pool: ProcessPoolExecutor | None = None
        self._pool_size = 0

    def start(self, config: TrainConfig, verify_seconds: float, at_most: int) -> None:
        """Start the verifying processes (once) where a verification looks slow, at most
        ``at_most`` (one per core); they import and warm up while the plan goes on screening."""
        if self._pool is not None or self.workers == 0:
            return
        count = self.workers
        if count is None:
            if verify_seconds < PARALLEL_FROM_SECONDS:
                return
            count = min(at_most, _cores())
        if count < 2:
            return
        from concurrent.futures import ProcessPoolExecutor
        from multiprocessing import get_context

        # spawn: a fork would copy this process's threads and locks mid-flight.
        self._pool_size = count
        self._pool = ProcessPoolExecutor(
            count,
            mp_context=get_context("spawn"),
            initializer=_warm,
            initargs=(config, self.launch, self.setup),
        )

    @property
    def parallel(self) -> int:
        """How many verifications run at once."""
        return self._pool_size if self._pool is not None else 1

    def estimates(self, configs: list[TrainConfig]) -> list[Estimate | str]:
        """Each config's full estimate, or why it could not be made, in the worker processes
        where they were started (the same function: the same figures)."""
        if self._pool is not None and len(configs) > 1:
            from concurrent.futures.process import BrokenProcessPool

            with signals_held():  # submit spawns the workers
                futures = [self._pool.submit(_verified, c, self.launch) for c in configs]
            try:
                return [f.result() for f in futures]
            except BrokenProcessPool:  # a worker died (memory?): verify here instead
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
        return [_verified(c, self.launch) for c in configs]

    def end(self, stopped: bool) -> None:
        """End the workers: at once where the plan was ``stopped`` (a signal, an error), not
        after their estimates."""
        if self._pool is None:
            return
        workers = list(self._pool._processes.values()) if stopped else []
        for process in workers:
            process.terminate()
        for process in workers:
            process.join()
        # Its manager thread too, which sees its workers gone and ends: one still running at
        # exit races Python's exit hook for pools (concurrent.futures.process._python_exit
        # wakes it through a pipe the thread may be closing), whose traceback then followed
        # the plan's one line (seen once, under load).
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool = None


def _verified(config: TrainConfig, launch: Launch) -> Estimate | str:
    """A full estimate, or why it could not be made (one line: it crosses processes)."""
    try:
        return estimate(config, launch)
    except EffitrainError as exc:
        return str(exc)


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _warm(config: TrainConfig, launch: Launch, setup: Callable[[], None] | None) -> None:
    """A verifying worker's start: ending with the plan's process (:func:`_end_with_parent`),
    ``setup``, its imports and a one-layer estimate (fake tensors keep a cache of shapes per
    process)."""
    _end_with_parent()
    if setup is not None:
        setup()
    with suppress(Exception), cut_to(1):
        estimate(config, launch)


_HELD: dict[str, Any] = {"depth": 0, "pending": None}


@contextmanager
def signals_held() -> Iterator[None]:
    """A signal handler that calls :func:`held_signal` lets the block finish first, then takes
    the signal: a signal inside ``ProcessPoolExecutor.submit``, which spawns the workers, would
    leave a half-started worker (its start-up data unsent) to print a traceback."""
    import signal

    _HELD["depth"] += 1
    try:
        yield
    finally:
        _HELD["depth"] -= 1
        pending, _HELD["pending"] = _HELD["pending"], None
        if pending is not None and _HELD["depth"] == 0:
            signal.raise_signal(pending)


def held_signal(signum: int) -> bool:
    """Whether ``signum`` waits for the end of a :func:`signals_held` block (kept until then)."""
    if _HELD["depth"] == 0:
        return False
    _HELD["pending"] = signum
    return True


def _end_with_parent() -> None:
    """End this worker when the plan's process ends, however it ends: a worker waits for work
    on a queue that its parent's death does not close. Ctrl-C is the parent's to handle (it
    ends its workers); the terminal sends it to the workers too."""
    import signal
    import threading
    from multiprocessing import parent_process
    from multiprocessing.connection import wait

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])  # ready once the parent is gone
        os._exit(1)

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()
