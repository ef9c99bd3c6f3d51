"""The local-disk Store: saves under `--root`, published by rename.

A save is written into a temp sibling of its target, its save manifest is
written last (`checkpointd.storage.save_manifest`), the tree is fsynced and
renamed into place. At every instant the target is the complete old tree, the complete new tree,
or (only between the two renames of a replacement) absent with the old tree
parked beside it as `.checkpointd-old-<name>-<hex>`. `recover` repairs that
window and clears leftover temp dirs when the daemon starts. Saves that
are checkpoint prefixes sharing a dir (training checkpoints) are committed
by `checkpointd.storage.prefix` instead of the dir rename. Stdlib only
(and crc32c, for the manifest).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import functools
import logging
import os
import secrets
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path, PurePath
from types import TracebackType

from checkpointd.core.ports import CommittedSave, SaveMeta, Staged
from checkpointd.protocol.errors import InvalidRequestError, RunNotFoundError, SaveFailedError
from checkpointd.protocol.names import (
    OLD_PREFIX,
    RESERVED_PREFIX,
    RETIRED_PREFIX,
    SUFFIX_HEX_LEN,
    TMP_PREFIX,
    check_export_dir,
    check_run_name,
)
from checkpointd.storage import prefix, save_manifest

_LOGGER = logging.getLogger(__name__)

# The names this store derives from a save's <name> (TMP_PREFIX, OLD_PREFIX,
# RETIRED_PREFIX, each with "-<16 hex>") are defined with the export-dir rules
# in checkpointd.protocol.names, which limit <name> to MAX_EXPORT_NAME_BYTES so
# that they fit a filesystem name.
_HEX_LEN = SUFFIX_HEX_LEN


def _suffix() -> str:
    return secrets.token_hex(_HEX_LEN // 2)


def make_temp_sibling(target: Path) -> Path:
    """Creates an empty temp dir next to `target` to write into.

    Args:
        target: Where the finished tree will be published.

    Returns:
        `<target.parent>/.checkpointd-tmp-<target.name>-<hex>`, created, with
        any missing parents of `target` created too.

    Raises:
        OSError: if the parents or the temp dir cannot be created.
    """
    target = Path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        # mkdir says "File exists" when the parent is a file; say what is wrong.
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(target.parent)) from None
    tmp = target.parent / f"{TMP_PREFIX}{target.name}-{_suffix()}"
    tmp.mkdir()
    return tmp


def _fsync_dir(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Fsyncs every regular file and directory under `path`, and `path`.

    Directories are synced after their contents so new entries are durable.
    Symlinks are not followed.
    """
    path = Path(path)
    if not path.is_dir() or path.is_symlink():
        _fsync_file(path)
        return
    _fsync_below(path)
    _fsync_dir(path)


def _fsync_below(path: Path, skip: str | None = None) -> None:
    """Fsyncs every regular file and dir under the dir `path`, each dir after what is in it, but not `path`.

    Symlinks are not followed, nor is the file `path/<skip>` synced (a
    commit's manifest, which its writer syncs). `path` is the caller's to
    fsync once no entry is added to it any more (`fsync_tree` at once; a
    commit after the manifest).
    """
    top = os.fspath(path)
    for dirpath, _dirnames, filenames in os.walk(top, topdown=False):
        for name in filenames:
            file = os.path.join(dirpath, name)
            if not os.path.islink(file) and not (name == skip and dirpath == top):
                _fsync_file(file)
        if dirpath != top:
            _fsync_dir(dirpath)


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
    regular file has grown by since the last look. The daemon's dirty
    threshold (a tenth of free memory by default) is far above a save's
    size, so without this the disk would start on a 400 MB data file only at
    the commit's fsync; with it, the disk works while SaveV2 still copies,
    and the fsync finds little left to write. It never waits for the disk
    and guarantees nothing: the fsync before publishing does. Files are
    opened once (by inode) and followed through renames (SaveV2 writes a
    `.tempstate` name and renames it). Errors are ignored for the same
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
        files: dict[int, tuple[int, int]] = {}  # inode -> (fd, bytes handed to the disk)
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
                                files[inode] = (fd, 0)
                    except OSError:
                        continue
                for inode, (fd, done) in files.items():
                    try:
                        size = os.fstat(fd).st_size
                        if size > done:
                            sync_range(fd, done, size - done)
                            files[inode] = (fd, size)
                    except OSError as e:
                        _LOGGER.debug("writeback in %s: %s", self._directory, e)
        finally:
            for fd, _ in files.values():
                os.close(fd)


# The staging dirs of LocalStores that fsync, while they are being written:
# only their files are handed to the disk early. Another store's staging (the
# S3 store's is never fsynced: a save is durable once in the bucket) would
# only be written to disk for nothing.
_fsynced_staging: set[Path] = set()
_fsynced_staging_lock = threading.Lock()


@contextlib.contextmanager
def writing(directory: Path, nbytes: int) -> Iterator[None]:
    """Around a format's write of `nbytes` into `directory`: for one of at least WRITEBACK_BYTES,
    a `Writeback` if `directory` (or its parent) is the staging dir of a LocalStore that fsyncs,
    and the heap's free pages handed back to the system before and after (`release_free_memory`)."""
    directory = Path(directory)
    if nbytes < WRITEBACK_BYTES:
        yield
        return
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
    above it (the writeback thread's, for one), so without this the daemon
    kept those 8 MiB (and other freed pages) resident after a large save: a
    medium (40 MB) save's peak over idle was 1.22-1.32 x its payload with the
    writeback, 1.09-1.20 with a trim after the write, 1.10 with one before
    it too (what is freed by then is not in the save's peak). About a
    millisecond each, on writes of WRITEBACK_BYTES or more only.
    """
    trim = _libc_malloc_trim()
    if trim is not None:
        trim(0)


def remove_quietly(path: Path) -> None:
    """Deletes a file or tree if it exists; logs, never raises, on failure."""
    path = Path(path)
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError as e:
        _LOGGER.warning("could not remove %s: %s", path, e)


def publish_dir(tmp: Path, target: Path, *, fsync: bool = True, synced: bool = False) -> None:
    """Renames the finished tree `tmp` to `target`, replacing an old tree.

    Args:
        tmp: A complete tree, usually from `make_temp_sibling(target)`.
        target: The published path; an existing directory there is replaced.
        fsync: Whether to fsync the tree and the parent (off only in tests).
        synced: The caller has fsynced every file and dir of `tmp` already
            (`LocalStore.commit`); only the parent is fsynced here.

    Raises:
        SaveFailedError: if `target` exists and is not a directory.
        OSError: if a rename or fsync fails; `tmp` is then left for the caller.
    """
    tmp, target = Path(tmp), Path(target)
    parent = target.parent
    if fsync and not synced:
        fsync_tree(tmp)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        # A symlink to a directory is refused too: renaming over it would
        # replace the link, not the tree the user pointed it at.
        raise SaveFailedError(
            f"cannot publish to {target}: it exists and is not a directory; "
            "move it away or choose another export_dir"
        )
    if not target.exists():
        os.rename(tmp, target)
        if fsync:
            _fsync_dir(parent)
        return
    old = parent / f"{OLD_PREFIX}{target.name}-{_suffix()}"
    os.rename(target, old)
    try:
        os.rename(tmp, target)
    except OSError:
        # Put the old tree back so a failed save leaves what was there.
        os.rename(old, target)
        raise
    if fsync:
        _fsync_dir(parent)
    remove_quietly(old)


def _split_old(name: str) -> str | None:
    """Returns `<name>` of `.checkpointd-old-<name>-<hex>`, or None."""
    return _split_suffixed(name, OLD_PREFIX)


def _split_suffixed(name: str, head: str) -> str | None:
    """Returns `<name>` of `<head><name>-<hex>`, or None."""
    if not name.startswith(head):
        return None
    rest = name[len(head) :]
    base, sep, hexpart = rest.rpartition("-")
    if not sep or not base or len(hexpart) != _HEX_LEN:
        return None
    try:
        int(hexpart, 16)
    except ValueError:
        return None
    return base


def recover(root: Path) -> int:
    """Repairs interrupted publications under `root` (run at daemon start).

    Deletes every `.checkpointd-tmp-*` dir, and every `.checkpointd-tmp-<name>-<hex>`
    file (a state file being replaced, `LocalStore.write_file`). Renames every
    `.checkpointd-old-<name>-<hex>` dir back to `<name>` if `<name>` is
    absent, else deletes it. Symlinks are not followed; other names are
    never touched.

    Returns:
        The number of entries deleted or renamed.
    """
    fixed = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in filenames:
            if _split_suffixed(name, TMP_PREFIX) is not None:
                _LOGGER.info("recover: deleting unfinished temp file %s", Path(dirpath, name))
                Path(dirpath, name).unlink(missing_ok=True)
                fixed += 1
        keep = []
        for name in sorted(dirnames):
            entry = Path(dirpath, name)
            if entry.is_symlink():
                continue
            if name.startswith(TMP_PREFIX):
                _LOGGER.info("recover: deleting unfinished temp dir %s", entry)
                remove_quietly(entry)
                fixed += 1
                continue
            base = _split_old(name)
            if base is None:
                keep.append(name)
                continue
            original = Path(dirpath, base)
            if os.path.lexists(original):
                _LOGGER.info("recover: deleting replaced tree %s", entry)
                remove_quietly(entry)
            else:
                _LOGGER.warning("recover: restoring %s from %s", original, entry)
                os.rename(entry, original)
                keep.append(base)
            fixed += 1
        dirnames[:] = keep
    return fixed


def resolve_export_dir(root: Path, run: str, export_dir: str) -> Path:
    """Returns the absolute target of a save: `<root>/<run>/<export_dir>`.

    Symlinks on the way are followed and must stay inside `<root>/<run>`.

    Raises:
        InvalidRequestError: if the run name or export dir is invalid, or the
            path resolves outside the run's folder.
    """
    check_run_name(run)
    relative = check_export_dir(export_dir)
    run_dir = Path(os.path.realpath(root / run))
    target = run_dir / relative
    # `run_dir` is real and `relative` has no '.' or '..': without a symlink
    # below `run_dir`, `target` is its own realpath. Looking for one costs an
    # lstat per part of `relative`, not per part of the whole path (twice per
    # save: at the accept and at the write).
    if _has_symlink(run_dir, relative.parts):
        real = Path(os.path.realpath(target))
        if real != target and run_dir not in real.parents:
            raise InvalidRequestError(
                f"export_dir {export_dir!r} resolves outside the run's folder (through a symlink)"
            )
    return target


def _has_symlink(base: Path, parts: tuple[str, ...]) -> bool:
    """Whether `base/parts[0]`, `base/parts[0]/parts[1]`, ... holds a symlink (up to the first absent one)."""
    path = os.fspath(base)
    for part in parts:
        path = os.path.join(path, part)
        try:
            if stat.S_ISLNK(os.lstat(path).st_mode):
                return True
        except OSError:
            return False  # absent (or unreadable) here and below: realpath keeps the rest as it is
    return False


class LocalStore:
    """Committed saves in a directory tree: `<root>/<folder>/<export_dir>/`.

    Implements `checkpointd.core.ports.Store`. Thread-safe: every save has a
    temp dir of its own, and a replacement is two renames.
    """

    def __init__(
        self,
        root: Path,
        *,
        fsync: bool = True,
        thread_initializer: Callable[[], None] | None = None,
    ) -> None:
        """Creates the store; the root is made if missing.

        Args:
            root: the daemon's --root.
            fsync: whether to fsync saves before publishing them (off only in tests).
            thread_initializer: run in the threads that fsync (e.g. to lower
                their priority as the writer threads' is).
        """
        self.root = Path(root)
        self._fsync = fsync
        # fsyncs a save's files while its manifest's CRCs read them back.
        self._syncer = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="fsync", initializer=thread_initializer)

    def describe(self) -> str:
        return str(self.root.resolve())

    def location(self, path: PurePath) -> str:
        return str(path)

    def recover(self) -> int:
        return recover(self.root)

    def target(self, folder: str, export_dir: str) -> Path:
        return resolve_export_dir(self.root, folder, export_dir)

    def stage(self, target: PurePath) -> Path:
        staging = make_temp_sibling(Path(target))
        if self._fsync:
            with _fsynced_staging_lock:
                _fsynced_staging.add(staging)
        return staging

    def commit(self, staged: Staged, target: PurePath, meta: SaveMeta) -> int:
        target = Path(target)
        _unstage(staged.path)
        if staged.files_prefix is not None:  # named as they will be, so the manifest lists them so
            prefix.rename_staged(staged.path, staged.files_prefix, target.name)
        # The disk flushes the files and the dirs below the save's own (all
        # complete) while the manifest's CRCs read the files back from the
        # page cache (both release the GIL); the manifest is fsynced as it is
        # written, then the save's dir, after its last entry: every file and
        # dir once, before the rename.
        syncing = self._syncer.submit(_fsync_below, staged.path, save_manifest.MANIFEST_NAME) if self._fsync else None
        try:
            save_manifest.write_staged_manifest(staged, meta, fsync=self._fsync)
        finally:
            if syncing is not None:
                syncing.result()  # raises its OSError; the tree is not published
        if self._fsync:
            _fsync_dir(staged.path)
        if staged.files_prefix is not None:
            prefix.publish(staged.path, target, fsync=self._fsync)
        else:
            publish_dir(staged.path, target, fsync=self._fsync, synced=True)
        return staged.bytes_written  # the listed files' bytes, as verify counts them (not the manifest's)

    def discard(self, staged: Path) -> None:
        _unstage(staged)
        remove_quietly(staged)

    def committed(self, folder: str, run: str | None) -> list[CommittedSave]:
        folder_dir = self._folder_dir(folder)
        if not folder_dir.is_dir():
            return []
        saves = [_read(d, folder_dir) for d in save_manifest.find_save_dirs(folder_dir)]
        saves += [_read(p, folder_dir, is_prefix=True) for p in save_manifest.find_prefixes(folder_dir)]
        return [save for save in saves if save is not None and (run is None or save.run == run)]

    def committed_at(self, folder: str, export_dir: str) -> CommittedSave:
        target = resolve_export_dir(self.root, folder, export_dir)
        save = _read(target, self._folder_dir(folder)) if target.is_dir() else None
        if save is None and prefix.is_committed(target):  # a dir of that name may be there too
            save = _read(target, self._folder_dir(folder), is_prefix=True)
        if save is None:
            raise RunNotFoundError(
                f"no committed save at {export_dir!r} in folder {folder!r} (no such dir, or it has "
                f"no valid {save_manifest.MANIFEST_NAME})"
            )
        return save

    def delete(self, save: CommittedSave) -> bool:
        if save.prefix:
            return prefix.delete(Path(save.path))
        # Renamed away first (one step, so the save stops counting at once),
        # then deleted; a crash in between leaves a temp dir `recover` removes.
        path = Path(save.path)
        doomed = path.parent / f"{RETIRED_PREFIX}{path.name}-{_suffix()}"
        try:
            os.rename(path, doomed)
        except OSError as e:
            _LOGGER.warning("could not delete %s: %s", path, e)
            return False
        remove_quietly(doomed)
        return True

    def folders(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(
            e.name
            for e in os.scandir(self.root)
            if e.is_dir(follow_symlinks=False) and not e.name.startswith(RESERVED_PREFIX) and _is_run_name(e.name)
        )

    def read_file(self, path: PurePath) -> bytes | None:
        try:
            return Path(path).read_bytes()
        except FileNotFoundError:
            return None

    def write_file(self, path: PurePath, data: bytes) -> None:
        path = Path(path)
        # A temp sibling (removed by `recover` if a crash leaves it), fsynced,
        # then renamed over: readers see the old file or the new one.
        tmp = path.parent / f"{TMP_PREFIX}{path.name}-{_suffix()}"
        try:
            with open(tmp, "xb") as f:
                f.write(data)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self._fsync:
            _fsync_dir(path.parent)

    def close(self) -> None:
        self._syncer.shutdown(wait=True)

    def _folder_dir(self, folder: str) -> Path:
        # Absolute and real, as resolve_export_dir makes save paths.
        return Path(os.path.realpath(self.root / check_run_name(folder)))


def _unstage(staging: Path) -> None:
    with _fsynced_staging_lock:
        _fsynced_staging.discard(Path(staging))


def _is_run_name(name: str) -> bool:
    try:
        check_run_name(name)
    except InvalidRequestError:
        return False
    return True


def _read(save_dir: Path, folder_dir: Path, *, is_prefix: bool = False) -> CommittedSave | None:
    """The save at `save_dir` (a dir, or a checkpoint prefix), or None if it has no valid manifest."""
    try:
        if is_prefix:
            document = save_manifest.read_manifest(save_dir.parent, prefix.manifest_path(save_dir).name)
        else:
            document = save_manifest.read_manifest(save_dir)
        return save_manifest.committed_save(
            document, save_dir, save_dir.relative_to(folder_dir).as_posix(), prefix=is_prefix
        )
    except (save_manifest.ManifestError, KeyError, TypeError, ValueError) as e:
        _LOGGER.debug("not a committed save: %s (%s)", save_dir, e)
        return None
