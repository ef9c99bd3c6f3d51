"""A run's busy lock: one open file description of its lock file, and its exclusive flock(2).

The daemon and same-host trainers share it (see `checkpointd.transport.shm` and
`checkpointd_client.local_decision`): a save of the run is in flight exactly while
someone holds the lock. flock locks belong to an open file description, so
each holder opens the file itself and holders contend even within one
process; a process that dies lets go of its lock.
"""

from __future__ import annotations

import fcntl
import os


class BusyLock:
    """One open file description of a run's busy lock file. Not thread-safe."""

    def __init__(self, path: str, *, create: bool = False) -> None:
        """Opens the lock file at `path`; with `create`, makes it (0600, and it must not exist).

        Raises:
            OSError: it cannot be opened (or, with `create`, it exists).
        """
        self.path = path
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        self._fd = os.open(path, flags, 0o600)

    def try_take(self) -> bool:
        """Takes the exclusive flock without waiting; False if another holder has it."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def stale(self) -> bool:
        """True once the file has been removed (its daemon stopped, or closed the run)."""
        try:
            return os.fstat(self._fd).st_nlink == 0
        except OSError:
            return True

    def close(self) -> None:
        os.close(self._fd)  # lets go of the flock too
