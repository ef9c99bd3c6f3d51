"""A local root's committed files as bytes, for RestoreFiles: listed from the manifest, read with pread.

The bytes go out as the committed files hold them; nothing is decoded. A save
that is a dir of its own lists its files relative to that dir; a training
checkpoint's prefix, relative to its checkpoint dir, beside its manifest.

`Verified` vouches for files a client on this host may read in place: each
is checked once against its manifest's size and CRC32C, and known after by
its stat (device, inode, mtime, size), so a file replaced or rewritten
since is checked again, and one that no longer matches is not vouched for.

Every file is opened through the save's dir, held open (`open_base`: from
`/` along the real path its listing took) with `O_NOFOLLOW` at every
component below (`checkpointd.durable.dirs.open_file`): a link put in the
save's path since it was committed is refused, never followed.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

from checkpointd.core.ports import CommittedSave, SavedFile
from checkpointd.durable import dirs
from checkpointd.protocol.errors import InvalidRequestError, RunNotFoundError, SaveFailedError
from checkpointd.protocol.wire import FILE_CHUNK_BYTES
from checkpointd.storage import save_manifest


def base_dir(save: CommittedSave) -> Path:
    """The dir a save's manifest paths are relative to."""
    path = Path(save.path)
    return path.parent if save.prefix else path


def manifest_name(save: CommittedSave) -> str:
    """The save's manifest's file name in `base_dir`."""
    return save.path.name + save_manifest.PREFIX_MANIFEST_SUFFIX if save.prefix else save_manifest.MANIFEST_NAME


def open_base(save: CommittedSave) -> int:
    """The save's `base_dir`, opened from `/` along the real path its listing took, following no link.

    Raises:
        InvalidRequestError: a component of its path is a link now.
        RunNotFoundError: its dir is gone, or a file is in its place.
        SaveFailedError: it could not be opened otherwise.
    """
    try:
        return dirs.open_real(os.fspath(base_dir(save)))
    except dirs.Moved as e:
        raise _linked(save, e) from None
    except (FileNotFoundError, NotADirectoryError):
        raise RunNotFoundError(f"the save {save.export_dir!r} is no longer committed (its dir is gone)") from None
    except OSError as e:
        raise SaveFailedError(f"{save.export_dir!r}: cannot open its dir ({e.strerror or e})") from None


def _linked(save: CommittedSave, e: dirs.Moved) -> InvalidRequestError:
    return InvalidRequestError(
        f"{save.export_dir!r}: {e}, put in the save's path after it was committed; it is not followed "
        "and nothing was read through it: keep links out of the run's folder"
    )


def files_of(save: CommittedSave) -> list[SavedFile]:
    """Every file of a local committed save, as its manifest lists them.

    Raises:
        RunNotFoundError: the manifest is gone or unreadable (the save was deleted).
        InvalidRequestError: a link is in the save's path.
    """
    base = open_base(save)
    try:
        document = save_manifest.read_manifest(Path(dirs.fd_path(base)), manifest_name(save))
    except save_manifest.ManifestError as e:
        raise RunNotFoundError(f"the save {save.path} is no longer committed ({e})") from None
    finally:
        os.close(base)
    return [SavedFile(e.path, e.size, int(e.crc32c, 16)) for e in document["files"]]


def read_ranges(save: CommittedSave, ranges: Sequence[tuple[str, int, int]]) -> Iterator[bytes]:
    """Each (path, offset, length) of the save's files, in order, as pread pieces of at most FILE_CHUNK_BYTES.

    Raises:
        SaveFailedError: a file is missing, unreadable, or shorter than asked.
        InvalidRequestError: a link is in the save's path, or in a file's.
        RunNotFoundError: the save's dir is gone.
    """
    base = open_base(save)
    try:
        for path, offset, length in ranges:
            yield from _read_range(save, base, path, offset, length)
    finally:
        os.close(base)


def _read_range(save: CommittedSave, base: int, path: str, offset: int, length: int) -> Iterator[bytes]:
    try:
        fd = dirs.open_file(base, path)
    except dirs.Moved as e:
        raise _linked(save, e) from None
    except OSError as e:
        raise SaveFailedError(f"{save.export_dir!r}: cannot open {path} ({e.strerror or e})") from None
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

    def check(self, save: CommittedSave, files: Sequence[SavedFile]) -> dict[str, tuple[int, int, int]]:
        """(st_dev, st_ino, st_mtime_ns) of each file of `save` that matches its size and CRC32C.

        A file behind a link, or gone, is not vouched for.

        Raises:
            InvalidRequestError, RunNotFoundError, SaveFailedError: as `open_base`.
        """
        out = {}
        base = open_base(save)
        try:
            for f in files:
                try:
                    fd = dirs.open_file(base, f.path)
                except (OSError, dirs.Moved):
                    continue
                try:
                    if self._matches(save, f, fd):
                        st = os.fstat(fd)
                        out[f.path] = (st.st_dev, st.st_ino, st.st_mtime_ns)
                finally:
                    os.close(fd)
        finally:
            os.close(base)
        return out

    def _matches(self, save: CommittedSave, f: SavedFile, fd: int) -> bool:
        st = os.fstat(fd)
        key = (f"{base_dir(save)}/{f.path}", st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, f.crc32c)
        with self._lock:
            if key in self._known:
                return True
        try:
            size, crc = save_manifest.file_checksum(dirs.fd_path(fd), mapped=True)  # the open file itself
        except OSError:
            return False
        if size != f.size or crc != f.crc32c or os.fstat(fd).st_mtime_ns != st.st_mtime_ns:
            return False
        with self._lock:
            self._known[key] = None
            while len(self._known) > self._capacity:
                self._known.popitem(last=False)
        return True
