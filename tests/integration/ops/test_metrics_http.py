"""The daemon's /metrics over HTTP, after a known sequence of saves: exact values.

One module fixture drives the sequence on the module's own daemon, which
nothing else saves to (it checks every series is 0 first): saves of both
kinds, skips forced by holding the run's lane with a raw Save stream (header
sent, accept received, no chunks yet), and a failure forced by saving into an
export dir that is an existing regular file. It scrapes /metrics over HTTP
while the lane is held, after it is released and at the end; the tests then
check one metric each, parsed with prometheus_client's own parser.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import tensorflow as tf

from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client import CheckpointdError, RemotePolicySaver, SaveFailedError, SaveResult
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon
from tests.integration.support.raw import HeldSave, run_status
from tests.integration.support.scrape import Metrics

RPC_TIMEOUT = 30.0
RUN = "metrics"
KINDS = ("saved_model", "checkpoint")


@dataclass
class Sequence:
    """What the known sequence did and what /metrics said along the way."""

    daemon: Daemon
    before: Metrics  # before any save
    during: Metrics  # while a raw stream held the lane
    released: Metrics  # right after that save was durable
    end: Metrics  # after the whole sequence
    written: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    started: float = 0.0  # wall time before the first save
    last_started: float = 0.0  # wall time before the last successful save
    finished: float = 0.0  # wall time after it was durable
    status: pb.RunStatus | None = None


@pytest.fixture(scope="module")
def sequence(daemon: Daemon) -> Iterator[Sequence]:
    """Runs, in order: 2 ok saves, a held save with 3 skips, 1 failure, 1 ok save.

    Expected: saved_model ok 2, skipped 1, failed 1; checkpoint ok 2, skipped 2.
    """
    train_step = tf.Variable(0, dtype=tf.int64)
    saver = RemotePolicySaver(
        policies.build(policies.q()),
        daemon.address,
        run=RUN,
        train_step=train_step,
        timeout=RPC_TIMEOUT,
    )
    lane: HeldSave | None = None
    try:
        saver.register()
        before = Metrics(daemon.metrics_url)
        seq = Sequence(daemon, before, before, before, before)

        def count(result: SaveResult) -> None:
            assert result.bytes_written > 0
            seq.written[result.kind.value] += result.bytes_written

        seq.started = time.time()
        train_step.assign(1)
        count(saver.save("sm-1", blocking=True).result())
        train_step.assign(2)
        count(saver.save_checkpoint("ck-1", blocking=True).result())

        train_step.assign(3)
        lane = HeldSave(daemon, saver, train_step, "ck-held", kind=pb.CHECKPOINT, chunk_bytes=1 << 20)
        seq.during = Metrics(daemon.metrics_url)
        skips = [
            saver.save("sm-skipped"),
            saver.save_checkpoint("ck-skipped-1"),
            saver.save_checkpoint("ck-skipped-2"),
        ]
        assert [t.skipped for t in skips] == [True, True, True]
        raw = lane.release()
        assert raw.kind == pb.CHECKPOINT and raw.bytes_written > 0
        seq.written["checkpoint"] += raw.bytes_written
        seq.released = Metrics(daemon.metrics_url)

        (daemon.root / RUN / "blocker").write_text("a regular file where the export dir would go")
        with pytest.raises(SaveFailedError):
            saver.save("blocker", blocking=True)

        train_step.assign(4)
        seq.last_started = time.time()
        ticket = saver.save("sm-2")  # non-blocking: accepted, then durable in the background
        assert not ticket.skipped
        count(ticket.result(timeout=RPC_TIMEOUT))
        seq.finished = time.time()
        seq.end = Metrics(daemon.metrics_url)
        seq.status = run_status(daemon, RUN)
        yield seq
    finally:
        if lane is not None:
            lane.close()
        with contextlib.suppress(CheckpointdError):
            saver.close()


EXPECTED = {
    ("saved_model", "ok"): 2, ("saved_model", "skipped"): 1, ("saved_model", "failed"): 1,
    ("checkpoint", "ok"): 2, ("checkpoint", "skipped"): 2, ("checkpoint", "failed"): 0,
}  # fmt: skip


def test_every_series_exists_at_zero_before_any_save(sequence: Sequence) -> None:
    m = sequence.before
    assert {(k, o): m("checkpointd_saves_total", kind=k, outcome=o) for k, o in EXPECTED} == dict.fromkeys(EXPECTED, 0)
    for kind in KINDS:
        assert m("checkpointd_saves_skipped_total", kind=kind) == 0
        assert m("checkpointd_save_duration_seconds_count", kind=kind) == 0
        assert m("checkpointd_written_bytes_total", kind=kind) == 0
    assert m("checkpointd_saves_in_flight") == 0


def test_saves_total_counts_each_kind_and_outcome(sequence: Sequence) -> None:
    m = sequence.end
    assert m.types["checkpointd_saves"] == "counter"
    assert {(k, o): m("checkpointd_saves_total", kind=k, outcome=o) for k, o in EXPECTED} == EXPECTED


def test_skipped_total_counts_the_forced_skips(sequence: Sequence) -> None:
    m = sequence.end
    assert m("checkpointd_saves_skipped_total", kind="saved_model") == 1
    assert m("checkpointd_saves_skipped_total", kind="checkpoint") == 2


def test_in_flight_is_one_while_a_stream_holds_the_lane_and_zero_after(sequence: Sequence) -> None:
    assert sequence.during("checkpointd_saves_in_flight") == 1
    assert sequence.released("checkpointd_saves_in_flight") == 0
    assert sequence.end("checkpointd_saves_in_flight") == 0


def test_duration_histogram_counts_ok_and_failed_saves_by_kind(sequence: Sequence) -> None:
    m = sequence.end
    assert m.types["checkpointd_save_duration_seconds"] == "histogram"
    for kind in KINDS:
        count = m("checkpointd_save_duration_seconds_count", kind=kind)
        assert count == EXPECTED[(kind, "ok")] + EXPECTED[(kind, "failed")]
        assert m("checkpointd_save_duration_seconds_bucket", kind=kind, le="+Inf") == count
        assert 0 < m("checkpointd_save_duration_seconds_sum", kind=kind) < sequence.finished - sequence.started


def test_written_bytes_is_the_sum_of_save_results(sequence: Sequence) -> None:
    m = sequence.end
    assert m.types["checkpointd_written_bytes"] == "counter"
    for kind in KINDS:
        assert m("checkpointd_written_bytes_total", kind=kind) == sequence.written[kind]


def test_last_success_is_the_time_of_the_last_durable_save(sequence: Sequence) -> None:
    last = sequence.end("checkpointd_last_success_timestamp_seconds", run=RUN)
    assert sequence.last_started <= last <= sequence.finished


def test_status_tells_the_same_story(sequence: Sequence) -> None:
    status = sequence.status
    assert (status.saves_ok, status.saves_skipped, status.saves_failed) == (4, 3, 1)
    assert status.last_success.unix_seconds == sequence.end("checkpointd_last_success_timestamp_seconds", run=RUN)
    assert status.last_success.step == 4
    assert "blocker" in status.last_error


def test_runs_gauge_counts_registered_runs(sequence: Sequence) -> None:
    assert sequence.end("checkpointd_runs") == 1
