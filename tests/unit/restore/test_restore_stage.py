"""restore_stage: a plan's ranges landed in files under a staging dir, checked, and deleted after.

Fake stores stand behind the seam: one with only read_ranges (the pieces
written one by one), one with stage_ranges of its own (as the object store).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Generator, Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath

import crc32c
import pytest

from checkpointd.core.ports import CommittedSave, SavedFile, StagesFiles
from checkpointd.protocol.errors import ChecksumError, LimitExceededError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.restores import staged_files as restore_stage
from checkpointd.restores.files import FilePlan

PIECE = 1000
DATA = bytes(range(256)) * 20  # 5120 bytes: several pieces, the last one short
INDEX = b"an index"


class _Files:
    """A SaveFiles store holding two files in memory, read in pieces of PIECE bytes."""

    def __init__(self, files: Mapping[str, bytes]) -> None:
        self.files = dict(files)

    def files_of(self, save: CommittedSave) -> list[SavedFile]:
        return [SavedFile(p, len(b), crc32c.crc32c(b)) for p, b in self.files.items()]

    def local_dir(self, save: CommittedSave) -> Path | None:
        return None

    def verified(self, save: CommittedSave, files: Sequence[SavedFile]) -> dict[str, tuple[int, int, int]]:
        return {}

    def read_ranges(self, save: CommittedSave, ranges: Sequence[tuple[str, int, int]]) -> Iterator[bytes]:
        for path, offset, length in ranges:
            for at in range(offset, offset + length, PIECE):
                yield self.files[path][at : min(at + PIECE, offset + length)]


class _Stages(_Files):
    """A store that stages ranges itself (as the object store does), counting its calls."""

    calls = 0

    def stage_ranges(
        self, save: CommittedSave, ranges: Sequence[tuple[str, int, int]], fds: Mapping[str, int]
    ) -> Generator[tuple[str, int, int, int], None, None]:
        self.calls += 1
        for path, offset, length in ranges:
            data = self.files[path][offset : offset + length]
            os.pwrite(fds[path], data, offset)
            yield path, offset, length, crc32c.crc32c(data)


SAVE = CommittedSave(PurePosixPath("run/train/ckpt-1"), "train/ckpt-1", "run", SaveKind.TRAINING_CHECKPOINT, 1, 0.0)


def _plan(committed: Sequence[SavedFile], ranges: Sequence[tuple[str, int, int]]) -> FilePlan:
    return FilePlan(SAVE, tuple(committed), tuple(ranges), None, {})


def _whole(store: _Files, committed: Sequence[SavedFile] | None = None) -> FilePlan:
    committed = committed if committed is not None else store.files_of(SAVE)
    return _plan(committed, [(f.path, 0, f.size) for f in committed])


@pytest.mark.parametrize("kind", [_Files, _Stages], ids=["pieces", "store-staged"])
def test_whole_files_land_byte_for_byte_and_the_dir_goes_when_the_block_ends(tmp_path: Path, kind: type) -> None:
    store = kind({"ckpt-1.index": INDEX, "ckpt-1.data-00000-of-00001": DATA})
    assert isinstance(store, StagesFiles) == (kind is _Stages)
    with restore_stage.staged(store, _whole(store), tmp_path) as staged:
        assert staged.dir.parent == tmp_path and staged.dir.name.startswith(restore_stage.PREFIX)
        assert staged.paths == ("ckpt-1.index", "ckpt-1.data-00000-of-00001")
        assert (staged.dir / "ckpt-1.data-00000-of-00001").read_bytes() == DATA
        assert (staged.dir / "ckpt-1.index").read_bytes() == INDEX
        assert staged.nbytes == len(DATA) + len(INDEX)
        assert os.stat(staged.dir / "ckpt-1.index").st_mode & 0o777 == 0o600
    assert os.listdir(tmp_path) == []
    if isinstance(store, _Stages):
        assert store.calls == 1


@pytest.mark.parametrize("kind", [_Files, _Stages], ids=["pieces", "store-staged"])
def test_a_file_that_does_not_match_its_manifest_is_refused_and_nothing_stays(tmp_path: Path, kind: type) -> None:
    store = kind({"ckpt-1.index": INDEX, "ckpt-1.data-00000-of-00001": DATA})
    committed = store.files_of(SAVE)
    store.files["ckpt-1.data-00000-of-00001"] = DATA[:-1] + b"\x00"  # same size, other bytes
    with pytest.raises(ChecksumError, match=r"ckpt-1\.data-00000-of-00001 does not match its manifest's CRC32C"):
        with restore_stage.staged(store, _whole(store, committed), tmp_path):
            pytest.fail("a corrupt file was handed out")
    assert os.listdir(tmp_path) == []


def test_a_partial_range_lands_at_its_offset_in_a_file_of_full_size_with_holes_around(tmp_path: Path) -> None:
    store = _Files({"ckpt-1.index": INDEX, "ckpt-1.data-00000-of-00001": DATA})
    committed = store.files_of(SAVE)
    plan = _plan(committed, [("ckpt-1.data-00000-of-00001", 1500, 2100)])
    with restore_stage.staged(store, plan, tmp_path) as staged:
        assert staged.paths == ("ckpt-1.data-00000-of-00001",)
        landed = (staged.dir / "ckpt-1.data-00000-of-00001").read_bytes()
    assert len(landed) == len(DATA)
    assert landed[1500:3600] == DATA[1500:3600]
    assert landed[:1500] == bytes(1500) and landed[3600:] == bytes(len(DATA) - 3600)


def test_no_room_on_the_tmpfs_is_a_limit_that_says_to_restore_without_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    store = _Files({"ckpt-1.index": INDEX, "ckpt-1.data-00000-of-00001": DATA})
    with pytest.raises(LimitExceededError, match="without staging"):
        with restore_stage.staged(store, _whole(store), tmp_path):
            pytest.fail("staged without room")
    assert os.listdir(tmp_path) == []
