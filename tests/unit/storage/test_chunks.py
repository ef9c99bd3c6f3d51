"""Chunk digests, their record in a manifest, and range copies: pure arithmetic and one file pair."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointd.bundle import chunks
from checkpointd.core import chunk_record
from checkpointd.durable import copies

C = chunks.CHUNK_BYTES


@settings(deadline=None, max_examples=40)
@given(size=st.integers(0, 3 * C + 5), cuts=st.lists(st.integers(1, C + 3), max_size=12))
def test_a_chunk_log_folds_any_pieces_into_each_chunks_crc(size: int, cuts: list[int]) -> None:
    data = (bytes(range(251)) * (size // 251 + 1))[:size]
    log, at = chunks.ChunkLog(size), 0
    for cut in [*cuts, size]:  # pieces of any length, split at chunk boundaries as the sink splits them
        end = min(size, at + cut)
        for a, b in chunks.spans(at, end - at):
            log.add(b - a, crc32c.crc32c(data[a:b]))
        at = end
    assert log.complete and log.crcs == chunks.digests(data)


def test_range_crc_is_the_crc_of_the_chunks_bytes() -> None:
    size = 2 * C + 77
    data = os.urandom(size)
    crcs = chunks.digests(data)
    assert chunks.range_crc(crcs, 0, size) == crc32c.crc32c(data)
    assert chunks.range_crc(crcs[1:], C, size) == crc32c.crc32c(data[C:])


def test_a_record_round_trips_and_anything_malformed_is_no_record(tmp_path: Path) -> None:
    f = tmp_path / "data"
    f.write_bytes(b"x" * 10)
    t = chunk_record.BaseTensor("k", "float32", (2, 3), 5, C + 1, (1, 2))
    field = chunk_record.record(".data", f.stat(), [t])
    parsed = chunk_record.parse({chunk_record.FIELD: field})
    assert parsed is not None and parsed.tensors["k"] == t and parsed.identity == chunk_record.identity(f.stat())
    assert chunk_record.parse(None) is None and chunk_record.parse({chunk_record.FIELD: "x"}) is None
    wrong_count = {**field, "tensors": [{**field["tensors"][0], "size": 3 * C}]}
    assert chunk_record.parse({chunk_record.FIELD: wrong_count}) is None
    assert chunk_record.parse({chunk_record.FIELD: {**field, "identity": [1, 2]}}) is None
    assert chunk_record.parse({chunk_record.FIELD: {**field, "tensors": [{"key": "k"}]}}) is None


@pytest.mark.parametrize("kernel", [True, False], ids=["copy_file_range", "refused: pread/pwrite"])
def test_a_range_is_copied_to_its_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: bool) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    data = os.urandom(3 * C + 9)
    src.write_bytes(data)
    dst.write_bytes(b"\0" * (2 * C))
    if not kernel:

        def refused(*args: object) -> int:
            raise OSError(errno.EXDEV, "cross-device")

        monkeypatch.setattr(copies.os, "copy_file_range", refused)
    s, d = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY)
    try:
        copies.copy_range(s, 5, d, 100, 2 * C + 3)
        with pytest.raises(OSError, match="ends"):
            copies.copy_range(s, len(data) - 2, d, 0, 10)  # the source is shorter than the range
    finally:
        os.close(s)
        os.close(d)
    assert dst.read_bytes()[100 : 100 + 2 * C + 3] == data[5 : 5 + 2 * C + 3]


@settings(max_examples=60, deadline=None)
@given(
    offset=st.integers(0, 3 * 4096),
    shift=st.sampled_from([0, 4096, 8192, 1, 4097]),
    nbytes=st.integers(1, 5 * 4096),
)
def test_a_range_at_the_same_offset_modulo_a_block_is_copied_whole_in_head_middle_and_tail(
    tmp_path_factory: pytest.TempPathFactory, offset: int, shift: int, nbytes: int
) -> None:
    tmp = tmp_path_factory.mktemp("copy")
    data = bytes(range(256)) * (10 * 4096 // 256)
    src, dst = tmp / "src", tmp / "dst"
    src.write_bytes(data)
    dst.write_bytes(b"\0" * (len(data) + 8192))
    s, d = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY)
    try:
        copies.copy_range(s, offset, d, offset + shift, nbytes)
    finally:
        os.close(s)
        os.close(d)
    out = dst.read_bytes()
    assert out[offset + shift : offset + shift + nbytes] == data[offset : offset + nbytes]
    assert out[: offset + shift].count(0) == offset + shift  # nothing written outside the range
    assert out[offset + shift + nbytes :].count(0) == len(out) - offset - shift - nbytes
