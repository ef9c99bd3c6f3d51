"""The shared wire codecs: chunkers, the chunk check, byte order, messages.

Moved here from test_client_snapshot.py (then named for the client's
`array_chunks`, `file_chunks` and `encoded_chunks`), which needed TensorFlow
only to import the client; the codecs now live in `checkpointd.protocol.wire`.
"""

from __future__ import annotations

import os

import crc32c
import ml_dtypes
import numpy as np
import pytest
from google.protobuf.message import DecodeError

from checkpointd.protocol import wire
from checkpointd.protocol.errors import ChecksumError, InvalidRequestError
from checkpointd.v1 import checkpointd_pb2 as pb

BF16 = ml_dtypes.bfloat16


def check_chunks(chunks, limit: int) -> bytes:
    """Asserts the chunk invariants; returns the reassembled bytes."""
    data = bytearray()
    for c in chunks:
        assert c.offset == len(data), "offsets must be contiguous"
        assert 0 < len(c.data) <= limit
        assert c.crc32c == crc32c.crc32c(c.data)
        data += c.data
    return bytes(data)


def array_chunks(arrays, chunk_bytes: int):
    """What a snapshot sends: each array's wire bytes, chunked over their concatenation."""
    return wire.chunks(map(wire.byte_view, arrays), chunk_bytes)


# Chunking.

ARRAYS = [
    np.arange(250, dtype=np.float32).reshape(10, 25),
    np.zeros((0, 3), np.float32),
    np.array([1.5, -2.25, 3.0], dtype=BF16),
    np.array([True, False, True, True, False]),
    np.array(2**40 + 7, dtype=np.int64),  # 0-d, like train_step
    np.arange(-5, 6, dtype=np.int64),
]


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1 << 20])
def test_array_chunks_reassemble_to_the_exact_bytes(chunk_bytes: int) -> None:
    chunks = list(array_chunks(ARRAYS, chunk_bytes))
    assert check_chunks(chunks, chunk_bytes) == b"".join(a.tobytes() for a in ARRAYS)


def test_array_chunks_never_span_two_arrays() -> None:
    boundaries = np.cumsum([a.nbytes for a in ARRAYS])
    for c in array_chunks(ARRAYS, 64):
        assert not any(c.offset < b < c.offset + len(c.data) for b in boundaries)


def test_zero_size_arrays_yield_no_chunks() -> None:
    assert list(array_chunks([np.zeros((0,), np.float32), np.zeros((2, 0), BF16)], 8)) == []


def test_wire_bytes_are_little_endian_and_c_order() -> None:
    big = np.array([1.0, -2.0], dtype=">f4")
    fortran = np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3))
    data = check_chunks(array_chunks([big, fortran], 5), 5)
    assert data == np.array([1.0, -2.0], "<f4").tobytes() + np.arange(6, dtype="<i8").tobytes()


def test_little_endian_hands_back_an_array_that_already_is() -> None:
    # The shared-memory path relies on it: no copy when nothing needs swapping.
    for array in (np.arange(4, dtype="<f4"), np.array(3, np.int64), np.zeros(3, np.uint8), np.array([1, 2], ">u1")):
        assert wire.little_endian(array) is array
    swapped = wire.little_endian(np.array([1, 2], ">i4"))
    assert swapped.tobytes() == np.array([1, 2], "<i4").tobytes()


@pytest.mark.parametrize("chunk_bytes", [0, -1, 1.5])
def test_chunk_bytes_must_be_a_positive_int(chunk_bytes: object) -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        list(array_chunks(ARRAYS, chunk_bytes))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_bytes"):
        list(wire.template_chunks(".", chunk_bytes))  # type: ignore[arg-type]


def test_file_chunks_cover_every_file_with_relative_paths(tmp_path) -> None:
    files = {
        "saved_model.pb": os.urandom(1000),
        "exact.bin": os.urandom(64),
        "variables/variables.index": os.urandom(10),
        "assets/empty.txt": b"",
    }
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content)
    by_path: dict[str, list] = {}
    order = []
    for c in wire.template_chunks(str(tmp_path), 64):
        if not order or order[-1] != c.path:
            order.append(c.path)
        by_path.setdefault(c.path, []).append(c)
    assert order == sorted(files)  # sorted, each file whole before the next
    assert set(by_path) == set(files)
    for name, chunks in by_path.items():
        if files[name]:
            assert check_chunks(chunks, 64) == files[name]
        else:
            assert [(c.offset, c.data, c.crc32c) for c in chunks] == [(0, b"", crc32c.crc32c(b""))]
    assert wire.template_size(str(tmp_path)) == sum(map(len, files.values()))


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1 << 20])
def test_encoded_chunks_are_the_serialized_save_requests_byte_for_byte(chunk_bytes: int) -> None:
    arrays = [*ARRAYS, np.zeros(300, np.uint8), np.arange(200, dtype=np.float64)]  # zero CRCs, offset 0
    want = [pb.SaveRequest(chunk=c).SerializeToString() for c in array_chunks(arrays, chunk_bytes)]
    assert list(wire.save_request_chunks(map(wire.byte_view, arrays), chunk_bytes)) == want


@pytest.mark.parametrize(
    ("path", "offset", "data"),
    [("ckpt-5.data-00000-of-00001", 3 << 20, b"\x00\x01" * 700), ("variables/variables.index", 0, b"x"), ("", 9, b"y")],
)
def test_an_encoded_chunk_with_a_path_is_the_serialized_restore_files_response(
    path: str, offset: int, data: bytes
) -> None:
    crc = crc32c.crc32c(data)
    want = pb.RestoreFilesResponse(chunk=pb.Chunk(path=path, offset=offset, data=data, crc32c=crc))
    assert wire.encoded_chunk(offset, data, crc, path) == want.SerializeToString()
    assert pb.RestoreFilesResponse.FromString(wire.encoded_chunk(offset, data, crc, path)) == want


# The receiving side's check, on what the chunkers send.


def test_every_chunk_a_chunker_sends_passes_the_check() -> None:
    received = 0
    total = sum(a.nbytes for a in ARRAYS)
    for c in array_chunks(ARRAYS, 7):
        wire.check_chunk(c, received, total, "snapshot")
        received += len(c.data)
    assert received == total


def test_check_chunk_refuses_order_overrun_and_a_bad_crc() -> None:
    good = wire.chunk(b"abcdef", 10)
    assert wire.check_chunk(good, 10, 16, "snapshot") == b"abcdef"  # the data, read once
    with pytest.raises(InvalidRequestError, match="offset 10, expected 0"):
        wire.check_chunk(good, 0, 16, "snapshot")
    with pytest.raises(InvalidRequestError, match="past the announced 15 bytes"):
        wire.check_chunk(good, 10, 15, "snapshot")
    bad = pb.Chunk(offset=10, data=b"abcdef", crc32c=good.crc32c ^ 1)
    with pytest.raises(ChecksumError, match="snapshot: CRC32C mismatch"):
        wire.check_chunk(bad, 10, 16, "snapshot")


# Messages.


class _Spec:
    key = "k/.ATTRIBUTES/VARIABLE_VALUE"
    checkpoint_key = "policy/k/.ATTRIBUTES/VARIABLE_VALUE"
    dtype = "float32"
    shape = (2, 3)


def test_variable_to_pb_carries_every_field() -> None:
    assert wire.variable_to_pb(_Spec()) == pb.Variable(
        key=_Spec.key, checkpoint_key=_Spec.checkpoint_key, dtype="float32", shape=[2, 3]
    )


def test_numpy_state_to_pb_keeps_the_entries_in_order() -> None:
    state = wire.numpy_state_to_pb(b"graph", [("numpy_arrays/b", 3), ("numpy_arrays/a", 0)])
    assert state.object_graph == b"graph"
    assert [(e.checkpoint_key, e.nbytes) for e in state.entries] == [("numpy_arrays/b", 3), ("numpy_arrays/a", 0)]


def _same_as_protobuf(data: bytes) -> wire.ChunkRequest | pb.SaveRequest:
    """`parse_save_request(data)`, asserted to mean what `SaveRequest.FromString(data)` means."""
    parsed = wire.parse_save_request(data)
    expected = pb.SaveRequest.FromString(data)
    assert parsed.WhichOneof("item") == expected.WhichOneof("item")
    if isinstance(parsed, wire.ChunkRequest):
        c, e = parsed.chunk, expected.chunk
        assert (c.path, c.offset, bytes(c.data), c.crc32c) == (e.path, e.offset, e.data, e.crc32c)
    return parsed


@pytest.mark.parametrize(
    ("offset", "size", "path"), [(0, 0, ""), (0, 1, ""), (5, 1 << 20, ""), ((1 << 64) - 1, 3, "a/é.txt")]
)
def test_a_chunk_as_the_client_encodes_it_is_read_without_a_copy(offset: int, size: int, path: str) -> None:
    payload = os.urandom(size)
    data = wire.encoded_chunk(offset, payload, crc32c.crc32c(payload), path)
    parsed = _same_as_protobuf(data)
    assert isinstance(parsed, wire.ChunkRequest)
    if size:
        assert parsed.chunk.data.obj is data  # a view of the received message: no copy
    assert bytes(wire.check_chunk(parsed.chunk, offset, offset + size, "snapshot")) == payload


def test_any_other_save_request_is_protobufs_to_read_and_means_the_same() -> None:
    chunk = pb.SaveRequest(chunk=pb.Chunk(offset=7, data=b"abc", crc32c=crc32c.crc32c(b"abc"))).SerializeToString()
    body = chunk[2:]  # the Chunk message's own fields
    others = [
        pb.SaveRequest(header=pb.SaveHeader(run="r", export_dir="e", snapshot_bytes=3)).SerializeToString(),
        pb.SaveRequest(shared_memory_written=pb.SharedMemoryWritten()).SerializeToString(),
        chunk + chunk,  # the chunk twice: protobuf merges the two
        b"\x12" + bytes([len(body) + 2]) + body + b"\x10\x09",  # the offset twice: the last wins
        b"\x12" + bytes([len(body) + 2]) + body + b"\x28\x01",  # an unknown field in the chunk
        chunk + b"\x08\x01",  # an unknown field in the request
        b"\x12\x05\x1a\x03abc",  # no offset, no CRC: zeros
    ]
    for data in others:
        parsed = _same_as_protobuf(data)
        assert data == b"\x12\x05\x1a\x03abc" or not isinstance(parsed, wire.ChunkRequest)
    for truncated in (
        chunk[:-1],
        b"\x12\x05\x1a\x09abc",
        b"\x12\x04\x0a\x02\xff\xfe",
    ):  # short; past the end; bad UTF-8
        with pytest.raises(DecodeError):
            pb.SaveRequest.FromString(truncated)
        malformed = wire.parse_save_request(truncated)  # not raised: gRPC would answer INTERNAL
        with pytest.raises(InvalidRequestError, match=r"^Save: a message is not a SaveRequest .*checkpointd.proto$"):
            malformed.WhichOneof("item")
