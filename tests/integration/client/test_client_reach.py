"""Reaching the daemon from a live trainer: a daemon stopped and restarted, and addresses that are not its port.

- Training never dies of a checkpoint: with the daemon stopped, a
  non-blocking save of RemotePolicySaver or RemoteCheckpointer returns a
  failed ticket (counted, the outage warned once with the address), a
  blocking save and flush still raise; once the daemon is back on the same
  port, saves succeed again: the saver dials again and registers the run again
  on its own.
- A save that dials a fresh channel during an outage leaves the old one open
  while an upload still uses it: a RemoteCheckpointer's background upload
  ends durable, as a RemotePolicySaver's does (both count their uploads).
- A URL is refused at construction ("HOST:PORT, not a URL"); the daemon's
  metrics port given as the address is named as not its gRPC port; the
  checkpointer's errors name the address as the policy saver's do.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import tensorflow as tf

from checkpointd.protocol import wire
from checkpointd.protocol.kinds import SaveKind
from checkpointd_client import DeadlineError, RemoteCheckpointer, RemotePolicySaver, UnavailableError
from checkpointd_client.ticket import SaveCounts, SaveTicket
from checkpointd_client.transport.session import DaemonSession
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon

WAIT = 60.0  # seconds; every wait here is bounded by it
# The savers' RPC deadline: a call to the stopped daemon ends refused (UnavailableError)
# or, if gRPC's connection attempt stalls, at this deadline (DeadlineError); both are survived.
RPC_DEADLINE = 20.0
DOWN = (UnavailableError, DeadlineError)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("checkpointd_client")
    ]


def test_a_live_policy_saver_survives_a_daemon_stop_and_saves_again_after_its_restart(
    fresh_daemon: Callable[..., Daemon], caplog: pytest.LogCaptureFixture
) -> None:
    first = fresh_daemon()
    step = tf.Variable(1, dtype=tf.int64)
    saver = RemotePolicySaver(policies.build(policies.q()), first.address, run="outage", train_step=step,
                              timeout=RPC_DEADLINE)  # fmt: skip
    try:
        assert saver.save("before").result(WAIT) is not None
        assert saver.save("before-2").result(WAIT) is not None
        assert first.terminate() == 0

        with caplog.at_level(logging.INFO, logger="checkpointd_client"):
            down = [saver.save(f"down-{i}") for i in range(3)]  # no raise: training goes on
            errors = [t.exception(WAIT) for t in down]
            assert all(isinstance(e, DOWN) for e in errors), errors
            assert first.address in str(errors[0])
            warned = _warnings(caplog)
            assert len(warned) == 1, warned  # once per outage
            assert first.address in warned[0] and "tries again" in warned[0]
            assert saver.counts.failed == 3

            with pytest.raises(DOWN, match=first.address):
                saver.save("down-blocking", blocking=True)
            with pytest.raises(DOWN, match=first.address):
                saver.flush(WAIT)

            second = fresh_daemon("--port", str(first.port))  # the same root, the same port
            step.assign(2)
            ticket = saver.save("after", blocking=True)  # dials again, registers again
            assert ticket.result(0) is not None and ticket.result(0).step == 2
            assert "registered run=outage" in second.log()
            assert any("answers again" in r.getMessage() for r in caplog.records)
            assert saver.save("after-2").result(WAIT) is not None  # non-blocking saves are back too
        assert (second.root / "outage" / "after-2" / "saved_model.pb").is_file()
        assert saver.counts.durable == 4
    finally:
        saver.close(WAIT)


def test_a_live_checkpointer_survives_a_daemon_stop_and_saves_again_after_its_restart(
    fresh_daemon: Callable[..., Daemon], caplog: pytest.LogCaptureFixture
) -> None:
    first = fresh_daemon()
    weights = tf.Variable([1.0, 2.0, 3.0])
    checkpointer = RemoteCheckpointer(
        "train", first.address, run="outage-train", timeout=RPC_DEADLINE, weights=weights, global_step=tf.Variable(0)
    )
    try:
        assert checkpointer.save(1).result(WAIT) is not None
        assert first.terminate() == 0
        with caplog.at_level(logging.INFO, logger="checkpointd_client"):
            failed = checkpointer.save(2)  # no raise: the Learner's interval save goes on
            assert isinstance(failed.exception(WAIT), DOWN)
            assert first.address in str(failed.exception(0))
            assert checkpointer.counts.failed == 1 and len(_warnings(caplog)) == 1

            second = fresh_daemon("--port", str(first.port))
            weights.assign([4.0, 5.0, 6.0])
            assert checkpointer.save(3, blocking=True).result(0) is not None
            assert checkpointer.save(4).result(WAIT) is not None
        prefix = tf.train.latest_checkpoint(str(second.root / "outage-train" / "train"))
        assert prefix.endswith("ckpt-4")
        assert tf.train.load_checkpoint(prefix).get_tensor("weights/.ATTRIBUTES/VARIABLE_VALUE").tolist() == [4, 5, 6]
    finally:
        checkpointer.close(WAIT)


def test_a_checkpointers_upload_in_flight_keeps_its_channel_when_a_save_dials_a_fresh_one(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The upload of save 1 is held on the wire until save 2 has dialled a fresh channel.
    go, dialled = threading.Event(), threading.Event()
    chunks = wire.save_request_chunks

    def held(*args: Any, **kwargs: Any) -> Iterator[bytes]:
        assert go.wait(WAIT)
        yield from chunks(*args, **kwargs)

    before_trying = DaemonSession.before_trying

    def trying(self: DaemonSession) -> None:
        before_trying(self)
        dialled.set()

    monkeypatch.setattr(wire, "save_request_chunks", held)
    weights = tf.Variable([1.0, 2.0, 3.0])
    checkpointer = RemoteCheckpointer(
        "train", daemon.address, run="channel-in-use", shared_memory=False, incremental=False,
        timeout=RPC_DEADLINE, weights=weights, global_step=tf.Variable(0),
    )  # fmt: skip
    try:
        first = checkpointer.save(1)  # accepted; its upload runs on the channel of now
        assert not first.skipped and not first.done()
        # An outage begins, as a non-blocking save the daemon could not take begins one:
        # the next save dials a fresh channel (the old one may be in gRPC's backoff).
        session = checkpointer._daemon  # noqa: SLF001 - the session the checkpointer saves through
        lost = SaveTicket("elsewhere", SaveKind.TRAINING_CHECKPOINT, 0, SaveCounts())
        session.survive(lost, UnavailableError("a save the daemon could not take"))
        monkeypatch.setattr(DaemonSession, "before_trying", trying)
        second: list[Any] = []
        saving = threading.Thread(target=lambda: second.append(checkpointer.save(2, blocking=True)))
        saving.start()
        assert dialled.wait(WAIT)
        go.set()
        assert first.result(WAIT).step == 1  # its channel was not closed under it
        saving.join(WAIT)
        assert second and second[0].result(0).step == 2
    finally:
        go.set()
        checkpointer.close(WAIT)


def test_the_checkpointers_errors_name_the_daemons_address() -> None:
    with pytest.raises(UnavailableError, match=r"^registering run 'nowhere\.train' at 127\.0\.0\.1:1: "):
        RemoteCheckpointer("train", "127.0.0.1:1", run="nowhere", timeout=WAIT, step=tf.Variable(0))


def test_a_url_is_refused_at_construction_saying_host_port() -> None:
    policy = policies.build(policies.q())
    with pytest.raises(ValueError, match="HOST:PORT, not a URL") as raised:
        RemotePolicySaver(policy, "http://localhost:33100", run="url")
    assert "'localhost:33100'" in str(raised.value)
    with pytest.raises(ValueError, match="HOST:PORT, not a URL"):
        RemoteCheckpointer("train", "http://localhost:33100", run="url", step=tf.Variable(0))


def test_the_metrics_port_as_the_address_is_named_as_not_the_grpc_port(daemon: Daemon) -> None:
    wrong = f"127.0.0.1:{daemon.metrics_port}"
    saver = RemotePolicySaver(policies.build(policies.q()), wrong, run="wrong-port", timeout=WAIT)
    try:
        with pytest.raises(UnavailableError, match="not checkpointd's gRPC port") as raised:
            saver.register()
        assert f"at {wrong}" in str(raised.value) and "--metrics-port" in str(raised.value)
    finally:
        saver.close(WAIT)
