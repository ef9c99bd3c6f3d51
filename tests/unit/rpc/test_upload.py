"""checkpointd.rpc.upload: a snapshot's chunks written into the save's parts as they arrive; receive buffers."""

from __future__ import annotations

import crc32c
import pytest

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


class Parts:
    """A sink that keeps what it is given: (part, offset, bytes) per write."""

    def __init__(self, parts: list[int]) -> None:
        self.writes: list[tuple[int, int, bytes]] = []
        self.sizes = parts

    def write(self, part: int, offset: int, data: object, crc: int | None = None) -> None:
        self.writes.append((part, offset, bytes(memoryview(data))))  # type: ignore[arg-type]

    def joined(self) -> list[bytes]:
        out = [b""] * len(self.sizes)
        for part, offset, data in self.writes:
            assert offset == len(out[part])  # each part in order
            out[part] += data
        return out


@pytest.mark.parametrize("read_ahead", [False, True])
@pytest.mark.parametrize("chunk_bytes", [1, 3, 7, 64, 1000])
def test_each_chunk_is_written_into_its_parts_as_it_arrives(
    chunk_bytes: int, read_ahead: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if read_ahead:  # the chunks taken from the stream by a thread of their own, as for a large snapshot
        monkeypatch.setattr(upload, "READ_AHEAD_FROM", 0)
    parts = [5, 0, 64, 1, 130, 3]  # chunks of 3 or 7 bytes span parts
    data = bytes(range(256))[: sum(parts)]
    sink = Parts(parts)
    transport = upload.receive_snapshot(iter(_requests(data, chunk_bytes)), len(data), _Context(), parts, None, sink)
    assert transport == "grpc"
    got = sink.joined()
    assert [len(p) for p in got] == parts
    assert b"".join(got) == data
    assert all(len(d) <= chunk_bytes for _, _, d in sink.writes)  # never more than a chunk at once
    assert 1 not in {part for part, _, _ in sink.writes}  # an empty part gets no write


def test_a_short_snapshot_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="ended after 4 of its 8"):
        upload.receive_snapshot(iter(_requests(b"abcd", 4)), 8, _Context(), [3, 5], None, Parts([3, 5]))


def test_parts_that_do_not_sum_to_the_snapshot_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="sum to 7"):
        upload.receive_snapshot(iter(_requests(b"abcd", 4)), 8, _Context(), [3, 4], None, Parts([3, 4]))


@pytest.mark.parametrize("read_ahead", [False, True])
def test_a_bad_crc_in_a_large_snapshot_is_data_loss(read_ahead: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if read_ahead:
        monkeypatch.setattr(upload, "READ_AHEAD_FROM", 0)
    data = bytes(5 << 20)
    requests = _requests(data, 1 << 20)
    requests[3].chunk.crc32c ^= 1
    with pytest.raises(ChecksumError, match="offset 3145728"):
        upload.receive_snapshot(iter(requests), len(data), _Context(), [len(data)], None, Parts([len(data)]))
