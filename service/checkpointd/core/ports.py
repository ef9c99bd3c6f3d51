"""What the core and the save pipeline need from the outside world, as Protocols.

The two seams a new backend or save kind plugs into:
- `Store`: where committed saves live (`checkpointd.storage.local` on disk).
  A save is staged in a private local dir, then committed with its save
  manifest written last: a save exists only once its manifest does. A save
  is a dir of its own (policies), or a set of files `<prefix>.*` sharing a
  dir with others (training checkpoints, as TensorFlow lays them out).
- `SaveFormat`: how one kind of save is checked, written into staging and
  read back (`checkpointd.formats.policy` for policy SavedModels and
  checkpoints, `checkpointd.formats.training_checkpoint` for training checkpoints).
  A save's files are opened before its snapshot arrives (`SaveFormat.open`)
  and written as it does (`SaveSink`), so no snapshot is held whole.
`checkpointd.server` picks the implementations.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from checkpointd.core.checkpoint_spec import CheckpointSpec
    from checkpointd.core.manifest import Manifest, VariableSpec
    from checkpointd.core.numpy_state import NumpyPayload, NumpyStateSpec
    from checkpointd.protocol.kinds import SaveKind

# A snapshot: every variable's bytes concatenated, or one buffer per variable.
SnapshotBytes = bytes | bytearray | memoryview | Sequence[memoryview]


class Clock(Protocol):
    def __call__(self) -> float:
        """Seconds since the epoch."""


class MetricsSink(Protocol):
    """Receives every save outcome; `checkpointd.metrics` implements it."""

    def save_skipped(self, run: str, kind: str) -> None: ...

    def save_written(self, run: str, kind: str, bytes_written: int, seconds: float, at: float) -> None: ...

    def save_failed(self, run: str, kind: str, seconds: float) -> None: ...

    def save_cancelled(self, run: str, kind: str, seconds: float) -> None:
        """An accepted save's caller went away before it was written (no failure)."""

    def in_flight_changed(self, delta: int) -> None: ...

    def run_closed(self, run: str) -> None:
        """The run's lane closed: its per-run series can go."""


class NullSink:
    """A MetricsSink that records nothing."""

    def save_skipped(self, run: str, kind: str) -> None:
        pass

    def save_written(self, run: str, kind: str, bytes_written: int, seconds: float, at: float) -> None:
        pass

    def save_failed(self, run: str, kind: str, seconds: float) -> None:
        pass

    def save_cancelled(self, run: str, kind: str, seconds: float) -> None:
        pass

    def in_flight_changed(self, delta: int) -> None:
        pass

    def run_closed(self, run: str) -> None:
        pass


class PhaseSink(Protocol):
    """Times the phases of accepted saves and counts their transports (`checkpointd.metrics`)."""

    def observe_phase(self, kind: str, phase: str, seconds: float) -> None: ...

    def snapshot_received(self, kind: str, transport: str) -> None: ...

    def payload_bytes(self, kind: str, received: int, copied: int) -> None:
        """Counts one committed save's payload: bytes received, and bytes copied from its base."""

    def preemption_save(self, outcome: str, notice_to_durable: float | None) -> None:
        """Counts one accepted save on notice by outcome; `notice_to_durable`: seconds, if written and known."""


class NullPhases:
    """A PhaseSink that records nothing."""

    def observe_phase(self, kind: str, phase: str, seconds: float) -> None:
        pass

    def snapshot_received(self, kind: str, transport: str) -> None:
        pass

    def payload_bytes(self, kind: str, received: int, copied: int) -> None:
        pass

    def preemption_save(self, outcome: str, notice_to_durable: float | None) -> None:
        pass


@dataclass(frozen=True)
class SaveMeta:
    """What a save's manifest records besides its files."""

    run: str
    kind: SaveKind
    step: int
    export_dir: str  # as the trainer named it
    trainer_versions: Mapping[str, str] = field(default_factory=dict)  # the trainer's (SaveHeader), e.g. tensorflow's


@dataclass(frozen=True)
class Staged:
    """A save's files, written by a SaveFormat into a Store's staging dir.

    Attributes:
        path: the local staging dir holding the files.
        bytes_written: their total size.
        versions: software versions for the save manifest (e.g. tensorflow's).
        known: (size, CRC32C) of files whose content the format already
            checksummed (template files written from memory), by
            '/'-separated path, so the store need not read them back.
        extra: format-specific fields for the save manifest.
        files_prefix: None for a save that is a dir of its own. Else the
            staged files are named `<files_prefix><suffix>` and are committed
            beside the target as `<target.name><suffix>`, sharing its parent
            dir with other saves (a TensorFlow checkpoint prefix).
    """

    path: Path
    bytes_written: int
    versions: Mapping[str, str]
    known: Mapping[str, tuple[int, int]] | None = None
    extra: Mapping[str, Any] | None = None
    files_prefix: str | None = None


@dataclass(frozen=True)
class CommittedSave:
    """One committed save, as its manifest describes it.

    Attributes:
        path: where it lives: a dir on the daemon's host for the local store
            (a `Path`), an object key for the object store (a
            `PurePosixPath` relative to the bucket).
        export_dir: the save relative to its folder, '/'-separated.
        run: the run that wrote it.
        kind: its kind.
        step: the train step in its snapshot.
        created: Unix time the daemon committed it.
        prefix: True for files `<path>.*` sharing their dir with other
            saves (a training checkpoint), False for a dir of its own.
        extra: the format's fields of its manifest (Staged.extra), if any.
    """

    path: PurePath
    export_dir: str
    run: str
    kind: SaveKind
    step: int
    created: float
    prefix: bool = False
    extra: Mapping[str, Any] | None = None

    @property
    def name(self) -> str:
        """The save's last path component (a training checkpoint's "ckpt-<step>")."""
        return self.path.name


class SaveValues(Protocol):
    """A committed save opened for Restore, checked against the run's manifest.

    A training checkpoint's values also have `checkpoint`, the CheckpointSpec
    of what it holds (payload order); policy saves' need not.
    """

    numpy_state: NumpyStateSpec | None
    nbytes: int

    def pieces(self) -> Iterator[memoryview]:
        """Each variable's raw bytes in manifest order, then each numpy entry's."""
        ...


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


class Leases(Protocol):
    """Who writes a run, when several daemons share one store (`checkpointd.storage.s3_lease`).

    A run is written by one daemon at a time: the one holding its lease.
    One store per daemon (local disk) needs none (`NoLeases`). Every method
    is thread-safe; `hold` and `check` of a run this daemon holds send no
    request.
    """

    def hold(self, run: str, deadline: float | None, waiting: Callable[[str], None] | None = None) -> None:
        """Makes this daemon the run's holder, or confirms it is; called before a run's template or save is written.

        Waits (until `deadline`, time.monotonic() seconds; None: no wait) for
        another daemon's lease to be released or to expire. Before it waits,
        it logs at INFO and calls `waiting` (once) with the same sentence:
        how long, and who holds the lease.

        Raises:
            RunHeldError: another daemon still holds it at the deadline
                (the message names the holder and when its lease expires).
            UnavailableError: the store cannot be reached.
        """

    def check(self, run: str) -> None:
        """Raises RunHeldError unless this daemon's lease on the run is still valid: the fence before a commit."""

    def release(self, run: str) -> None:
        """Lets go of the run's lease (the run closed or went idle); another daemon may take it at once."""

    def holder(self, run: str) -> str | None:
        """Who holds the run's lease now ("" if this daemon), None if nobody; for status."""

    def close(self) -> None:
        """Releases every lease this daemon holds and stops renewing (daemon shutdown)."""


class NoLeases:
    """The Leases of a store that one daemon owns alone: every run is always this daemon's."""

    def hold(self, run: str, deadline: float | None, waiting: Callable[[str], None] | None = None) -> None:
        pass

    def check(self, run: str) -> None:
        pass

    def release(self, run: str) -> None:
        pass

    def holder(self, run: str) -> str | None:
        return None

    def close(self) -> None:
        pass


@runtime_checkable
class LocalCopies(Protocol):
    """A Store whose saves are not local files (an object store) gives readers local copies.

    SaveFormat.read needs a save's files on a filesystem; Restore opens a
    save of such a store through `local_copy`.
    """

    def local_copy(self, save: CommittedSave) -> AbstractContextManager[CommittedSave]:
        """Brings a committed save's files to a private local dir, checked against its manifest.

        Yields the save with `path` local; the copy is deleted on exit.

        Raises:
            ChecksumError, SaveFailedError: a file is missing, corrupt or unreadable.
        """
        ...


@dataclass(frozen=True)
class SavedFile:
    """One file of a committed save, as its manifest lists it.

    Attributes:
        path: relative to the save's dir (its checkpoint dir for a prefix).
        size: bytes.
        crc32c: the whole file's CRC32C.
    """

    path: str
    size: int
    crc32c: int


@runtime_checkable
class SaveFiles(Protocol):
    """A Store that hands out a committed save's files as bytes, for RestoreFiles."""

    def files_of(self, save: CommittedSave) -> list[SavedFile]:
        """Every file of the save, from its manifest.

        Raises:
            RunNotFoundError: the save is no longer committed.
        """
        ...

    def local_dir(self, save: CommittedSave) -> Path | None:
        """The local dir the files' paths are relative to; None if they are not local files."""
        ...

    def verified(self, save: CommittedSave, files: Sequence[SavedFile]) -> dict[str, tuple[int, int, int]]:
        """The (st_dev, st_ino, st_mtime_ns) of each local file found to match its manifest (size and CRC32C).

        A file that does not match, or is no local file, is left out.
        """
        ...

    def read_ranges(self, save: CommittedSave, ranges: Sequence[tuple[str, int, int]]) -> Iterator[bytes]:
        """The bytes of each (path, offset, length) in order, in pieces of at most 3 MiB (wire.FILE_CHUNK_BYTES).

        Raises:
            SaveFailedError: a file is missing or unreadable.
            UnavailableError: the object store failed.
        """
        ...


@runtime_checkable
class StagesFiles(Protocol):
    """A SaveFiles Store that can land a save's byte ranges straight in local files (a staged RestoreFiles)."""

    def stage_ranges(
        self, save: CommittedSave, ranges: Sequence[tuple[str, int, int]], fds: Mapping[str, int]
    ) -> Generator[tuple[str, int, int, int], None, None]:
        """Writes each (path, offset, length) into `fds[path]` at its offset.

        Yields:
            (path, offset, length, crc32c) of each range, in order, once
            every byte of it is written.

        Raises:
            SaveFailedError: a file is missing or shorter than asked.
            UnavailableError: the object store failed.
            OSError: a write failed.
        """
        ...


class SaveSink(Protocol):
    """A save's files, open in staging, taking the snapshot's parts as they arrive.

    The parts are the wire's (each variable or tensor, then the numpy
    state's bytes), each one's bytes in order; the parts themselves may come
    in any order. `close` may be called from another thread than the writer's
    (a save given up mid-upload): it waits for a write in progress, and
    later writes fail.
    """

    def write(self, part: int, offset: int, data: Any, crc: int | None = None) -> None:
        """Takes `data`, the bytes of part #`part` from `offset` on (the bytes it has so far).

        `crc`, if given, is `data`'s CRC32C as the receiver checked it (a
        sink may fold it in instead of summing the bytes again).

        Raises:
            InvalidRequestError: out of order or past the part's size.
            Exception: the files could not be written.
        """
        ...

    def finish(self) -> Staged:
        """Completes the files once every part has come; returns them staged for the Store.

        Raises:
            InvalidRequestError: a part is incomplete.
            Exception: the files could not be written.
        """
        ...

    def close(self) -> None:
        """Closes the files (again: nothing); the staging dir is the caller's to discard."""
        ...


@runtime_checkable
class WatchedSink(Protocol):
    """A SaveSink that reports its data file's byte ranges as they are written (`BundleSink`)."""

    def watch(self, on_range: Callable[[int, int], None]) -> tuple[Path, int]:
        """Calls `on_range(start, end)` per written range, any order; returns the data file's path and size."""
        ...


@runtime_checkable
class WholePartsSink(Protocol):
    """A SaveSink that takes a snapshot's parts all at once (one in shared memory) and picks their order."""

    def write_parts(self, views: Sequence[memoryview]) -> None:
        """Takes every part whole (`views[j]` is part j's bytes), as `write(j, 0, views[j])` for each would.

        Raises:
            as `SaveSink.write`.
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


class SaveFormat(Protocol):
    """One family of save kinds: how a run registers, and how its saves are written and read."""

    @property
    def kinds(self) -> tuple[SaveKind, ...]:
        """The kinds this format writes."""
        ...

    def register(
        self,
        run: str,
        staged_dir: Path,
        variables: Sequence[VariableSpec],
        checkpoint_object_graph: bytes,
    ) -> Manifest:
        """Validates an uploaded template and makes it the run's template.

        `staged_dir` is consumed (kept or deleted).

        Raises:
            InvalidRequestError: the template or `variables` are not valid for this format.
        """
        ...

    def check(
        self,
        manifest: Manifest,
        variables: Sequence[VariableSpec],
        snapshot_bytes: int,
        numpy_state: NumpyStateSpec | None,
        max_snapshot_bytes: int,
        *,
        checkpoint: CheckpointSpec | None = None,
    ) -> None:
        """Refuses a save header that does not fit the run's manifest, before the decision.

        `checkpoint` is a training checkpoint's own description, given (only)
        to the format of TRAINING_CHECKPOINT saves; the pipeline passes it to
        no other, so policy formats need not take it.

        Raises:
            InvalidRequestError, LimitExceededError: naming what is wrong.
        """
        ...

    def write(
        self,
        run: str,
        kind: SaveKind,
        manifest: Manifest,
        staging: Path,
        snapshot: SnapshotBytes,
        numpy_state: NumpyPayload | None,
        *,
        checkpoint: CheckpointSpec | None = None,
    ) -> Staged:
        """Writes one save's files into the empty dir `staging`.

        `manifest` is the one the snapshot was checked against: a run
        registered anew meanwhile fails the save rather than mislabel it.
        `checkpoint`: as for `check`, the training checkpoint the snapshot
        holds (one part per tensor).

        Raises:
            RunNotFoundError: the run has no template here.
            SaveFailedError: the snapshot does not fit the run's template.
            Exception: the files could not be written (the pipeline reports
                it as SaveFailedError with the reason).
        """
        ...

    def open(
        self,
        run: str,
        kind: SaveKind,
        manifest: Manifest,
        staging: Path,
        parts: Sequence[int],
        numpy_state: NumpyStateSpec | None,
        *,
        checkpoint: CheckpointSpec | None = None,
    ) -> SaveSink:
        """Opens one save's files in the empty dir `staging`, before its snapshot arrives.

        `parts` are the snapshot's part sizes as the pipeline receives them:
        each variable (or a training checkpoint's tensor), then the numpy
        state's bytes (0 without). Otherwise as `write`, whose snapshot the
        returned sink takes piece by piece.

        Raises:
            RunNotFoundError: the run has no template here.
            SaveFailedError: the parts do not fit the run's template.
            Exception: the files could not be created.
        """
        ...

    def read(self, save: CommittedSave, manifest: Manifest) -> SaveValues:
        """Opens a committed save of this format for Restore.

        Raises:
            InvalidRequestError: the save does not fit the run's manifest.
            ChecksumError, SaveFailedError: its files are corrupt or unreadable.
        """
        ...
