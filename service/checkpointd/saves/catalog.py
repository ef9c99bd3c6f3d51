"""Committed saves on disk: a run's newest one, or the one at an export dir.

A save is committed once its dir, holding `checkpointd.manifest.json`, has
been renamed into place: the manifest is written last, before the fsync and
the rename. So the saves of a run are found by reading manifests under its
folder, which works just as well after a daemon restart as before it: nothing
here depends on what the daemon remembers. A manifest names its run, so runs
that share a folder (a trainer's policies) are told apart.

Stdlib only; the newest of thousands of checkpoints is a walk and a small JSON
read per save.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from checkpointd.storage import save_manifest
from checkpointd.protocol.errors import RunNotFoundError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.names import check_run_name
from checkpointd.storage.local import resolve_export_dir

_LOGGER = logging.getLogger(__name__)

_KINDS = {k.value: k for k in SaveKind}


@dataclass(frozen=True)
class CommittedSave:
    """One committed save, as its manifest describes it.

    Attributes:
        path: the save dir (absolute, on the daemon's host).
        export_dir: the save dir relative to its folder, '/'-separated.
        run: the run that wrote it.
        kind: SAVED_MODEL or CHECKPOINT.
        step: the train step in its snapshot.
        created: Unix time the daemon wrote it.
    """

    path: Path
    export_dir: str
    run: str
    kind: SaveKind
    step: int
    created: float


def _folder_dir(root: Path, folder: str) -> Path:
    # Absolute and real, as resolve_export_dir makes save paths.
    return Path(os.path.realpath(Path(root) / check_run_name(folder)))


def _read(save_dir: Path, folder_dir: Path) -> CommittedSave | None:
    """The save at `save_dir`, or None if it has no valid manifest."""
    try:
        document = save_manifest.read_manifest(save_dir)
        kind = _KINDS[document["kind"]]
        return CommittedSave(
            path=save_dir,
            export_dir=save_dir.relative_to(folder_dir).as_posix(),
            run=str(document["run"]),
            kind=kind,
            step=int(document["step"]),
            created=float(document["created_unix_seconds"]),
        )
    except (save_manifest.ManifestError, KeyError, TypeError, ValueError) as e:
        _LOGGER.debug("not a committed save: %s (%s)", save_dir, e)
        return None


def find_latest(
    root: Path, folder: str, run: str, kind: SaveKind | None = None
) -> CommittedSave | None:
    """The run's newest committed save under `<root>/<folder>/`.

    Newest means the latest creation time, then the highest step.

    Args:
        root: the daemon's root.
        folder: the run's folder (a valid run name; usually the run's name).
        run: only saves whose manifest names this run count.
        kind: only saves of this kind count; None for either.

    Returns:
        The save, or None if the run has none (or its folder does not exist).
    """
    best: CommittedSave | None = None
    for save in committed_saves(root, folder, run):
        if kind is not None and save.kind is not kind:
            continue
        if best is None or (save.created, save.step) > (best.created, best.step):
            best = save
    return best


def committed_saves(root: Path, folder: str, run: str) -> list[CommittedSave]:
    """Every committed save of `run` under `<root>/<folder>/`, in no order."""
    folder_dir = _folder_dir(root, folder)
    if not folder_dir.is_dir():
        return []
    saves = (_read(save_dir, folder_dir) for save_dir in save_manifest.find_save_dirs(folder_dir))
    return [save for save in saves if save is not None and save.run == run]


def committed_save(root: Path, folder: str, export_dir: str) -> CommittedSave:
    """The committed save at `<root>/<folder>/<export_dir>`.

    Raises:
        InvalidRequestError: `export_dir` is not a valid relative path in the folder.
        RunNotFoundError: there is no committed save there (nothing, or a dir
            without a valid manifest).
    """
    target = resolve_export_dir(Path(root), folder, export_dir)
    save = _read(target, _folder_dir(root, folder)) if target.is_dir() else None
    if save is None:
        raise RunNotFoundError(
            f"no committed save at {export_dir!r} in folder {folder!r} (no such dir, or it has "
            f"no valid {save_manifest.MANIFEST_NAME})"
        )
    return save
