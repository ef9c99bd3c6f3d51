"""Atomic publication of a directory: write a temp sibling, then rename it in.

At every instant the target is the complete old tree, the complete new tree,
or (only between the two renames of a replacement) absent with the old tree
parked beside it as `.checkpointd-old-<name>-<hex>`. `recover` repairs that
window and clears leftover temp dirs when the daemon starts. Stdlib only.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
from pathlib import Path

from checkpointd.protocol.errors import InvalidRequestError, SaveFailedError
from checkpointd.protocol.names import check_export_dir, check_run_name

_LOGGER = logging.getLogger(__name__)

TMP_PREFIX = ".checkpointd-tmp-"
OLD_PREFIX = ".checkpointd-old-"
# Length of the random hex suffix (secrets.token_hex(8)).
_HEX_LEN = 16


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
        raise NotADirectoryError(
            errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(target.parent)
        ) from None
    tmp = target.parent / f"{TMP_PREFIX}{target.name}-{_suffix()}"
    tmp.mkdir()
    return tmp


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
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
    for dirpath, _dirnames, filenames in os.walk(path, topdown=False):
        for name in filenames:
            file = Path(dirpath, name)
            if not file.is_symlink():
                _fsync_file(file)
        _fsync_dir(Path(dirpath))


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


def publish_dir(tmp: Path, target: Path, *, fsync: bool = True) -> None:
    """Renames the finished tree `tmp` to `target`, replacing an old tree.

    Args:
        tmp: A complete tree, usually from `make_temp_sibling(target)`.
        target: The published path; an existing directory there is replaced.
        fsync: Whether to fsync the tree and the parent (off only in tests).

    Raises:
        SaveFailedError: if `target` exists and is not a directory.
        OSError: if a rename or fsync fails; `tmp` is then left for the caller.
    """
    tmp, target = Path(tmp), Path(target)
    parent = target.parent
    if fsync:
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
    if not name.startswith(OLD_PREFIX):
        return None
    rest = name[len(OLD_PREFIX) :]
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

    Deletes every `.checkpointd-tmp-*` dir. Renames every
    `.checkpointd-old-<name>-<hex>` dir back to `<name>` if `<name>` is
    absent, else deletes it. Symlinks are not followed; other names are
    never touched.

    Returns:
        The number of entries deleted or renamed.
    """
    fixed = 0
    for dirpath, dirnames, _filenames in os.walk(root, followlinks=False):
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
    real = Path(os.path.realpath(target))
    if real != target and run_dir not in real.parents:
        raise InvalidRequestError(
            f"export_dir {export_dir!r} resolves outside the run's folder (through a symlink)"
        )
    return target
