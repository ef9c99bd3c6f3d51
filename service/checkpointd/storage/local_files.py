"""A local root's committed files as bytes, for RestoreFiles: listed from the manifest, read with pread.

The bytes go out as the committed files hold them; nothing is decoded. A save
that is a dir of its own lists its files relative to that dir; a training
checkpoint's prefix, relative to its checkpoint dir, beside its manifest.

`Verified` vouches for files a client on this host may read in place: each
is checked once against its manifest's size and CRC32C, and known after by
its stat (device, inode, mtime, size), so a file replaced or rewritten
since is checked again, and one that no longer matches is not vouched for.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

from checkpointd.core.ports import CommittedSave, SavedFile
from checkpointd.durable import dirs
from checkpointd.protocol.errors import RunNotFoundError, SaveFailedError
from checkpointd.protocol.wire import FILE_CHUNK_BYTES
from checkpointd.storage import save_manifest


def base_dir(save: CommittedSave) -> Path:
    """The dir a save's manifest paths are relative to."""
    path = Path(save.path)
    return path.parent if save.prefix else path


def manifest_name(save: CommittedSave) -> str:
    """The save's manifest's file name in `base_dir`."""
    return save.path.name + save_manifest.PREFIX_MANIFEST_SUFFIX if save.prefix else save_manifest.MANIFEST_NAME


def files_of(save: CommittedSave) -> list[SavedFile]:
    """Every file of a local committed save, as its manifest lists them.

    Raises:
        RunNotFoundError: the manifest is gone or unreadable (the save was deleted).
    """
    try:
        document = save_manifest.read_manifest(base_dir(save), manifest_name(save))
    except save_manifest.ManifestError as e:
        raise RunNotFoundError(f"the save {save.path} is no longer committed ({e})") from None
    return [SavedFile(e.path, e.size, int(e.crc32c, 16)) for e in document["files"]]


def read_ranges(save: CommittedSave, ranges: Sequence[tuple[str, int, int]]) -> Iterator[bytes]:
    """Each (path, offset, length) of the save's files, in order, as pread pieces of at most FILE_CHUNK_BYTES.

    Raises:
        SaveFailedError: a file is missing, unreadable, or shorter than asked.
    """
    # Through the save's dir as it was listed, opened once: a link put in its
    # path since, or in place of one of its files, is never followed.
    try:
        base = dirs.open_real(os.fspath(base_dir(save)))
    except (OSError, dirs.Moved) as e:
        raise SaveFailedError(f"{save.export_dir!r}: cannot open its dir ({e})") from None
    try:
        for path, offset, length in ranges:
            yield from _read_range(save, base, path, offset, length)
    finally:
        os.close(base)


def _read_range(save: CommittedSave, base: int, path: str, offset: int, length: int) -> Iterator[bytes]:
    parent, _, name = path.rpartition("/")
    try:
        where, _ = dirs.open_below(base, parent.split("/") if parent else [])
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=where)
        finally:
            os.close(where)
    except (OSError, dirs.Moved) as e:
        raise SaveFailedError(
            f"{save.export_dir!r}: cannot open {path} ({e.strerror if isinstance(e, OSError) and e.strerror else e})"
        ) from None
    try:
        end = offset + length
        while offset < end:
            data = os.pread(fd, min(FILE_CHUNK_BYTES, end - offset), offset)
            if not data:
                raise SaveFailedError(f"{save.export_dir!r}: {path} ends at {offset}, before {end}")
            yield data  # bytes: a chunk message takes them without another copy
            offset += len(data)
    except OSError as e:
        raise SaveFailedError(f"{save.export_dir!r}: cannot read {path} ({e.strerror})") from None
    finally:
        os.close(fd)


class Verified:
    """The stats of committed files found to match their manifests. Thread-safe.

    Args:
        capacity: how many files it remembers (the oldest are forgotten first).
    """

    def __init__(self, capacity: int = 4096) -> None:
        self._lock = threading.Lock()
        self._known: OrderedDict[tuple[str, int, int, int, int, int], None] = OrderedDict()
        self._capacity = capacity

    def check(self, base: Path, files: Sequence[SavedFile]) -> dict[str, tuple[int, int, int]]:
        """(st_dev, st_ino, st_mtime_ns) of each file under `base` that matches its size and CRC32C."""
        out = {}
        for f in files:
            full = base / f.path
            try:
                st = os.stat(full)
            except OSError:
                continue
            key = (str(full), st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, f.crc32c)
            with self._lock:
                known = key in self._known
            if not known:
                try:
                    size, crc = save_manifest.file_checksum(full, mapped=True)
                except OSError:
                    continue
                if size != f.size or crc != f.crc32c or os.stat(full).st_mtime_ns != st.st_mtime_ns:
                    continue
                with self._lock:
                    self._known[key] = None
                    while len(self._known) > self._capacity:
                        self._known.popitem(last=False)
            out[f.path] = (st.st_dev, st.st_ino, st.st_mtime_ns)
        return out
