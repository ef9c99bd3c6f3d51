"""Writing one save into the Store: staged, written by its format, committed, or discarded.

Two ways in, one rule: nothing new is left behind on failure (the staging
dir is discarded; the Store commits the manifest last).

- `streamed`: the format's files are opened in staging before the snapshot
  arrives (`SaveFormat.open`), the receiver writes each chunk into them as
  it lands, and `StreamedSave.commit` finishes and commits them. The
  snapshot is never held whole.
- `write_save`: a snapshot already in memory, written and committed in one
  call (tests, tools).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import cast

from checkpointd.core.checkpoint_spec import CheckpointSpec
from checkpointd.core.numpy_state import NumpyPayload, NumpyStateSpec
from checkpointd.core.ports import (
    SaveFormat,
    SaveMeta,
    SaveSink,
    SnapshotBytes,
    Store,
    StreamingStore,
    WatchedSink,
)
from checkpointd.core.variable_manifest import Manifest
from checkpointd.protocol.errors import CheckpointdError, SaveFailedError, describe
from checkpointd.saves.kinds import own_spec

_LOGGER = logging.getLogger(__name__)


@dataclass
class StreamedSave:
    """A save whose files are open in staging (see `streamed`)."""

    store: Store
    meta: SaveMeta
    target: PurePath
    staging: Path
    sink: SaveSink

    def commit(self, target: PurePath) -> int:
        """Finishes the files and commits them at `target` (checked again by the caller); returns the bytes.

        Raises:
            InvalidRequestError: the snapshot is incomplete.
            Exception: the files could not be finished or committed.
        """
        staged = self.sink.finish()
        return self.store.commit(staged, target, self.meta)


@contextlib.contextmanager
def streamed(
    store: Store,
    fmt: SaveFormat,
    meta: SaveMeta,
    manifest: Manifest,
    target: PurePath,
    parts: Sequence[int],
    numpy_state: NumpyStateSpec | None,
    checkpoint: CheckpointSpec | None = None,
    *,
    gone: Callable[[], bool] = lambda: False,
) -> Iterator[StreamedSave]:
    """Stages a save at `target` and opens its format's files, for the block to receive and commit.

    Whatever ends the block early (a bad chunk, a broken stream, the
    deadline, a full disk) closes the files, after any write in progress,
    and discards the staging dir and the parent dirs staging made. Errors that are not the daemon's own
    become SaveFailedError with the reason, logged; but once `gone()` (the
    caller went away), the error is its broken stream, no write failure:
    raised as it is (gRPC knows its own), and the pipeline logs the save
    once, as cancelled.

    Raises:
        RunNotFoundError: the run has no template in the format.
        SaveFailedError: the save could not be written, with the reason.
    """
    parent = os.path.dirname(target)
    made = _missing_dirs(parent)
    try:
        staging = store.stage(target)
    except OSError as e:
        raise write_failed(meta, target, e) from e
    if os.path.dirname(staging) != parent:  # staged elsewhere (an object store's local dir)
        made = []
    try:
        sink = fmt.open(meta.run, meta.kind, manifest, staging, parts, numpy_state, **own_spec(checkpoint))
        try:
            if _is(type(store), StreamingStore) and _is(type(sink), WatchedSink):
                # An object store sends parts as they fill.
                cast(StreamingStore, store).stream(staging, target, meta, cast(WatchedSink, sink))
            yield StreamedSave(store, meta, target, staging, sink)
        finally:
            sink.close()
    except BaseException as e:
        store.discard(staging)
        _remove_empty(made)
        if isinstance(e, CheckpointdError) or not isinstance(e, Exception) or gone():
            raise
        raise write_failed(meta, target, e) from e


@functools.lru_cache(maxsize=64)
def _is(kind: type, protocol: type) -> bool:
    """`isinstance` for a runtime-checkable Protocol of methods, looked up once per class.

    Protocol instance checks inspect every member at every call; a Store's
    or sink's methods are its class's, so its class answers for it.
    """
    return issubclass(kind, protocol)


def _missing_dirs(parent: str) -> list[Path]:
    """The dirs from `parent` up that do not exist yet (staging beside the target will make them), deepest first."""
    missing = []
    path = parent
    while not os.path.exists(path) and path != os.path.dirname(path):
        missing.append(Path(path))
        path = os.path.dirname(path)
    return missing


def _remove_empty(dirs: list[Path]) -> None:
    """Removes the dirs a discarded save's staging made, deepest first, while they are empty.

    A save is staged at its accept, before its snapshot arrives; one that
    fails then must leave the tree as it found it, its export dir's new
    parents included. A dir another save has put something in meanwhile
    stays (rmdir refuses it), and so do the ones above it.
    """
    for path in dirs:
        try:
            path.rmdir()
        except OSError:
            return


def write_save(
    store: Store,
    fmt: SaveFormat,
    meta: SaveMeta,
    manifest: Manifest,
    target: PurePath,
    snapshot: SnapshotBytes,
    numpy_state: NumpyPayload | None = None,
    *,
    checkpoint: CheckpointSpec | None = None,
) -> int:
    """Stages, writes and commits one save held in memory at `target`; returns the bytes committed.

    Raises:
        RunNotFoundError: the run has no template in the format.
        SaveFailedError: the save could not be written, with the reason.
    """
    try:
        staging = store.stage(target)
    except OSError as e:
        raise write_failed(meta, target, e) from e
    try:
        staged = fmt.write(meta.run, meta.kind, manifest, staging, snapshot, numpy_state, **own_spec(checkpoint))
        return store.commit(staged, target, meta)
    except BaseException as e:
        store.discard(staging)
        if isinstance(e, CheckpointdError) or not isinstance(e, Exception):
            raise
        raise write_failed(meta, target, e) from e


def write_failed(meta: SaveMeta, target: PurePath, e: Exception) -> SaveFailedError:
    """A write's OS-level (or other unexpected) error as the SaveFailedError the caller hears, logged."""
    reason = f"could not write {meta.kind.value} to {target}: {describe(e)}"
    _LOGGER.warning("run %s: %s", meta.run, reason)
    return SaveFailedError(f"run {meta.run!r}: {reason}")
