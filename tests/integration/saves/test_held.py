"""The trainer's busy lock against the real daemon (see checkpointd_client.local_decision).

After a save accepted into shared memory, a non-blocking save decides
"skipped or not" by taking the run's busy lock itself, with no round trip.
These tests check that every ticket's `skipped` is still exact with several
savers on one run, that the daemon counts every skip, and the ways out: a
segment the daemon dropped, a killed process holding the lock, a daemon restart.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import tensorflow as tf

from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client import RemotePolicySaver, SaveTicket
from tests.integration.saves.test_shm import policy, savers  # noqa: F401 - test_shm's fixtures
from tests.integration.support.daemon import Daemon
from tests.integration.support.disk import saved_step
from tests.integration.support.raw import TIMEOUT, RawSave, Stub, counts, saver_header
from tests.integration.support.scrape import Metrics

HAMMER = 30  # non-blocking saves per saver


def _held_saves(daemon: Daemon, run: str) -> int:
    return sum(1 for line in daemon.log().splitlines() if f"saved run={run} " in line and " held=yes " in line)


def _ready(saver: RemotePolicySaver, export_dir: str) -> None:
    """An ordinary save into shared memory: the daemon offers the segment and the lock with it."""
    assert saver.save(export_dir, blocking=True).result(TIMEOUT) is not None


def test_two_savers_hammering_one_run_get_exact_skips(
    fresh_daemon: Callable[..., Daemon],
    savers,  # noqa: F811 - test_shm's fixture
    tmp_path: Path,
) -> None:
    daemon = fresh_daemon("--shm-dir", str(tmp_path))
    a, _ = savers(daemon, "both", step=1)
    b, _ = savers(daemon, "both", step=2)
    _ready(a, "a-ready")
    _ready(b, "b-ready")
    # Nothing in flight: this one takes the lock itself and is written.
    fast = a.save("a-fast")
    assert not fast.skipped and fast.result(TIMEOUT) is not None
    assert _held_saves(daemon, "both") == 1

    tickets: list[tuple[str, SaveTicket]] = []
    lock = threading.Lock()

    def hammer(saver: RemotePolicySaver, prefix: str) -> None:
        for i in range(HAMMER):
            ticket = saver.save(f"{prefix}{i}")
            with lock:
                tickets.append((f"{prefix}{i}", ticket))

    threads = [threading.Thread(target=hammer, args=(s, p)) for s, p in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive()
    a.flush(TIMEOUT)
    b.flush(TIMEOUT)  # also reports the last local skips

    assert len(tickets) == 2 * HAMMER
    skipped = [d for d, t in tickets if t.skipped]
    accepted = [d for d, t in tickets if not t.skipped]
    run_dir = daemon.root / "both"
    for export_dir, ticket in tickets:
        assert ticket.done()
        if ticket.skipped:
            assert "in flight" in ticket.reason and not (run_dir / export_dir).exists()
        else:
            result = ticket.result(0)
            assert result is not None and (run_dir / export_dir).is_dir(), export_dir
            assert saved_step(run_dir / export_dir) == (1 if export_dir.startswith("a") else 2)
    ok, daemon_skipped, failed = counts(daemon, "both")
    assert (ok, failed) == (3 + len(accepted), 0)
    assert daemon_skipped == len(skipped)
    metrics = Metrics(daemon.metrics_url)
    assert metrics("checkpointd_saves_skipped_total", kind="saved_model") == len(skipped)
    assert _held_saves(daemon, "both") >= 1


def test_a_segment_dropped_under_the_cap_falls_back_to_chunks_and_commits(
    fresh_daemon: Callable[..., Daemon],
    savers,  # noqa: F811 - test_shm's fixture
    tmp_path: Path,
) -> None:
    probe = fresh_daemon("--shm-dir", str(tmp_path))  # learns one run's segment size
    learn, _ = savers(probe, "probe")
    _ready(learn, "ready")
    (segment,) = (p for p in next(tmp_path.glob("checkpointd-*")).iterdir() if p.suffix != ".lock")
    size = segment.stat().st_size
    learn.close(timeout=TIMEOUT)
    assert probe.terminate() == 0
    # Room for one segment: each run's save evicts the other's idle one.
    daemon = fresh_daemon("--shm-dir", str(tmp_path), "--max-staging-bytes", str(size * 3 // 2))
    a, _ = savers(daemon, "lru-a", step=0)
    b, _ = savers(daemon, "lru-b")
    _ready(a, "ready")
    _ready(b, "ready")  # a's segment is gone now

    ticket = a.save("after-drop")  # held, into a's old map: the daemon offers no segment
    assert not ticket.skipped
    assert ticket.result(TIMEOUT) is not None and saved_step(daemon.root / "lru-a" / "after-drop") == 0
    assert "export_dir=after-drop" in daemon.log() and "held=yes transport=grpc" in daemon.log()
    # The next save asks again, and is offered the new segment.
    assert a.save("again", blocking=True).result(TIMEOUT) is not None
    assert counts(daemon, "lru-a") == (3, 0, 0)


_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def test_a_killed_process_holding_the_lock_does_not_wedge_the_run(
    fresh_daemon: Callable[..., Daemon],
    savers,  # noqa: F811 - test_shm's fixture
    tmp_path: Path,
) -> None:
    daemon = fresh_daemon("--shm-dir", str(tmp_path))
    saver, step = savers(daemon, "killed")
    _ready(saver, "ready")
    (lock_file,) = tmp_path.glob("checkpointd-*/killed-*.lock")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(lock_file)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        # Held by another process: this saver skips at once, and so does the daemon's own decision.
        local = saver.save("local")
        assert local.skipped and "busy lock" in local.reason
        header, _ = saver_header(saver, step, "wire")
        with daemon.channel() as channel, RawSave(Stub(channel), pb.SaveRequest(header=header)) as call:
            decision = call.decision()
            assert not decision.accepted and "busy lock" in decision.reason
    finally:
        holder.kill()
        holder.wait(TIMEOUT)

    after = saver.save("after")
    assert not after.skipped and after.result(TIMEOUT) is not None
    saver.flush(TIMEOUT)
    assert counts(daemon, "killed") == (2, 2, 0)


def test_after_a_daemon_restart_the_next_save_goes_the_ordinary_way(
    fresh_daemon: Callable[..., Daemon],
    savers,  # noqa: F811 - test_shm's fixture
    tmp_path: Path,
) -> None:
    shm_root = tmp_path / "shm"
    shm_root.mkdir()
    first = fresh_daemon("--shm-dir", str(shm_root))
    saver, _ = savers(first, "restarted")
    _ready(saver, "ready")
    assert saver.save("fast").result(TIMEOUT) is not None and _held_saves(first, "restarted") == 1
    assert first.terminate() == 0  # its shm folder, lock file included, is removed

    second = fresh_daemon("--shm-dir", str(shm_root), "--port", str(first.port))
    ticket = saver.save("after-restart")
    assert not ticket.skipped and ticket.result(TIMEOUT) is not None
    assert "registered run=restarted" in second.log()
    assert _held_saves(second, "restarted") == 0
    # And the fast path comes back with the new daemon's lock.
    assert saver.save("fast-again").result(TIMEOUT) is not None
    assert _held_saves(second, "restarted") == 1


def test_a_held_save_ending_never_lets_go_of_the_next_saves_lock(
    fresh_daemon: Callable[..., Daemon],
    savers,  # noqa: F811 - test_shm's fixture
    tmp_path: Path,
) -> None:
    """Save i's upload thread ends (its write callback, then its cleanup) after save i+1 took the lock.

    The lock is one file description per saver, so save i's cleanup must not
    release it then: save i+1 would reach the daemon holding nothing and fail
    ("nobody holds it"). Each save's write callback waits until the next
    save() has returned, which puts the cleanup exactly in that window.
    """
    daemon = fresh_daemon("--shm-dir", str(tmp_path))
    saver, _ = savers(daemon, "next")
    _ready(saver, "ready")
    rounds = 8
    taken = [threading.Event() for _ in range(rounds + 1)]

    def waiting_for(i: int) -> tf.train.CheckpointOptions:
        def callback(_: str) -> None:
            assert taken[i + 1].wait(TIMEOUT), f"save {i + 1} did not start"

        return tf.train.CheckpointOptions(experimental_write_callbacks=[callback])

    for i in range(rounds):
        # Save i-1 is durable (so not in flight: this one takes the lock), and
        # its thread waits in its callback until this save() has returned.
        ticket = saver.save_checkpoint(f"c{i}", options=waiting_for(i))
        assert not ticket.skipped, ticket.reason
        taken[i].set()  # save i-1's thread goes on now, while save i is in flight
        assert ticket.result(TIMEOUT) is not None, i
    taken[rounds].set()
    saver.flush(TIMEOUT)
    ok, _, failed = counts(daemon, "next")
    assert (ok, failed) == (1 + rounds, 0)
    assert _held_saves(daemon, "next") == rounds
