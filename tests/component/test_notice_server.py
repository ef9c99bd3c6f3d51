"""A Server on notice, through real gRPC with the fake store: the window, the refusals, status and the gauge.

`Server.stop()` runs on a thread (as `checkpointd serve` runs it on SIGTERM);
the health Watch tells the test when the notice was given.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from checkpointd.v1 import checkpointd_pb2 as pb
from tests.component.conftest import Served, serving, snapshot
from tests.component.fakes import LIMIT
from tests.component.raw import RawSave, register, register_requests, save_header, snapshot_chunks

RUN = "held"
WINDOW = 1.0  # a window the test waits out


class Stopping:
    """`server.stop()` on a thread; `result()` waits for its answer with a deadline."""

    def __init__(self, up: Served) -> None:
        self._done: list[bool] = []
        self.started = time.monotonic()
        self.thread = threading.Thread(target=lambda: self._done.append(up.stop()), name="stop")
        watch = health_pb2_grpc.HealthStub(up.channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=LIMIT)  # type: ignore[attr-defined]  # not in the stubs
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        self.thread.start()
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING  # on notice
        watch.cancel()

    def result(self) -> tuple[bool, float]:
        self.thread.join(LIMIT)
        assert not self.thread.is_alive(), "stop() did not return"
        return self._done[0], time.monotonic() - self.started


def _served(tmp_path: Path, window: float) -> Iterator[Served]:
    yield from serving(tmp_path, notice_window_seconds=window)


@pytest.fixture
def long_window(tmp_path: Path) -> Iterator[Served]:
    """A window longer than any test here waits: it ends early or the test fails."""
    yield from _served(tmp_path, 3 * LIMIT)


@pytest.fixture
def short_window(tmp_path: Path) -> Iterator[Served]:
    yield from _served(tmp_path, WINDOW)


def raw(up: Served, header: pb.SaveHeader) -> RawSave:
    call = RawSave(up.stub, header, LIMIT)
    up.closers.append(call.close)
    return call


def wait_for_status(up: Served, done: Callable[[pb.StatusResponse], bool]) -> pb.StatusResponse:
    """The daemon's status once `done` holds of it; polled with a deadline (the state has no event to wait on)."""
    deadline = time.monotonic() + LIMIT
    while not done(reply := up.stub.GetStatus(pb.StatusRequest(), timeout=LIMIT)):
        assert time.monotonic() < deadline, f"status never got there: {reply}"
        threading.Event().wait(0.01)
    return reply


def refused_registration(up: Served, run: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        up.stub.RegisterRun(register_requests(run), timeout=LIMIT)
    return caught.value


def test_on_notice_a_held_runs_final_save_commits_a_new_run_is_refused_and_the_window_ends_with_it(
    long_window: Served,
) -> None:
    up = long_window
    register(up.stub, RUN)
    assert up.server.registry.get_sample_value("checkpointd_draining") == 0
    stopping = Stopping(up)

    reply = up.stub.GetStatus(pb.StatusRequest(), timeout=LIMIT)
    assert reply.draining and 0 < reply.notice_seconds_left <= 3 * LIMIT
    assert up.server.registry.get_sample_value("checkpointd_draining") == 1
    error = refused_registration(up, "newcomer")
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    details = error.details() or ""
    assert f"port {up.server.port}" in details and "pid" in details and "takes no new runs" in details, details
    assert "newcomer" not in {r.run for r in up.stub.GetStatus(pb.StatusRequest(), timeout=LIMIT).runs}
    register(up.stub, RUN)  # its trainer registering again: still its daemon

    final = raw(up, save_header(RUN, "final", step=9, blocking=True, on_notice=True))
    assert final.decision().accepted
    assert final.finish(snapshot_chunks(snapshot(9))).step == 9
    clean, took = stopping.result()
    assert clean and took < LIMIT  # the run's final save was in: no waiting out the window
    assert [(s.export_dir, s.step) for s in up.store.saves()] == [("final", 9)]


def test_after_the_window_every_save_is_refused_and_the_accepted_ones_still_finish(short_window: Served) -> None:
    up = short_window
    register(up.stub, RUN)
    in_flight = raw(up, save_header(RUN, "accepted-before", step=1))
    assert in_flight.decision().accepted  # then silent: it holds the drain
    stopping = Stopping(up)

    during = raw(up, save_header(RUN, "during", step=2, blocking=True))  # queued behind the one in flight
    (row,) = wait_for_status(up, lambda r: r.runs[0].in_flight.waiting == 1).runs
    assert row.in_flight.export_dir == "accepted-before"
    wait_for_status(up, lambda r: r.notice_seconds_left == 0)  # the window is over
    late = raw(up, save_header(RUN, "after", step=3, blocking=True))
    assert late.refused().code() is grpc.StatusCode.UNAVAILABLE
    assert up.stub.GetStatus(pb.StatusRequest(), timeout=LIMIT).draining
    assert refused_registration(up, RUN).code() is grpc.StatusCode.UNAVAILABLE  # not even a held run now

    assert in_flight.finish(snapshot_chunks(snapshot(1))).step == 1
    assert during.decision().accepted  # taken in the window, so drained
    assert during.finish(snapshot_chunks(snapshot(2))).step == 2
    clean, took = stopping.result()
    assert clean and took >= WINDOW
    assert sorted(s.export_dir for s in up.store.saves()) == ["accepted-before", "during"]
