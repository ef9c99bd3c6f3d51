"""checkpointd.rpc.upload.receive_snapshot: chunks laid out in aligned parts."""

from __future__ import annotations

import mmap

import crc32c
import numpy as np
import pytest

from checkpointd.protocol import wire
from checkpointd.protocol.errors import ChecksumError, InvalidRequestError
from checkpointd.rpc import upload
from checkpointd.v1 import checkpointd_pb2 as pb


class _Context:
    def is_active(self) -> bool:
        return True


def _requests(data: bytes, chunk_bytes: int) -> list[pb.SaveRequest]:
    return [
        pb.SaveRequest(
            chunk=pb.Chunk(
                offset=i,
                data=data[i : i + chunk_bytes],
                crc32c=crc32c.crc32c(data[i : i + chunk_bytes]),
            )
        )
        for i in range(0, len(data), chunk_bytes)
    ]


@pytest.mark.parametrize("chunk_bytes", [1, 3, 7, 64, 1000])
def test_parts_hold_their_bytes_each_64_byte_aligned(chunk_bytes: int) -> None:
    parts = [5, 0, 64, 1, 130, 3]  # chunks of 3 or 7 bytes span parts
    data = bytes(range(256))[: sum(parts)]
    got, transport = upload.receive_snapshot(iter(_requests(data, chunk_bytes)), len(data), _Context(), parts)
    assert transport == "grpc"
    assert [len(p) for p in got] == parts
    assert b"".join(bytes(p) for p in got) == data
    for p in got:
        if len(p):
            assert np.frombuffer(p, np.uint8).ctypes.data % wire.ALIGNMENT == 0
            assert not p.readonly  # the writer wraps only writable memory without a copy
    offsets, size = wire.aligned_offsets(parts)
    assert all(o % wire.ALIGNMENT == 0 for o in offsets)
    assert size == offsets[-1] + parts[-1]


def test_a_short_snapshot_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="ended after 4 of its 8"):
        upload.receive_snapshot(iter(_requests(b"abcd", 4)), 8, _Context(), [3, 5])


def test_a_large_snapshot_lands_in_a_mapped_buffer_of_aligned_writable_parts() -> None:
    # Past receive_buffer's threshold: an anonymous map, not a NumPy array.
    parts = [3 << 20, 5, 2 << 20, 0, 77]
    data = np.random.default_rng(1).integers(0, 256, sum(parts), dtype=np.uint8).tobytes()
    got, _ = upload.receive_snapshot(iter(_requests(data, 1 << 20)), len(data), _Context(), parts)
    assert [len(p) for p in got] == parts
    assert b"".join(bytes(p) for p in got) == data
    for p in got:
        if len(p):
            assert np.frombuffer(p, np.uint8).ctypes.data % wire.ALIGNMENT == 0
            assert not p.readonly
    assert isinstance(got[0].obj, mmap.mmap)


@pytest.mark.parametrize("nbytes", [0, 1, 4 << 20, (4 << 20) + 1])
def test_receive_buffer_is_writable_aligned_memory_of_the_size_asked(nbytes: int) -> None:
    buffer = upload.receive_buffer(nbytes)
    assert buffer.nbytes == nbytes and not buffer.readonly
    if nbytes:
        array = np.frombuffer(buffer, np.uint8)
        assert array.ctypes.data % wire.ALIGNMENT == 0
        array[:] = 7  # every byte can be written
        assert buffer[nbytes - 1] == 7


def test_a_bad_crc_in_a_large_snapshot_is_data_loss() -> None:
    data = bytes(5 << 20)
    requests = _requests(data, 1 << 20)
    requests[3].chunk.crc32c ^= 1
    with pytest.raises(ChecksumError, match="offset 3145728"):
        upload.receive_snapshot(iter(requests), len(data), _Context(), [len(data)])
