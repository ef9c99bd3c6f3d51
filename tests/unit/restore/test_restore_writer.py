"""restore_writer.Writer: chunks written on its thread land at their offsets; a failed write is raised, not lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpointd_client.restore import chunk_writer as restore_writer


def test_chunks_land_at_their_offsets_in_files_made_at_their_size(tmp_path: Path) -> None:
    writer = restore_writer.Writer(str(tmp_path), {"a/x.data": 10, "y.index": 4})
    data = memoryview(bytearray(b"0123456789"))
    for at in (6, 0, 3):  # out of order, more than WRITES_QUEUED in all with y's
        writer("a/x.data", at, data[at : at + (4 if at == 6 else 3)])
    for n in range(restore_writer.WRITES_QUEUED + 2):
        writer("y.index", n % 4, bytes([65 + n % 4]))
    writer.close()
    assert (tmp_path / "a" / "x.data").read_bytes() == b"0123456789"
    assert (tmp_path / "y.index").read_bytes() == b"ABCD"
    writer("y.index", 0, b"Z")  # usable again after close
    writer.close()
    assert (tmp_path / "y.index").read_bytes() == b"ZBCD"


def test_a_failed_write_is_raised_by_the_next_call_or_close_and_the_rest_is_not_written(tmp_path: Path) -> None:
    (tmp_path / "blocked").write_bytes(b"")  # a file where the chunk's dir would go
    writer = restore_writer.Writer(str(tmp_path), {"blocked/x": 4, "ok": 4})
    writer("blocked/x", 0, b"abcd")
    with pytest.raises(OSError):
        for _ in range(restore_writer.WRITES_QUEUED + 2):
            writer("ok", 0, b"abcd")
        writer.close()
    assert not (tmp_path / "ok").exists()
    writer.abandon()  # nothing left to raise


def test_abandon_keeps_quiet_about_a_chunk_of_an_unknown_file(tmp_path: Path) -> None:
    writer = restore_writer.Writer(str(tmp_path), {})
    writer("x", 0, b"ab")
    writer.abandon()
    with pytest.raises(KeyError):
        writer("x", 0, b"ab")
        writer.close()
