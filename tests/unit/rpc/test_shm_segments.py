"""checkpointd.transport.shm: per-run shared-memory segments, and receiving a snapshot through one."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
from pathlib import Path

import crc32c
import pytest

from checkpointd.protocol import wire
from checkpointd.protocol.errors import InvalidRequestError
from checkpointd.rpc import upload
from checkpointd.transport import shm
from checkpointd.v1 import checkpointd_pb2 as pb
from tests.unit.rpc.test_upload import Parts

PARTS = [40, 0, 4096, 8, 3]


class _Context:
    def is_active(self) -> bool:
        return True


@pytest.fixture
def memory(tmp_path: Path):
    shared = shm.SharedMemory(tmp_path, 1 << 30)
    yield shared
    shared.close()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_segment_is_private_aligned_and_sized_for_its_parts(memory: shm.SharedMemory) -> None:
    segment = memory.segment("run-a", PARTS)

    assert segment is not None
    assert segment.path.parent == memory.folder
    assert _mode(memory.folder) == 0o700
    assert _mode(segment.path) == 0o600
    offsets, size = wire.aligned_offsets(PARTS)
    assert segment.offsets == tuple(offsets) and segment.size == size
    assert segment.path.stat().st_size == size
    views = segment.views()
    assert [len(v) for v in views] == PARTS
    assert all(o % wire.ALIGNMENT == 0 for o in segment.offsets)
    assert not any(v.readonly for v in views)  # SaveV2 wraps writable memory without a copy


def test_a_write_through_the_file_shows_in_the_daemons_views(memory: shm.SharedMemory) -> None:
    segment = memory.segment("run-a", PARTS)
    assert segment is not None
    with open(segment.path, "r+b") as f:  # what a trainer's map writes
        f.seek(segment.offsets[2])
        f.write(b"\x07" * 4096)

    assert bytes(segment.views()[2]) == b"\x07" * 4096


def test_the_same_layout_reuses_the_segment_and_another_replaces_it(memory: shm.SharedMemory) -> None:
    first = memory.segment("run-a", PARTS)
    assert memory.segment("run-a", PARTS) is first
    other_run = memory.segment("run-b", PARTS)
    assert other_run is not None and other_run.path != first.path

    resized = memory.segment("run-a", [*PARTS[:-1], 17])  # the numpy state grew

    assert resized is not None and resized is not first
    assert not first.path.exists()
    assert resized.path.exists() and other_run.path.exists()


def test_drop_and_close_free_the_files(memory: shm.SharedMemory) -> None:
    a, b = memory.segment("run-a", PARTS), memory.segment("run-b", PARTS)
    memory.drop("run-a")
    memory.drop("never-registered")

    assert not a.path.exists() and b.path.exists()
    memory.close()
    assert not memory.folder.exists()


def test_no_room_means_no_segment_and_nothing_left(
    memory: shm.SharedMemory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shm.os, "posix_fallocate", full)

    assert memory.segment("run-a", PARTS) is None
    assert list(memory.folder.iterdir()) == []
    assert "no room for" in caplog.text and "over gRPC" in caplog.text


def test_idle_segments_give_way_least_recently_used_first_busy_ones_never(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    page = [4096]
    shared = shm.SharedMemory(tmp_path, 3 * 4096)
    try:
        a, b, c = (shared.segment(run, page) for run in ("a", "b", "c"))
        for run in ("a", "b"):
            shared.release(run)  # "c" is still saving
        assert shared.segment("a", page) is a  # "a" is now used more recently than "b"
        shared.release("a")

        d = shared.segment("d", page)  # full: the least recently used idle one goes

        assert d is not None and not b.path.exists()
        assert a.path.exists() and c.path.exists()
        assert shared.nbytes == 3 * 4096
        e = shared.segment("e", page)  # frees "a", the last idle one
        assert e is not None and not a.path.exists()
        # Every segment is busy (c, d, e): no room, and the save goes over gRPC.
        assert shared.segment("f", page) is None
        assert "its saves go over gRPC" in caplog.text
        assert all(x.path.exists() for x in (c, d, e))
        shared.release("d")
        assert shared.segment("g", [5 * 4096]) is None  # larger than the cap itself
        assert d.path.exists()  # nothing is freed for a segment that could never fit
    finally:
        shared.close()


def test_an_empty_snapshot_gets_no_segment(memory: shm.SharedMemory) -> None:
    assert memory.segment("run-a", [0, 0]) is None


def test_folders_of_dead_daemons_are_removed_live_and_foreign_ones_kept(tmp_path: Path) -> None:
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)  # fmt: skip
    dead = tmp_path / f"checkpointd-{int(finished.stdout)}-{'0' * 16}"
    live = tmp_path / f"checkpointd-{os.getpid()}-{'1' * 16}"
    unrelated = tmp_path / "checkpointd-notes"
    for d in (dead, live, unrelated):
        d.mkdir()
        (d / "seg").write_bytes(b"x")

    shared = shm.SharedMemory(tmp_path, 1 << 30)
    try:
        assert not dead.exists()
        assert live.exists() and unrelated.exists()
    finally:
        shared.close()


# upload.receive_snapshot, with a segment offered.


def _written() -> pb.SaveRequest:
    return pb.SaveRequest(shared_memory_written=pb.SharedMemoryWritten())


def test_shared_memory_written_hands_over_the_segments_views(memory: shm.SharedMemory) -> None:
    segment = memory.segment("run-a", PARTS)
    assert segment is not None
    segment.views()[0][:] = b"v" * 40

    sink = Parts(PARTS)
    transport = upload.receive_snapshot(iter([_written()]), sum(PARTS), _Context(), PARTS, segment, sink)

    assert transport == "shm"
    # Each part written once, straight from the segment's memory.
    assert [(part, offset) for part, offset, _ in sink.writes] == [(j, 0) for j, n in enumerate(PARTS) if n]
    assert [len(p) for p in sink.joined()] == PARTS
    assert sink.joined()[0] == b"v" * 40


def test_shared_memory_written_without_an_offer_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="offered no shared memory"):
        upload.receive_snapshot(iter([_written()]), sum(PARTS), _Context(), PARTS, None, Parts(PARTS))


def test_nothing_may_follow_shared_memory_written(memory: shm.SharedMemory) -> None:
    segment = memory.segment("run-a", PARTS)
    chunk = pb.SaveRequest(chunk=pb.Chunk(offset=0, data=b"x"))

    with pytest.raises(InvalidRequestError, match="nothing may follow"):
        upload.receive_snapshot(iter([_written(), chunk]), sum(PARTS), _Context(), PARTS, segment, Parts(PARTS))


def test_chunks_still_work_when_a_segment_was_offered(memory: shm.SharedMemory) -> None:
    segment = memory.segment("run-a", [4])
    data = b"abcd"
    chunk = pb.SaveRequest(chunk=pb.Chunk(offset=0, data=data, crc32c=crc32c.crc32c(data)))

    sink = Parts([4])
    transport = upload.receive_snapshot(iter([chunk]), 4, _Context(), [4], segment, sink)

    assert transport == "grpc" and sink.joined() == [data]
