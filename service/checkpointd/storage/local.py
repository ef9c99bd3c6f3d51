"""The local-disk Store: saves under `--root`, published by rename.

A save is written into a temp sibling of its target, its save manifest is
written last (`checkpointd.storage.save_manifest`), the tree is fsynced and
renamed into place (`checkpointd.durable.files`, which says what a reader
sees at every instant and how `recover` repairs a crash). Saves that
are checkpoint prefixes sharing a dir (training checkpoints) are committed
by `checkpointd.storage.prefix` instead of the dir rename. Where a save's
target is under the root is `checkpointd.storage.local_paths`'s. Stdlib only
(and crc32c, for the manifest).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path, PurePath

from checkpointd.core.ports import CommittedSave, SavedFile, SaveMeta, Staged
from checkpointd.durable import dirs, files, writeback
from checkpointd.durable import group_commit as group_commit_
from checkpointd.protocol.errors import InvalidRequestError, RunNotFoundError, SaveFailedError
from checkpointd.protocol.names import (
    RESERVED_PREFIX,
    RETIRED_PREFIX,
    TMP_PREFIX,
    check_run_name,
    is_run_name,
)
from checkpointd.storage import local_files, manifest_cache, prefix, save_manifest, verify
from checkpointd.storage.local_paths import _path_of, _real_root, _real_run_dir, resolve_export_dir
from checkpointd.storage.manifest_cache import ManifestCache

_LOGGER = logging.getLogger(__name__)

# Saves below this size are committed in a group (with `group_commit`): their
# syncs are latency, shared well; a larger save's fsyncs are bandwidth, run
# in parallel with its manifest's CRCs, and flush only its own files.
GROUP_COMMIT_BYTES = writeback.WRITEBACK_BYTES


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
        group_commit: bool = False,
    ) -> None:
        """Creates the store; the root is made if missing.

        Args:
            root: the daemon's --root.
            fsync: whether to fsync saves before publishing them (off only in tests).
            thread_initializer: run in the threads that fsync (e.g. to lower
                their priority as the writer threads' is).
            group_commit: small saves committed close together share their
                syncs (`checkpointd.durable.group_commit`: syncfs of the
                root's filesystem) instead of fsyncing each file and dir;
                only with `fsync`, and where libc has syncfs.
        """
        self.root = Path(root)
        self._fsync = fsync
        self._manifests = ManifestCache()  # committed saves read, by their manifest's identity
        sync = group_commit_.syncfs_of(self.root) if fsync and group_commit else None
        self._group = group_commit_.GroupSync(sync) if sync is not None else None
        # fsyncs a save's files while its manifest's CRCs read them back.
        self._syncer = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="fsync", initializer=thread_initializer)
        self._verified = local_files.Verified()  # committed files checked for RestoreFiles' same-host readers
        self._lock = threading.Lock()
        self._staged: dict[Path, _Staging] = {}  # by the staging path `stage` returned

    def describe(self) -> str:
        return str(self.root.resolve())

    def location(self, path: PurePath) -> str:
        return str(path)

    def recover(self) -> int:
        return files.recover(self.root, interrupted=prefix.roll_back)

    def target(self, folder: str, export_dir: str) -> Path:
        return resolve_export_dir(self.root, folder, export_dir)

    def stage(self, target: PurePath) -> Path:
        # The target's parent is held open from here on (`checkpointd.durable.dirs`):
        # every write, rename and delete of the save goes through it.
        place, name = self._open_parent(os.fspath(target), create=True)
        try:
            tmp = f"{TMP_PREFIX}{name}-{files.new_suffix()}"
            os.mkdir(tmp, dir_fd=place.fd)
            staging_fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=place.fd)
        except BaseException:
            if place.made:
                dirs.remove_empty(place.base_fd, place.made)
            place.close()
            raise
        staging = Path(dirs.fd_path(staging_fd))
        with self._lock:
            self._staged[staging] = _Staging(place, tmp, staging_fd)
        if self._fsync:
            writeback.mark_fsynced(staging)
        return staging

    def _open_parent(self, path: str | PurePath, *, create: bool = False) -> tuple[dirs.HeldDir, str]:
        """Opens the parent of `path` (a target this store resolved) without following a link below its run's folder.

        Links already there are resolved first and must stay inside the root
        (or the run's folder, if that is a link), as `resolve_export_dir`
        checks them against the run's folder; from the open on,
        a component swapped for a link or a file is refused, never followed.

        Raises:
            InvalidRequestError: a component is (now) a link leading out of
                the run's folder, a file, or a link put there meanwhile.
            OSError: the dir could not be opened or made.
        """
        path = os.path.abspath(path)
        root = _real_root(os.fspath(self.root))
        for given in (root, os.path.abspath(self.root)):  # made from the real root, or from the root as given
            if path.startswith(given + os.sep):
                path = os.path.join(root, path[len(given) + 1 :])
                break
        else:  # not below the root: a place a tool named itself (`writes.write_save`), taken as it is now
            parent = os.path.realpath(os.path.dirname(path))
            if create:
                _make_dirs(parent)
            return dirs.hold_below(parent, [], create=False), os.path.basename(path)
        run = os.path.relpath(path, root).split(os.sep, 1)[0]
        base = _real_run_dir(root, run) if os.path.islink(os.path.join(root, run)) else root
        parent, name = os.path.split(path)
        real_parent = os.path.realpath(parent)
        below = os.path.relpath(real_parent, base)
        if real_parent != base and not real_parent.startswith(base + os.sep):
            raise InvalidRequestError(
                f"{path} resolves outside its run's folder (through a symlink); nothing was written"
            )
        if create and base == root:
            _make_dirs(root)  # the root is made if missing, with the first save
        try:
            return dirs.hold_below(base, [] if below == "." else below.split(os.sep), create=create), name
        except dirs.Moved as e:
            raise InvalidRequestError(
                f"{path} changed while the daemon was using it ({e}); nothing was written there: "
                "keep the run's folder free of links and files in the save's way, and save again"
            ) from e

    def _staging(self, staged: PurePath) -> _Staging | None:
        with self._lock:
            return self._staged.get(Path(staged))

    def commit(self, staged: Staged, target: PurePath, meta: SaveMeta) -> int:
        target = target if isinstance(target, Path) else Path(target)
        held = self._staging(staged.path)
        if held is None:
            raise SaveFailedError(f"{staged.path} was not staged by this store; nothing was committed")
        if not dirs.same_dir(held.place.fd, os.path.dirname(target)):
            raise InvalidRequestError(
                f"the dir of {target} was moved or replaced while the save was written; nothing was committed: "
                "leave the run's folder to the daemon while it saves, and save again"
            )
        writeback.unmark_fsynced(staged.path)
        if (
            self._group is not None
            and staged.files_prefix is None
            and staged.bytes_written < GROUP_COMMIT_BYTES
            and self._on_root_filesystem(staged.path)
        ):
            written = self._commit_in_group(staged, held, target, meta, self._group)
        else:
            written = self._commit_alone(staged, held, target, meta)
        with self._lock:
            del self._staged[Path(staged.path)]
        held.close()
        return written

    def _commit_alone(self, staged: Staged, held: _Staging, target: Path, meta: SaveMeta) -> int:
        if staged.files_prefix is not None:  # named as they will be, so the manifest lists them so
            staged = prefix.rename_staged_save(staged, target.name)
        # The disk flushes the files and the dirs below the save's own (all
        # complete) while the manifest's CRCs read the files back from the
        # page cache (both release the GIL); the manifest is fsynced as it is
        # written, then the save's dir, after its last entry: every file and
        # dir once, before the rename.
        syncing = (
            self._syncer.submit(files.fsync_below, staged.path, save_manifest.MANIFEST_NAME) if self._fsync else None
        )
        try:
            save_manifest.write_staged_manifest(staged, meta, fsync=self._fsync)
        finally:
            if syncing is not None:
                syncing.result()  # raises its OSError; the tree is not published
        if self._fsync:
            os.fsync(held.fd)
        if staged.files_prefix is not None:
            prefix.publish(staged.path, held.place.fd, held.name, target, fsync=self._fsync)
        else:
            files.publish_dir(
                held.name, target.name, fsync=self._fsync, synced=True, dir_fd=held.place.fd, shown=str(target)
            )
        return staged.bytes_written  # the listed files' bytes, as verify counts them (not the manifest's)

    def _on_root_filesystem(self, path: Path) -> bool:
        """Whether `path` is on the root's filesystem, the one the group's syncfs flushes.

        A run's folder may be a symlink to another filesystem; its saves then
        keep their own fsyncs.
        """
        try:
            return os.stat(path).st_dev == os.stat(self.root).st_dev
        except OSError:
            return False

    def _commit_in_group(
        self, staged: Staged, held: _Staging, target: Path, meta: SaveMeta, group: group_commit_.GroupSync
    ) -> int:
        """A small save's commit sharing its syncs with the saves committed beside it.

        The files and the manifest are written without a sync; the first
        barrier makes them (and the staging dir's entries) durable, the
        rename publishes the complete tree (parking a replaced one), and the
        second barrier makes the renames durable before the save is reported
        and the replaced tree deleted. A crash before the rename leaves the
        staging dir, which `recover` deletes; one between the renames, the
        parked tree, which it puts back.
        """
        save_manifest.write_staged_manifest(staged, meta, fsync=False)
        group.barrier()
        old = files.publish_dir(
            held.name, target.name, fsync=False, keep_old=True, dir_fd=held.place.fd, shown=str(target)
        )
        group.barrier()
        if old is not None:
            dirs.remove_quietly(held.place.fd, old.name, target.parent)
        return staged.bytes_written

    def discard(self, staged: Path) -> None:
        writeback.unmark_fsynced(staged)
        with self._lock:
            held = self._staged.pop(Path(staged), None)
        if held is None:
            files.remove_quietly(staged)
            return
        dirs.remove_quietly(held.place.fd, held.name, staged)
        if held.place.made:
            dirs.remove_empty(held.place.base_fd, held.place.made)
        held.close()

    def committed(self, folder: str, run: str | None) -> list[CommittedSave]:
        folder_dir = self._folder_dir(folder)
        if not folder_dir.is_dir():
            return []
        saves = [_read(d, folder_dir, self._manifests) for d in verify.find_save_dirs(folder_dir)]
        saves += [_read(p, folder_dir, self._manifests, is_prefix=True) for p in verify.find_prefixes(folder_dir)]
        return [save for save in saves if save is not None and (run is None or save.run == run)]

    def committed_at(self, folder: str, export_dir: str) -> CommittedSave:
        # Links on the way are resolved here, once (and must stay in the run's
        # folder): the save is read along its real path, following no link after.
        target = _path_of(os.path.realpath(resolve_export_dir(self.root, folder, export_dir)))
        save = _read(target, self._folder_dir(folder), self._manifests) if target.is_dir() else None
        if save is None and prefix.is_committed(target):  # a dir of that name may be there too
            save = _read(target, self._folder_dir(folder), self._manifests, is_prefix=True)
        if save is None:
            raise RunNotFoundError(
                f"no committed save at {export_dir!r} in folder {folder!r} (no such dir, or it has "
                f"no valid {save_manifest.MANIFEST_NAME})"
            )
        return save

    def delete(self, save: CommittedSave) -> bool:
        path = Path(save.path)
        try:
            place, name = _open_listed_parent(save)
        except (InvalidRequestError, OSError) as e:
            _LOGGER.warning("could not delete %s: %s", path, e)
            return False
        try:
            if save.prefix:
                return prefix.delete(path, place.fd)
            # Renamed away first (one step, so the save stops counting at once),
            # then deleted; a crash in between leaves a temp dir `recover` removes.
            doomed = f"{RETIRED_PREFIX}{name}-{files.new_suffix()}"
            try:
                if stat.S_ISLNK(os.lstat(name, dir_fd=place.fd).st_mode):
                    raise OSError(f"{path} is a symlink now, not the save")
                os.rename(name, doomed, src_dir_fd=place.fd, dst_dir_fd=place.fd)
            except OSError as e:
                _LOGGER.warning("could not delete %s: %s", path, e)
                return False
            dirs.remove_quietly(place.fd, doomed, path.parent)
            return True
        finally:
            place.close()

    def folders(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(
            e.name
            for e in os.scandir(self.root)
            if e.is_dir(follow_symlinks=False) and not e.name.startswith(RESERVED_PREFIX) and is_run_name(e.name)
        )

    def read_file(self, path: PurePath) -> bytes | None:
        try:
            return Path(path).read_bytes()
        except FileNotFoundError:
            return None

    def write_file(self, path: PurePath, data: bytes) -> None:
        place, name = self._open_parent(os.fspath(path))
        # A temp sibling (removed by `recover` if a crash leaves it), fsynced,
        # then renamed over: readers see the old file or the new one.
        tmp = f"{TMP_PREFIX}{name}-{files.new_suffix()}"
        try:
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=place.fd
            )
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=place.fd, dst_dir_fd=place.fd)
            if self._fsync:
                os.fsync(place.fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=place.fd)
            raise
        finally:
            place.close()

    # RestoreFiles (ports.SaveFiles).

    def files_of(self, save: CommittedSave) -> list[SavedFile]:
        return local_files.files_of(save)

    def local_dir(self, save: CommittedSave) -> Path | None:
        return local_files.base_dir(save).resolve()

    def read_ranges(self, save: CommittedSave, ranges: Sequence[tuple[str, int, int]]) -> Iterator[bytes]:
        return local_files.read_ranges(save, ranges)

    def verified(self, save: CommittedSave, files: Sequence[SavedFile]) -> dict[str, tuple[int, int, int]]:
        return self._verified.check(save, files)

    # Restore (ports.HeldSaves).

    @contextlib.contextmanager
    def held(self, save: CommittedSave) -> Iterator[CommittedSave]:
        base = local_files.open_base(save)
        try:
            held = Path(dirs.fd_path(base))
            yield replace(save, path=held / save.path.name if save.prefix else held)
        finally:
            os.close(base)

    def close(self) -> None:
        self._syncer.shutdown(wait=True)
        if self._group is not None:
            self._group.close()

    def _folder_dir(self, folder: str) -> Path:
        # Absolute and real, as resolve_export_dir makes save paths.
        return Path(os.path.realpath(self.root / check_run_name(folder)))


def _make_dirs(path: str) -> None:
    """`os.makedirs(path)` if missing; a file in the way is NotADirectoryError, not mkdir's "File exists"."""
    if os.path.isdir(path):
        return
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path) from None


def _open_listed_parent(save: CommittedSave) -> tuple[dirs.HeldDir, str]:
    """Opens the dir of a save as it was listed (`committed`), following no link that is new since.

    Its folder's real path was taken at the listing: it must still be its own
    real path (no component swapped for a link since), and the export dir's
    components below it are opened without following a link.

    Raises:
        InvalidRequestError: a component is a link, or not a dir, now.
        OSError: a dir could not be opened (gone).
    """
    parts = save.export_dir.split("/")
    path = os.fspath(save.path)
    folder = path
    for _ in parts:
        folder = os.path.dirname(folder)
    try:
        return dirs.hold_below(dirs.open_real(folder), parts[:-1], create=False), parts[-1]
    except dirs.Moved as e:
        raise InvalidRequestError(f"{path} changed since it was listed ({e})") from e


@dataclass
class _Staging:
    """A staged save's place, held open from its accept to its commit or discard."""

    place: dirs.HeldDir  # the target's parent
    name: str  # the staging dir's name in it
    fd: int  # the staging dir

    def close(self) -> None:
        os.close(self.fd)
        self.place.close()


def _read(save_dir: Path, folder_dir: Path, cache: ManifestCache, *, is_prefix: bool = False) -> CommittedSave | None:
    """The save at `save_dir` (a dir, or a checkpoint prefix), or None if it has no valid manifest.

    Its manifest is read through its dir opened from `/` along its real path
    (`dirs.open_real`): a link swapped into the path since it was listed is
    not followed, and the save is not one. A manifest file read before and
    unchanged since (`checkpointd.storage.manifest_cache`) is not parsed again.
    """
    name = prefix.manifest_path(save_dir).name if is_prefix else save_manifest.MANIFEST_NAME
    try:
        base = dirs.open_real(os.fspath(save_dir.parent if is_prefix else save_dir))
    except (OSError, dirs.Moved) as e:
        _LOGGER.debug("not a committed save: %s (%s)", save_dir, e)
        return None
    try:
        where = (save_dir, folder_dir, is_prefix)
        try:
            st = os.stat(name, dir_fd=base, follow_symlinks=False)
        except OSError:
            st = None  # read_manifest says what is wrong
        manifest = manifest_cache.identity(st) if st is not None and stat.S_ISREG(st.st_mode) else None
        if manifest is not None and (known := cache.get(where, manifest)) is not None:
            return known
        document = save_manifest.read_manifest(Path(dirs.fd_path(base)), name)
        save = save_manifest.committed_save(
            document, save_dir, save_dir.relative_to(folder_dir).as_posix(), prefix=is_prefix
        )
        if manifest is not None:
            cache.put(where, manifest, save)
        return save
    except (save_manifest.ManifestError, KeyError, TypeError, ValueError) as e:
        _LOGGER.debug("not a committed save: %s (%s)", save_dir, e)
        return None
    finally:
        os.close(base)
