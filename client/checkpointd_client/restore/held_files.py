"""A save's files on the daemon's host, held open while TensorFlow may still read them.

An in-place restore reads the committed files where the daemon keeps them.
TensorFlow reads a checkpoint by path, and not only in `restore()`: values
it defers (an optimizer's slots, restored when the optimizer builds them on
its first apply; objects added later) are read when those objects appear,
from the same path, through a new reader (`CheckpointPosition` keeps the
prefix, not an open file). By then retention may have deleted the save (a
newer one past `max_to_keep`), or a save of the same name may have replaced
it: the deferred read would fail, or silently restore the other save's
values.

So the files are opened once, each checked by `fstat` against the stat the
daemon vouched for (its manifest checked that very inode), and TensorFlow is
given a private dir of symlinks to those open descriptors
(`/proc/<pid>/fd/N`, which open the file they hold even once it is
unlinked). Every later read, deferred ones included, gets the bytes of the
save the restore started from. Closing releases the descriptors (and with
them a deleted save's disk space). Where there is no `/proc` (not Linux), or
a file is not there as vouched, there is nothing to hold: the caller fetches
the files instead.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Sequence

from checkpointd.protocol import wire
from checkpointd.v1 import checkpointd_pb2 as pb

_LOGGER = logging.getLogger(__name__)

INDEX_SUFFIX = ".index"
# Where the symlinks go: memory where there is some, they are tiny either way.
LINKS_PARENT = "/dev/shm"
DIR_PREFIX = "checkpointd-in-place-"


class HeldFiles:
    """A save's files, open, behind a private dir of links TensorFlow reads them through.

    Attributes:
        directory: the dir to read the files from, at the paths the daemon
            listed them (relative to its own dir).
        index: the bytes of the save's index file (checked against its
            manifest's CRC32C), or b"" if none was asked for.
    """

    def __init__(self, directory: str, fds: Sequence[int], index: bytes) -> None:
        self.directory = directory
        self.index = index
        self._fds = list(fds)

    def close(self) -> None:
        """Releases the files and removes the links; idempotent."""
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        shutil.rmtree(self.directory, ignore_errors=True)


def hold(header: pb.RestoreFilesHeader, *, check_index: bool = True) -> HeldFiles | None:
    """The header's files, held open where the daemon keeps them, if each is there as it vouched.

    Args:
        header: the daemon's RestoreFiles header (its `local_dir` and each
            file's stat).
        check_index: read the index file and check it against its
            manifest's CRC32C (a training checkpoint's restore reads it).

    Returns:
        The held files, or None if they cannot be read in place here (no
        `local_dir`, no `/proc`, a file missing or of another stat, an
        index that does not match): fetch them instead.
    """
    fd_dir = f"/proc/{os.getpid()}/fd"
    if not header.local_dir or not os.path.isdir(fd_dir):
        return None
    fds: list[int] = []
    try:
        index = b""
        for f in header.files:
            fd = _open_as_vouched(header.local_dir, f)
            if fd is None:
                _release(fds)
                return None
            fds.append(fd)
            if check_index and f.path.endswith(INDEX_SUFFIX):
                index = os.pread(fd, f.size, 0)
                if len(index) != f.size or wire.crc32c_of(index) != f.crc32c:
                    _release(fds)
                    return None
        directory = _links_dir()
        try:
            for f, fd in zip(header.files, fds, strict=True):
                link = os.path.join(directory, f.path)
                os.makedirs(os.path.dirname(link), exist_ok=True)
                os.symlink(f"{fd_dir}/{fd}", link)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
    except BaseException:
        _release(fds)
        raise
    return HeldFiles(directory, fds, index)


def _open_as_vouched(local_dir: str, f: pb.RestoreFile) -> int | None:
    """`f` opened, if the file at its path is the one the daemon checked (same device, inode, mtime, size)."""
    if not f.inode or os.path.isabs(f.path) or ".." in f.path.split("/"):
        return None
    try:
        fd = os.open(os.path.join(local_dir, f.path), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size) != (f.device, f.inode, f.mtime_ns, f.size):
        os.close(fd)
        return None
    return fd


def _release(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    fds.clear()


def _links_dir() -> str:
    """A new links dir, named after this process; the first one a process makes sweeps those of dead ones first."""
    usable = os.path.isdir(LINKS_PARENT) and os.access(LINKS_PARENT, os.W_OK)
    parent = LINKS_PARENT if usable else tempfile.gettempdir()
    if not _swept:
        _swept.append(parent)
        swept = sweep(parent)
        if swept:
            _LOGGER.info("removed %d in-place restore dirs of trainers gone without close() from %s", swept, parent)
    return tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir=parent)


_swept: list[str] = []  # the parent swept by this process, once


def sweep(parent: str) -> int:
    """Removes the links dirs under `parent` whose process is gone (killed before `close()`); returns how many.

    A dir is this user's and named `<DIR_PREFIX><pid>-...`; one of an older
    client (no pid in its name) is its links' owner's, from their
    `/proc/<pid>/fd/N` targets. A live process's, or one whose owner cannot
    be told, is left alone.
    """
    removed = 0
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return 0
    for entry in entries:
        if not entry.name.startswith(DIR_PREFIX):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        pid = _owner(entry.path, entry.name[len(DIR_PREFIX) :])
        if pid is not None and pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += 1
    return removed


def _owner(path: str, rest: str) -> int | None:
    """The pid that made the links dir at `path` (`rest`: its name after DIR_PREFIX), or None if it cannot be told."""
    head = rest.split("-", 1)[0]
    if head.isdigit() and "-" in rest:
        return int(head)
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            try:
                parts = os.readlink(os.path.join(dirpath, name)).split("/")  # /proc/<pid>/fd/<n>
            except OSError:
                continue
            if len(parts) == 5 and parts[1] == "proc" and parts[2].isdigit() and parts[3] == "fd":
                return int(parts[2])
    return None
