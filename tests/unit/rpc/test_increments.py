"""An incremental save's requests: which chunks go as SameChunks, summed or taken as the base's unsummed."""

from __future__ import annotations

import random

import crc32c
from hypothesis import given
from hypothesis import strategies as st

from checkpointd.protocol import increments
from checkpointd.v1 import checkpointd_pb2 as pb

CHUNK = 16


def _base(*parts: bytes) -> pb.IncrementalBase:
    digests = [[crc32c.crc32c(p[i : i + CHUNK]) for i in range(0, len(p), CHUNK)] for p in parts]
    return pb.IncrementalBase(chunk_bytes=CHUNK, parts=[pb.PartDigests(chunk_crc32c=d) for d in digests])


def _decoded(requests: list[bytes]) -> list[tuple[str, int, int]]:
    """(kind, offset, length) of each request: "chunk" or "same"."""
    out = []
    for r in map(pb.SaveRequest.FromString, requests):
        if r.HasField("same"):
            out.append(("same", r.same.offset, r.same.length))
        else:
            out.append(("chunk", r.chunk.offset, len(r.chunk.data)))
    return out


def test_chunks_nobody_wrote_go_as_the_bases_even_if_their_bytes_differ() -> None:
    before, now = bytes(64), bytes(range(64))  # every chunk differs from the base's bytes
    sent = increments.Sent()
    requests = list(increments.save_requests([now], _base(before), CHUNK, sent, written=[[(20, 24)]]))
    # Only chunk 1 (bytes 16..32) overlaps a written range: summed, differs, sent.
    assert _decoded(requests) == [("same", 0, 16), ("chunk", 16, 16), ("same", 32, 32)]
    assert (sent.chunk_bytes, sent.same_bytes, sent.unsummed_bytes) == (16, 48, 48)
    same = [pb.SaveRequest.FromString(r).same for r in requests if pb.SaveRequest.FromString(r).HasField("same")]
    assert list(same[1].chunk_crc32c) == list(_base(before).parts[0].chunk_crc32c[2:])


def test_without_written_ranges_every_chunk_is_summed() -> None:
    before = bytes(64)
    now = bytes(16) + b"x" * 16 + bytes(32)
    for written in (None, [None]):
        sent = increments.Sent()
        requests = list(increments.save_requests([now], _base(before), CHUNK, sent, written=written))
        assert _decoded(requests) == [("same", 0, 16), ("chunk", 16, 16), ("same", 32, 32)]
        assert sent.unsummed_bytes == 0


def test_a_written_chunk_equal_to_the_base_is_still_sent_as_same() -> None:
    data = bytes(range(48))
    sent = increments.Sent()
    requests = list(increments.save_requests([data], _base(data), CHUNK, sent, written=[[(0, 48)]]))
    assert _decoded(requests) == [("same", 0, 48)]
    assert sent.unsummed_bytes == 0


@given(
    size=st.integers(1, 100),
    ranges=st.lists(st.tuples(st.integers(0, 100), st.integers(0, 100)), max_size=4),
    seed=st.integers(0, 2**32 - 1),
)
def test_when_the_written_ranges_are_true_the_requests_rebuild_the_bytes(
    size: int, ranges: list[tuple[int, int]], seed: int
) -> None:
    rng = random.Random(seed)
    before = bytes(rng.getrandbits(8) for _ in range(size))
    now = bytearray(before)
    written = sorted((min(a, b, size), min(max(a, b), size)) for a, b in ranges)
    for start, stop in written:
        now[start:stop] = bytes(rng.getrandbits(8) for _ in range(stop - start))
    rebuilt = bytearray(size)
    for r in map(
        pb.SaveRequest.FromString, increments.save_requests([bytes(now)], _base(before), CHUNK, None, [written])
    ):
        if r.HasField("same"):
            rebuilt[r.same.offset : r.same.offset + r.same.length] = before[
                r.same.offset : r.same.offset + r.same.length
            ]
        else:
            rebuilt[r.chunk.offset : r.chunk.offset + len(r.chunk.data)] = r.chunk.data
    assert bytes(rebuilt) == bytes(now)
