"""writeback.Writeback: a file's growth is handed to the disk as it is written (and for which saves), on real files, no TF."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from checkpointd.core.ports import SaveMeta, Staged
from checkpointd.durable import writeback
from checkpointd.protocol.kinds import SaveKind
from checkpointd.storage.local import LocalStore

DEADLINE = 10.0
META = SaveMeta("run", SaveKind.CHECKPOINT, 1, "save")


class Recorder:
    """A sync_range that records each call's inode and range, and can wait for the looks after a write."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls: list[tuple[int, int, int]] = []  # (inode, offset, nbytes)
        self._changed = threading.Condition()

    def __call__(self, fd: int, offset: int, nbytes: int) -> None:
        with self._changed:
            self.calls.append((os.fstat(fd).st_ino, offset, nbytes))
            self._changed.notify_all()
        if self.fail:
            raise OSError(5, "I/O error")

    def handed_over(self, inode: int, since: int) -> list[tuple[int, int]]:
        """Waits (up to DEADLINE) for two calls on `inode` after the first `since` calls: the second began after
        everything written before `since` was counted, so its range is what the writeback asked of the disk."""
        with self._changed:
            self._changed.wait_for(lambda: sum(i == inode for i, _, _ in self.calls[since:]) >= 2, timeout=DEADLINE)
            return [(o, n) for i, o, n in self.calls[since:] if i == inode]


def covers(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether one of `ranges` (offset, nbytes; nbytes 0 is to the end of the file) holds [start, end)."""
    return any(o <= start and (n == 0 or o + n >= end) for o, n in ranges)


def pwrite_and_wait(path: Path, at: int, data: bytes, recorder: Recorder) -> None:
    """Writes `data` at `at` of `path` (created if absent), then asserts the writeback handed that range over."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        inode = os.fstat(fd).st_ino
        with recorder._changed:  # noqa: SLF001 - the count of calls before the write
            since = len(recorder.calls)
        os.pwrite(fd, data, at)
    finally:
        os.close(fd)
    ranges = recorder.handed_over(inode, since)
    assert covers(ranges[1:], at, at + len(data)), f"bytes {at}..{at + len(data)} never handed over: {ranges}"


def write_in_steps(path: Path, steps: list[bytes], recorder: Recorder) -> None:
    """Appends each step, and asserts the writeback handed it over before the next."""
    for data in steps:
        pwrite_and_wait(path, path.stat().st_size if path.exists() else 0, data, recorder)


def test_every_write_is_handed_over_wherever_it_lands_and_through_a_rename(tmp_path: Path) -> None:
    recorder = Recorder()
    with writeback.Writeback(tmp_path, interval=0.001, sync_range=recorder):
        # A bundle's tensors go where they belong, in the wire's order, and an incremental save's
        # copies anywhere: a range far past the end first, then the hole below it, then appends.
        pwrite_and_wait(tmp_path / "data.tempstate123", 70000, b"c" * 5000, recorder)
        pwrite_and_wait(tmp_path / "data.tempstate123", 0, b"a" * 70000, recorder)
        os.rename(tmp_path / "data.tempstate123", tmp_path / "data")  # followed through a rename
        write_in_steps(tmp_path / "data", [b"d" * 10, b"e" * 3], recorder)
    inode = (tmp_path / "data").stat().st_ino
    assert {c[0] for c in recorder.calls} == {inode}  # one file, by its inode


def test_every_file_of_the_dir_is_followed_but_not_subdirs(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "below").write_bytes(b"x" * 100)
    recorder = Recorder()
    with writeback.Writeback(tmp_path, interval=0.001, sync_range=recorder):
        write_in_steps(tmp_path / "index", [b"i" * 10], recorder)
        write_in_steps(tmp_path / "data", [b"d" * 20], recorder)
    assert {c[0] for c in recorder.calls} == {(tmp_path / n).stat().st_ino for n in ("index", "data")}


def test_errors_are_not_raised_and_files_are_closed(tmp_path: Path) -> None:
    fds = len(os.listdir("/proc/self/fd"))
    recorder = Recorder(fail=True)
    with writeback.Writeback(tmp_path, interval=0.001, sync_range=recorder):
        write_in_steps(tmp_path / "data", [b"d" * 10], recorder)
    assert recorder.calls
    assert len(os.listdir("/proc/self/fd")) == fds


def test_a_missing_dir_is_no_error(tmp_path: Path) -> None:
    recorder = Recorder()
    with writeback.Writeback(tmp_path / "absent", interval=0.001, sync_range=recorder):
        pass
    assert recorder.calls == []


@pytest.mark.skipif(writeback._libc_sync_file_range() is None, reason="libc has no sync_file_range")  # noqa: SLF001
def test_libc_sync_file_range_starts_writeback_of_a_real_file(tmp_path: Path) -> None:
    sync_range = writeback._libc_sync_file_range()  # noqa: SLF001 - the real call behind the default
    assert sync_range is not None
    path = tmp_path / "data"
    path.write_bytes(b"x" * 100_000)
    fd = os.open(path, os.O_RDONLY)
    try:
        sync_range(fd, 0, 100_000)
        with pytest.raises(OSError):
            sync_range(fd, -1, 10)  # EINVAL: the error is raised, with its errno
    finally:
        os.close(fd)


def test_only_an_fsyncing_local_stores_large_staging_is_written_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[Path] = []
    trims: list[int] = []

    class Started(writeback.Writeback):
        def __enter__(self) -> writeback.Writeback:
            started.append(self._directory)  # noqa: SLF001
            return self

    monkeypatch.setattr(writeback, "Writeback", Started)
    monkeypatch.setattr(writeback, "release_free_memory", lambda: trims.append(1))

    def written_back(directory: Path, nbytes: int) -> bool:
        started.clear()
        with writeback.writing(directory, nbytes):
            pass
        return started == [directory]

    synced = LocalStore(tmp_path / "synced")
    unsynced = LocalStore(tmp_path / "unsynced", fsync=False)
    try:
        staging = synced.stage(synced.target("run", "save"))
        big = writeback.WRITEBACK_BYTES
        assert written_back(staging, big)  # a training checkpoint's files
        assert written_back(staging / "variables", big)  # a policy's
        assert len(trims) == 4  # the free heap is handed back before and after each large write
        assert not written_back(staging, big - 1)  # small: its fsync is latency, not bandwidth
        assert len(trims) == 4
        assert not written_back(unsynced.stage(unsynced.target("run", "save")), big)
        (tmp_path / "s3-staging").mkdir()
        assert not written_back(tmp_path / "s3-staging", big)  # another store's
        assert len(trims) == 8  # large writes there too
        synced.discard(staging)
        assert not written_back(staging, big)  # forgotten once discarded
        again = synced.stage(synced.target("run", "save"))
        synced.commit(Staged(path=again, bytes_written=0, versions={}), synced.target("run", "save"), META)
        assert not written_back(again, big)  # and once committed
    finally:
        synced.close()
        unsynced.close()
