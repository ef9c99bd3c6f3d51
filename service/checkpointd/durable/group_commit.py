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

    def sync() -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if syncfs(fd) != 0:
                code = ctypes.get_errno()
                raise OSError(code, f"syncfs of {path}: {os.strerror(code)}")
        finally:
            os.close(fd)

    return sync


class _Round:
    """One sync and the callers it covers."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: OSError | None = None
        self.callers = 0


class GroupSync:
    """Shares one filesystem sync among the callers that arrive while the last one ran. Thread-safe.

    A thread of its own runs the syncs: it waits for a caller, takes every
    caller that arrived by then into the round, syncs, and wakes them; those
    arriving meanwhile form the next round.
    """

    def __init__(self, sync: Sync, *, name: str = "group-sync") -> None:
        """Args:
        sync: makes everything written to the filesystem so far durable (`syncfs_of`).
        name: the thread's name.
        """
        self._sync = sync
        self._cond = threading.Condition()
        self._next = _Round()
        self._closed = False
        self.rounds = 0  # syncs run (for tests and logs)
        self.covered = 0  # barriers they answered
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def barrier(self) -> None:
        """Returns once a sync that started after this call has finished.

        Raises:
            OSError: that sync failed (every caller it covered hears it); or
                the GroupSync is closed.
        """
        with self._cond:
            if self._closed:
                raise OSError("the store is closed: no sync runs any more")
            joined = self._next
            joined.callers += 1
            self._cond.notify_all()
        joined.done.wait()
        if joined.error is not None:
            raise joined.error

    def close(self) -> None:
        """Runs the last round for the callers waiting, then stops the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._next.callers == 0 and not self._closed:
                    self._cond.wait()
                if self._next.callers == 0:  # closed, nobody waiting
                    return
                current, self._next = self._next, _Round()
            try:
                self._sync()
            except OSError as e:
                _LOGGER.error("a shared sync of %d saves' writes failed: %s", current.callers, e)
                current.error = e
            except BaseException as e:  # noqa: BLE001 - every waiter must wake, with an error
                current.error = OSError(f"the shared sync failed: {e!r}")
            self.rounds += 1
            self.covered += current.callers
            current.done.set()
