"""restore_files.cut: a data file's ranges cut into whole recorded chunks, each with the CRC32C the save recorded;
and restore_files.plan's check of the asked ranges against the save's files.

The record is built as chunk_record.record writes it, over bytes held here,
so each piece's CRC32C can be checked against the bytes it covers.
"""

from __future__ import annotations

import os
from pathlib import PurePosixPath

import crc32c
import pytest

from checkpointd.core import chunk_record
from checkpointd.core.ports import CommittedSave, SavedFile
from checkpointd.protocol.errors import InvalidRequestError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.restores.files import cut, plan

CB = 10  # the record's chunk size, small so a few bytes hold many chunks
LIMIT = 25  # the largest piece: two whole chunks fit, three do not
# (key, offset, size): a gap at 0..3 (a header), a tensor not a multiple of CB, one right after, a gap, one more.
TENSORS = (("a", 3, 24), ("b", 27, 30), ("c", 61, 5))
DATA = bytes((n * 7 + 1) % 251 for n in range(70))
DATA_FILE = "ckpt-4.data-00000-of-00001"


def _save(data_file: str = ".data-00000-of-00001", size: int = len(DATA)) -> tuple[CommittedSave, list[SavedFile]]:
    tensors = [
        chunk_record.BaseTensor(k, "float32", (size_ // 1,), offset, size_,
                                tuple(crc32c.crc32c(DATA[offset + at : offset + min(at + CB, size_)])
                                      for at in range(0, size_, CB)))
        for k, offset, size_ in TENSORS
    ]  # fmt: skip
    st = os.stat_result((0, 5, 6, 1, 0, 0, size, 0, 0, 0))
    field = chunk_record.record(data_file, st, tensors)
    field["chunk_bytes"] = CB
    field["identity"] = [6, 5, size, 1]  # device, inode, size, mtime_ns
    save = CommittedSave(
        PurePosixPath("/ckpts/ckpt-4"), "ckpt-4", "run", SaveKind.CHECKPOINT, 4, 0.0, prefix=True,
        extra={chunk_record.FIELD: field},
    )  # fmt: skip
    files = [SavedFile("ckpt-4.index", 9, 0), SavedFile(DATA_FILE, len(DATA), crc32c.crc32c(DATA))]
    return save, files


def _check_tiles(pieces: list[tuple[str, int, int, int | None]], offset: int, length: int) -> None:
    at = offset
    for _, start, size, crc in pieces:
        assert start == at and 0 < size <= LIMIT
        if crc is not None:
            assert crc == crc32c.crc32c(DATA[start : start + size])
        at += size
    assert at == offset + length


def test_the_whole_data_file_is_cut_at_recorded_chunks_with_their_crcs() -> None:
    save, files = _save()
    pieces = cut(save, files, [(DATA_FILE, 0, len(DATA))], LIMIT)
    _check_tiles(pieces, 0, len(DATA))
    known = [(start, size) for _, start, size, crc in pieces if crc is not None]
    # a's three chunks 3..13..23..27 (24 bytes), b's 27..37..47 (a third would pass LIMIT), b's last, c's.
    assert known == [(3, 24), (27, 20), (47, 10), (61, 5)]
    assert [(start, size) for _, start, size, crc in pieces if crc is None] == [(0, 3), (57, 4), (66, 4)]


def test_a_range_starting_or_ending_inside_a_chunk_computes_those_bytes() -> None:
    save, files = _save()
    pieces = cut(save, files, [(DATA_FILE, 8, 45)], LIMIT)
    _check_tiles(pieces, 8, 45)
    assert pieces[0][1:] == (8, 5, None)  # the rest of a's first chunk
    assert [(s, n) for _, s, n, crc in pieces if crc is not None] == [(13, 24), (37, 10)]
    assert pieces[-1][1:] == (47, 6, None)  # ends inside b's last chunk


@pytest.mark.parametrize(
    ("data_file", "size"),
    [(".data-00000-of-00002", len(DATA)), (".data-00000-of-00001", len(DATA) + 1)],
    ids=["another-file", "another-size"],
)
def test_a_record_of_another_file_gives_no_crcs(data_file: str, size: int) -> None:
    save, files = _save(data_file, size)
    pieces = cut(save, files, [(DATA_FILE, 0, len(DATA))], LIMIT)
    _check_tiles(pieces, 0, len(DATA))
    assert all(crc is None for *_, crc in pieces)


def test_other_files_and_saves_without_a_record_are_cut_at_the_limit() -> None:
    save, files = _save()
    assert cut(save, files, [("ckpt-4.index", 0, 9)], 4) == [
        ("ckpt-4.index", 0, 4, None), ("ckpt-4.index", 4, 4, None), ("ckpt-4.index", 8, 1, None),
    ]  # fmt: skip
    bare = CommittedSave(save.path, save.export_dir, save.run, save.kind, save.step, 0.0, prefix=True)
    assert all(crc is None for *_, crc in cut(bare, files, [(DATA_FILE, 0, len(DATA))], LIMIT))


class _Files:
    """A store holding one committed save with `files` (SaveFiles, and committed_at for restore.find)."""

    def __init__(self, save: CommittedSave, files: list[SavedFile]) -> None:
        self.save, self.files = save, files

    def committed_at(self, folder: str, export_dir: str) -> CommittedSave:
        return self.save

    def describe(self) -> str:
        return "files"

    def files_of(self, save: CommittedSave) -> list[SavedFile]:
        return self.files

    def local_dir(self, save: CommittedSave) -> None:
        return None

    def verified(self, save: CommittedSave, files: object) -> dict[str, tuple[int, int, int]]:
        return {}

    def read_ranges(self, save: CommittedSave, ranges: object) -> list[bytes]:
        raise AssertionError("plan reads nothing")


@pytest.mark.parametrize("offset", [len(DATA) + 1, len(DATA) + 600])
def test_a_range_to_the_end_of_a_file_starting_past_its_end_is_invalid(offset: int) -> None:
    """Length 0 is "to the end": from past the end that was a negative length, and INTERNAL (found by the fuzz)."""
    store = _Files(*_save())
    with pytest.raises(InvalidRequestError, match="past the end"):
        plan(store, "f", "run", "ckpt-4", [(DATA_FILE, offset, 0)], header_only=False)  # type: ignore[arg-type]
    at_the_end = plan(store, "f", "run", "ckpt-4", [(DATA_FILE, len(DATA), 0)], header_only=False)  # type: ignore[arg-type]
    assert at_the_end.ranges == ((DATA_FILE, len(DATA), 0),)  # nothing left to send: an empty range
