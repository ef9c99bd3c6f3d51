"""The shared-memory transport against the real daemon.

A trainer on the daemon's host copies an accepted snapshot into the run's
segment instead of streaming it; these tests check the bytes, the fallbacks
(a daemon with --no-shm, a segment the trainer cannot open), a client that
claims shared memory it was not offered, and the segment folder's life.
"""

from __future__ import annotations

import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import tensorflow as tf

from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client import RemotePolicySaver
from checkpointd_client.transport import shm as client_shm
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon
from tests.integration.support.raw import TIMEOUT, RawSave, Stub, counts, export_template, register
from tests.integration.support.scrape import Metrics


@pytest.fixture(scope="module")
def policy() -> object:
    return policies.build(policies.q())


@pytest.fixture
def savers(policy: object) -> Iterator[Callable[..., tuple[RemotePolicySaver, tf.Variable]]]:
    made: list[RemotePolicySaver] = []

    def make(daemon: Daemon, run: str, step: int = 3, **kwargs: object) -> tuple[RemotePolicySaver, tf.Variable]:
        train_step = tf.Variable(step, dtype=tf.int64)
        saver = RemotePolicySaver(policy, daemon.address, run=run, train_step=train_step, timeout=TIMEOUT, **kwargs)
        made.append(saver)
        return saver, train_step

    yield make
    for saver in made:
        try:
            saver.close(timeout=TIMEOUT)
        except Exception:  # noqa: BLE001 - a daemon the test stopped; the test has judged it
            pass


def _received(daemon: Daemon, transport: str) -> float:
    return Metrics(daemon.metrics_url)("checkpointd_snapshots_received_total", kind="saved_model", transport=transport)


def _folders(shm_root: Path) -> list[Path]:
    return sorted(shm_root.glob("checkpointd-*"))


def _segments(folder: Path) -> list[Path]:
    """The segments in a daemon's folder (not the runs' busy lock files)."""
    return sorted(p for p in folder.iterdir() if p.suffix != ".lock")


def _data_files(export_dir: Path) -> bytes:
    return (export_dir / "variables" / "variables.data-00000-of-00001").read_bytes()


def test_same_host_saves_go_through_a_private_segment_and_match_the_wire(
    fresh_daemon: Callable[..., Daemon], savers, tmp_path: Path
) -> None:
    shm_root = tmp_path / "shm"
    shm_root.mkdir()
    daemon = fresh_daemon("--shm-dir", str(shm_root))
    shared, _ = savers(daemon, "shared")
    wire, _ = savers(daemon, "wire", shared_memory=False)

    for i in range(3):  # the segment is made once, then reused
        assert shared.save(f"s{i}", blocking=True).result(TIMEOUT).path.endswith(f"s{i}")
    assert wire.save("w", blocking=True).result(TIMEOUT) is not None

    assert (_received(daemon, "shm"), _received(daemon, "grpc")) == (3, 1)
    (folder,) = _folders(shm_root)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    (segment,) = _segments(folder)  # one run used shared memory: one segment
    assert stat.S_IMODE(segment.stat().st_mode) == 0o600
    # The same values, by either transport, make the same checkpoint bytes.
    assert _data_files(daemon.root / "shared" / "s2") == _data_files(daemon.root / "wire" / "w")

    shared.close(timeout=TIMEOUT)
    wire.close(timeout=TIMEOUT)
    daemon.terminate()
    assert _folders(shm_root) == []  # a daemon that stops frees its segments


def test_a_saver_uses_shared_memory_for_the_values_at_the_call(
    fresh_daemon: Callable[..., Daemon], savers, policy: object, tmp_path: Path
) -> None:
    daemon = fresh_daemon("--shm-dir", str(tmp_path))
    saver, step = savers(daemon, "at-call")
    saver.save("warm", blocking=True).result(TIMEOUT)
    policies.perturb(policy, seed=5)
    step.assign(11)
    expected = policies.values(policy)

    ticket = saver.save("point")
    policies.perturb(policy, seed=6)  # after the call: not in the save
    step.assign(12)
    ticket.result(TIMEOUT)

    loaded = tf.saved_model.load(str(daemon.root / "at-call" / "point"))
    got = [v.numpy() for v in loaded.model_variables]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(got, expected, strict=True))
    assert loaded.get_train_step().numpy() == 11
    assert _received(daemon, "shm") == 2


def test_a_daemon_with_no_shm_offers_none(fresh_daemon: Callable[..., Daemon], savers, tmp_path: Path) -> None:
    daemon = fresh_daemon("--no-shm", "--shm-dir", str(tmp_path))  # --no-shm wins
    saver, _ = savers(daemon, "no-shm")

    assert saver.save("s", blocking=True).result(TIMEOUT) is not None

    assert (_received(daemon, "shm"), _received(daemon, "grpc")) == (0, 1)
    assert _folders(tmp_path) == []
    assert "shared memory off" in daemon.log()


def test_a_segment_the_trainer_cannot_open_falls_back_to_grpc(
    fresh_daemon: Callable[..., Daemon], savers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = fresh_daemon("--shm-dir", str(tmp_path))
    saver, _ = savers(daemon, "elsewhere")

    def another_host(self: client_shm.SegmentMap, offer: pb.SharedMemory) -> None:
        raise FileNotFoundError(2, "No such file or directory", offer.path)

    # As a trainer on another host, or in another container, finds the path.
    monkeypatch.setattr(client_shm.SegmentMap, "__init__", another_host)
    for i in range(2):
        assert saver.save(f"s{i}", blocking=True).result(TIMEOUT).path.endswith(f"s{i}")

    assert (_received(daemon, "shm"), _received(daemon, "grpc")) == (0, 2)
    # After the first failure the saver stops asking: the daemon made one segment, for the first.
    assert len(_segments(_folders(tmp_path)[0])) == 1


def test_claiming_shared_memory_that_was_not_offered_is_refused(daemon: Daemon, tmp_path: Path) -> None:
    template = export_template(policies.build(policies.q()), tmp_path / "template")
    with daemon.channel() as channel:
        stub = Stub(channel)
        run = register(stub, "claims", template)
        # The header does not ask for shared memory, so the accept offers none.
        with RawSave(stub, pb.SaveRequest(header=run.header("claimed"))) as call:
            decision = call.decision()
            assert decision.accepted and not decision.HasField("shared_memory")
            call.send(pb.SaveRequest(shared_memory_written=pb.SharedMemoryWritten()))
            call.half_close()
            assert call.refused() == grpc.StatusCode.INVALID_ARGUMENT
        assert not (daemon.root / "claims" / "claimed").exists()
        assert counts(stub, "claims") == (0, 0, 1)
        # The run is free again, and a proper save of it lands.
        with RawSave(stub, pb.SaveRequest(header=run.header("proper"))) as call:
            assert call.decision().accepted
            assert call.finish(run.chunks()).path.endswith("proper")
    assert "offered no shared memory" in daemon.log()


def test_a_killed_daemons_segments_are_removed_by_the_next_daemon(
    fresh_daemon: Callable[..., Daemon], policy: object, tmp_path: Path
) -> None:
    first = fresh_daemon("--shm-dir", str(tmp_path))
    saver = RemotePolicySaver(policy, first.address, run="killed", timeout=TIMEOUT)
    saver.save("s", blocking=True).result(TIMEOUT)
    (left,) = _folders(tmp_path)
    assert len(_segments(left)) == 1
    first.proc.kill()  # no drain, no cleanup
    first.proc.wait(TIMEOUT)
    assert left.exists()

    second = fresh_daemon("--shm-dir", str(tmp_path))

    assert not left.exists()
    (now,) = _folders(tmp_path)
    assert now.name.startswith(f"checkpointd-{second.proc.pid}-")
