"""Admission limits on uploads: how many at once, and how many bytes staged.

A save's snapshot is held in memory from accept to write. Without a cap, many
trainers (or one hostile client) could make the daemon allocate more than the
machine has and be OOM-killed, losing every save in flight. The budget
reserves a save's bytes before its lane decides. At a limit the request waits
a little (`wait`, `--admission-wait`) for a slot or the bytes to free up, as a
burst of many trainers' saves would otherwise be refused while the saves ahead
of it end within milliseconds; still at the limit, it is refused with
RESOURCE_EXHAUSTED, before anything is allocated or counted.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from checkpointd.protocol.errors import LimitExceededError


def default_staging_bytes() -> int:
    """Half of the machine's physical memory."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError):
        return 8 << 30


class UploadBudget:
    """Counts saves between admission and their end, and their snapshot bytes."""

    def __init__(self, max_uploads: int, max_bytes: int, wait: float = 0.0) -> None:
        """Args:
        max_uploads: saves admitted at once.
        max_bytes: their snapshots' bytes at once.
        wait: seconds a save at a limit waits for room before it is refused (0: refused at once).
        """
        self.max_uploads = max_uploads
        self.max_bytes = max_bytes
        self.wait = wait
        self._lock = threading.Condition()
        self._uploads = 0
        self._bytes = 0

    @property
    def in_use(self) -> tuple[int, int]:
        """(saves, bytes) reserved now."""
        with self._lock:
            return self._uploads, self._bytes

    @contextmanager
    def reserve(self, nbytes: int, run: str) -> Iterator[Callable[[], None]]:
        """Holds one upload slot and `nbytes` until the block ends or the
        yielded `release()` is called (idempotent), whichever comes first.

        Raises:
            LimitExceededError: too many uploads at once, or not enough
                staging memory left.
        """
        with self._lock:
            if nbytes <= self.max_bytes:  # one that can never fit is refused without waiting
                self._lock.wait_for(
                    lambda: self._uploads < self.max_uploads and self._bytes + nbytes <= self.max_bytes,
                    timeout=self.wait,
                )
            if self._uploads >= self.max_uploads:
                raise LimitExceededError(
                    f"run {run!r}: the daemon is at its limit of {self.max_uploads} saves at "
                    "once (--max-concurrent-uploads); retry later"
                )
            if self._bytes + nbytes > self.max_bytes:
                raise LimitExceededError(
                    f"run {run!r}: a {nbytes}-byte snapshot does not fit in the staging memory "
                    f"left ({self.max_bytes - self._bytes} of {self.max_bytes} bytes, "
                    "--max-staging-bytes); retry later"
                )
            self._uploads += 1
            self._bytes += nbytes
        held = [True]

        def release() -> None:
            with self._lock:
                if held[0]:
                    held[0] = False
                    self._uploads -= 1
                    self._bytes -= nbytes
                    self._lock.notify_all()

        try:
            yield release
        finally:
            release()
