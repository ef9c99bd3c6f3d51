"""The save pipeline takes the path its chooser picks for each incremental save, and reports it.

A real LocalStore (no fsync) and TrainingFormat behind the pipeline, no
TensorFlow: the uploads are built by the client's code
(`checkpointd.protocol.increments`) against the offer the accept made and
received by `rpc.upload.receive_snapshot`, as the servicer does.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from checkpointd.bundle import DATA_SUFFIX, INDEX_SUFFIX, chunks
from checkpointd.core.checkpoint_spec import CheckpointSpec, TensorSpec
from checkpointd.core.config import ServeConfig
from checkpointd.core.incremental_path import ChooserConfig, IncrementalPath, PathChooser
from checkpointd.core.ports import NullPhases, SaveSink
from checkpointd.core.retention import RetentionPolicy
from checkpointd.formats import versions
from checkpointd.formats.training_checkpoint import TrainingFormat
from checkpointd.protocol import increments
from checkpointd.protocol.kinds import SaveKind
from checkpointd.rpc import upload
from checkpointd.saves.budget import UploadBudget
from checkpointd.saves.checkpoint_dirs import CheckpointDirs
from checkpointd.saves.pipeline import Decision, Formats, Result, SavePipeline, SaveRequest
from checkpointd.saves.pool import WriterPool
from checkpointd.saves.retention import Retention
from checkpointd.saves.runs import Lanes
from checkpointd.storage.local import LocalStore
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import tf_formats_pb2
from tests.component.fakes import LIMIT, RecordingSink

MiB = chunks.CHUNK_BYTES
KEYS = ("buffer/.ATTRIBUTES/VARIABLE_VALUE", "kernel/.ATTRIBUTES/VARIABLE_VALUE")


def _object_graph() -> bytes:
    graph = tf_formats_pb2.TrackableObjectGraph()
    root = graph.nodes.add()
    for n, key in enumerate(KEYS, start=1):
        name = key.split("/")[0]
        root.children.add(node_id=n, local_name=name)
        graph.nodes.add().attributes.add(name="VARIABLE_VALUE", full_name=name, checkpoint_key=key)
    return graph.SerializeToString()


SPEC = CheckpointSpec(
    _object_graph(),
    (TensorSpec(KEYS[0], "uint8", (8, MiB), 8 * MiB), TensorSpec(KEYS[1], "float32", (1000,), 4000)),
)


@pytest.fixture(autouse=True)
def _no_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    # The manifest's versions name TensorFlow's, which this tier may not import.
    monkeypatch.setattr(versions, "recorded", lambda: {"checkpointd": "test"})


class _Call:
    def is_active(self) -> bool:
        return True


class _Paths(NullPhases):
    """Records each incremental save's path as the metrics would count it."""

    def __init__(self) -> None:
        self.counted: list[str] = []

    def incremental_path(self, kind: str, path: str) -> None:
        self.counted.append(path)


@dataclass
class _Upload:
    """A client's upload of `values`: SameChunks for the chunks the accept's base has, if it offered one."""

    values: Sequence[bytes]
    offer: pb.IncrementalBase | None = None

    def __call__(
        self, parts: Sequence[int], segment: object, deadline: float, sink: SaveSink, then: Callable[[str], object]
    ) -> object:
        requests = increments.save_requests([*self.values, b""], self.offer, MiB)
        total = sum(parts)
        upload.receive_snapshot((pb.SaveRequest.FromString(r) for r in requests), total, _Call(), parts, None, sink)  # type: ignore[arg-type]
        return then("grpc")


@dataclass
class _Rig:
    pipeline: SavePipeline
    root: Path
    phases: _Paths

    def save(self, step: int, values: Sequence[bytes]) -> tuple[Decision, Result]:
        request = SaveRequest(
            run="r", kind=SaveKind.TRAINING_CHECKPOINT, export_dir=f"d/ckpt-{step}", blocking=True, step=step,
            variables=(), snapshot_bytes=sum(len(v) for v in values), checkpoint=SPEC, incremental=True,
        )  # fmt: skip
        receive = _Upload(values)
        events = self.pipeline.save(request, receive, timeout=LIMIT)
        decision = next(events)
        assert isinstance(decision, Decision) and decision.accepted
        if decision.base is not None:
            receive.offer = pb.IncrementalBase(
                export_dir=decision.base.export_dir,
                chunk_bytes=decision.base.chunk_bytes,
                parts=[pb.PartDigests(chunk_crc32c=c) for c in decision.base.parts],
            )
        (result,) = list(events)
        assert isinstance(result, Result)
        return decision, result

    def files(self, step: int) -> tuple[bytes, bytes]:
        prefix = self.root / "r" / "d" / f"ckpt-{step}"
        return Path(str(prefix) + INDEX_SUFFIX).read_bytes(), Path(str(prefix) + DATA_SUFFIX).read_bytes()


@pytest.fixture
def make_rig(tmp_path: Path) -> Iterator[Callable[[PathChooser], _Rig]]:
    closers: list[Callable[[], None]] = []

    def make(paths: PathChooser) -> _Rig:
        where = tmp_path / f"rig{len(closers)}"
        config = ServeConfig(
            root=where / "root", port=0, metrics_port=None, fsync=False, write_nice=0, upload_timeout_seconds=LIMIT
        )
        store = LocalStore(config.root, fsync=False)
        kept = Retention(store, RetentionPolicy(), CheckpointDirs(store))
        kept.start()
        pool = WriterPool()
        phases = _Paths()
        pipeline = SavePipeline(
            config, Lanes(sink=RecordingSink()), store, Formats(TrainingFormat()), pool,
            budget=UploadBudget(4, 64 * MiB), retention=kept, phases=phases, paths=paths,
        )  # fmt: skip
        pipeline.register("r", "", (), b"", 0, lambda: where, kind=SaveKind.TRAINING_CHECKPOINT)

        def close() -> None:
            kept.stop(timeout=LIMIT)
            pool.close()
            store.close()

        closers.append(close)
        return _Rig(pipeline, config.root, phases)

    yield make
    for close in closers:
        close()


def _values(seed: int) -> list[bytearray]:
    rng = random.Random(seed)
    return [bytearray(rng.randbytes(t.nbytes)) for t in SPEC.tensors]


def _changed(values: Sequence[bytearray]) -> list[bytearray]:
    """One chunk of the buffer and the kernel changed: seven of the buffer's eight chunks are the same."""
    buffer, kernel = bytearray(values[0]), bytearray(values[1])
    buffer[3 * MiB : 3 * MiB + 10] = b"x" * 10
    kernel[:4] = b"abcd"
    return [buffer, kernel]


def test_a_root_that_copies_offers_the_base_and_copies_the_unchanged_chunks(make_rig) -> None:
    rig = make_rig(PathChooser(IncrementalPath.CLONE))
    first = _values(1)
    _, full = rig.save(1, first)
    assert (full.incremental_path, full.bytes_copied) == ("no_base", 0)

    decision, second = rig.save(2, _changed(first))
    assert decision.base is not None
    assert second.incremental_path == "clone" and second.bytes_copied == 7 * MiB
    assert rig.phases.counted == ["no_base", "clone"]


def test_where_receiving_measured_cheaper_no_base_is_offered_and_every_byte_is_received(make_rig, tmp_path) -> None:
    paths = PathChooser(IncrementalPath.COPY, ChooserConfig(samples=1, explore_every=100))
    rig = make_rig(paths)
    first = _values(1)
    rig.save(1, first)  # a full save: prices receiving
    alike = f"grpc/training_checkpoint/{full_bytes().bit_length()}"
    paths.observed(alike, seconds=100.0, received=MiB, copied=7 * MiB)  # copying measured far dearer

    decision, second = rig.save(2, _changed(first))
    assert decision.base is None
    assert (second.incremental_path, second.bytes_copied, second.bytes_received) == ("receive", 0, full_bytes())
    assert rig.phases.counted == ["no_base", "receive"]

    # The same values through the copying path commit the same bytes.
    other = make_rig(PathChooser(IncrementalPath.COPY))
    other.save(1, first)
    _, copied = other.save(2, _changed(first))
    assert copied.incremental_path == "copy" and copied.bytes_copied == 7 * MiB
    assert rig.files(2) == other.files(2)


def test_each_save_feeds_the_chooser(make_rig) -> None:
    paths = PathChooser(IncrementalPath.COPY)
    rig = make_rig(paths)
    first = _values(1)
    rig.save(1, first)
    alike = f"grpc/training_checkpoint/{full_bytes().bit_length()}"
    receive, copy = paths.costs(alike)
    assert receive is not None and receive > 0 and copy is None
    rig.save(2, _changed(first))
    assert paths.costs(alike)[1] is not None


def full_bytes() -> int:
    return sum(t.nbytes for t in SPEC.tensors)
