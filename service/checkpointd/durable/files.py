"""Files made durable: temp siblings, fsync, publication by rename, and repair after a crash.

A tree is written into a temp sibling of its target (`make_temp_sibling`),
fsynced, and renamed into place (`publish_dir`). At every instant the target
is the complete old tree, the complete new tree, or (only between the two
renames of a replacement) absent with the old tree parked beside it as
`.checkpointd-old-<name>-<hex>`. `recover` repairs that window and clears
leftover temp entries when the daemon starts; `check_writable_dir` proves,
before the daemon serves, that a dir takes writes at all.

Below both `checkpointd.formats` and `checkpointd.storage`: a format
publishing a tree and the local store committing one share these, and
neither imports the other. Stdlib only.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from checkpointd.durable import dirs
from checkpointd.protocol.errors import SaveFailedError, describe
from checkpointd.protocol.names import OLD_PREFIX, SUFFIX_HEX_LEN, TMP_PREFIX

_LOGGER = logging.getLogger(__name__)

# The names derived from a target's <name> (TMP_PREFIX, OLD_PREFIX,
# RETIRED_PREFIX, each with "-<16 hex>") are defined with the export-dir rules
# in checkpointd.protocol.names, which limit <name> to MAX_EXPORT_NAME_BYTES so
# that they fit a filesystem name.
_HEX_LEN = SUFFIX_HEX_LEN


def new_suffix() -> str:
    """A fresh random `<hex>` for a derived name (`<prefix><name>-<hex>`)."""
    return secrets.token_hex(_HEX_LEN // 2)


def make_temp_sibling(target: Path | str) -> Path:
    """Creates an empty temp dir next to `target` to write into.

    Args:
        target: Where the finished tree will be published.

    Returns:
        `<target.parent>/.checkpointd-tmp-<target.name>-<hex>`, created, with
        any missing parents of `target` created too.

    Raises:
        OSError: if the parents or the temp dir cannot be created.
    """
    # As text (pathlib parses every path it makes): a save stages at its accept.
    parent, name = os.path.split(os.fspath(_path(target)))
    parent = parent or "."
    if not os.path.isdir(parent):
        try:
            os.makedirs(parent, exist_ok=True)
        except FileExistsError:
            # mkdir says "File exists" when the parent is a file; say what is wrong.
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), parent) from None
    tmp = os.path.join(parent, f"{TMP_PREFIX}{name}-{new_suffix()}")
    os.mkdir(tmp)
    return Path(tmp)


def _path(path: Path | str) -> Path:
    """`path` as a Path, normalized as pathlib does; one given already is not parsed again."""
    return path if isinstance(path, Path) else Path(path)


def write_new(path: str, content: bytes | memoryview, *, fsync: bool = False) -> None:
    """Writes `content` as a new file (O_EXCL: never one that exists) with three syscalls, not Python's buffered six.

    For the small files a save writes whole from memory into its own staging
    dir: each syscall lets go of the GIL, and under load getting it back is
    the cost. `fsync`: flushed before it is closed.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        view = memoryview(content)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path | str) -> None:
    """Fsyncs the directory `path`, so its new or renamed entries are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path | str) -> None:
    """Fsyncs the file `path`."""
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
        fsync_file(path)
        return
    fsync_below(path)
    fsync_dir(path)


def fsync_below(path: Path, skip: str | None = None) -> None:
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
                fsync_file(file)
        if dirpath != top:
            fsync_dir(dirpath)


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


def publish_dir(
    tmp: Path | str,
    target: Path | str,
    *,
    fsync: bool = True,
    synced: bool = False,
    keep_old: bool = False,
    dir_fd: int | None = None,
    shown: str | None = None,
) -> Path | None:
    """Renames the finished tree `tmp` to `target`, replacing an old tree.

    Args:
        tmp: A complete tree, usually from `make_temp_sibling(target)`.
        target: The published path; an existing directory there is replaced.
        fsync: Whether to fsync the tree and the parent (off only in tests,
            and in a group commit, whose shared syncs cover both).
        synced: The caller has fsynced every file and dir of `tmp` already
            (a store's commit); only the parent is fsynced here.
        keep_old: leave the replaced tree parked (`.checkpointd-old-*`) and
            return it, for the caller to delete once the rename is durable
            (a group commit, after its shared sync); `recover` deletes it
            after a crash.
        dir_fd: the target's parent, held open (`checkpointd.durable.dirs`):
            `tmp` and `target` are then names in it, and no path is looked
            up again; a returned parked tree is a name in it too.
        shown: the target's path for messages, with `dir_fd`.

    Returns:
        The parked old tree if `keep_old` and there was one; else None.

    Raises:
        SaveFailedError: if `target` exists and is not a directory.
        OSError: if a rename or fsync fails; `tmp` is then left for the caller.
    """
    if dir_fd is not None:
        name = os.fspath(target)
        return _publish_in(dir_fd, os.fspath(tmp), name, shown or name, fsync, synced, keep_old)
    # As text (pathlib's parsing cost more than the renames).
    where = os.fspath(_path(target))
    parent, name = os.path.split(where)
    parent = parent or "."
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        old = _publish_in(fd, os.path.abspath(tmp), name, where, fsync, synced, keep_old)
    finally:
        os.close(fd)
    return None if old is None else Path(parent, old)


def _publish_in(fd: int, tmp: str, name: str, shown: str, fsync: bool, synced: bool, keep_old: bool) -> Path | None:
    """`publish_dir` in the open dir `fd`: `tmp` a name in it (or an absolute path), `name` the target's."""
    if fsync and not synced:
        fsync_tree(Path(tmp if os.path.isabs(tmp) else os.path.join(f"/proc/self/fd/{fd}", tmp)))
    try:
        mode: int | None = os.lstat(name, dir_fd=fd).st_mode
    except (FileNotFoundError, NotADirectoryError):
        mode = None
    if mode is not None and not stat.S_ISDIR(mode):
        # A symlink to a directory is refused too: renaming over it would
        # replace the link, not the tree the user pointed it at.
        raise SaveFailedError(
            f"cannot publish to {shown}: it exists and is not a directory; move it away or choose another export_dir"
        )
    if mode is None:
        os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        if fsync:
            os.fsync(fd)
        return None
    old = f"{OLD_PREFIX}{name}-{new_suffix()}"
    os.rename(name, old, src_dir_fd=fd, dst_dir_fd=fd)
    try:
        os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
    except OSError:
        # Put the old tree back so a failed save leaves what was there.
        os.rename(old, name, src_dir_fd=fd, dst_dir_fd=fd)
        raise
    if fsync:
        os.fsync(fd)
    if keep_old:
        return Path(old)
    try:
        shutil.rmtree(old, dir_fd=fd)
    except OSError as e:
        _LOGGER.warning("could not remove the replaced tree %s: %s", old, e)
    return None


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


def recover(root: Path, interrupted: Callable[[int, str, str], int] | None = None) -> int:
    """Repairs interrupted publications under `root` (run at daemon start).

    Deletes every `.checkpointd-tmp-*` dir (first calling `interrupted` with
    its parent dir's descriptor, its name and the `<name>` of
    `.checkpointd-tmp-<name>-<hex>`: what a publication out of it left in the
    parent is the caller's to undo; it returns how many entries it removed),
    and every `.checkpointd-tmp-<name>-<hex>` file (a state file being
    replaced, as `LocalStore.write_file` does). Renames every
    `.checkpointd-old-<name>-<hex>` dir back to `<name>` if `<name>` is
    absent, else deletes it. Symlinks are not followed; other names are
    never touched.

    Returns:
        The number of entries deleted or renamed.
    """
    fixed = 0
    if not os.path.isdir(root):
        return fixed
    # Through each dir's descriptor (dirs.walk): a component swapped for a
    # symlink or a file while this runs is never followed, nor anything deleted through it.
    for dirpath, dirnames, filenames, dir_fd in dirs.walk(os.fspath(root)):
        for name in filenames:
            if _split_suffixed(name, TMP_PREFIX) is not None:
                _LOGGER.info("recover: deleting unfinished temp file %s", Path(dirpath, name))
                dirs.remove_quietly(dir_fd, name, dirpath)
                fixed += 1
        keep = []
        for name in sorted(dirnames):
            entry = Path(dirpath, name)
            if _is_link(name, dir_fd):
                continue
            if name.startswith(TMP_PREFIX):
                base = _split_suffixed(name, TMP_PREFIX)
                if interrupted is not None and base is not None:
                    fixed += interrupted(dir_fd, name, base)
                _LOGGER.info("recover: deleting unfinished temp dir %s", entry)
                dirs.remove_quietly(dir_fd, name, dirpath)
                fixed += 1
                continue
            base = _split_old(name)
            if base is None:
                keep.append(name)
                continue
            if dirs.exists(dir_fd, base):
                _LOGGER.info("recover: deleting replaced tree %s", entry)
                dirs.remove_quietly(dir_fd, name, dirpath)
            else:
                _LOGGER.warning("recover: restoring %s from %s", Path(dirpath, base), entry)
                os.rename(name, base, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                keep.append(base)
            fixed += 1
        dirnames[:] = keep
    return fixed


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except FileNotFoundError:
        return True  # gone meanwhile: nothing to do there


def check_writable_dir(path: Path, what: str) -> None:
    """Makes `path` if missing and proves it a writable directory, or says why it is not.

    Raises:
        OSError: with what to fix and the OS's reason.
    """
    if path.exists() and not path.is_dir():
        raise OSError(f"{what} {path} is not a directory; it must be a directory, or a path where one can be made")
    try:
        path.mkdir(parents=True, exist_ok=True)
        # Permission bits do not stop root; a read-only mount or an immutable dir
        # does. Only writing tells.
        fd, probe = tempfile.mkstemp(prefix=f"{TMP_PREFIX}probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OSError(f"{what} {path} is not a writable directory: {describe(e)}") from None
