"""Incremental saves through the real receiver, sink and bundle writer: the files are a full save's, byte for byte.

A base checkpoint is written in full (`TrainingFormat.write`, which records
its chunk digests); the next save's requests are built by the client's code
(`checkpointd.protocol.increments`) against the base's offer, received by
`rpc.upload.receive_snapshot` into the real sink with the base beside it, and
its files compared with a full save of the same values. No TensorFlow: the
full save's identity with SaveV2 is the bundle tests' and fidelity suite's.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpointd.bundle import DATA_SUFFIX, INDEX_SUFFIX, chunks
from checkpointd.core import chunk_record
from checkpointd.core.checkpoint_spec import CheckpointSpec, TensorSpec
from checkpointd.formats import versions
from checkpointd.formats.training_checkpoint import STAGED_STEM, TrainingFormat
from checkpointd.protocol import increments
from checkpointd.protocol.errors import ChecksumError, InvalidRequestError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.rpc import upload
from checkpointd.saves import bases
from checkpointd.v1 import checkpointd_pb2 as pb

MiB = chunks.CHUNK_BYTES
ROW = 4096  # a replay buffer row's bytes (uint8 rows of this width)
ROWS = 900  # 3.5 MiB: three whole chunks and a short one


@pytest.fixture(autouse=True)
def _no_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    # The manifest's versions name TensorFlow's, which this tier may not import.
    monkeypatch.setattr(versions, "recorded", lambda: {"checkpointd": "test"})


class _Call:
    def is_active(self) -> bool:
        return True


def _spec(buffer_rows: int = ROWS, weights: int = 3000) -> CheckpointSpec:
    return CheckpointSpec(
        b"object graph",
        (
            TensorSpec("buffer/.ATTRIBUTES/VARIABLE_VALUE", "uint8", (buffer_rows, ROW), buffer_rows * ROW),
            TensorSpec("kernel/.ATTRIBUTES/VARIABLE_VALUE", "float32", (weights,), weights * 4),
            TensorSpec("step/.ATTRIBUTES/VARIABLE_VALUE", "int64", (), 8),
            TensorSpec("state/.ATTRIBUTES/py_state", "string", (), 11),
        ),
    )


def _values(spec: CheckpointSpec, seed: int) -> list[bytearray]:
    rng = random.Random(seed)
    return [bytearray(rng.randbytes(t.nbytes)) for t in spec.tensors]


def _full(root: Path, spec: CheckpointSpec, values: Sequence[bytes]) -> Path:
    """A full save's staging dir."""
    root.mkdir()
    TrainingFormat().write("run", SaveKind.TRAINING_CHECKPOINT, None, root, list(values), None, checkpoint=spec)  # type: ignore[arg-type]
    return root


def _base(staged: Path, spec: CheckpointSpec) -> bases.OpenBase:
    """The staged save as the next save's base, as `open_base` would find it committed."""
    import json

    extra = json.loads((staged / "extra.json").read_text()) if (staged / "extra.json").exists() else None
    assert extra is not None
    record = chunk_record.parse(extra)
    assert record is not None
    fd = os.open(staged / (STAGED_STEM + DATA_SUFFIX), os.O_RDONLY)
    parts: list[chunk_record.BaseTensor | None] = []
    for t in spec.tensors:
        b = record.tensors.get(t.checkpoint_key)
        parts.append(b if b is not None and (b.dtype, b.shape, b.size) == (t.dtype, t.shape, t.nbytes) else None)
    parts.append(None)
    return bases.OpenBase("base", staged, fd, record.identity, record.chunk_bytes, parts)


def _write_base(root: Path, spec: CheckpointSpec, values: Sequence[bytes]) -> Path:
    """A full save whose manifest fields are kept beside it (extra.json), as the Store would record them."""
    import json

    root.mkdir()
    staged = TrainingFormat().write(
        "run",
        SaveKind.TRAINING_CHECKPOINT,
        None,
        root,
        list(values),
        None,
        checkpoint=spec,  # type: ignore[arg-type]
    )
    (root / "extra.json").write_text(json.dumps(dict(staged.extra or {})))
    return root


def _incremental(root: Path, spec: CheckpointSpec, values: Sequence[bytes], base: bases.OpenBase) -> increments.Sent:
    """Receives the values as an incremental save against `base` into `root`; returns what was sent."""
    root.mkdir()
    parts = [t.nbytes for t in spec.tensors] + [0]
    offer = pb.IncrementalBase(
        export_dir=base.export_dir,
        chunk_bytes=base.chunk_bytes,
        parts=[pb.PartDigests(chunk_crc32c=c) for c in base.offer()],
    )
    sent = increments.Sent()
    requests = [pb.SaveRequest.FromString(r) for r in increments.save_requests([*values, b""], offer, MiB, sent)]
    fmt = TrainingFormat()
    with fmt.open("run", SaveKind.TRAINING_CHECKPOINT, None, root, parts, None, checkpoint=spec) as sink:  # type: ignore[arg-type]
        upload.receive_snapshot(iter(requests), sum(parts), _Call(), parts, None, bases.Incremental(sink, base, parts))  # type: ignore[arg-type]
        sink.settle()  # the copies run on copier threads; the pipeline waits the same way
        base.check()
        sink.finish()
    return sent


def _files(root: Path) -> tuple[bytes, bytes]:
    return (root / (STAGED_STEM + INDEX_SUFFIX)).read_bytes(), (root / (STAGED_STEM + DATA_SUFFIX)).read_bytes()


# Change patterns, applied to the next save's values (the buffer is tensor 0).
def _change(values: list[bytearray], pattern: str, a: int, b: int) -> None:
    buf = values[0]
    if pattern == "one_byte":
        buf[a % len(buf)] ^= 0xFF
    elif pattern == "chunk_edge":
        edge = MiB * (1 + a % 3)
        for i in range(edge - 1 - b % 7, edge + 1 + b % 5):
            buf[i] ^= 0x5A
    elif pattern == "ring":  # rows [start, start + n) modulo the capacity, as a replay buffer overwrites them
        start, n = a % ROWS, 1 + b % (ROWS // 10)
        for r in range(start, start + n):
            row = (r % ROWS) * ROW
            buf[row : row + ROW] = random.Random(r).randbytes(ROW)
    elif pattern == "everything":
        flip = bytes(x ^ 0x33 for x in range(256))
        for i, v in enumerate(values):
            values[i] = bytearray(v.translate(flip))
    elif pattern == "weights":
        values[1][a % len(values[1])] ^= 1


PATTERNS = ["none", "one_byte", "chunk_edge", "ring", "everything", "weights"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pattern=st.sampled_from(PATTERNS), a=st.integers(0, 1 << 30), b=st.integers(0, 1 << 30), seed=st.integers(0, 3))
def test_any_change_pattern_commits_the_bytes_of_a_full_save(
    tmp_path_factory: pytest.TempPathFactory, pattern: str, a: int, b: int, seed: int
) -> None:
    tmp = tmp_path_factory.mktemp("incr")
    spec = _spec()
    values = _values(spec, seed)
    base = _base(_write_base(tmp / "base", spec, values), spec)
    try:
        _change(values, pattern, a, b)
        sent = _incremental(tmp / "incremental", spec, values, base)
    finally:
        base.close()
    assert _files(tmp / "incremental") == _files(_full(tmp / "full", spec, values))
    assert sent.chunk_bytes + sent.same_bytes == spec.nbytes
    if pattern == "none":
        assert sent.chunk_bytes == 11  # the string (Python state): always sent
    if pattern == "everything":
        assert sent.same_bytes == 0
    if pattern in ("one_byte", "chunk_edge"):
        assert sent.same_bytes >= spec.tensors[0].nbytes - 2 * MiB


def test_a_resized_tensor_is_sent_whole_and_the_rest_copied(tmp_path: Path) -> None:
    old = _spec()
    values = _values(old, 1)
    base = _base(_write_base(tmp_path / "base", old, values), old)
    new = _spec(weights=3001)  # the kernel grew; the buffer did not change
    new_values = [values[0], bytearray(random.Random(9).randbytes(3001 * 4)), values[2], values[3]]
    try:
        sent = _incremental(tmp_path / "incremental", new, new_values, base)
    finally:
        base.close()
    assert _files(tmp_path / "incremental") == _files(_full(tmp_path / "full", new, new_values))
    assert sent.same_bytes == new.tensors[0].nbytes + 8  # the whole buffer and the step copied
    assert sent.chunk_bytes == 3001 * 4 + 11


def test_a_base_deleted_mid_save_still_gives_its_bytes(tmp_path: Path) -> None:
    """Retention may delete the base while the save copies: the open descriptor keeps its bytes."""
    spec = _spec()
    values = _values(spec, 2)
    staged = _write_base(tmp_path / "base", spec, values)
    base = _base(staged, spec)
    try:
        for f in staged.iterdir():
            f.unlink()
        values[0][5] ^= 1
        _incremental(tmp_path / "incremental", spec, values, base)
    finally:
        base.close()
    assert _files(tmp_path / "incremental") == _files(_full(tmp_path / "full", spec, values))


def test_a_base_written_to_mid_save_fails_it_with_data_loss(tmp_path: Path) -> None:
    spec = _spec()
    values = _values(spec, 3)
    staged = _write_base(tmp_path / "base", spec, values)
    base = _base(staged, spec)
    try:
        with open(staged / (STAGED_STEM + DATA_SUFFIX), "r+b") as f:  # tampered in place after the offer
            f.seek(MiB + 3)
            f.write(b"\x00\x01\x02")
            os.utime(f.fileno(), ns=(1, 1))
        with pytest.raises(ChecksumError, match="send the save again in full"):
            _incremental(tmp_path / "incremental", spec, values, base)
    finally:
        base.close()


def test_references_to_chunks_the_base_does_not_have_are_refused(tmp_path: Path) -> None:
    spec = _spec()
    values = _values(spec, 4)
    base = _base(_write_base(tmp_path / "base", spec, values), spec)
    parts = [t.nbytes for t in spec.tensors] + [0]
    (tmp_path / "new").mkdir()
    try:
        with TrainingFormat().open(
            "run",
            SaveKind.TRAINING_CHECKPOINT,
            None,
            tmp_path / "new",
            parts,
            None,
            checkpoint=spec,  # type: ignore[arg-type]
        ) as sink:
            into = bases.Incremental(sink, base, parts)
            with pytest.raises(InvalidRequestError, match="not the base's"):
                into.same(0, MiB, [base.parts[0].crcs[0] ^ 1])  # type: ignore[union-attr]
            with pytest.raises(InvalidRequestError, match="not in a tensor the base holds"):
                into.same(sum(t.nbytes for t in spec.tensors[:3]), 11, [0])  # Python state: no digests
            with pytest.raises(InvalidRequestError, match="whole chunks"):
                into.same(1, MiB, list(base.parts[0].crcs[:1]))  # type: ignore[union-attr]
    finally:
        base.close()


def _whole_parts(
    root: Path, spec: CheckpointSpec, values: Sequence[bytes], base: bases.OpenBase
) -> list[tuple[int, int, object, int]]:
    """Writes the values whole (a snapshot in shared memory) against `base` into `root`; returns the ranges referred.

    With `base.source` set (an object store's base) the unchanged ranges are
    referred to, not copied: they are copied here afterwards from the base's
    file, as the store's UploadPartCopy would, so the files can be compared.
    """
    root.mkdir()
    parts = [t.nbytes for t in spec.tensors] + [0]
    referred: list[tuple[int, int, object, int]] = []
    fmt = TrainingFormat()
    with fmt.open("run", SaveKind.TRAINING_CHECKPOINT, None, root, parts, None, checkpoint=spec) as sink:  # type: ignore[arg-type]
        if base.source is not None:
            sink.watch(lambda start, end: None)
            sink.watch_references(lambda start, end, source, offset: referred.append((start, end, source, offset)))
        bases.Incremental(sink, base, parts).write_parts([memoryview(v) for v in [*values, b""]])
        sink.settle()
        base.check()
        sink.finish()
    data = root / (STAGED_STEM + DATA_SUFFIX)
    with open(data, "r+b") as f:
        for start, end, _, offset in referred:
            f.seek(start)
            f.write(os.pread(base.fd, end - start, offset))
    return referred


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pattern=st.sampled_from(PATTERNS),
    a=st.integers(0, 1 << 30),
    b=st.integers(0, 1 << 30),
    remote=st.booleans(),
)
def test_a_snapshot_given_whole_copies_or_refers_its_unchanged_chunks_and_commits_a_full_saves_bytes(
    tmp_path_factory: pytest.TempPathFactory, pattern: str, a: int, b: int, remote: bool
) -> None:
    tmp = tmp_path_factory.mktemp("whole")
    spec = _spec()
    values = _values(spec, 1)
    base = _base(_write_base(tmp / "base", spec, values), spec)
    if remote:
        base.source = "the base object"  # the store copies it; the sink only names the ranges
    try:
        _change(values, pattern, a, b)
        referred = _whole_parts(tmp / "incremental", spec, values, base)
    finally:
        base.close()
    assert _files(tmp / "incremental") == _files(_full(tmp / "full", spec, values))
    assert bool(referred) == (remote and base.copied > 0)
    assert sum(end - start for start, end, _, _ in referred) == (base.copied if remote else 0)
    if pattern == "none":
        assert base.copied == sum(t.nbytes for t in spec.tensors[:-1])  # all but the Python state's string
    if pattern == "everything":
        assert base.copied == 0
    if pattern in ("one_byte", "chunk_edge"):
        assert base.copied >= spec.tensors[0].nbytes - 2 * MiB
