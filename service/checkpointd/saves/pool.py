"""The writer pool: threads that write and commit saves, at a lower CPU priority.

Saves are written at `--write-nice`: on these threads, or on the thread
that received the save once it was lowered to that value (it stays there);
the gRPC threads that answer decisions keep their priority, so a trainer's
stall does not grow while the daemon writes on the same cores.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable
from typing import TypeVar

_LOGGER = logging.getLogger(__name__)

_T = TypeVar("_T")


_lowered = threading.local()  # .nice: the nice value this thread was lowered to here


def lower_priority(nice: int) -> None:
    """Raises this thread's nice value to `nice` (Linux: per thread); never lowers it."""
    if nice <= 0 or not hasattr(os, "setpriority") or getattr(_lowered, "nice", 0) >= nice:
        return
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        _lowered.nice = nice
    except OSError as e:
        _LOGGER.warning("could not set the writer threads' nice value to %d: %s", nice, e)


def _at_priority(nice: int) -> bool:
    """Whether this thread already runs at `nice` or lower (0: every thread does)."""
    return nice <= 0 or getattr(_lowered, "nice", 0) >= nice


class WriterPool:
    """Runs save writes on threads at `nice`. Thread-safe."""

    def __init__(self, nice: int = 0, max_workers: int = 16) -> None:
        """Args:
        nice: the threads' nice value (Linux sets it per thread): above 0,
            training on the same machine gets the CPU first and saves use
            what is left. 0 leaves them be.
        max_workers: how many saves may be written at once.
        """
        self.nice = nice
        self._workers = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="write", initializer=lower_priority, initargs=(nice,)
        )

    def initializer(self) -> None:
        """Lowers the calling thread's priority to the pool's (for other pools doing save work)."""
        lower_priority(self.nice)

    def run(self, work: Callable[[], _T]) -> _T:
        """Runs `work` at the pool's priority and returns its result (or raises its error).

        On the calling thread if it runs at that priority already (it has
        written the save: `lower_priority`), else on a writer thread: a hand-off
        there and back is two context switches and two waits for the GIL.
        """
        if _at_priority(self.nice):
            return work()
        return self._workers.submit(work).result()

    def close(self) -> None:
        self._workers.shutdown(wait=True)
