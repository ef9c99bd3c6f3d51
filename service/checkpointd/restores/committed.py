"""Restore: a run's committed save, found in the Store and opened by its format.

Everything is checked before the caller streams anything: the save exists,
and its keys, dtypes and shapes fit the run's manifest. A tensor found
corrupt while it is read is raised from `SaveValues.pieces()`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from checkpointd.core.ports import CommittedSave, HeldSaves, LocalCopies, SaveFormat, SaveValues, Store
from checkpointd.core.variable_manifest import Manifest
from checkpointd.protocol.errors import RunNotFoundError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.saves import catalog

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class Opened:
    """A committed save, opened for reading."""

    save: CommittedSave
    values: SaveValues


def open_committed(
    store: Store,
    format_for: Callable[[SaveKind], SaveFormat],
    folder: str,
    run: str,
    export_dir: str,
    manifest: Manifest,
) -> Opened:
    """Opens the save at `export_dir` in `folder`, or the run's newest one.

    Args:
        store: where the saves live.
        format_for: the SaveFormat of a kind.
        folder: the run's folder.
        run: the run (registered; `manifest` is its manifest).
        export_dir: the save to read, relative to the folder; empty for the
            run's newest committed save.
        manifest: the run's manifest: which keys to read, in payload order.

    Raises:
        RunNotFoundError: the run has no committed save (at `export_dir`).
        InvalidRequestError: `export_dir` is invalid, or the save's keys do
            not match the manifest (the message names the first one).
        ChecksumError, SaveFailedError: the save is corrupt or unreadable.
    """
    save = find(store, folder, run, export_dir)
    return Opened(save, format_for(save.kind).read(save, manifest))


def find(store: Store, folder: str, run: str, export_dir: str) -> CommittedSave:
    """The committed save at `export_dir` in `folder`, or the run's newest one (RunNotFoundError if none)."""
    if export_dir:
        return store.committed_at(folder, export_dir)
    found = catalog.find_latest(store, folder, run)
    if found is None:
        raise RunNotFoundError(
            f"run {run!r} has no committed save in folder {folder!r} of {store.describe()} to restore"
        )
    return found


@contextlib.contextmanager
def opening(
    store: Store,
    format_for: Callable[[SaveKind], SaveFormat],
    folder: str,
    run: str,
    export_dir: str,
    manifest: Manifest,
) -> Iterator[Opened]:
    """As `open_committed`, for the duration of a `with`: a store whose saves are not local
    files (`LocalCopies`, the object store) lends a checked local copy until the block ends,
    one of local files (`HeldSaves`) the save's dir held open, read following no link."""
    if isinstance(store, LocalCopies):
        lend = store.local_copy
    elif isinstance(store, HeldSaves):
        lend = store.held
    else:
        yield open_committed(store, format_for, folder, run, export_dir, manifest)
        return
    save = find(store, folder, run, export_dir)
    with lend(save) as local:
        yield Opened(save, format_for(save.kind).read(local, manifest))


def log_restored(run: str, opened: Opened, seconds: float) -> None:
    """Logs a restore streamed in full."""
    save = opened.save
    _LOGGER.info(
        "restored run=%s kind=%s export_dir=%s step=%d bytes=%d in %.3fs",
        run, save.kind.value, save.export_dir, save.step, opened.values.nbytes, seconds,
    )  # fmt: skip
