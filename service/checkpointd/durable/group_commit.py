"""Group commit: saves that finish close together share one filesystem sync.

A small save's commit on the local disk is a handful of fsyncs (each file,
each dir, the manifest, the parent after the rename), each waiting for a
journal commit; 256 trainers saving once a second make that thousands of
syncs a second, each a thread hand-off and a context switch. Databases
batch their log flushes instead: every transaction that reached the log
while one flush ran is made durable by the next one, and each caller
returns only after a flush that started after its own write.

`GroupSync` does that for a filesystem. `barrier()` returns once a sync that
started after the call has finished (so everything the caller wrote before
it is durable), or raises that sync's error. The sync is Linux `syncfs(2)`
on the filesystem of a dir (`syncfs_of`): one call writes back every dirty
file and dir there and commits the journal, for all the saves of the batch
at once; its error (since Linux 5.8) says a writeback failed. Callers that
arrive while a sync runs wait for the next one, which then covers them all.

`LocalStore` commits a save through it in two barriers: the files and the
manifest are written, a barrier makes them durable in the staging dir, the
staging dir is renamed into place, and a second barrier makes the rename
durable before the save is reported. A crash before the rename leaves the
staging dir (deleted by recovery); one after it, a complete save. Stdlib
only (ctypes for libc).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

_LOGGER = logging.getLogger(__name__)

Sync = Callable[[], None]  # makes the filesystem's writes so far durable; raises OSError


@functools.cache
def _libc_syncfs() -> Callable[[int], int] | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).syncfs
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def syncfs_of(directory: Path) -> Sync | None:
    """A `Sync` that calls syncfs(2) on the filesystem holding `directory`, or None where libc has no syncfs.

    The dir is opened at each call (it may be replaced meanwhile), so the
    sync follows the path, as the saves under it do.
    """
    syncfs = _libc_syncfs()
    if syncfs is None:
        return None
    path = os.fspath(directory)
    if _filesystem_type(path).startswith("fuse"):
        # Linux's syncfs never asks a FUSE server to fsync (FUSE_SYNCFS goes to
        # virtiofs only): an fsync that would fail there would go unseen, and a
        # save be reported durable. Such a root keeps each save's own fsyncs.
        return None

    def sync() -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if syncfs(fd) != 0:
                code = ctypes.get_errno()
                raise OSError(code, f"syncfs of {path}: {os.strerror(code)}")
        finally:
            os.close(fd)

    return sync


def _filesystem_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str:
    """The type of the filesystem mounted where `path` (made real) is: its deepest mount point's ("" if unknown)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open(mountinfo, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not rest:
            continue
        point = parts[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, rest.split()[0]
    return kind


class _Round:
    """One sync and the callers it covers; its callers wait on `woken` (one lock for all rounds)."""

    def __init__(self, lock: threading.Lock) -> None:
        self.woken = threading.Condition(lock)
        self.error: OSError | None = None
        self.callers = 0
        self.started = False  # its sync runs (on its leader's thread)
        self.finished = False


class GroupSync:
    """Shares one filesystem sync among the callers that arrive while the last one ran. Thread-safe.

    No thread of its own: the first caller to find no sync running leads a
    round, running the sync on its own thread; callers arriving meanwhile
    join the next round and wait. As a round ends its leader wakes its
    callers and, if the next round has any, one of them to lead it: a
    leader never waits, and every other caller is woken once, where a sync
    thread cost every caller two hand-offs (to the thread and back).
    """

    def __init__(self, sync: Sync) -> None:
        """Args:
        sync: makes everything written to the filesystem so far durable (`syncfs_of`).
        """
        self._sync = sync
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # close() waits on it for the last round
        self._running: _Round | None = None
        self._next: _Round | None = None  # the callers waiting for the sync after the running one
        self._closed = False
        self.rounds = 0  # syncs run (for tests and logs)
        self.covered = 0  # barriers they answered

    def barrier(self) -> None:
        """Returns once a sync that started after this call has finished.

        Raises:
            OSError: that sync failed (every caller it covered hears it); or
                the GroupSync is closed.
        """
        with self._lock:
            if self._closed:
                raise OSError("the store is closed: no sync runs any more")
            if self._running is None:  # nothing running, so nobody waits either: lead at once
                joined = self._running = _Round(self._lock)
                joined.callers += 1
                lead = True
            else:
                if self._next is None:
                    self._next = _Round(self._lock)
                joined = self._next
                joined.callers += 1
                # Woken when it ends, or (one caller) to lead it once the running one has.
                while not joined.finished and not (joined is self._running and not joined.started):
                    joined.woken.wait()
                lead = not joined.finished
            joined.started = True
        if lead:
            self._lead(joined)
        if joined.error is not None:
            raise joined.error

    def waiting(self) -> int:
        """How many callers wait for the next round (for tests and logs)."""
        with self._lock:
            return self._next.callers if self._next is not None else 0

    def _lead(self, current: _Round) -> None:
        """Runs `current`'s sync on this thread, then wakes its callers and the next round's leader."""
        try:
            self._sync()
        except OSError as e:
            current.error = e
        except BaseException as e:  # noqa: BLE001 - every waiter must wake, with an error
            current.error = OSError(f"the shared sync failed: {e!r}")
        with self._lock:
            if current.error is not None:
                _LOGGER.error("a shared sync of %d saves' writes failed: %s", current.callers, current.error)
            self.rounds += 1
            self.covered += current.callers
            current.finished = True
            current.woken.notify_all()
            self._running, self._next = self._next, None
            if self._running is not None:
                self._running.woken.notify()  # one of them leads it
            else:
                self._idle.notify_all()

    def close(self) -> None:
        """Refuses further barriers; returns once the rounds of the callers waiting have run."""
        with self._lock:
            self._closed = True
            while self._running is not None:
                self._idle.wait()
