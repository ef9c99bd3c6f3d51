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
never listed, reported by `checkpointd verify`, overwritten by the next save
of that step), or the new save. Delete: the manifest goes first, then the
files it lists. Stdlib only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from checkpointd.core.ports import Staged
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


def publish(staging: Path, target: Path, *, fsync: bool = True) -> None:
    """Commits the staged prefix `target` (files and manifest in `staging`) into `target.parent`.

    `staging` must be inside `target.parent` and hold `<target.name>.*` and
    the manifest (MANIFEST_NAME), nothing else; it is removed once empty.

    Raises:
        OSError: a rename or fsync failed; what is left is described in the
            module docstring.
    """
    parent = target.parent
    files = sorted(f for f in os.listdir(staging) if f != save_manifest.MANIFEST_NAME)
    if fsync:
        _fsync_tree(staging)
    old = manifest_path(target)
    if old.exists():
        old.unlink()  # the old save stops counting before any of its files is replaced
        _LOGGER.info("replacing the committed checkpoint %s", target)
        if fsync:
            _fsync_dir(parent)
    # Data shards before the index: a reader that finds the index finds its data.
    for entry in sorted(files, key=lambda f: f.endswith(".index")):
        os.rename(staging / entry, parent / entry)
    if fsync:
        _fsync_dir(parent)
    os.rename(staging / save_manifest.MANIFEST_NAME, old)
    if fsync:
        _fsync_dir(parent)
    try:
        staging.rmdir()
    except OSError as e:
        _LOGGER.warning("could not remove the empty staging dir %s: %s", staging, e)


def delete(prefix: Path) -> bool:
    """Deletes a committed prefix: its manifest first, then the files it lists.

    Returns:
        False if the manifest could not be removed (the save still counts).
    """
    try:
        listed = [e.path for e in save_manifest.read_manifest(prefix.parent, manifest_path(prefix).name)["files"]]
    except save_manifest.ManifestError as e:
        _LOGGER.warning("could not read the manifest of %s to delete it: %s", prefix, e)
        listed = []
    try:
        manifest_path(prefix).unlink()
    except OSError as e:
        _LOGGER.warning("could not delete %s: %s", prefix, e)
        return False
    for rel in listed:
        path = prefix.parent / rel
        if path.name.startswith(prefix.name + "."):  # never another save's file
            try:
                path.unlink(missing_ok=True)
            except OSError as e:
                _LOGGER.warning("could not remove %s: %s", path, e)
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
