"""One daemon per root: an exclusive flock(2) on a file in the daemon's state dir, held while it runs.

A daemon's local dir (its `--root`, or for an s3:// root its `--work-dir`)
holds what only that daemon may touch: temp dirs of saves in flight, parked
trees, staging. Recovery at start deletes or restores those, so a second
daemon on the same dir would destroy the first one's saves in flight. The
daemon therefore takes this lock before recovery and holds it until it
exits; a second daemon finds it taken and refuses to start.

The lock is `<state dir>/daemon.lock` (the state dir is `.checkpointd/`, a
name no run or export dir may take: `checkpointd.protocol.names`). flock
locks belong to an open file description and the kernel drops them when
the process dies, however it dies (SIGKILL included), so a dead holder
never blocks the next start. The holder writes its pid, host and start time
into the file, for the message the next daemon prints.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

LOCK_NAME = "daemon.lock"
_MAX_HOLDER_BYTES = 4096  # what a holder writes is one short JSON line


@dataclass(frozen=True)
class Holder:
    """Who holds a daemon lock: enough for a person to find the process.

    Attributes:
        pid: the holder's process id (on `host`).
        host: the holder's hostname.
        started: when it took the lock, in seconds since the epoch.
    """

    pid: int
    host: str
    started: float

    def describe(self) -> str:
        """`pid 123 on host h, running since 2026-12-01 21:30:05 UTC`."""
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"pid {self.pid} on host {self.host}, running since {since}"


class DirInUseError(OSError):
    """Another live daemon holds the dir's lock; this one must not start.

    An OSError, so `checkpointd serve` reports it as `cannot start: ...` and exits 2.

    Attributes:
        holder: who holds it, or None if the holder had not written itself yet
            (it is starting at this very moment) or wrote something unreadable.
    """

    def __init__(self, message: str, holder: Holder | None) -> None:
        super().__init__(message)
        self.holder = holder


class DirLock:
    """The held lock of one daemon's dir; `release()` (or process exit) lets go of it.

    Usage: `lock = DirLock.take(state_dir, what="the root", flag="--root")`.
    """

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def take(
        cls,
        state_dir: Path,
        *,
        what: str,
        flag: str,
        pid: int | None = None,
        host: str | None = None,
        now: float | None = None,
    ) -> DirLock:
        """Takes `<state_dir>/daemon.lock` without waiting, and writes this process into it.

        Args:
            state_dir: the daemon's state dir (made by the caller).
            what: the dir the lock guards, as the message names it
                (e.g. "the root /data/ckpt").
            flag: the flag that picks another dir (`--root`, `--work-dir`).
            pid, host, now: who this process is (default: its own pid,
                hostname, the time now); tests set them.

        Returns:
            The held lock.

        Raises:
            DirInUseError: another open file description holds it (another
                daemon, live); the message names the holder and the flag.
            OSError: the lock file cannot be opened or locked.
        """
        path = state_dir / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            who = holder.describe() if holder is not None else "a daemon starting right now"
            raise DirInUseError(
                f"{what} is in use by another checkpointd ({who}); a daemon must own its dir alone, or "
                f"it would delete the other's saves in flight: stop that daemon, or give this one another {flag}",
                holder,
            ) from None
        except BaseException:
            os.close(fd)
            raise
        me = Holder(
            os.getpid() if pid is None else pid, host or socket.gethostname(), time.time() if now is None else now
        )
        try:
            data = json.dumps({"pid": me.pid, "host": me.host, "started": me.started}).encode() + b"\n"
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        except BaseException:
            os.close(fd)  # lets go of the flock too
            raise
        return cls(fd, path)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Lets go of the lock (idempotent). The file stays: removing it would race the next taker."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def _read_holder(fd: int) -> Holder | None:
    """What the holder wrote into the lock file, or None if nothing readable yet."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        fields = json.loads(os.pread(fd, _MAX_HOLDER_BYTES, 0))
        return Holder(int(fields["pid"]), str(fields["host"]), float(fields["started"]))
    return None
