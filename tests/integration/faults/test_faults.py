"""Faults: writes that fail, trainers that vanish or stall mid-upload.

Each fault must end the same way: the caller gets a clear error, the save is
counted failed, nothing of it stays on disk, earlier saves still verify, and
the run's lane serves the next save at once (accepted, not skipped).

Disk full uses a 2 MiB tmpfs as the daemon's --root (falling back to a
loop-mounted ext4 image, else skipping with the reason): it needs root, as
does a run folder remounted read-only under the running daemon (a tmpfs of its own).
An fsync that fails EIO comes from a FUSE layer (tests/integration/support/eio_fs.py):
it needs /dev/fuse, root and fusepy (in the test extra),
else it skips; device-mapper's error target would need the dm module, which
this kernel lacks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import tensorflow as tf
from tf_agents.policies import policy_saver

from checkpointd.cli import verify
from checkpointd.protocol import wire
from checkpointd.protocol.codes import error_for
from checkpointd.protocol.errors import DeadlineError, SaveFailedError
from checkpointd.rpc.upload import within
from checkpointd.storage import local
from checkpointd.storage.verify import verify_dir
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc as pb_grpc
from checkpointd_client import RemotePolicySaver, snapshot, template
from checkpointd_client.transport.connection import ConnectionOptions
from checkpointd_client.transport.session import DaemonSession
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon, start_daemon, wait_until
from tests.integration.support.disk import read_only
from tests.integration.support.raw import RawSave, run_status
from tests.integration.support.scrape import Metrics

DEADLINE = 30.0  # any single wait in these tests


# The upload deadline's reader, without a daemon.


def _blocking_source(items: list[int], release: threading.Event) -> Iterator[int]:
    yield from items
    release.wait(DEADLINE)  # a client that stops sending and never half-closes


def _readers() -> int:
    return sum(t.name == "upload-reader" for t in threading.enumerate())


def _taking(got: list[int]) -> Callable[[Iterator[int]], str]:
    def receive(requests: Iterator[int]) -> str:
        for item in requests:
            got.append(item)
        return "received"

    return receive


def _same(received: str) -> str:
    return received


def test_within_runs_then_on_the_reader_after_the_receive_and_no_deadline_cuts_it_off() -> None:
    threads: list[int] = []
    committing = threading.Event()
    release = threading.Event()

    def receive(requests: Iterator[int]) -> str:
        threads.append(threading.get_ident())
        return str(sum(requests))

    def then(received: str) -> str:
        threads.append(threading.get_ident())
        committing.set()
        assert release.wait(DEADLINE)  # the commit outlasts the upload's deadline
        return f"committed {received}"

    outcome: list[str] = []
    caller = threading.Thread(
        target=lambda: outcome.append(within(receive, iter(range(4)), time.monotonic() + 0.2, 0.2, then))
    )
    caller.start()
    assert committing.wait(DEADLINE)
    caller.join(0.4)  # past the deadline, still waiting for the commit
    assert caller.is_alive()
    release.set()
    caller.join(DEADLINE)
    assert outcome == ["committed 6"]
    assert len(threads) == 2 and threads[0] == threads[1] != caller.ident


def test_within_runs_the_receive_on_a_reader_and_returns_its_result() -> None:
    got: list[int] = []
    assert within(_taking(got), iter(range(10)), time.monotonic() + DEADLINE, DEADLINE, _same) == "received"
    assert got == list(range(10))
    wait_until(lambda: _readers() == 0, "the reader ended", DEADLINE)


def test_within_cuts_off_a_stalled_source_at_the_deadline_and_its_reader_ends() -> None:
    release = threading.Event()
    got: list[int] = []
    started = time.monotonic()
    with pytest.raises(DeadlineError, match=r"upload did not finish within 0\.3s"):
        within(_taking(got), _blocking_source([1, 2], release), started + 0.3, 0.3, _same)
    assert got == [1, 2]
    assert 0.3 <= time.monotonic() - started < 5.0
    release.set()  # the call ends: the reader sees the end of the stream
    wait_until(lambda: _readers() == 0, "the reader ended", DEADLINE)


def test_within_hands_the_source_error_to_the_caller() -> None:
    def failing() -> Iterator[int]:
        yield 1
        raise grpc.RpcError("cancelled")

    with pytest.raises(grpc.RpcError):
        within(_taking([]), failing(), time.monotonic() + DEADLINE, DEADLINE, _same)


def test_within_reader_stops_at_its_next_request_once_the_deadline_passed() -> None:
    # The client stalls past the deadline, then sends on: the reader takes no more.
    release = threading.Event()

    def stalling() -> Iterator[int]:
        yield 1
        release.wait(DEADLINE)
        yield from range(2, 1000)

    got: list[int] = []
    with pytest.raises(DeadlineError):
        within(_taking(got), stalling(), time.monotonic() + 0.2, 0.2, _same)
    release.set()
    wait_until(lambda: _readers() == 0, "the reader ended", DEADLINE)
    assert got == [1]


# Helpers for the daemon tier.


class Trainer:
    """A run registered by hand, so its snapshots can be sent chunk by chunk."""

    def __init__(self, daemon: Daemon, run: str) -> None:
        self.run = run
        self.daemon = daemon
        self.channel = grpc.insecure_channel(daemon.address)
        self.stub = pb_grpc.CheckpointServiceStub(self.channel)
        self.train_step = tf.Variable(0, dtype=tf.int64)
        saver = policy_saver.PolicySaver(policies.build(policies.q()), train_step=self.train_step)
        options = ConnectionOptions(chunk_bytes=1 << 20, timeout=DEADLINE)
        self.session = DaemonSession(daemon.address, run, options, owner="saver", upload_threads=1)
        self.bindings = template.register(self.session, saver)

    def save(self, export_dir: str, *, step: int, kind: int = pb.SAVED_MODEL) -> tuple[RawSave, list[pb.Chunk]]:
        self.train_step.assign(step)
        snap = snapshot.take_snapshot(self.bindings, self.train_step)
        header = pb.SaveHeader(
            run=self.run, kind=kind, export_dir=export_dir, step=step,
            variables=self.bindings.protos(), snapshot_bytes=snap.nbytes,
        )  # fmt: skip
        return RawSave(self.stub, pb.SaveRequest(header=header)), list(wire.chunks(snap.parts(), 64))

    def save_whole(self, export_dir: str, *, step: int) -> pb.SaveResult:
        call, chunks = self.save(export_dir, step=step)
        with call:
            assert call.decision().accepted
            return call.finish(chunks)

    def in_flight(self) -> bool:
        return run_status(self.stub, self.run).HasField("in_flight")

    def close(self) -> None:
        self.session.shutdown()
        self.channel.close()


def saves_total(daemon: Daemon, kind: str, outcome: str) -> float:
    return Metrics(daemon.metrics_url)("checkpointd_saves_total", kind=kind, outcome=outcome)


def temp_dirs(root: Path) -> list[str]:
    return [os.path.join(d, n) for d, names, _ in os.walk(root) for n in names if n.startswith(local.TMP_PREFIX)]


@pytest.fixture(scope="module")
def q_policy():  # noqa: ANN201
    return policies.build(policies.q())


def remote_saver(daemon: Daemon, run: str, policy) -> RemotePolicySaver:  # noqa: ANN001
    return RemotePolicySaver(policy, daemon.address, run=run, timeout=DEADLINE)


# Write failures.


def test_an_export_dir_blocked_by_a_file_fails_and_the_lane_serves_on(daemon: Daemon, q_policy) -> None:  # noqa: ANN001
    run_dir = daemon.root / "faults-blocked"
    saver = remote_saver(daemon, "faults-blocked", q_policy)
    try:
        saver.save("good", blocking=True)
        (run_dir / "blocked").write_text("a user's file")
        failed = saves_total(daemon, "saved_model", "failed")

        with pytest.raises(SaveFailedError, match="blocked: it exists and is not a directory"):
            saver.save("blocked", blocking=True)

        assert saves_total(daemon, "saved_model", "failed") == failed + 1
        assert (run_dir / "blocked").read_text() == "a user's file"
        assert temp_dirs(run_dir) == []
        after = saver.save("after")  # non-blocking: accepted, since the lane is free
        assert not after.skipped
        after.result(DEADLINE)
        assert [r.ok for r in verify.verify_paths([run_dir / "good", run_dir / "after"])] == [True, True]
    finally:
        saver.close()


def test_an_export_dir_under_a_file_fails_and_the_lane_serves_on(daemon: Daemon, q_policy) -> None:  # noqa: ANN001
    run_dir = daemon.root / "faults-parent"
    saver = remote_saver(daemon, "faults-parent", q_policy)
    try:
        saver.save_checkpoint("good", blocking=True)
        (run_dir / "afile").write_text("not a dir")
        failed = saves_total(daemon, "checkpoint", "failed")

        with pytest.raises(SaveFailedError, match=r"Not a directory \(.*afile\)"):
            saver.save_checkpoint("afile/ckpt", blocking=True)

        assert saves_total(daemon, "checkpoint", "failed") == failed + 1
        assert (run_dir / "afile").read_text() == "not a dir"
        assert temp_dirs(run_dir) == []
        after = saver.save_checkpoint("after")
        assert not after.skipped
        after.result(DEADLINE)
        assert all(r.ok for r in verify.verify_paths([run_dir]))
    finally:
        saver.close()


def test_an_unwritable_state_dir_fails_registration_with_the_os_reason_and_is_survivable(
    fresh_daemon,
    q_policy,  # noqa: ANN001
) -> None:
    daemon = fresh_daemon()
    saver = remote_saver(daemon, "faults-state", q_policy)
    try:
        with read_only(daemon.root / ".checkpointd") as reason:  # e.g. remounted read-only after start
            with pytest.raises(SaveFailedError) as caught:
                saver.register()
            # The OS reason, not "internal error in RegisterRun (OSError)".
            assert "could not store its template" in str(caught.value)
            assert reason in str(caught.value)
            assert "internal error" not in str(caught.value)
        assert daemon.proc.poll() is None
        assert "Traceback" not in daemon.log()
        saver.register()  # writable again: the same call works
        saver.save("after", blocking=True)
    finally:
        saver.close()
    assert (daemon.root / "faults-state" / "after" / "saved_model.pb").is_file()


def _mount_small_disk(where: Path) -> str:
    """Mounts a 2 MiB filesystem at `where`; returns which kind, or skips."""
    where.mkdir()
    tried = []
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True, text=True
    )
    if done.returncode == 0:
        return "tmpfs"
    tried.append(f"tmpfs: {done.stderr.strip()}")
    image = where.parent / "small-disk.img"
    for command in (
        ["truncate", "-s", "4M", str(image)],
        ["mkfs.ext4", "-q", "-F", str(image)],
        ["mount", "-o", "loop", str(image), str(where)],
    ):
        done = subprocess.run(command, capture_output=True, text=True) if shutil.which(command[0]) else None
        if done is None or done.returncode != 0:
            tried.append(f"{command[0]}: {done.stderr.strip() if done else 'not installed'}")
            pytest.skip("cannot mount a small filesystem here (needs root): " + "; ".join(tried))
    return "loop ext4"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    disk = tmp_path / "disk"
    _mount_small_disk(disk)
    try:
        yield disk
    finally:
        if subprocess.run(["umount", str(disk)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.fixture
def full_disk_daemon(small_disk: Path, tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(small_disk / "root", tmp_path / "work")
    try:
        yield d
    finally:
        d.proc.kill()
        d.proc.wait()


def _fill(path: Path) -> None:
    """Writes `path` until the filesystem is full."""
    block = b"\0" * (64 << 10)
    with open(path, "wb") as f:
        try:
            while True:
                f.write(block)
                f.flush()
        except OSError:
            pass
    assert shutil.disk_usage(path.parent).free < (64 << 10)


def test_a_full_disk_fails_the_save_cleanly_and_the_lane_serves_on(full_disk_daemon: Daemon, q_policy) -> None:  # noqa: ANN001
    daemon = full_disk_daemon
    run_dir = daemon.root / "faults-full"
    saver = remote_saver(daemon, "faults-full", q_policy)
    try:
        saver.save("good", blocking=True)
        filler = daemon.root / "filler"
        _fill(filler)

        with pytest.raises(SaveFailedError, match="No space left on device"):
            saver.save("big", blocking=True)

        assert saves_total(daemon, "saved_model", "failed") == 1
        assert saves_total(daemon, "saved_model", "ok") == 1
        assert not (run_dir / "big").exists()
        assert temp_dirs(daemon.root) == []
        assert verify_dir(run_dir / "good").ok
        filler.unlink()
        after = saver.save("after")
        assert not after.skipped
        after.result(DEADLINE)
        assert all(r.ok for r in verify.verify_paths([run_dir]))
    finally:
        saver.close()


@pytest.fixture
def remountable_daemon(tmp_path: Path) -> Iterator[tuple[Daemon, Path]]:
    """A daemon and its run folder `faults-ro` on a tmpfs of its own (yielded), rw again at teardown.

    The run folder, not the whole root: the daemon holds `.checkpointd/daemon.lock`
    open for writing while it runs, so the kernel refuses `remount,ro` of the
    root's own filesystem (EBUSY). A filesystem the kernel turns read-only on
    an error (ext4 errors=remount-ro) ignores open writers, but cannot be made
    writable again without an unmount: a folder on a mount of its own is what
    goes read-only and back under a running daemon.
    """
    root = tmp_path / "root"
    disk = root / "faults-ro"
    disk.mkdir(parents=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    d = None
    try:
        d = start_daemon(root, tmp_path / "work")
        yield d, disk
    finally:
        if d is not None:
            d.proc.kill()
            d.proc.wait()
        subprocess.run(["mount", "-o", "remount,rw", str(disk)], capture_output=True)
        if subprocess.run(["umount", str(disk)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _remount(disk: Path, mode: str) -> None:
    done = subprocess.run(["mount", "-o", f"remount,{mode}", str(disk)], capture_output=True, text=True)
    assert done.returncode == 0, f"remount,{mode}: {done.stderr.strip()}"


def test_a_run_folder_remounted_read_only_fails_saves_clearly_and_they_commit_again_once_it_is_writable(
    remountable_daemon: tuple[Daemon, Path],
    q_policy,  # noqa: ANN001
) -> None:
    daemon, run_dir = remountable_daemon
    saver = remote_saver(daemon, "faults-ro", q_policy)
    try:
        saver.save("good", blocking=True)
        saver.save_checkpoint("ckpt-good", blocking=True)
        _remount(run_dir, "ro")  # no file of it is held open for writing between saves
        failed = saves_total(daemon, "saved_model", "failed")

        with pytest.raises(SaveFailedError, match="Read-only file system") as caught:
            saver.save("ro", blocking=True)
        assert "internal error" not in str(caught.value)
        with pytest.raises(SaveFailedError, match="Read-only file system"):
            saver.save_checkpoint("ckpt-ro", blocking=True)
        ticket = saver.save("ro-async")  # non-blocking: a failed ticket, never a raise
        assert isinstance(ticket.exception(DEADLINE), SaveFailedError)

        assert saves_total(daemon, "saved_model", "failed") >= failed + 2
        assert daemon.proc.poll() is None and "Traceback" not in daemon.log()
        assert not any((run_dir / name).exists() for name in ("ro", "ckpt-ro", "ro-async"))
        assert temp_dirs(daemon.root) == []
        latest = saver.latest()  # the daemon serves on: reads answer while writes cannot
        assert latest is not None and latest.path.endswith("ckpt-good")

        _remount(run_dir, "rw")
        after = saver.save("after")
        assert not after.skipped
        after.result(DEADLINE)
        saver.save_checkpoint("ckpt-after", blocking=True)
        results = verify.verify_paths([run_dir])
        assert results and all(r.ok for r in results), results
        assert {p.name for p in run_dir.iterdir()} == {"good", "ckpt-good", "after", "ckpt-after"}
    finally:
        saver.close()


@pytest.fixture
def eio_disk(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A FUSE mount (`eio_fs`) whose fsync fails EIO while a flag file exists: yields (mount, flag)."""
    fuse = pytest.importorskip("fuse", reason="fusepy is not installed: no FUSE layer for an fsync that fails EIO")
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("no /dev/fuse, or not root: cannot mount a FUSE filesystem here")
    backing, mount, flag = tmp_path / "backing", tmp_path / "eio", tmp_path / "fail-fsync"
    backing.mkdir()
    mount.mkdir()
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(fuse.__file__), os.environ.get("PYTHONPATH", "")])
    )
    log = open(tmp_path / "eio_fs.log", "wb")  # noqa: SIM115 - open while the filesystem runs
    fs = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.support.eio_fs", str(backing), str(mount), str(flag)],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).resolve().parents[3],
    )  # fmt: skip
    try:
        wait_until(lambda: os.path.ismount(mount) or fs.poll() is not None, "the FUSE filesystem mounted", DEADLINE)
        if not os.path.ismount(mount):
            pytest.skip(f"the FUSE filesystem did not mount: {(tmp_path / 'eio_fs.log').read_text()[-500:]}")
        yield mount, flag
    finally:
        fs.terminate()  # libfuse unmounts on SIGTERM
        try:
            fs.wait(DEADLINE)
        except subprocess.TimeoutExpired:
            fs.kill()
            fs.wait()
        if os.path.ismount(mount):
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)
        log.close()


def _eio_saves(daemon: Daemon, flag: Path, q_policy) -> tuple[Path, list[BaseException | None]]:  # noqa: ANN001
    """A good save, two saves while fsync fails EIO, one after; returns the run dir and the two saves' errors."""
    run_dir = daemon.root / "faults-eio"
    saver = remote_saver(daemon, "faults-eio", q_policy)
    errors: list[BaseException | None] = []
    try:
        saver.save("good", blocking=True)
        flag.touch()
        for call, name in ((saver.save, "eio"), (saver.save_checkpoint, "ckpt-eio")):
            errors.append(call(name).exception(DEADLINE))
        flag.unlink()
        after = saver.save("after")
        assert not after.skipped
        after.result(DEADLINE)
    finally:
        saver.close()
    return run_dir, errors


def test_an_fsync_that_fails_eio_fails_the_save_and_commits_nothing_of_it(
    eio_disk: tuple[Path, Path],
    tmp_path: Path,
    q_policy,  # noqa: ANN001
) -> None:
    mount, flag = eio_disk
    daemon = start_daemon(mount / "root", tmp_path / "work", "--no-group-commit")  # fsync per file and dir
    try:
        run_dir, errors = _eio_saves(daemon, flag, q_policy)
        for error in errors:
            assert isinstance(error, SaveFailedError) and "Input/output error" in str(error), error
        assert daemon.proc.poll() is None and "Traceback" not in daemon.log()
    finally:
        daemon.terminate()
    assert {p.name for p in run_dir.iterdir()} == {"good", "after"}
    assert temp_dirs(run_dir) == []
    results = verify.verify_paths([run_dir])
    assert results and all(r.ok for r in results), results


def test_an_fsync_that_fails_eio_under_group_commit_fails_the_save(
    # The default daemon: group commit would sync with one syncfs(2), which on a FUSE
    # mount never reaches the server's fsync, so a FUSE root keeps each save's fsyncs.
    eio_disk: tuple[Path, Path],
    tmp_path: Path,
    q_policy,  # noqa: ANN001
) -> None:
    mount, flag = eio_disk
    daemon = start_daemon(mount / "root", tmp_path / "work")
    try:
        _, errors = _eio_saves(daemon, flag, q_policy)
    finally:
        daemon.terminate()
    assert all(isinstance(e, SaveFailedError) for e in errors), errors


# Trainers that vanish or stall.


def test_a_trainer_that_disconnects_mid_upload_frees_the_lane(daemon: Daemon) -> None:
    trainer = Trainer(daemon, "faults-cancel")
    try:
        failed = saves_total(daemon, "saved_model", "failed")
        cancelled = saves_total(daemon, "saved_model", "cancelled")
        call, chunks = trainer.save("partial", step=1)
        assert len(chunks) >= 6
        with call:
            assert call.decision().accepted
            call.send_chunks(chunks[: len(chunks) // 2])
        # The call is cancelled; the daemon ends the save as it notices.
        wait_until(lambda: not trainer.in_flight(), "the cancelled save left the lane", DEADLINE)
        # A caller gone is no write failure: counted as cancelled, and CheckpointdSaveFailed stays quiet.
        assert saves_total(daemon, "saved_model", "cancelled") == cancelled + 1
        assert saves_total(daemon, "saved_model", "failed") == failed

        call, chunks = trainer.save("next", step=2)
        with call:
            assert call.decision().accepted  # not skipped
            assert call.finish(chunks).step == 2
        run_dir = daemon.root / "faults-cancel"
        assert sorted(os.listdir(run_dir)) == ["next"]
        assert verify_dir(run_dir / "next").ok
    finally:
        trainer.close()


def test_a_stalled_upload_times_out_and_frees_the_lane(fresh_daemon) -> None:  # noqa: ANN001
    daemon = fresh_daemon("--upload-timeout", "2")
    trainer = Trainer(daemon, "faults-stall")
    try:
        for sent in (0, 3):  # a client that sends nothing, then one that stops midway
            call, chunks = trainer.save(f"stalled-{sent}", step=sent)
            with call:
                accepted = time.monotonic()
                assert call.decision().accepted
                call.send_chunks(chunks[:sent])
                # While it stalls it holds the lane: a non-blocking save is skipped.
                other, _ = trainer.save("skipped", step=99)
                with other:
                    assert not other.decision().accepted
                with pytest.raises(grpc.RpcError) as caught:
                    call.result()  # never half-closed: waits for the daemon's verdict
                took = time.monotonic() - accepted
            code, details = caught.value.code(), caught.value.details()
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED, details
            assert "upload did not finish within 2s" in details
            assert isinstance(error_for(code, details), DeadlineError)
            assert 1.9 <= took < 10.0
            # Freed at the deadline: the next save is accepted straight away.
            result = trainer.save_whole("next", step=sent + 1)
            assert result.step == sent + 1
        assert saves_total(daemon, "saved_model", "failed") == 2
        assert saves_total(daemon, "saved_model", "skipped") == 2
        run_dir = daemon.root / "faults-stall"
        assert sorted(os.listdir(run_dir)) == ["next"]
        assert verify_dir(run_dir / "next").ok
    finally:
        trainer.close()
