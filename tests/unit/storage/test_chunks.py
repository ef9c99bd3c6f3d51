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


def _reflink_dir() -> Path | None:
    """A dir on a file system that clones, if the machine has one mounted (CHECKPOINTD_REFLINK_DIR)."""
    where = os.environ.get("CHECKPOINTD_REFLINK_DIR")
    return Path(where) if where else None


@pytest.mark.parametrize("tmpfile", [True, False])
def test_the_extent_sharing_probe_answers_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tmpfile: bool
) -> None:
    if not tmpfile:  # a file system without O_TMPFILE: named files, unlinked at once
        real_open = copies.os.open

        def no_tmpfile(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
            if flags & os.O_TMPFILE == os.O_TMPFILE:
                raise OSError(errno.EOPNOTSUPP, "no O_TMPFILE here")
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(copies.os, "open", no_tmpfile)
    cloned: list[bytes] = []
    monkeypatch.setattr(copies.fcntl, "ioctl", lambda fd, op, arg: cloned.append(arg))
    assert copies.shares_extents(tmp_path) is True and len(cloned) == 1
    monkeypatch.undo()
    assert copies.shares_extents(tmp_path) in (True, False)  # this machine's answer (ext4, tmpfs: False)
    assert list(tmp_path.iterdir()) == []


def test_a_file_system_that_refuses_clones_is_probed_as_copying(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(fd: int, op: int, arg: bytes) -> None:
        raise OSError(errno.EOPNOTSUPP, "no reflink")

    monkeypatch.setattr(copies.fcntl, "ioctl", refused)
    assert copies.shares_extents(tmp_path) is False
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(_reflink_dir() is None, reason="no reflink file system mounted (CHECKPOINTD_REFLINK_DIR)")
def test_a_reflink_file_system_is_probed_as_cloning() -> None:
    where = _reflink_dir()
    assert where is not None and copies.shares_extents(where)
