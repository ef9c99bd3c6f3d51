"""group_commit.GroupSync and LocalStore's group commit: shared syncs, each caller after its own, errors to all; no TF."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from checkpointd.core.ports import SaveMeta, Staged
from checkpointd.durable import group_commit
from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.names import TMP_PREFIX
from checkpointd.storage import local, save_manifest
from checkpointd.storage.local import LocalStore

DEADLINE = 10.0


class GatedSync:
    """A sync that blocks until released, and records the calls' order against the writes."""

    def __init__(self) -> None:
        self.calls = 0
        self.entered = threading.Semaphore(0)
        self.release = threading.Semaphore(0)
        self.fail_next: OSError | None = None

    def __call__(self) -> None:
        self.calls += 1
        self.entered.release()
        assert self.release.acquire(timeout=DEADLINE), "the test never released the sync"
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error


def _barrier_in_thread(group: group_commit.GroupSync) -> tuple[threading.Thread, list[BaseException | None]]:
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            group.barrier()
            outcome.append(None)
        except OSError as e:
            outcome.append(e)

    thread = threading.Thread(target=call)
    thread.start()
    return thread, outcome


def test_callers_that_arrive_during_a_sync_share_the_next_one_and_none_returns_before_a_sync_after_its_call() -> None:
    sync = GatedSync()
    group = group_commit.GroupSync(sync)
    try:
        first, first_out = _barrier_in_thread(group)
        assert sync.entered.acquire(timeout=DEADLINE)  # round 1 runs, covering the first caller only
        later = [_barrier_in_thread(group) for _ in range(5)]  # they arrive while round 1 runs
        sync.release.release()
        first.join(DEADLINE)
        assert first_out == [None]
        # Round 1 started before the five called: none of them may return on it.
        assert sync.entered.acquire(timeout=DEADLINE)  # round 2: all five at once
        assert all(not outcome for _, outcome in later)
        sync.release.release()
        for thread, outcome in later:
            thread.join(DEADLINE)
            assert outcome == [None]
        assert (sync.calls, group.rounds, group.covered) == (2, 2, 6)
    finally:
        sync.release.release()
        group.close()


def test_a_failed_sync_fails_every_caller_it_covered_and_the_next_round_runs_afresh() -> None:
    sync = GatedSync()
    group = group_commit.GroupSync(sync)
    try:
        sync.fail_next = OSError(5, "Input/output error")
        blocker, blocker_out = _barrier_in_thread(group)
        assert sync.entered.acquire(timeout=DEADLINE)
        covered = [_barrier_in_thread(group) for _ in range(3)]
        sync.release.release()  # round 1 (the blocker) fails
        blocker.join(DEADLINE)
        assert isinstance(blocker_out[0], OSError) and blocker_out[0].errno == 5
        sync.fail_next = OSError(28, "No space left on device")
        assert sync.entered.acquire(timeout=DEADLINE)
        sync.release.release()  # round 2 (the three) fails too
        for thread, outcome in covered:
            thread.join(DEADLINE)
            assert isinstance(outcome[0], OSError) and outcome[0].errno == 28
        after, after_out = _barrier_in_thread(group)
        assert sync.entered.acquire(timeout=DEADLINE)
        sync.release.release()
        after.join(DEADLINE)
        assert after_out == [None]  # a later round that succeeds answers its callers
    finally:
        sync.release.release()
        group.close()


def test_each_round_runs_on_the_thread_of_one_of_its_callers_with_no_sync_thread() -> None:
    sync = GatedSync()
    ran_on: list[int] = []
    group = group_commit.GroupSync(lambda: (ran_on.append(threading.get_ident()), sync()))
    try:
        first, first_out = _barrier_in_thread(group)
        assert sync.entered.acquire(timeout=DEADLINE)
        later = [_barrier_in_thread(group) for _ in range(3)]
        sync.release.release()
        assert sync.entered.acquire(timeout=DEADLINE)  # round 2, led by one of the three
        sync.release.release()
        for thread, outcome in [(first, first_out), *later]:
            thread.join(DEADLINE)
            assert outcome == [None]
        assert ran_on[0] == first.ident
        assert ran_on[1] in {thread.ident for thread, _ in later}
        assert not any(t.name == "group-sync" for t in threading.enumerate())
    finally:
        sync.release.release()
        group.close()


def test_close_returns_after_the_round_of_a_caller_still_waiting() -> None:
    sync = GatedSync()
    group = group_commit.GroupSync(sync)
    first, first_out = _barrier_in_thread(group)
    assert sync.entered.acquire(timeout=DEADLINE)
    waiting, waiting_out = _barrier_in_thread(group)
    deadline = time.monotonic() + DEADLINE
    while group.waiting() == 0:  # the caller has joined round 2 (else close would refuse it)
        assert time.monotonic() < deadline, "the second caller never reached the barrier"
        threading.Event().wait(0.001)
    closer = threading.Thread(target=group.close)
    closer.start()
    sync.release.release()  # round 1 ends; the waiting caller leads round 2
    assert sync.entered.acquire(timeout=DEADLINE)
    assert closer.is_alive()  # round 2 still runs
    sync.release.release()
    for thread in (first, waiting, closer):
        thread.join(DEADLINE)
    assert (first_out, waiting_out, group.rounds) == ([None], [None], 2)


def test_a_closed_group_refuses_barriers() -> None:
    group = group_commit.GroupSync(lambda: None)
    group.barrier()
    group.close()
    with pytest.raises(OSError, match="closed"):
        group.barrier()


def test_syncfs_of_a_real_dir_runs_and_a_missing_dir_raises(tmp_path: Path) -> None:
    sync = group_commit.syncfs_of(tmp_path)
    if sync is None:
        pytest.skip("libc has no syncfs here")
    sync()
    missing = group_commit.syncfs_of(tmp_path / "gone")
    assert missing is not None
    with pytest.raises(FileNotFoundError):
        missing()


class CountingSync:
    """Counts syncs; checks at each that the save's files and manifest are there and the target is not yet."""

    def __init__(self, target: Path) -> None:
        self.states: list[tuple[bool, bool]] = []  # (manifest in a staging dir beside the target, target published)
        self._target = target

    def __call__(self) -> None:
        staged = self._target.parent.glob(f"{TMP_PREFIX}{self._target.name}-*")
        manifest = any((s / save_manifest.MANIFEST_NAME).exists() for s in staged)
        self.states.append((manifest, self._target.exists()))


def test_a_small_save_is_committed_with_two_shared_syncs_its_files_first_then_its_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "root" / "run" / "save"
    recorder = CountingSync(target)
    monkeypatch.setattr(group_commit, "syncfs_of", lambda directory: recorder)
    fsyncs: list[object] = []
    monkeypatch.setattr(local.files, "fsync_dir", lambda path: fsyncs.append(path))
    monkeypatch.setattr(os, "fsync", lambda fd: fsyncs.append(fd))
    store = LocalStore(tmp_path / "root", group_commit=True)
    try:
        staging = store.stage(store.target("run", "save"))
        (staging / "variables").mkdir()
        (staging / "variables" / "variables.index").write_bytes(b"index")
        meta = SaveMeta("run", SaveKind.CHECKPOINT, 3, "save")
        written = store.commit(Staged(path=staging, bytes_written=5, versions={}), target, meta)
        assert written == 5
        # Sync 1 finds the manifest in staging and nothing published; sync 2 finds the rename done.
        assert recorder.states == [(True, False), (False, True)]
        assert fsyncs == []  # no per-file or per-dir fsync: the shared syncs cover them
        assert save_manifest.read_manifest(target)["step"] == 3
        assert not staging.exists()
    finally:
        store.close()


def test_large_saves_and_unsynced_stores_keep_their_own_fsyncs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = CountingSync(tmp_path / "none")
    monkeypatch.setattr(group_commit, "syncfs_of", lambda directory: recorder)
    store = LocalStore(tmp_path / "root", group_commit=True)
    unsynced = LocalStore(tmp_path / "unsynced", group_commit=True, fsync=False)
    try:
        meta = SaveMeta("run", SaveKind.CHECKPOINT, 1, "save")
        target = store.target("run", "save")
        staging = store.stage(target)
        store.commit(Staged(path=staging, bytes_written=local.GROUP_COMMIT_BYTES, versions={}), target, meta)
        assert recorder.states == []  # large: its own fsyncs
        assert save_manifest.read_manifest(target)["step"] == 1
        other = unsynced.target("run", "save")
        unsynced.commit(Staged(path=unsynced.stage(other), bytes_written=1, versions={}), other, meta)
        assert recorder.states == []
    finally:
        store.close()
        unsynced.close()


def test_a_small_save_replacing_one_parks_the_old_tree_until_the_rename_is_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    target = root / "run" / "save"
    seen: list[list[str]] = []  # the run dir's entries at each sync
    monkeypatch.setattr(
        group_commit, "syncfs_of", lambda directory: lambda: seen.append(sorted(os.listdir(target.parent)))
    )
    store = LocalStore(root, group_commit=True)
    try:
        for step in (1, 2):
            staging = store.stage(store.target("run", "save"))
            (staging / "f").write_bytes(b"%d" % step)
            store.commit(
                Staged(path=staging, bytes_written=1, versions={}),
                target,
                SaveMeta("run", SaveKind.CHECKPOINT, step, "save"),
            )
        assert save_manifest.read_manifest(target)["step"] == 2
        assert (target / "f").read_bytes() == b"2"
        first_sync, second_sync = seen[2], seen[3]  # the replacement's (names sorted: dot-names first)
        assert first_sync[0].startswith(".checkpointd-tmp-save-") and first_sync[1] == "save"
        # At its second sync the new tree is in place and the old one parked, not yet deleted.
        assert second_sync[0].startswith(".checkpointd-old-save-") and second_sync[1] == "save"
        assert os.listdir(target.parent) == ["save"]  # deleted once the renames were durable
    finally:
        store.close()


def test_a_save_on_another_filesystem_than_the_root_keeps_its_own_fsyncs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = CountingSync(tmp_path / "none")
    monkeypatch.setattr(group_commit, "syncfs_of", lambda directory: recorder)
    store = LocalStore(tmp_path / "root", group_commit=True)
    try:
        target = store.target("run", "save")
        staging = store.stage(target)
        real_stat = os.stat
        root = os.fspath(tmp_path / "root")

        class _OtherDevice:
            def __init__(self, st: os.stat_result) -> None:
                self.st_dev = st.st_dev + 1

        # The run's folder as if it were a mount (or a symlink to one) below the root.
        monkeypatch.setattr(
            os,
            "stat",
            lambda p, *a, **k: _OtherDevice(real_stat(p))
            if os.fspath(p) == os.fspath(staging)
            else real_stat(p, *a, **k),
        )
        store.commit(
            Staged(path=staging, bytes_written=1, versions={}), target, SaveMeta("run", SaveKind.CHECKPOINT, 1, "save")
        )
        assert recorder.states == []  # not the group's: syncfs of the root would not cover it
        assert save_manifest.read_manifest(target)["step"] == 1
        assert root in os.fspath(target)
    finally:
        store.close()


def test_a_fuse_root_keeps_its_own_fsyncs_and_the_deepest_mount_names_the_type(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
        "40 22 0:50 / /mnt/fuse rw,nosuid - fuse.eio eio rw\n"
        "41 22 0:51 / /mnt/fuse2 rw - tmpfs tmpfs rw\n"
    )
    assert group_commit._filesystem_type("/mnt/fuse/root", str(mountinfo)) == "fuse.eio"
    assert group_commit._filesystem_type("/mnt/fuse2/x", str(mountinfo)) == "tmpfs"  # not a prefix match of /mnt/fuse
    assert group_commit._filesystem_type("/srv", str(mountinfo)) == "ext4"
    assert group_commit._filesystem_type("/srv", str(tmp_path / "absent")) == ""
