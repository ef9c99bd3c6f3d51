"""The real servicer through real gRPC on 127.0.0.1, with a FakeStore and a FakeFormat.

Each test starts a `Server` on port 0 (`served`); a save is held in flight
either by a RawSave that sends its header and then nothing (accepted,
receiving) or by the fake store's commit gate (everything sent).
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable

import crc32c
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from checkpointd.core.variable_manifest import VariableSpec
from checkpointd.v1 import checkpointd_pb2 as pb
from tests.component.conftest import SNAPSHOT_BYTES, VARIABLES, Served, snapshot
from tests.component.fakes import LIMIT, SNAPSHOT_FILE, FakeStore
from tests.component.raw import (
    TEMPLATE,
    RawSave,
    register,
    register_requests,
    save_header,
    save_requests,
    snapshot_chunks,
    variables_pb,
)

RUN = "run1"


@pytest.fixture
def up(served: Served) -> Served:
    """A server with RUN registered."""
    register(served.stub, RUN)
    return served


def raw(served: Served, header: pb.SaveHeader, timeout: float = LIMIT) -> RawSave:
    call = RawSave(served.stub, header, timeout)
    served.closers.append(call.close)
    return call


def held(served: Served, export_dir: str = "held", step: int = 1) -> RawSave:
    """A save accepted and then silent: its run's lane stays busy until it is finished."""
    call = raw(served, save_header(RUN, export_dir, step))
    decision = call.decision()
    assert decision.accepted, decision.reason
    return call


def save(served: Served, export_dir: str, step: int = 1, **fields: object) -> pb.SaveResult:
    """A whole save; returns its result."""
    call = raw(served, save_header(RUN, export_dir, step, **fields))
    assert call.decision().accepted
    return call.finish(snapshot_chunks(snapshot(step)))


def status(served: Served, run: str = RUN) -> pb.RunStatus:
    (row,) = served.stub.GetStatus(pb.StatusRequest(run=run), timeout=LIMIT).runs
    return row


def counts(served: Served, run: str = RUN) -> tuple[int, int, int]:
    row = status(served, run)
    return row.saves_ok, row.saves_skipped, row.saves_failed


def code(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code()


def eventually(predicate: Callable[[], bool]) -> bool:
    """True once `predicate` holds; False if it still does not after LIMIT seconds.

    For daemon state the test can only read (a blocking save queued behind
    another); a passing test returns within a few checks.
    """
    deadline = time.monotonic() + LIMIT
    pause = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            return False
        pause.wait(0.005)
    return True


def restored(served: Served, **fields: object) -> tuple[pb.RestoreHeader, bytes]:
    """A Restore's header and payload, every chunk's offset and CRC32C checked."""
    responses = served.stub.Restore(pb.RestoreRequest(run=RUN, **fields), timeout=LIMIT)  # type: ignore[arg-type]
    first = next(responses)
    assert first.WhichOneof("item") == "header"
    payload = b""
    for response in responses:
        c = response.chunk
        assert c.offset == len(payload) and crc32c.crc32c(c.data) == c.crc32c
        payload += c.data
    return first.header, payload


# RegisterRun.


def test_register_run_receives_the_template_chunk_by_chunk(served: Served) -> None:
    reply = register(served.stub, RUN, folder="shared")

    assert (reply.run, reply.folder, reply.snapshot_bytes) == (RUN, "shared", SNAPSHOT_BYTES)
    assert list(reply.variables) == variables_pb()
    (registration,) = served.fmt.registered
    assert registration.files == TEMPLATE  # reassembled from 16-byte chunks, the empty file too
    assert registration.manifest.variables == VARIABLES
    assert registration.checkpoint_object_graph == b"object graph"
    staging = served.server.config.state_dir / "staging"
    assert not staging.exists() or list(staging.iterdir()) == []
    assert status(served).state == "open"


def test_a_template_the_format_refuses_registers_nothing(served: Served) -> None:
    assert code(lambda: register(served.stub, RUN, {"other.pb": b"x"})) is grpc.StatusCode.INVALID_ARGUMENT
    assert code(lambda: status(served)) is grpc.StatusCode.NOT_FOUND
    assert served.fmt.registered == []


def test_a_template_chunk_with_a_bad_crc_is_data_loss(served: Served) -> None:
    requests = list(register_requests(RUN))
    requests[1].chunk.crc32c ^= 1

    assert code(lambda: served.stub.RegisterRun(iter(requests), timeout=LIMIT)) is grpc.StatusCode.DATA_LOSS
    assert served.fmt.registered == []


def test_a_template_shorter_than_announced_is_invalid(served: Served) -> None:
    requests = list(register_requests(RUN))[:-1]

    assert code(lambda: served.stub.RegisterRun(iter(requests), timeout=LIMIT)) is grpc.StatusCode.INVALID_ARGUMENT


# Save.


def test_a_save_is_accepted_and_answers_its_result(up: Served) -> None:
    result = save(up, "first", step=5)

    assert result.path == str(FakeStore.ROOT / RUN / "first")
    assert (result.step, result.kind) == (5, pb.SAVED_MODEL)
    assert result.bytes_written == SNAPSHOT_BYTES + sum(len(c) for c in TEMPLATE.values())
    (committed,) = up.store.saves()
    assert up.store.files(committed.path)[SNAPSHOT_FILE] == snapshot(5)
    row = status(up)
    assert (row.saves_ok, row.saves_skipped, row.saves_failed) == (1, 0, 0)
    assert row.last_success.path == result.path and row.last_success.step == 5
    assert not row.HasField("in_flight")


def test_a_save_while_one_is_held_is_skipped_and_the_held_one_completes(up: Served) -> None:
    first = held(up, "held", step=1)

    second = raw(up, save_header(RUN, "second", step=2))
    decision = second.decision()
    assert not decision.accepted and "'held'" in decision.reason
    assert second.ended()  # the daemon ends a skipped call OK, with nothing more
    row = status(up)
    assert row.saves_skipped == 1 and row.in_flight.export_dir == "held"

    result = first.finish(snapshot_chunks(snapshot(1)))
    assert result.step == 1
    assert counts(up) == (1, 1, 0)
    assert [s.export_dir for s in up.store.saves()] == ["held"]


def test_a_blocking_save_whose_client_goes_away_leaves_the_queue(up: Served) -> None:
    first = held(up, "held", step=1)
    # Its deadline outlasts the checks below: only the cancel can end its wait.
    waiter = raw(up, save_header(RUN, "waiting", step=2, blocking=True), timeout=3 * LIMIT)
    assert eventually(lambda: status(up).in_flight.waiting == 1)

    waiter.close()  # cancels: the servicer's callback wakes the wait, which gives up

    assert eventually(lambda: status(up).in_flight.waiting == 0)
    first.finish(snapshot_chunks(snapshot(1)))
    assert counts(up) == (1, 0, 0)
    assert [m.export_dir for m in up.store.commits] == ["held"]


def test_a_bad_crc_after_the_accept_is_data_loss_and_counts_as_failed(up: Served) -> None:
    call = raw(up, save_header(RUN, "corrupt"))
    assert call.decision().accepted
    chunks = snapshot_chunks(snapshot(1))
    chunks[1].crc32c ^= 1
    call.send_chunks(chunks)
    call.half_close()

    assert call.refused().code() is grpc.StatusCode.DATA_LOSS
    row = status(up)
    assert (row.saves_ok, row.saves_failed) == (0, 1) and "CRC32C" in row.last_error
    assert up.store.saves() == [] and up.store.live_staging() == []  # its open files discarded
    assert save(up, "after", step=2).step == 2  # the lane lives on


def test_a_failed_write_is_internal_with_the_os_reason(up: Served) -> None:
    up.fmt.fail_next_write(OSError(errno.EIO, "Input/output error"))

    call = raw(up, save_header(RUN, "broken"))
    assert call.decision().accepted
    call.send_chunks(snapshot_chunks(snapshot(1)))
    call.half_close()
    error = call.refused()

    assert error.code() is grpc.StatusCode.INTERNAL and "Input/output error" in (error.details() or "")
    assert counts(up) == (0, 0, 1)
    assert up.store.saves() == [] and up.store.live_staging() == []


def test_a_held_save_fails_internal_when_its_run_registers_other_variables(up: Served) -> None:
    call = held(up)
    renamed = tuple(
        VariableSpec("new_" + v.key, "new/" + v.checkpoint_key, v.dtype, v.shape) for v in VARIABLES
    )  # same sizes: only the manifest tells the layouts apart
    register(up.stub, RUN, variables=renamed)

    call.send_chunks(snapshot_chunks(snapshot(1)))
    call.half_close()
    error = call.refused()

    assert error.code() is grpc.StatusCode.INTERNAL and "registered again" in (error.details() or "")
    assert counts(up) == (0, 0, 1) and up.store.saves() == []


def test_bad_headers_are_refused_before_a_decision(up: Served) -> None:
    cases = {
        "unregistered": (save_header("nobody", "x"), grpc.StatusCode.NOT_FOUND),
        "escaping export_dir": (save_header(RUN, "../x"), grpc.StatusCode.INVALID_ARGUMENT),
        "wrong size": (save_header(RUN, "x", snapshot_bytes=1), grpc.StatusCode.INVALID_ARGUMENT),
        "kind unset": (save_header(RUN, "x", kind=pb.SAVE_KIND_UNSPECIFIED), grpc.StatusCode.INVALID_ARGUMENT),
    }
    for name, (header, expected) in cases.items():
        call = raw(up, header)
        assert call.refused().code() is expected, name

    assert counts(up) == (0, 0, 0)
    assert up.store.staged == []


def test_numpy_state_travels_after_the_variables_and_comes_back(up: Served) -> None:
    state = pb.NumpyState(
        object_graph=b"numpy graph",
        entries=[
            pb.NumpyStateEntry(checkpoint_key="numpy_arrays/a", nbytes=5),
            pb.NumpyStateEntry(checkpoint_key="numpy_arrays/b", nbytes=20),
        ],
    )
    extra = bytes(range(100, 125))
    call = raw(up, save_header(RUN, "with-numpy", 3, numpy_state=state, snapshot_bytes=SNAPSHOT_BYTES + 25))
    assert call.decision().accepted
    call.finish(snapshot_chunks(snapshot(3), extra))  # chunks straddle the variables and the state

    (write,) = up.fmt.writes
    assert (write.snapshot, write.numpy_state) == (snapshot(3), extra)
    header, payload = restored(up)
    assert header.numpy_state == state
    assert header.snapshot_bytes == SNAPSHOT_BYTES + 25
    assert payload == snapshot(3) + extra


# Flush, CloseRun, GetStatus, GetLatest, Restore.


def test_flush_times_out_while_a_save_is_held_and_returns_once_it_is_done(up: Served) -> None:
    call = held(up)

    flush = pb.FlushRequest(run=RUN, timeout_seconds=0.05)
    assert code(lambda: up.stub.Flush(flush, timeout=LIMIT)) is grpc.StatusCode.DEADLINE_EXCEEDED
    call.finish(snapshot_chunks(snapshot(1)))

    assert list(up.stub.Flush(pb.FlushRequest(run=RUN), timeout=LIMIT).runs) == [RUN]
    register(up.stub, "run2")
    assert list(up.stub.Flush(pb.FlushRequest(), timeout=LIMIT).runs) == [RUN, "run2"]


def test_close_run_refuses_later_saves_until_the_run_registers_again(up: Served) -> None:
    assert up.stub.CloseRun(pb.CloseRunRequest(run=RUN), timeout=LIMIT).run == RUN
    assert status(up).state == "closed"

    refused = raw(up, save_header(RUN, "late"))
    assert refused.refused().code() is grpc.StatusCode.FAILED_PRECONDITION
    register(up.stub, RUN)
    assert status(up).state == "open"
    assert save(up, "reopened").path.endswith("/reopened")


def test_close_run_waits_for_the_held_save(up: Served) -> None:
    call = held(up)
    closing = pb.CloseRunRequest(run=RUN, timeout_seconds=0.05)
    assert code(lambda: up.stub.CloseRun(closing, timeout=LIMIT)) is grpc.StatusCode.DEADLINE_EXCEEDED
    assert status(up).state == "closing"

    call.finish(snapshot_chunks(snapshot(1)))
    up.stub.CloseRun(pb.CloseRunRequest(run=RUN), timeout=LIMIT)
    assert status(up).state == "closed"
    assert counts(up) == (1, 0, 0)


def test_get_latest_and_restore_read_back_what_was_committed(up: Served) -> None:
    save(up, "model", step=1)
    save(up, "ckpt", step=2, kind=pb.CHECKPOINT)

    latest = up.stub.GetLatest(pb.LatestRequest(run=RUN), timeout=LIMIT)
    assert latest.found and (latest.export_dir, latest.step, latest.kind) == ("ckpt", 2, pb.CHECKPOINT)
    model = up.stub.GetLatest(pb.LatestRequest(run=RUN, kind=pb.SAVED_MODEL), timeout=LIMIT)
    assert (model.export_dir, model.step) == ("model", 1)

    header, payload = restored(up)
    assert (header.export_dir, header.step, header.kind) == ("ckpt", 2, pb.CHECKPOINT)
    assert list(header.variables) == variables_pb() and payload == snapshot(2)
    header, payload = restored(up, export_dir="model")
    assert header.step == 1 and payload == snapshot(1)
    assert code(lambda: restored(up, export_dir="missing")) is grpc.StatusCode.NOT_FOUND


def test_an_unknown_run_is_not_found_everywhere_but_get_latest(served: Served) -> None:
    stub = served.stub
    assert code(lambda: stub.GetStatus(pb.StatusRequest(run="nobody"), timeout=LIMIT)) is grpc.StatusCode.NOT_FOUND
    assert code(lambda: stub.Flush(pb.FlushRequest(run="nobody"), timeout=LIMIT)) is grpc.StatusCode.NOT_FOUND
    assert code(lambda: stub.CloseRun(pb.CloseRunRequest(run="nobody"), timeout=LIMIT)) is grpc.StatusCode.NOT_FOUND
    assert code(lambda: next(stub.Restore(pb.RestoreRequest(run="nobody"), timeout=LIMIT))) is grpc.StatusCode.NOT_FOUND
    assert (
        code(lambda: list(stub.Save(save_requests(save_header("nobody", "x"), snapshot(1)), timeout=LIMIT)))
        is grpc.StatusCode.NOT_FOUND
    )
    assert not stub.GetLatest(pb.LatestRequest(run="nobody"), timeout=LIMIT).found  # need not be registered


# Stop.


def test_stop_without_a_notice_window_refuses_new_saves_and_drains_the_accepted_one(up: Served) -> None:
    gate = up.store.hold_next_commit()
    call = raw(up, save_header(RUN, "draining", step=4))
    assert call.decision().accepted
    call.send_chunks(snapshot_chunks(snapshot(4)))
    call.half_close()
    gate.wait_reached()  # everything sent; the commit waits for the test

    health = health_pb2_grpc.HealthStub(up.channel)
    request = health_pb2.HealthCheckRequest(service="")
    watch = health.Watch(request, timeout=LIMIT)  # type: ignore[attr-defined]  # not in the stubs
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    stopping = threading.Thread(target=lambda: stopped.append(up.stop()))
    stopped: list[bool] = []
    stopping.start()
    try:
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
        late = raw(up, save_header(RUN, "late"))
        assert late.refused().code() is grpc.StatusCode.UNAVAILABLE  # refused from NOT_SERVING on
        assert status(up).in_flight.export_dir == "draining"

        gate.release()
        assert call.result().step == 4
    finally:
        gate.release()
        stopping.join(LIMIT)
    assert stopped == [True]  # every accepted save finished within the grace
    assert [s.export_dir for s in up.store.saves()] == ["draining"]


def test_a_save_whose_caller_goes_away_mid_upload_counts_as_cancelled_not_failed(up: Served) -> None:
    call = held(up, "gone")
    call.send_chunks(snapshot_chunks(snapshot(1))[:1])  # part of the snapshot, then Ctrl-C
    call.close()
    assert eventually(lambda: status(up).saves_cancelled == 1)
    row = status(up)
    assert (row.saves_ok, row.saves_skipped, row.saves_failed, row.last_error) == (0, 0, 0, "")
    assert not [s for s in up.store.saves() if s.export_dir == "gone"]
    assert eventually(lambda: not up.store.live_staging())  # its staging was discarded
    assert save(up, "after", step=2).path  # the lane is free and serving
