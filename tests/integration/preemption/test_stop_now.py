"""A second signal during the drain: the callers of the abandoned saves are told, before the daemon exits.

The first SIGTERM drains; a second one stops at once and abandons the saves
still in flight. Their callers must get UNAVAILABLE saying the daemon was
stopped at once and the save is not to be counted on, not a dropped
connection ("Socket closed"). Saves are held in flight by raw Save streams
that have their accept and half their snapshot, and send nothing more.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tensorflow as tf
from grpc_health.v1 import health_pb2, health_pb2_grpc

from checkpointd_client import CheckpointdError, RemotePolicySaver
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon, start_daemon
from tests.integration.support.raw import HeldSave

TIMEOUT = 60.0
SERVICE = "checkpointd.v1.CheckpointService"


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(tmp_path / "root", tmp_path / "work", "--no-shm")
    try:
        yield d
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


@pytest.fixture
def closers() -> Iterator[list[object]]:
    made: list[object] = []
    yield made
    for c in made:
        with contextlib.suppress(CheckpointdError):
            c.close()  # type: ignore[attr-defined]


def _held(daemon: Daemon, closers: list[object], run: str) -> HeldSave:
    step = tf.Variable(3, dtype=tf.int64)
    remote = RemotePolicySaver(policies.build(policies.q()), daemon.address, run=run, train_step=step, timeout=TIMEOUT)
    closers.append(remote)
    held = HeldSave(daemon, remote, step, "abandoned", chunk_bytes=1 << 10)
    closers.append(held)
    chunks = held.chunks()
    held.send_chunks(chunks[: len(chunks) // 2])
    return held


def _draining(daemon: Daemon) -> None:
    with grpc.insecure_channel(daemon.address) as channel:
        for reply in health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=TIMEOUT
        ):
            if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                return


def test_the_callers_of_saves_abandoned_by_a_second_sigterm_get_unavailable_saying_so(
    daemon: Daemon, closers: list[object]
) -> None:
    held = [_held(daemon, closers, run) for run in ("first", "second")]
    daemon.proc.send_signal(signal.SIGTERM)
    _draining(daemon)
    assert daemon.proc.poll() is None  # the held saves keep the drain waiting
    daemon.proc.send_signal(signal.SIGTERM)

    for call in held:
        with pytest.raises(grpc.RpcError) as caught:
            while True:
                call.next()
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
        details = caught.value.details() or ""
        assert details.startswith(
            "the daemon was stopped at once (SIGTERM again during its drain) before this save was reported "
            "durable; treat it as not saved: save again on another daemon or after the daemon restarts"
        ), details
    assert daemon.proc.wait(TIMEOUT) == 1  # saves were abandoned
    log = daemon.log()
    assert "abandoning 2 unfinished saves" in log
    assert "SIGTERM again: told 2 open calls the daemon stopped at once (UNAVAILABLE)" in log
    assert "Traceback" not in log
    assert not (daemon.root / "first" / "abandoned").exists()  # abandoned, not torn


def test_a_second_sigint_with_no_save_in_flight_tells_nobody_and_exits_zero(daemon: Daemon) -> None:
    daemon.proc.send_signal(signal.SIGINT)
    daemon.proc.send_signal(signal.SIGINT)
    assert daemon.proc.wait(TIMEOUT) == 0
    assert "told" not in daemon.log()
