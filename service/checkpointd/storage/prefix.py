"""Checkpoint prefixes on local disk: saves whose files share a dir with other saves.

TensorFlow's `CheckpointManager` keeps every checkpoint of a dir side by
side: `<dir>/ckpt-7.index`, `<dir>/ckpt-7.data-00000-of-00001`, then
`ckpt-8.*`, and its `checkpoint` state file. A training checkpoint is
therefore not a dir of its own but a *prefix*, and its commit marker is a
manifest beside its files, `<dir>/ckpt-7.checkpointd.manifest.json`, written
last, listing each file with its size and CRC32C
(`checkpointd.storage.save_manifest`).

Commit: the files are staged in a private temp dir inside `<dir>` (so every
rename stays on one filesystem), renamed there to their final names, listed
in the manifest and fsynced; then an older save at the same prefix loses its
manifest (it stops counting), the files are renamed into `<dir>` (data
before index), and the manifest last; the dir is fsynced after each step. A
crash leaves either the old save, or files without a manifest (not a save:
never listed, overwritten by the next save of that step), or the new save.
The daemon's start-up recovery deletes such files (`roll_back`): the staging
dir, still there with its manifest, names them. Delete: the manifest goes
first, then the files it lists. Stdlib only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from checkpointd.core.ports import Staged
from checkpointd.durable import dirs
from checkpointd.storage import save_manifest

_LOGGER = logging.getLogger(__name__)


def manifest_path(prefix: Path) -> Path:
    """Where a prefix's manifest lives: `<prefix>.checkpointd.manifest.json`."""
    return prefix.with_name(prefix.name + save_manifest.PREFIX_MANIFEST_SUFFIX)


def is_committed(prefix: Path) -> bool:
    return manifest_path(prefix).is_file()


def rename_staged(staging: Path, staged_stem: str, name: str) -> None:
    """Renames the staged files `<staged_stem><suffix>` to `<name><suffix>`, in the staging dir.

    Raises:
        OSError: a file in staging is not one of the stem's (the format's bug).
    """
    for entry in sorted(os.listdir(staging)):
        if not entry.startswith(staged_stem):
            raise OSError(f"staged file {entry!r} is not named {staged_stem!r}+suffix")
        os.rename(staging / entry, staging / (name + entry[len(staged_stem) :]))


def rename_staged_save(staged: Staged, name: str) -> Staged:
    """`rename_staged` of a staged prefix save; returns it with the files it `known`s renamed alike.

    Raises:
        OSError: see `rename_staged`.
    """
    stem = staged.files_prefix
    if stem is None:
        raise ValueError("not a staged prefix save")
    rename_staged(staged.path, stem, name)
    if not staged.known:
        return staged
    known = {name + rel[len(stem) :] if rel.startswith(stem) else rel: v for rel, v in staged.known.items()}
    return dataclasses.replace(staged, known=known)


def publish(staging: Path, parent_fd: int, staging_name: str, target: Path, *, fsync: bool = True) -> None:
    """Commits the staged prefix `target` (files and manifest in `staging`) into the dir `parent_fd`.

    Args:
        staging: the staging dir's path (one that names it whatever its
            parent's path has become: `checkpointd.durable.dirs.fd_path`).
        parent_fd: the open dir the prefix is committed into, which holds
            the staging dir as `staging_name`.
        staging_name: the staging dir's name in `parent_fd`; it is removed
            once empty.
        target: the prefix's path, as checked (its parent is `parent_fd`):
            its name is used, and the path is shown in the log.
        fsync: whether to fsync the staged files and the dir after each step.

    `staging` holds `<target.name>.*` and the manifest (MANIFEST_NAME), nothing else.

    Raises:
        OSError: a rename or fsync failed; what is left is described in the
            module docstring.
    """
    files = sorted(f for f in os.listdir(staging) if f != save_manifest.MANIFEST_NAME)
    if fsync:
        _fsync_tree(staging)
    old = manifest_path(target).name
    try:
        os.unlink(old, dir_fd=parent_fd)  # the old save stops counting before any of its files is replaced
    except FileNotFoundError:
        pass
    else:
        _LOGGER.info("replacing the committed checkpoint %s", target)
        if fsync:
            os.fsync(parent_fd)
    # Data shards before the index: a reader that finds the index finds its data.
    for entry in sorted(files, key=lambda f: f.endswith(".index")):
        os.rename(staging / entry, entry, dst_dir_fd=parent_fd)
    if fsync:
        os.fsync(parent_fd)
    os.rename(staging / save_manifest.MANIFEST_NAME, old, dst_dir_fd=parent_fd)
    if fsync:
        os.fsync(parent_fd)
    try:
        os.rmdir(staging_name, dir_fd=parent_fd)
    except OSError as e:
        _LOGGER.warning("could not remove the empty staging dir %s: %s", staging_name, e)


def roll_back(parent_fd: int, staging_name: str, name: str) -> int:
    """Undoes a `publish` of the prefix `name` that a crash interrupted; returns the files deleted.

    Called by start-up recovery (`checkpointd.durable.files.recover`) for each
    staging dir it is about to delete. If that dir holds a prefix save's
    manifest (every file it lists is `<name>.<suffix>`, none in a subdir) and
    `<name>` has no manifest in the parent (the publish did not finish, or an
    older save there stopped counting when it began), the listed files in
    the parent are not a save: moved there before the crash, or the older
    save's being replaced. They are deleted, so the prefix is absent rather
    than partial. Nothing else is touched: a staging dir without a manifest
    was never published from, and a dir save is published by one rename.
    """
    if dirs.exists(parent_fd, manifest_path(Path(name)).name):
        return 0
    try:
        fd = os.open(staging_name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    except OSError:
        return 0
    try:
        listed = [e.path for e in save_manifest.read_manifest(Path(dirs.fd_path(fd)))["files"]]
    except (OSError, save_manifest.ManifestError):
        return 0  # not published from: its manifest is written before the first rename
    finally:
        os.close(fd)
    if not listed or not all("/" not in rel and rel.startswith(name + ".") for rel in listed):
        return 0
    removed = 0
    for rel in listed:
        try:
            os.unlink(rel, dir_fd=parent_fd)
        except FileNotFoundError:
            continue
        _LOGGER.warning("recover: deleting %s, left without its manifest by an interrupted commit", rel)
        removed += 1
    return removed


def delete(prefix: Path, parent_fd: int) -> bool:
    """Deletes a committed prefix: its manifest first, then the files it lists.

    Args:
        prefix: the save's path (shown in logs; its name is used).
        parent_fd: its dir, held open: nothing is looked up by path.

    Returns:
        False if the manifest could not be removed (the save still counts).
    """
    parent = Path(f"/proc/self/fd/{parent_fd}")
    manifest = manifest_path(prefix).name
    try:
        listed = [e.path for e in save_manifest.read_manifest(parent, manifest)["files"]]
    except save_manifest.ManifestError as e:
        _LOGGER.warning("could not read the manifest of %s to delete it: %s", prefix, e)
        listed = []
    try:
        os.unlink(manifest, dir_fd=parent_fd)
    except OSError as e:
        _LOGGER.warning("could not delete %s: %s", prefix, e)
        return False
    for rel in listed:
        if "/" not in rel and rel.startswith(prefix.name + "."):  # never another save's file
            try:
                os.unlink(rel, dir_fd=parent_fd)
            except FileNotFoundError:
                pass
            except OSError as e:
                _LOGGER.warning("could not remove %s: %s", prefix.parent / rel, e)
    return True


def _fsync_tree(path: Path) -> None:
    for entry in os.listdir(path):
        fd = os.open(path / entry, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
