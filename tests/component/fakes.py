"""Fakes behind the pipeline's seams: a Store in memory and a SaveFormat without TensorFlow.

- `Gate`: a point a worker stops at until the test releases it, and an event
  saying it got there, so a save is held "in flight" with no timing involved.
  A gate nobody releases gives way after `LIMIT` seconds (the save then
  fails), so a broken test ends instead of hanging.
- `FakeStore`: committed saves in a dict (their files read into memory at
  commit); staging dirs are real temp dirs, consumed by a commit as a rename
  would. Fails or holds the next commit on demand.
- `FakeFormat`: SAVED_MODEL and CHECKPOINT saves as one snapshot file (plus the
  template's files for SAVED_MODEL, and the numpy state's bytes and spec),
  read back from the store for Restore. Fails or holds the next write on demand.
  `open` returns a `BufferedSink`, which keeps the parts and writes at `finish`.
- `Upload`: a Receiver that writes a snapshot's bytes into the save's sink in
  the pipeline's parts, or holds, or raises.
- `RecordingSink`: a MetricsSink that keeps every call.
"""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import TypeVar

from checkpointd.core.numpy_state import NumpyEntry, NumpyPayload, NumpyStateSpec, check_payload
from checkpointd.core.ports import CommittedSave, SaveMeta, SaveSink, SnapshotBytes, Staged
from checkpointd.core.variable_manifest import Manifest, VariableSpec
from checkpointd.protocol.errors import (
    InvalidRequestError,
    RunNotFoundError,
    SaveFailedError,
)
from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.names import check_export_dir, check_run_name
from checkpointd.transport.shm import Segment

_T = TypeVar("_T")

# Upper bound on every wait in this tier; reached only when a test fails.
LIMIT = 10.0


class Gate:
    """Where a worker waits until the test calls `release`."""

    def __init__(self, limit: float = LIMIT) -> None:
        self._limit = limit
        self.reached = threading.Event()
        self._released = threading.Event()

    def pass_through(self) -> None:
        """Signals arrival, then waits for `release` (TimeoutError after `limit`)."""
        self.reached.set()
        if not self._released.wait(self._limit):
            raise TimeoutError(f"the test never released this gate within {self._limit:g}s")

    def release(self) -> None:
        self._released.set()

    def wait_reached(self) -> None:
        """Returns once a worker waits at the gate; fails the test after LIMIT."""
        assert self.reached.wait(LIMIT), "nothing reached the gate"


class _Switches:
    """One-shot failures and holds, taken in order by the next operations."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: list[BaseException] = []
        self._holds: list[Gate] = []
        self._gates: list[Gate] = []

    def fail_next(self, error: BaseException) -> None:
        with self._lock:
            self._failures.append(error)

    def hold_next(self) -> Gate:
        gate = Gate()
        with self._lock:
            self._holds.append(gate)
            self._gates.append(gate)
        return gate

    def take(self) -> tuple[Gate | None, BaseException | None]:
        with self._lock:
            gate = self._holds.pop(0) if self._holds else None
            error = self._failures.pop(0) if self._failures else None
        return gate, error

    def release_all(self) -> None:
        with self._lock:
            gates = list(self._gates)
        for gate in gates:
            gate.release()


def _read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@dataclass
class _Committed:
    folder: str
    save: CommittedSave
    files: dict[str, bytes]


class FakeStore:
    """A `checkpointd.core.ports.Store` in memory. Thread-safe.

    Targets are paths under `ROOT`, which is never created: nothing but the
    staging dirs (under `staging_root`) touches the disk. Each commit gets a
    later `created` time than the one before.

    Attributes:
        staged: every staging dir handed out, in order.
        discarded: every staging dir discarded, in order.
        commits: the meta of every successful commit, in order.
    """

    ROOT = Path("/fake-store")

    def __init__(self, staging_root: Path) -> None:
        self._staging_root = staging_root
        self._lock = threading.Lock()
        self._saves: dict[Path, _Committed] = {}
        self._ticks = itertools.count(1)
        self._commit = _Switches()
        self.staged: list[Path] = []
        self.discarded: list[Path] = []
        self.commits: list[SaveMeta] = []

    # Switches.

    def fail_next_commit(self, error: BaseException) -> None:
        """The next commit raises `error` and commits nothing."""
        self._commit.fail_next(error)

    def hold_next_commit(self) -> Gate:
        """The next commit waits at the returned gate before it commits."""
        return self._commit.hold_next()

    def release_all(self) -> None:
        """Opens every gate handed out (teardown)."""
        self._commit.release_all()

    # What the tests read.

    def saves(self) -> list[CommittedSave]:
        with self._lock:
            return [entry.save for entry in self._saves.values()]

    def files(self, path: Path) -> dict[str, bytes]:
        """The files of the committed save at `path` (KeyError if there is none)."""
        with self._lock:
            return dict(self._saves[path].files)

    def live_staging(self) -> list[Path]:
        """Staging dirs still on disk: neither committed nor discarded."""
        return [p for p in self.staged if p.exists()]

    # The Store.

    def describe(self) -> str:
        return f"memory ({self.ROOT})"

    def location(self, path: PurePath) -> str:
        return str(path)

    def recover(self) -> int:
        return 0

    def target(self, folder: str, export_dir: str) -> Path:
        return self.ROOT / check_run_name(folder) / check_export_dir(export_dir)

    def stage(self, target: Path) -> Path:
        self._staging_root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{target.name}-", dir=self._staging_root))
        with self._lock:
            self.staged.append(staging)
        return staging

    def commit(self, staged: Staged, target: Path, meta: SaveMeta) -> int:
        gate, error = self._commit.take()
        if gate is not None:
            gate.pass_through()
        if error is not None:
            raise error
        relative = target.relative_to(self.ROOT)
        folder, export_dir = relative.parts[0], "/".join(relative.parts[1:])
        files = _read_tree(staged.path)
        with self._lock:
            created = 1_000_000.0 + next(self._ticks)
            save = CommittedSave(target, export_dir, meta.run, meta.kind, meta.step, created)
            self._saves[target] = _Committed(folder, save, files)
            self.commits.append(meta)
        shutil.rmtree(staged.path)  # consumed, as the local store's rename does
        return staged.bytes_written

    def discard(self, staged: Path) -> None:
        with self._lock:
            self.discarded.append(staged)
        shutil.rmtree(staged, ignore_errors=True)

    def committed(self, folder: str, run: str | None) -> list[CommittedSave]:
        with self._lock:
            return [e.save for e in self._saves.values() if e.folder == folder and (run is None or e.save.run == run)]

    def committed_at(self, folder: str, export_dir: str) -> CommittedSave:
        target = self.target(folder, export_dir)
        with self._lock:
            entry = self._saves.get(target)
        if entry is None:
            raise RunNotFoundError(f"no committed save at {export_dir!r} in folder {folder!r}")
        return entry.save

    def delete(self, save: CommittedSave) -> bool:
        with self._lock:
            return self._saves.pop(save.path, None) is not None

    def folders(self) -> list[str]:
        with self._lock:
            return sorted({e.folder for e in self._saves.values()})


@dataclass(frozen=True)
class Registration:
    """What the fake format was given by one successful register."""

    run: str
    manifest: Manifest
    files: dict[str, bytes]
    checkpoint_object_graph: bytes


@dataclass(frozen=True)
class Write:
    """One write the fake format did: the snapshot's bytes as it received them."""

    run: str
    kind: SaveKind
    snapshot: bytes
    numpy_state: bytes | None


# Where the fake format puts a save's parts (relative to the save).
SNAPSHOT_FILE = "variables/snapshot.bin"
NUMPY_FILE = "numpy_state/numpy_state.bin"
NUMPY_SPEC_FILE = "numpy_state/spec.json"
# The file a template must hold to register (a stand-in for PolicyFormat's checks).
TEMPLATE_MARKER = "saved_model.pb"


def _join(snapshot: SnapshotBytes) -> bytes:
    if isinstance(snapshot, (bytes, bytearray, memoryview)):
        return bytes(snapshot)
    return b"".join(bytes(memoryview(part)) for part in snapshot)


@dataclass
class FakeValues:
    """`SaveValues` over a committed fake save's bytes."""

    numpy_state: NumpyStateSpec | None
    nbytes: int
    _parts: tuple[bytes, ...]

    def pieces(self) -> Iterator[memoryview]:
        for part in self._parts:
            yield memoryview(part)


class FakeFormat:
    """A `checkpointd.core.ports.SaveFormat` for policy kinds, without TensorFlow. Thread-safe.

    Like PolicyFormat, a write whose manifest is not the run's current
    registration fails with SaveFailedError instead of writing the values
    under the new registration's keys.

    Attributes:
        registered: every successful register, in order.
        writes: every write that produced files, in order.
    """

    kinds: tuple[SaveKind, ...] = (SaveKind.SAVED_MODEL, SaveKind.CHECKPOINT)

    def __init__(self, files: Callable[[Path], Mapping[str, bytes]]) -> None:
        """Args:
        files: the files of a committed save by its path (`FakeStore.files`).
        """
        self._files = files
        self._lock = threading.Lock()
        self._templates: dict[str, Registration] = {}
        self._write = _Switches()
        self.registered: list[Registration] = []
        self.writes: list[Write] = []

    # Switches.

    def fail_next_write(self, error: BaseException) -> None:
        """The next write raises `error` (after its hold, if any) and writes nothing."""
        self._write.fail_next(error)

    def hold_next_write(self) -> Gate:
        """The next write waits at the returned gate before it writes."""
        return self._write.hold_next()

    def release_all(self) -> None:
        self._write.release_all()

    # The SaveFormat.

    def register(
        self,
        run: str,
        staged_dir: Path,
        variables: Sequence[VariableSpec],
        checkpoint_object_graph: bytes,
    ) -> Manifest:
        try:
            check_run_name(run)
            files = _read_tree(staged_dir)
        finally:
            shutil.rmtree(staged_dir, ignore_errors=True)  # consumed either way
        if TEMPLATE_MARKER not in files:
            raise InvalidRequestError(f"template of run {run!r} has no {TEMPLATE_MARKER}")
        if not variables:
            raise InvalidRequestError(f"run {run!r} registers no variables")
        registration = Registration(run, Manifest(tuple(variables)), files, checkpoint_object_graph)
        with self._lock:
            self._templates[run] = registration
            self.registered.append(registration)
        return registration.manifest

    def check(
        self,
        manifest: Manifest,
        variables: Sequence[VariableSpec],
        snapshot_bytes: int,
        numpy_state: NumpyStateSpec | None,
        max_snapshot_bytes: int,
    ) -> None:
        check_payload(manifest, variables, snapshot_bytes, numpy_state, max_snapshot_bytes)

    def write(
        self,
        run: str,
        kind: SaveKind,
        manifest: Manifest,
        staging: Path,
        snapshot: SnapshotBytes,
        numpy_state: NumpyPayload | None,
    ) -> Staged:
        gate, error = self._write.take()
        if gate is not None:
            gate.pass_through()
        with self._lock:
            template = self._templates.get(run)
        if template is None:
            raise RunNotFoundError(f"run {run!r} has no template here")
        if template.manifest is not manifest and template.manifest != manifest:
            raise SaveFailedError(
                f"run {run!r} was registered again with other variables while this save was " "in flight; save again"
            )
        if error is not None:
            raise error
        data = _join(snapshot)
        if len(data) != manifest.nbytes:
            raise SaveFailedError(f"run {run!r}: snapshot has {len(data)} bytes, not {manifest.nbytes}")
        files: dict[str, bytes] = {SNAPSHOT_FILE: data}
        if kind is SaveKind.SAVED_MODEL:
            files.update(template.files)
        numpy_bytes = None
        if numpy_state is not None:
            numpy_bytes = bytes(numpy_state.data)
            files[NUMPY_FILE] = numpy_bytes
            files[NUMPY_SPEC_FILE] = json.dumps(
                {
                    "object_graph": numpy_state.spec.object_graph.hex(),
                    "entries": [[e.checkpoint_key, e.nbytes] for e in numpy_state.spec.entries],
                }
            ).encode()
        for relative, content in files.items():
            (staging / relative).parent.mkdir(parents=True, exist_ok=True)
            (staging / relative).write_bytes(content)
        with self._lock:
            self.writes.append(Write(run, kind, data, numpy_bytes))
        return Staged(
            path=staging,
            bytes_written=sum(len(c) for c in files.values()),
            versions={"fake_format": "1"},
        )

    def open(
        self,
        run: str,
        kind: SaveKind,
        manifest: Manifest,
        staging: Path,
        parts: Sequence[int],
        numpy_state: NumpyStateSpec | None,
    ) -> BufferedSink:
        def finish(pieces: list[bytes]) -> Staged:
            payload = NumpyPayload(numpy_state, pieces[-1]) if numpy_state is not None else None
            return self.write(run, kind, manifest, staging, [memoryview(p) for p in pieces[:-1]], payload)

        return BufferedSink(parts, finish)

    def read(self, save: CommittedSave, manifest: Manifest) -> FakeValues:
        files = self._files(save.path)
        data = files[SNAPSHOT_FILE]
        if len(data) != manifest.nbytes:
            raise InvalidRequestError(
                f"save {save.export_dir!r} holds {len(data)} bytes; the run's manifest needs " f"{manifest.nbytes}"
            )
        parts = [data[start:end] for start, end in manifest.offsets()]
        spec = None
        if NUMPY_SPEC_FILE in files:
            document = json.loads(files[NUMPY_SPEC_FILE])
            spec = NumpyStateSpec(
                bytes.fromhex(document["object_graph"]),
                tuple(NumpyEntry(key, nbytes) for key, nbytes in document["entries"]),
            )
            parts.append(files[NUMPY_FILE])
        return FakeValues(spec, sum(len(p) for p in parts), tuple(parts))


class BufferedSink:
    """A `SaveSink` that keeps each part's bytes and hands them to `finish` (the fake format's write)."""

    def __init__(self, parts: Sequence[int], finish: Callable[[list[bytes]], Staged]) -> None:
        self.parts = list(parts)
        self._kept = [bytearray() for _ in parts]
        self._finish = finish
        self.closed = False

    def write(self, part: int, offset: int, data: object, crc: int | None = None) -> None:
        if self.closed:
            raise ValueError("the sink is closed")
        kept = self._kept[part]
        if offset != len(kept) or offset + memoryview(data).nbytes > self.parts[part]:  # type: ignore[arg-type]
            raise InvalidRequestError(f"part #{part}: bytes at {offset}, expected {len(kept)}")
        kept += memoryview(data)  # type: ignore[arg-type]

    def finish(self) -> Staged:
        for j, (kept, size) in enumerate(zip(self._kept, self.parts, strict=True)):
            if len(kept) != size:
                raise InvalidRequestError(f"part #{j} ended after {len(kept)} of its {size} bytes")
        return self._finish([bytes(k) for k in self._kept])

    def close(self) -> None:
        self.closed = True


class Upload:
    """A `Receiver` that writes `data` into the save's sink in the pipeline's parts.

    With `hold`, it waits at the gate first (the save is accepted and in
    flight meanwhile); with `error`, it raises it instead (a bad upload).
    """

    def __init__(self, data: bytes, *, hold: Gate | None = None, error: BaseException | None = None) -> None:
        self.data = data
        self.hold = hold
        self.error = error
        self.calls = 0

    def __call__(
        self, parts: Sequence[int], segment: Segment | None, deadline: float, sink: SaveSink, then: Callable[[str], _T]
    ) -> _T:
        self.calls += 1
        if self.hold is not None:
            self.hold.pass_through()
        if self.error is not None:
            raise self.error
        assert sum(parts) == len(self.data), (list(parts), len(self.data))
        start = 0
        for j, size in enumerate(parts):
            if size:
                sink.write(j, 0, memoryview(self.data[start : start + size]))
            start += size
        return then("test")


@dataclass
class RecordingSink:
    """A MetricsSink that keeps every call, in order, as a tuple."""

    calls: list[tuple] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def _record(self, *call: object) -> None:
        with self._lock:
            self.calls.append(call)

    def save_skipped(self, run: str, kind: str) -> None:
        self._record("skipped", run, kind)

    def save_written(self, run: str, kind: str, bytes_written: int, seconds: float, at: float) -> None:
        self._record("written", run, kind, bytes_written)

    def save_failed(self, run: str, kind: str, seconds: float) -> None:
        self._record("failed", run, kind)

    def save_cancelled(self, run: str, kind: str, seconds: float) -> None:
        self._record("cancelled", run, kind)

    def in_flight_changed(self, delta: int) -> None:
        self._record("in_flight", delta)

    def run_closed(self, run: str) -> None:
        self._record("closed", run)

    def outcomes(self) -> list[tuple]:
        """The calls that count a save (skipped, written, failed, cancelled), in order."""
        with self._lock:
            return [c for c in self.calls if c[0] in ("skipped", "written", "failed", "cancelled")]
