"""Writeback while a save is written, and the heap handed back after: what a large write needs.

`writing` wraps a format's write of a save: for a large one, a `Writeback`
thread starts the disk on the files while they grow (if the staging dir is
one that will be fsynced, `mark_fsynced`), and glibc's free pages are given
back to the system before and after (`release_free_memory`). Below both
`checkpointd.formats` and `checkpointd.storage`. Stdlib only (ctypes for libc).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

_LOGGER = logging.getLogger(__name__)


# sync_file_range(2)'s SYNC_FILE_RANGE_WRITE: start writing the range's dirty pages out, without waiting.
_SYNC_FILE_RANGE_WRITE = 2
# How often `Writeback` hands the disk what was written since its last look.
WRITEBACK_INTERVAL = 0.05

# Files at least this large are handed to the disk as they are written
# (`writing`); below it a save's fsync is latency, not bandwidth.
WRITEBACK_BYTES = 8 << 20

SyncRange = Callable[[int, int, int], None]  # (fd, offset, nbytes); raises OSError


@functools.cache
def _libc_sync_file_range() -> SyncRange | None:
    """libc's sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE), or None where libc has none."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int

    def sync_range(fd: int, offset: int, nbytes: int) -> None:
        if function(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))

    return sync_range


class Writeback:
    """Starts the disk writing the files in `directory` while they are still being written.

    A context manager: while it is open, a thread looks at `directory` (not
    below it) every `interval` seconds and asks the kernel (Linux
    `sync_file_range`, SYNC_FILE_RANGE_WRITE) to start writing out what each
    regular file holds that is not yet on its way (`offset 0, nbytes 0`: the
    whole file, wherever it was written since the last look). The daemon's dirty
    threshold (a tenth of free memory by default) is far above a save's
    size, so without this the disk would start on a large data file only at
    the commit's fsync; with it, the disk works while the save is still
    being written, and the fsync finds little left to write. It never waits for the disk
    and guarantees nothing: the fsync before publishing does. Files are
    opened once (by inode) and followed through renames (a writer may write a
    `.tempstate` name and rename it, as SaveV2 does). Errors are ignored for the same
    reason; where libc has no sync_file_range it does nothing.
    """

    def __init__(
        self, directory: Path, *, interval: float = WRITEBACK_INTERVAL, sync_range: SyncRange | None = None
    ) -> None:
        """Args:
        directory: the dir whose files are being written.
        interval: seconds between looks.
        sync_range: the call that starts writeback (tests); default libc's.
        """
        self._directory = Path(directory)
        self._interval = interval
        self._sync_range = sync_range or _libc_sync_file_range()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Writeback:
        if self._sync_range is not None:
            self._thread = threading.Thread(target=self._run, name="writeback", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        sync_range = self._sync_range
        assert sync_range is not None
        files: dict[int, int] = {}  # inode -> fd
        try:
            while not self._stop.wait(self._interval):
                try:
                    entries = list(os.scandir(self._directory))
                except OSError:
                    continue
                for entry in entries:
                    try:
                        if entry.inode() not in files and entry.is_file(follow_symlinks=False):
                            fd = os.open(entry.path, os.O_RDONLY)
                            inode = os.fstat(fd).st_ino  # the name may have moved on since the scan
                            if inode in files:
                                os.close(fd)
                            else:
                                files[inode] = fd
                    except OSError:
                        continue
                for fd in files.values():
                    try:
                        # The whole file, not what it grew by: a bundle's tensors are written where they
                        # go (pwrite) in the wire's order, and an incremental save's copies land anywhere,
                        # so the pages written since the last look may lie anywhere below the end. The
                        # kernel finds the dirty pages by the page cache's tags: clean ones cost nothing.
                        sync_range(fd, 0, 0)
                    except OSError as e:
                        _LOGGER.debug("writeback in %s: %s", self._directory, e)
        finally:
            for fd in files.values():
                os.close(fd)


# The staging dirs that will be fsynced (a LocalStore's that fsyncs), while
# they are being written: only their files are handed to the disk early.
# Another store's staging (the S3 store's is never fsynced: a save is durable
# once in the bucket) would only be written to disk for nothing.
_fsynced_staging: set[Path] = set()
_fsynced_staging_lock = threading.Lock()


def mark_fsynced(staging: Path) -> None:
    """Says that `staging` will be fsynced before it is published: `writing` hands its files to the disk early."""
    with _fsynced_staging_lock:
        _fsynced_staging.add(staging if isinstance(staging, Path) else Path(staging))


def unmark_fsynced(staging: Path) -> None:
    """Undoes `mark_fsynced` (the staging dir is committed or discarded); a dir never marked is ignored."""
    with _fsynced_staging_lock:
        _fsynced_staging.discard(staging if isinstance(staging, Path) else Path(staging))


@contextlib.contextmanager
def writing(directory: Path | str, nbytes: int) -> Iterator[None]:
    """Around a format's write of `nbytes` into `directory`: for one of at least WRITEBACK_BYTES,
    a `Writeback` if `directory` (or its parent) is a staging dir that will be fsynced (`mark_fsynced`),
    and the heap's free pages handed back to the system before and after (`release_free_memory`)."""
    if nbytes < WRITEBACK_BYTES:
        yield
        return
    directory = Path(directory)
    with _fsynced_staging_lock:
        fsynced = directory in _fsynced_staging or directory.parent in _fsynced_staging
    release_free_memory()
    try:
        with Writeback(directory) if fsynced else contextlib.nullcontext():
            yield
    finally:
        release_free_memory()


@functools.cache
def _libc_malloc_trim() -> Callable[[int], int] | None:
    try:
        function = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


def release_free_memory() -> None:
    """Hands the heap's free pages back to the system (glibc `malloc_trim(0)`; elsewhere nothing).

    SaveV2 writes through an 8 MiB buffer of its own, freed when it returns;
    glibc keeps freed memory in its arenas wherever a live allocation sits
    above it (the writeback thread's, for one), so without a trim the daemon
    keeps that buffer (and other freed pages) resident after a large save,
    and the next save's peak starts from there. Trimming before the write
    too keeps what was freed by then out of the save's peak. Cheap next to
    the write, so it runs on writes of WRITEBACK_BYTES or more only.
    """
    trim = _libc_malloc_trim()
    if trim is not None:
        trim(0)
