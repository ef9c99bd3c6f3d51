"""Shared-memory segments: the same-host transport for snapshots.

A trainer on the daemon's host need not stream its snapshot through gRPC:
on an accept, the daemon offers the run's segment, a file on a tmpfs
(`/dev/shm` by default) that both processes map. The trainer copies the
variables straight into it (the copy it makes anyway for a point-in-time
snapshot) and says so; the daemon writes the bundle from views of the
segment, in the data file's order, without another copy. No chunking, CRC or socket is involved, which is
what made the wire path slow for large policies. A training checkpoint's
segment is laid out as an image of its data file (each tensor at its
offset in the file: `checkpointd.bundle.image`, the layout its format
gives), so the daemon writes it whole with O_DIRECT, past the page cache;
a policy's parts start on 64-byte boundaries (`aligned_offsets`).

Safety:
- The daemon's folder `<shm root>/checkpointd-<pid>-<random>` is mode 0700
  and each segment 0600, so only the daemon's user can map them; a trainer
  that cannot (another host, container or user) sends chunks instead.
- Segments are reserved with posix_fallocate: a tmpfs too small to hold one
  (Docker's 64 MB /dev/shm) refuses it here, as ENOSPC, rather than killing
  the trainer with SIGBUS on a write into a hole. The daemon then offers no
  segment and the save goes over the wire.
- A run's segment is used by one save at a time: the lane admits one save
  per run, and the trainer writes only after the accept and stops before
  the result.
- The folder goes when the daemon stops; a folder left by a daemon that was
  killed is removed by the next daemon that starts with the same shm root
  (its pid no longer runs).

Busy locks (the trainer's skip-if-busy without a round trip): beside the
segments, each run has an empty 0600 lock file, made by its first save that
may use shared memory and kept until the run is closed or the daemon stops
(segments come and go under the cap; the lock file does not). Closing the
run unlinks it, so its trainers' next saves see st_nlink 0 and ask the
daemon (which answers FAILED_PRECONDITION for the closed run); a reopened
run gets a lock file of another name, and a held save naming the old one
is refused. The
invariant is "a save of the run is in flight <=> someone holds an exclusive
flock(2) of it": the daemon holds it (through `RunLock`, its own open file
description) for each save it accepts the ordinary way, and a trainer on
this host takes it LOCK_NB itself, copies into the segment and sends a
"held" header (`SaveHeader.held`) instead of asking. flock locks belong to
an open file description, so every saver's fd and the daemon's contend with
each other even inside one process, and a killed process lets go of its lock.

Each segment stays mapped while its run lives, so a run's segment memory
(its snapshot size) is held between saves; it is freed when the run is
closed, re-registered with another layout, or the daemon stops, and idle
segments give way (least recently used first) when all of them together
would pass the daemon's cap (--max-staging-bytes).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from checkpointd.core.config import DEFAULT_SHM_ROOT
from checkpointd.protocol.busy_lock import BusyLock
from checkpointd.protocol.names import SHM_FOLDER
from checkpointd.protocol.wire import aligned_offsets

_LOGGER = logging.getLogger(__name__)
# Not MAP_POPULATE: the daemon only reads a segment, once the trainer has
# written it, and read faults map a tmpfs file's pages many at a time
# (fault-around), which costs less than populating every page one by one at
# creation, on the first save's path. The pages stay mapped for later saves.
_FLAGS = mmap.MAP_SHARED


def default_shm_root() -> Path | None:
    """`DEFAULT_SHM_ROOT` (/dev/shm) where it exists (Linux), else None: no shared memory."""
    return DEFAULT_SHM_ROOT if DEFAULT_SHM_ROOT.is_dir() else None


@dataclass
class Segment:
    """One run's mapped segment, laid out for one snapshot's part sizes."""

    path: Path
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    size: int
    _map: mmap.mmap

    def views(self) -> list[memoryview]:
        """One writable view per part at its offset (the map is page aligned)."""
        whole = memoryview(self._map)
        return [whole[o : o + n] for o, n in zip(self.offsets, self.sizes, strict=True)]

    def image(self) -> memoryview:
        """The whole segment, from its page-aligned start."""
        return memoryview(self._map)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive; the map goes with it
        self.path.unlink(missing_ok=True)


class RunLock:
    """The daemon's open file description of one run's busy lock file.

    Not thread-safe: `checkpointd.saves.runs.Lanes` calls it under its lock.
    """

    def __init__(self, path: Path) -> None:
        """Opens (making it, 0600, if needed) the lock file at `path`.

        Raises:
            OSError: it cannot be opened.
        """
        self.path = path
        self._lock = BusyLock(str(path), create=True)
        self.held = False
        self.closed = False

    def try_hold(self) -> bool:
        """Takes the exclusive flock without waiting; False if someone else holds it."""
        if not self.held:
            self.held = self._lock.try_take()
        return self.held

    def release(self) -> None:
        if self.held:
            self._lock.release()
            self.held = False

    def close(self) -> None:
        """Unlinks the file (trainers holding it see st_nlink 0) and closes it."""
        if not self.closed:
            self.closed = True
            self.path.unlink(missing_ok=True)
            self.release()
            self._lock.close()


class SharedMemory:
    """The daemon's segments, one per run, at most `max_bytes` in all. Thread-safe.

    A segment is busy from `segment()` until `release()` (its save); when a
    new one would pass `max_bytes`, the least recently used idle segments
    of other runs are freed first (a run that stopped saving without closing
    does not keep its memory forever), and if that is not enough the save
    goes over gRPC.
    """

    def __init__(self, root: Path, max_bytes: int) -> None:
        """Makes this daemon's private folder under `root`, clearing dead daemons' ones.

        Raises:
            OSError: the folder cannot be made.
        """
        self._root = Path(root)
        self._max_bytes = max_bytes
        remove_dead_folders(self._root)
        self._dir = self._root / f"checkpointd-{os.getpid()}-{secrets.token_hex(8)}"
        self._dir.mkdir(mode=0o700)
        self._lock = threading.Lock()
        # Least recently used first: a segment moves to the end when it is used.
        self._segments: dict[str, Segment] = {}
        self._busy: set[str] = set()
        self._warned: set[str] = set()
        self._serial = 0
        self._locks: dict[str, RunLock] = {}

    @property
    def nbytes(self) -> int:
        """The bytes of every segment held now."""
        with self._lock:
            return sum(s.size for s in self._segments.values())

    @property
    def folder(self) -> Path:
        return self._dir

    def segment(
        self, run: str, sizes: Sequence[int], layout: tuple[Sequence[int], int] | None = None
    ) -> Segment | None:
        """The run's segment for parts of `sizes`, made or remade as needed.

        `layout`, if given, is each part's offset and the segment's size (a
        format's image of its data file); by default each part starts on
        the next 64-byte boundary after the one before (`aligned_offsets`).
        Call it only while holding the run's lane (one save at a time).
        Returns None when the segment cannot be made, e.g. the tmpfs has
        no room (logged): the save then goes over the wire.
        """
        sizes = tuple(sizes)
        offsets, size = aligned_offsets(sizes) if layout is None else (list(layout[0]), layout[1])
        with self._lock:
            old = self._segments.pop(run, None)
            if old is not None and old.sizes == sizes and old.offsets == tuple(offsets) and old.size == size:
                self._segments[run] = old  # now the most recently used
                self._busy.add(run)
                return old
            freed = [old] if old is not None else []
            held = sum(s.size for s in self._segments.values())
            idle = [r for r in self._segments if r not in self._busy]
            if held - sum(self._segments[r].size for r in idle) + size > self._max_bytes:
                idle = []  # it cannot fit even then: free nothing for it
            for other in idle:
                if held + size <= self._max_bytes:
                    break
                evicted = self._segments.pop(other)
                held -= evicted.size
                freed.append(evicted)
            fits = 0 < size and held + size <= self._max_bytes
            if fits:
                self._serial += 1
                serial = self._serial
                self._busy.add(run)
            warn = not fits and size > 0 and run not in self._warned
            if warn:
                self._warned.add(run)
        for segment in freed:
            segment.close()
        if not fits:
            if warn:
                _LOGGER.warning(
                    "run %s: a %d-byte shared-memory segment would pass the %d bytes that "
                    "segments may hold (--max-staging-bytes) with %d held by saves in flight; "
                    "its saves go over gRPC until there is room",
                    run,
                    size,
                    self._max_bytes,
                    held,
                )
            return None
        path = self._dir / f"{run}-{serial}"
        try:
            segment = _make(path, tuple(sizes), tuple(offsets), size)
        except OSError as e:
            with self._lock:
                self._busy.discard(run)
            why = "no room for" if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG) else "cannot make"
            _LOGGER.warning(
                "run %s: %s a %d-byte shared-memory segment in %s (%s); this save goes over gRPC",
                run,
                why,
                size,
                self._dir,
                e.strerror or e,
            )
            return None
        with self._lock:
            self._segments[run] = segment
        return segment

    def lock(self, run: str, *, make: bool = True) -> RunLock | None:
        """The run's busy lock, made at the first call with `make`; None if it cannot be made (logged once).

        Kept until `close()`, whatever happens to the run's segment.
        """
        with self._lock:
            lock = self._locks.get(run)
            if lock is not None or not make:
                return lock
            self._serial += 1
            try:
                lock = self._locks[run] = RunLock(self._dir / f"{run}-{self._serial}.lock")
            except OSError as e:
                if run not in self._warned:
                    self._warned.add(run)
                    _LOGGER.warning("run %s: cannot make its busy lock in %s (%s)", run, self._dir, e.strerror or e)
                return None
            return lock

    def release(self, run: str) -> None:
        """Ends the run's save that `segment()` gave a segment to."""
        with self._lock:
            self._busy.discard(run)

    def drop(self, run: str) -> None:
        """Frees the run's segment, if it has one."""
        with self._lock:
            segment = self._segments.pop(run, None)
            self._busy.discard(run)
        if segment is not None:
            segment.close()

    def drop_lock(self, run: str) -> None:
        """Removes the run's busy lock file (the run was closed, its lane idle); a later save makes a new one."""
        with self._lock:
            lock = self._locks.pop(run, None)
        if lock is not None:
            lock.close()

    def close(self) -> None:
        """Frees every segment and removes the folder."""
        with self._lock:
            segments, self._segments = list(self._segments.values()), {}
            locks, self._locks = list(self._locks.values()), {}
        for segment in segments:
            segment.close()
        for lock in locks:
            lock.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _make(path: Path, sizes: tuple[int, ...], offsets: tuple[int, ...], size: int) -> Segment:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        mapped = mmap.mmap(fd, size, flags=_FLAGS)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)  # the map keeps the memory
    return Segment(path, sizes, offsets, size, mapped)


def remove_dead_folders(root: Path) -> None:
    """Removes segment folders of this user's daemons that no longer run."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        match = SHM_FOLDER.fullmatch(entry.name)
        if match is None or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if not _running(int(match.group(1))):
            _LOGGER.info("removing the shared-memory folder %s of a daemon that stopped", entry.path)
            shutil.rmtree(entry.path, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
