"""The Store seam: where committed saves live, and the capabilities only some stores offer.

A save is staged in a private local dir, then committed with its save
manifest written last: a save exists only once its manifest does. A save
is a dir of its own (policies), or a set of files `<prefix>.*` sharing a
dir with others (training checkpoints, as TensorFlow lays them out).
`checkpointd.storage.local` keeps saves on disk, `checkpointd.storage.s3`
in a bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path, PurePath
from typing import Protocol, runtime_checkable

from checkpointd.core.ports.records import CommittedSave, SaveMeta, Staged
from checkpointd.core.ports.sinks import WatchedSink


class Store(Protocol):
    """Where committed saves live. Every method is thread-safe.

    Readers trust manifests only: a save without one (cut short) never counts.
    """

    def describe(self) -> str:
        """Where the saves go, for logs (e.g. the root's absolute path)."""
        ...

    def location(self, path: PurePath) -> str:
        """A save's path (a target, or a CommittedSave's) as a person or a tool takes it.

        What clients are told a save is at (SaveResult.path, GetLatest,
        status): a path on the daemon's host, or `s3://BUCKET/KEY`, which
        `checkpointd fetch` and `verify` take.
        """
        ...

    def recover(self) -> int:
        """Cleans up what interrupted saves left behind (at start); returns how many."""
        ...

    def target(self, folder: str, export_dir: str) -> PurePath:
        """Where a save to `export_dir` in `folder` is committed (a path or an object key).

        Raises:
            InvalidRequestError: the export dir is invalid or leads out of the folder.
        """
        ...

    def stage(self, target: PurePath) -> Path:
        """An empty private local dir to write a save for `target` into.

        Raises:
            OSError: it cannot be made.
        """
        ...

    def commit(self, staged: Staged, target: PurePath, meta: SaveMeta) -> int:
        """Makes a staged save durable at `target`, its manifest last; returns its bytes.

        Its bytes are those of the files its manifest lists (what `checkpointd
        verify` counts); the manifest itself is not counted.

        A save already at `target` is replaced. On failure nothing new is
        committed and the staging dir is left for `discard`.

        Raises:
            SaveFailedError, OSError: the save could not be committed.
            RunHeldError: a store shared by a fleet: this daemon does not
                (or no longer) hold the run's lease; nothing is committed.
        """
        ...

    def discard(self, staged: Path) -> None:
        """Deletes a staging dir; never raises."""
        ...

    def committed(self, folder: str, run: str | None) -> list[CommittedSave]:
        """Every committed save of `run` (None: of any run) in `folder`, in no order."""
        ...

    def committed_at(self, folder: str, export_dir: str) -> CommittedSave:
        """The committed save at `export_dir` in `folder`.

        Raises:
            InvalidRequestError: `export_dir` is invalid.
            RunNotFoundError: no committed save is there.
        """
        ...

    def delete(self, save: CommittedSave) -> bool:
        """Deletes a committed save (its manifest first); False if it could not."""
        ...

    def folders(self) -> list[str]:
        """Every run folder that may hold saves (for recovery at start)."""
        ...

    def read_file(self, path: PurePath) -> bytes | None:
        """A small file's content beside the saves (a state file), or None if absent."""
        ...

    def write_file(self, path: PurePath, data: bytes) -> None:
        """Replaces a small file beside the saves (a state file) atomically and durably.

        Raises:
            UnavailableError: an object store failed (the next write may succeed); the old content stays.
            OSError: it could not be written; the old content stays.
        """
        ...


@runtime_checkable
class StreamingStore(Protocol):
    """A Store that starts sending a save's data file while it is written (the object store's parts)."""

    def stream(self, staging: Path, target: PurePath, meta: SaveMeta, sink: WatchedSink) -> None:
        """Starts the upload of the save staged at `staging` as its sink fills; `discard` or `commit` ends it.

        Never raises: a save that cannot stream is sent whole at commit.
        """
        ...


@runtime_checkable
class RemoteBases(Protocol):
    """A Store whose committed saves are objects another save's parts may be copied from (S3)."""

    def base_source(self, save: CommittedSave, data_file: str, size: int) -> object | None:
        """The committed data object `save`'s path + `data_file` of `size` bytes as copies name it; None if unusable."""
        ...


@runtime_checkable
class BoundedRequests(Protocol):
    """A Store whose reads may retry for long (an object store): a save's checks before its accept bound them."""

    def bounded(self, deadline: float | None) -> AbstractContextManager[None]:
        """No request this thread makes inside the block is retried past `deadline` (time.monotonic(); None: none).

        The call then raises UnavailableError naming the last error.
        """
        ...


@runtime_checkable
class TidiesLater(Protocol):
    """A Store whose start-up recovery has a slow part the daemon runs after it serves (an object store's listing).

    `Store.recover` does the quick part (local staging) before the bind.
    """

    def tidy(self, stopping: Callable[[], bool]) -> int:
        """Deletes what interrupted saves left in the store, older than its grace age; returns how many.

        Runs beside live saves (a peer's or this daemon's): whatever is younger
        than the grace age is left alone. Stops early once `stopping()` is
        true. Never raises: tidying only, a failure is logged.
        """
        ...


@runtime_checkable
class Closing(Protocol):
    """A Store (or other seam) holding threads or connections that the daemon ends at shutdown."""

    def close(self) -> None:
        """Ends them; called once, after the last save."""
        ...
