"""Admission limits on uploads: how many at once, and how many bytes staged.

A save's snapshot is held in memory from accept to write. Without a cap, many
trainers (or one hostile client) could make the daemon allocate more than the
machine has and be OOM-killed, losing every save in flight. The budget
reserves a save's bytes before its lane decides.

At a limit a request queues for room instead of being refused: a burst of
many trainers' saves arrives while the saves ahead of it end within
milliseconds. The queue is first come, first served, and a save ending hands
its room to the oldest waiters that fit, waking each of them alone (a wake of
every waiter at each release made each save's end cost a context switch and a
wait for the GIL per waiter, only for all but one to sleep again). A waiter
gives up at the end of its wait (`wait`, `--admission-wait`) or of its
call's deadline, whichever comes first, and is refused with
RESOURCE_EXHAUSTED, before anything is allocated or counted. A snapshot
larger than the whole staging memory is refused at once.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from checkpointd.protocol.errors import LimitExceededError


def default_staging_bytes() -> int:
    """Half of the machine's physical memory."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError):
        return 8 << 30


class _Waiter:
    """A request queued for room; woken alone, with its room already reserved, or at the end of its wait."""

    __slots__ = ("admitted", "nbytes", "woken")

    def __init__(self, nbytes: int, lock: threading.Lock) -> None:
        self.nbytes = nbytes
        self.admitted = False
        self.woken = threading.Condition(lock)


class UploadBudget:
    """Counts saves between admission and their end, and their snapshot bytes. Thread-safe.

    Lock discipline: one lock guards the counts and the queue; every waiter's
    condition shares it, so a release admits waiters and wakes them in one step.
    """

    def __init__(self, max_uploads: int, max_bytes: int, wait: float = 0.0) -> None:
        """Args:
        max_uploads: saves admitted at once.
        max_bytes: their snapshots' bytes at once.
        wait: seconds a save at a limit waits for room before it is refused (0: refused at once).
        """
        self.max_uploads = max_uploads
        self.max_bytes = max_bytes
        self.wait = wait
        self._lock = threading.Lock()
        self._queued = threading.Condition(self._lock)  # notified as the queue grows (`wait_for_waiters`)
        self._uploads = 0
        self._bytes = 0
        self._queue: collections.deque[_Waiter] = collections.deque()

    @property
    def in_use(self) -> tuple[int, int]:
        """(saves, bytes) reserved now."""
        with self._lock:
            return self._uploads, self._bytes

    @property
    def waiting(self) -> int:
        """Requests queued for room now."""
        with self._lock:
            return len(self._queue)

    def wait_for_waiters(self, count: int, timeout: float) -> bool:
        """Returns whether `count` requests were queued for room within `timeout` seconds (for tests and probes)."""
        with self._lock:
            return self._queued.wait_for(lambda: len(self._queue) >= count, timeout)

    @contextmanager
    def reserve(self, nbytes: int, run: str, deadline: float | None = None) -> Iterator[Callable[[], None]]:
        """Holds one upload slot and `nbytes` until the block ends or the
        yielded `release()` is called (idempotent), whichever comes first.

        At a limit, waits in line for room until `wait` seconds have passed
        or the monotonic `deadline` (the call's), whichever is first.

        Raises:
            LimitExceededError: still too many uploads at once, or not enough
                staging memory left, at the end of the wait; or a snapshot
                larger than the whole staging memory (at once).
        """
        with self._lock:
            self._take(nbytes, run, deadline)
        held = [True]

        def release() -> None:
            with self._lock:
                if held[0]:
                    held[0] = False
                    self._uploads -= 1
                    self._bytes -= nbytes
                    self._admit_waiters()

        try:
            yield release
        finally:
            release()

    def _fits(self, nbytes: int) -> bool:
        return self._uploads < self.max_uploads and self._bytes + nbytes <= self.max_bytes

    def _take(self, nbytes: int, run: str, deadline: float | None) -> None:
        """Reserves a slot and `nbytes`, waiting in line for them; the lock is held."""
        if not self._queue and self._fits(nbytes):  # nobody waits ahead of it
            self._uploads += 1
            self._bytes += nbytes
            return
        if nbytes > self.max_bytes:  # can never fit: refused without waiting
            raise self._refusal(nbytes, run, 0.0)
        started = time.monotonic()
        end = started + self.wait if deadline is None else min(started + self.wait, deadline)
        waiter = _Waiter(nbytes, self._lock)
        self._queue.append(waiter)
        self._queued.notify_all()
        try:
            while not waiter.admitted:
                left = end - time.monotonic()
                if left <= 0:
                    break
                waiter.woken.wait(left)
        except BaseException:  # interrupted: neither in line nor holding room afterwards
            if waiter.admitted:
                self._uploads -= 1
                self._bytes -= nbytes
            else:
                self._queue.remove(waiter)
            self._admit_waiters()
            raise
        if not waiter.admitted:
            self._queue.remove(waiter)
            self._admit_waiters()  # it may have been the head that kept smaller ones waiting for bytes
            raise self._refusal(nbytes, run, time.monotonic() - started)

    def _admit_waiters(self) -> None:
        """Hands the room there is to the oldest waiters that fit, in order, and wakes each; the lock is held."""
        while self._queue and self._fits(self._queue[0].nbytes):
            waiter = self._queue.popleft()
            self._uploads += 1
            self._bytes += waiter.nbytes
            waiter.admitted = True
            waiter.woken.notify()

    def _refusal(self, nbytes: int, run: str, waited: float) -> LimitExceededError:
        """The error a request still without room hears; the lock is held."""
        after = f" after waiting {waited:.3g} s for room (--admission-wait {self.wait:g} s, or the call's deadline)"
        if nbytes > self.max_bytes or self._uploads < self.max_uploads:  # the bytes keep it out
            return LimitExceededError(
                f"run {run!r}: a {nbytes}-byte snapshot does not fit in the staging memory "
                f"left ({self.max_bytes - self._bytes} of {self.max_bytes} bytes, "
                f"--max-staging-bytes){after if nbytes <= self.max_bytes else ''}; retry later"
            )
        return LimitExceededError(
            f"run {run!r}: the daemon is at its limit of {self.max_uploads} saves at "
            f"once (--max-concurrent-uploads){after}; retry later, or raise "
            "--max-concurrent-uploads or --admission-wait"
        )
