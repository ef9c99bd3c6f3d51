"""The save pipeline end to end (decide → receive → write → commit → retain), with fake seams.

A save is held "in flight" by a gate in its Upload (accepted, receiving) or
in the fake store's commit; every wait is on an event or a future, bounded
by LIMIT.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import pytest

from checkpointd.core.lane import LaneState
from checkpointd.core.ports import NullPhases
from checkpointd.core.retention import RetentionPolicy
from checkpointd.core.variable_manifest import VariableSpec
from checkpointd.protocol.errors import (
    ChecksumError,
    DeadlineError,
    InvalidRequestError,
    LimitExceededError,
    RunClosedError,
    RunHeldError,
    RunNotFoundError,
    SaveFailedError,
    UnavailableError,
)
from checkpointd.protocol.kinds import SaveKind, to_wire
from checkpointd.rpc import messages
from checkpointd.saves.pipeline import Decision, Result
from checkpointd.v1 import checkpointd_pb2 as pb
from tests.component.conftest import SNAPSHOT_BYTES, VARIABLES, MakeRig, Rig, request, snapshot
from tests.component.fakes import LIMIT, SNAPSHOT_FILE, FakeStore, Upload

ACCEPTED = Decision(accepted=True)


def written(rig: Rig) -> dict[str, bytes]:
    """The committed saves' snapshots, by export dir."""
    return {s.export_dir: rig.store.files(s.path)[SNAPSHOT_FILE] for s in rig.store.saves()}


def test_a_save_is_written_committed_and_counted(rig: Rig) -> None:
    events = rig.save(request("first", step=3))

    assert events[0] == ACCEPTED
    result = events[1]
    assert isinstance(result, Result) and len(events) == 2
    assert result.path == str(FakeStore.ROOT / "a" / "first")
    assert (result.step, result.kind) == (3, SaveKind.SAVED_MODEL)
    assert result.bytes_written == SNAPSHOT_BYTES + len(b"graph of a")  # snapshot + template file
    assert written(rig) == {"first": snapshot(3)}
    assert rig.store.live_staging() == []
    assert rig.stats().ok == 1
    assert rig.sink.outcomes() == [("written", "a", "saved_model", result.bytes_written)]
    assert rig.budget.in_use == (0, 0)


def test_a_checkpoint_save_has_no_template_files(rig: Rig) -> None:
    (_, result) = rig.save(request("ckpt", kind=SaveKind.CHECKPOINT))

    assert isinstance(result, Result) and result.kind is SaveKind.CHECKPOINT
    (save,) = rig.store.saves()
    assert set(rig.store.files(save.path)) == {SNAPSHOT_FILE}


# Skip if busy; blocking saves wait.


def test_a_non_blocking_save_while_one_is_in_flight_is_skipped_and_counted(rig: Rig) -> None:
    held, gate = rig.hold(request("held", step=1))

    events = rig.save(request("second", step=2))

    (decision,) = events
    assert isinstance(decision, Decision) and not decision.accepted
    assert "'held'" in decision.reason and "in flight" in decision.reason
    assert rig.stats().skipped == 1
    assert rig.sink.outcomes() == [("skipped", "a", "saved_model")]
    # The held save's files are open (it is receiving); the skipped one staged nothing.
    assert [p.name.split("-")[0] for p in rig.store.live_staging()] == ["held"] and rig.fmt.writes == []
    assert rig.budget.in_use == (1, SNAPSHOT_BYTES)  # the skip's reservation is back

    gate.release()
    (accepted, result) = held.result(LIMIT)
    assert accepted == ACCEPTED and isinstance(result, Result) and result.step == 1
    assert written(rig) == {"held": snapshot(1)}
    assert (rig.stats().ok, rig.stats().skipped, rig.stats().failed) == (1, 1, 0)


def test_a_blocking_save_waits_for_the_one_in_flight_and_runs_after_it(rig: Rig) -> None:
    held, gate = rig.hold(request("held", step=1))
    queued = threading.Event()

    def is_active() -> bool:
        queued.set()  # first asked once the save is queued, before it waits
        return True

    waiter = rig.in_background(request("next", step=2, blocking=True), is_active=is_active)
    assert queued.wait(LIMIT)
    assert rig.view().waiting == 1
    assert not waiter.done()  # it cannot run: the held save has the lane

    gate.release()
    (_, first) = held.result(LIMIT)
    (accepted, second) = waiter.result(LIMIT)

    assert isinstance(first, Result) and isinstance(second, Result)
    assert accepted == ACCEPTED and second.step == 2
    assert [m.export_dir for m in rig.store.commits] == ["held", "next"]
    assert (rig.stats().ok, rig.stats().skipped) == (2, 0)


def test_a_blocking_save_past_its_timeout_gives_up_without_a_trace(rig: Rig) -> None:
    held, gate = rig.hold(request("held"))

    with pytest.raises(DeadlineError, match="gave up waiting"):
        rig.save(request("late", blocking=True), timeout=0.05)

    assert rig.view().waiting == 0
    assert (rig.stats().ok, rig.stats().skipped, rig.stats().failed) == (0, 0, 0)
    assert rig.sink.outcomes() == []
    assert rig.budget.in_use == (1, SNAPSHOT_BYTES)  # only the held save's
    gate.release()
    held.result(LIMIT)
    assert [m.export_dir for m in rig.store.commits] == ["held"]


def test_a_blocking_save_whose_caller_went_away_gives_up_when_woken(rig: Rig) -> None:
    held, gate = rig.hold(request("held"))
    queued, gone = threading.Event(), threading.Event()

    def is_active() -> bool:
        queued.set()
        return not gone.is_set()

    waiter = rig.in_background(request("orphan", blocking=True), is_active=is_active)
    assert queued.wait(LIMIT)
    gone.set()
    rig.lanes.wake()  # what the servicer's call callback does

    with pytest.raises(DeadlineError):
        waiter.result(LIMIT)
    assert rig.view().waiting == 0
    gate.release()
    held.result(LIMIT)
    assert [m.export_dir for m in rig.store.commits] == ["held"]
    assert rig.stats().ok == 1 and rig.stats().failed == 0


# Failures are reported once, and the lane lives on.


def test_a_failed_write_reaches_the_caller_with_its_os_reason_and_the_next_save_works(
    rig: Rig,
) -> None:
    rig.fmt.fail_next_write(OSError(errno.EIO, "Input/output error", "/disk/w"))

    events = rig.pipeline.save(request("broken", step=1), Upload(snapshot(1)))
    assert next(events) == ACCEPTED
    with pytest.raises(SaveFailedError, match=r"Input/output error \(/disk/w\)"):
        next(events)

    assert rig.stats().failed == 1 and "Input/output error" in rig.stats().last_error
    assert rig.sink.outcomes() == [("failed", "a", "saved_model")]
    assert rig.store.saves() == []
    assert len(rig.store.staged) == 1 and rig.store.discarded == rig.store.staged
    assert rig.store.live_staging() == []
    assert rig.budget.in_use == (0, 0)

    (_, result) = rig.save(request("fixed", step=2))
    assert isinstance(result, Result)
    assert written(rig) == {"fixed": snapshot(2)}
    assert (rig.stats().ok, rig.stats().failed) == (1, 1)


def test_a_failed_commit_leaves_nothing_and_the_next_save_works(rig: Rig) -> None:
    rig.store.fail_next_commit(OSError(errno.ENOSPC, "No space left on device"))

    with pytest.raises(SaveFailedError, match="No space left on device"):
        rig.save(request("full"))

    assert rig.store.saves() == [] and rig.store.live_staging() == []
    assert rig.stats().failed == 1
    (_, result) = rig.save(request("roomy", step=2))
    assert isinstance(result, Result) and rig.stats().ok == 1


def test_a_bad_upload_after_the_accept_fails_the_save_and_the_lane_lives_on(rig: Rig) -> None:
    bad = Upload(snapshot(1), error=ChecksumError("snapshot: CRC32C mismatch in the chunk at offset 0"))

    events = rig.pipeline.save(request("corrupt"), bad)
    assert next(events) == ACCEPTED
    with pytest.raises(ChecksumError):
        next(events)

    assert bad.calls == 1
    assert rig.stats().failed == 1 and "CRC32C" in rig.stats().last_error
    assert rig.sink.outcomes() == [("failed", "a", "saved_model")]
    assert rig.store.live_staging() == [] and rig.store.saves() == []  # its open files discarded
    assert rig.view().in_flight is None and rig.budget.in_use == (0, 0)
    (_, result) = rig.save(request("good", step=2))
    assert isinstance(result, Result)


# Drain and close.


def test_drain_refuses_new_saves_and_flush_waits_for_the_accepted_one(rig: Rig) -> None:
    held, gate = rig.hold(request("held"))

    rig.lanes.drain()
    for late in (request("late"), request("late", blocking=True)):
        with pytest.raises(UnavailableError, match="shutting down"):
            rig.save(late)
    flushed = rig.workers.submit(rig.lanes.flush, None, LIMIT)
    assert not flushed.done()  # the held save still has the lane

    gate.release()
    assert flushed.result(LIMIT) == ["a"]
    assert [m.export_dir for m in rig.store.commits] == ["held"]  # committed before flush returned
    (_, result) = held.result(LIMIT)
    assert isinstance(result, Result)
    assert (rig.stats().ok, rig.stats().skipped, rig.stats().failed) == (1, 0, 0)


def test_close_run_refuses_later_saves_and_waits_for_the_one_in_flight(rig: Rig) -> None:
    held, gate = rig.hold(request("held"))

    with pytest.raises(DeadlineError):
        rig.pipeline.close_run("a", timeout=0.01)  # closing now, closed once the save ends
    assert rig.view().state is LaneState.CLOSING
    with pytest.raises(RunClosedError):
        rig.save(request("after"))
    closing = rig.workers.submit(rig.pipeline.close_run, "a", LIMIT)
    assert not closing.done()

    gate.release()
    closing.result(LIMIT)
    assert rig.view().state is LaneState.CLOSED
    assert ("closed", "a") in rig.sink.calls
    (_, result) = held.result(LIMIT)
    assert isinstance(result, Result)
    assert [m.export_dir for m in rig.store.commits] == ["held"]

    rig.register("a")  # reopens the lane
    (_, again) = rig.save(request("reopened", step=2))
    assert isinstance(again, Result)


# Admission limits.


def test_past_max_uploads_a_save_is_refused_before_its_decision(make_rig: MakeRig) -> None:
    rig = make_rig(max_uploads=1)
    rig.register("a")
    rig.register("b")
    held, gate = rig.hold(request("held"))

    # On the busy run it would otherwise be a skip, on an idle run an accept.
    for run in ("a", "b"):
        with pytest.raises(LimitExceededError, match="--max-concurrent-uploads"):
            rig.save(request("more", run=run))
    assert rig.stats("a").skipped == 0 and rig.stats("b") == rig.stats("b").__class__()
    assert rig.sink.outcomes() == []
    gate.release()
    held.result(LIMIT)
    assert [m.export_dir for m in rig.store.commits] == ["held"]


def test_a_save_at_max_uploads_waits_in_line_and_is_accepted_when_a_slot_frees(make_rig: MakeRig) -> None:
    rig = make_rig(max_uploads=1, admission_wait=3600.0)
    rig.register("a")
    rig.register("b")
    held, gate = rig.hold(request("held"))

    queued = rig.in_background(request("queued", run="b", step=2), timeout=LIMIT)
    assert rig.budget.wait_for_waiters(1, LIMIT)
    assert not queued.done() and rig.stats("b") == rig.stats("b").__class__()  # not decided, nor counted yet
    gate.release()

    assert held.result(LIMIT)[0] == ACCEPTED
    events = queued.result(LIMIT)
    assert events[0] == ACCEPTED and isinstance(events[1], Result)
    assert written(rig) == {"held": snapshot(1), "queued": snapshot(2)}
    assert rig.budget.in_use == (0, 0) and rig.budget.waiting == 0


def test_a_save_in_line_past_its_calls_deadline_is_refused_with_what_to_do(make_rig: MakeRig) -> None:
    rig = make_rig(max_uploads=1, admission_wait=3600.0)
    rig.register("a")
    rig.register("b")
    held, gate = rig.hold(request("held"))

    upload = Upload(snapshot(2))
    with pytest.raises(LimitExceededError) as info:
        rig.save(request("late", run="b", step=2), upload, timeout=1e-6)  # its deadline passes in line

    message = str(info.value)
    assert "run 'b'" in message and "limit of 1 saves at once (--max-concurrent-uploads)" in message
    assert "--admission-wait" in message and "retry later" in message
    assert upload.calls == 0 and rig.stats("b") == rig.stats("b").__class__()  # nothing received or counted
    assert rig.budget.waiting == 0
    gate.release()
    held.result(LIMIT)
    assert [m.export_dir for m in rig.store.commits] == ["held"]


def test_a_snapshot_larger_than_the_staging_left_is_refused_before_its_decision(
    make_rig: MakeRig,
) -> None:
    rig = make_rig(max_staging_bytes=SNAPSHOT_BYTES - 1)
    rig.register("a")
    upload = Upload(snapshot(1))

    with pytest.raises(LimitExceededError, match="--max-staging-bytes"):
        rig.save(request("big"), upload)

    assert upload.calls == 0 and rig.store.staged == []
    assert rig.sink.outcomes() == [] and rig.view().in_flight is None


def test_the_budget_is_released_before_the_caller_hears_the_result(make_rig: MakeRig) -> None:
    rig = make_rig(max_uploads=1, max_staging_bytes=SNAPSHOT_BYTES)
    rig.register("a")
    rig.register("b")

    events = rig.pipeline.save(request("first", run="a"), Upload(snapshot(1)))
    assert next(events) == ACCEPTED
    result = next(events)  # the generator is still open, suspended at its Result
    assert isinstance(result, Result)

    assert rig.budget.in_use == (0, 0)
    (_, other) = rig.save(request("second", run="b", step=2))  # fits: one slot, all the bytes
    assert isinstance(other, Result)
    assert list(events) == []  # and the first save's call ends there


# Bad input: refused before a decision, nothing written or counted.


_OTHER_B = VariableSpec("b", "other/b", "int64", (2,))
_B_INT32 = VariableSpec("b", VARIABLES[1].checkpoint_key, "int32", (2,))


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        pytest.param(request(run="nobody"), RunNotFoundError, "not registered", id="unknown-run"),
        pytest.param(request(run="../a"), InvalidRequestError, "run name", id="bad-run-name"),
        pytest.param(request("../escape"), InvalidRequestError, r"'\.\.'", id="export-dir-escapes"),
        pytest.param(request(""), InvalidRequestError, "export_dir is empty", id="export-dir-empty"),
        pytest.param(request(".checkpointd-tmp-x"), InvalidRequestError, "reserved", id="export-dir-reserved"),
        pytest.param(
            request(variables=VARIABLES[:1], snapshot_bytes=24), InvalidRequestError, "1 variables",
            id="too-few-variables",
        ),
        pytest.param(
            request(variables=(VARIABLES[0], _OTHER_B)), InvalidRequestError, "checkpoint_key",
            id="other-checkpoint-key",
        ),
        pytest.param(request(variables=(VARIABLES[0], _B_INT32)), InvalidRequestError, "int32", id="other-dtype"),
        pytest.param(
            request(snapshot_bytes=SNAPSHOT_BYTES + 1), InvalidRequestError, "declares 41 bytes", id="wrong-size"
        ),
    ],
)  # fmt: skip
def test_bad_input_is_refused_before_a_decision(rig: Rig, bad: object, error: type[Exception], match: str) -> None:
    upload = Upload(snapshot(1))

    with pytest.raises(error, match=match):
        rig.save(bad, upload)  # type: ignore[arg-type]

    assert upload.calls == 0 and rig.store.staged == [] and rig.fmt.writes == []
    assert rig.sink.outcomes() == [] and rig.stats() == rig.stats().__class__()
    assert rig.budget.in_use == (0, 0) and rig.view().in_flight is None


def test_a_snapshot_over_max_snapshot_bytes_is_refused_before_a_decision(make_rig: MakeRig) -> None:
    rig = make_rig(max_snapshot_bytes=SNAPSHOT_BYTES - 1)
    rig.register("a")

    with pytest.raises(LimitExceededError, match="--max-snapshot-bytes"):
        rig.save(request())

    assert rig.store.staged == [] and rig.sink.outcomes() == []
    assert rig.budget.in_use == (0, 0)


# Registration meanwhile; retention after.


def test_a_save_in_flight_when_its_run_is_registered_anew_fails_instead_of_mislabelling(
    rig: Rig,
) -> None:
    held, gate = rig.hold(request("held"))
    renamed = tuple(
        VariableSpec("new_" + v.key, "new/" + v.checkpoint_key, v.dtype, v.shape) for v in VARIABLES
    )  # same bytes, other keys: only the manifest tells them apart
    rig.register("a", renamed)

    gate.release()
    with pytest.raises(SaveFailedError, match="registered again"):
        held.result(LIMIT)
    assert rig.store.saves() == [] and rig.store.live_staging() == []
    assert rig.stats().failed == 1

    (_, result) = rig.save(request("fresh", variables=renamed))
    assert isinstance(result, Result)


def test_retention_keeps_the_newest_saves_after_each_commit(make_rig: MakeRig) -> None:
    rig = make_rig(retention=RetentionPolicy(keep_last=2))
    rig.register("a")

    for step in (1, 2, 3):
        rig.save(request(f"step{step}", step=step))
    rig.retention.wait_idle()

    assert sorted(written(rig)) == ["step2", "step3"]
    assert rig.retention.deleted == 1


class RecordingLeases:
    """A fleet's Leases, faked: records each call; `held_by` makes hold() refuse."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float | None]] = []
        self.held_by: str | None = None

    def hold(self, run: str, deadline: float | None, waiting: Callable[[str], None] | None = None) -> None:
        self.calls.append(("hold", run, deadline))
        if self.held_by is not None:
            raise RunHeldError(f"run {run!r} is written by daemon {self.held_by}")

    def check(self, run: str) -> None:
        self.calls.append(("check", run, None))

    def release(self, run: str) -> None:
        self.calls.append(("release", run, None))

    def holder(self, run: str) -> str | None:
        return self.held_by

    def close(self) -> None:
        pass


def test_a_fleets_run_is_held_before_its_template_is_received(make_rig: MakeRig) -> None:
    leases = RecordingLeases()
    rig = make_rig(leases=leases, lease_seconds=10.0, lease_idle_seconds=20.0)
    assert rig.pipeline.leases is leases
    before = time.monotonic()
    rig.register("a")
    assert [c[0] for c in leases.calls] == ["hold"] and rig.fmt.registered  # then the template
    (_, run, deadline) = leases.calls[0]
    assert run == "a" and deadline is not None
    assert before + 40.0 <= deadline <= time.monotonic() + 40.0  # no call deadline: idle + 2 ttl


def test_a_register_waits_for_a_lease_within_its_call_deadline_less_a_reserve(make_rig: MakeRig) -> None:
    leases = RecordingLeases()
    leases.held_by = "host-b (pid 12)"
    rig = make_rig(leases=leases)
    with pytest.raises(RunHeldError, match="host-b"):
        rig.register("a")
    started = time.monotonic()
    with pytest.raises(RunHeldError):
        rig.pipeline.register("a", "", VARIABLES, b"g", 1, lambda: pytest.fail("not reached"), timeout=5.0)
    (_, _, deadline) = leases.calls[-1]
    assert deadline is not None and started + 3.9 <= deadline <= time.monotonic() + 4.0  # 5 s less 1 s
    assert rig.fmt.registered == []  # nothing stored while another daemon holds the run


def test_a_save_of_a_run_held_elsewhere_is_refused_before_its_decision_and_close_releases(make_rig: MakeRig) -> None:
    leases = RecordingLeases()
    rig = make_rig(leases=leases)
    rig.register("a")
    events = rig.save(request("first"))
    assert isinstance(events[1], Result)
    assert ("hold", "a", None) in leases.calls
    leases.held_by = "host-b (pid 12)"
    with pytest.raises(RunHeldError, match="host-b"):
        rig.save(request("second"))
    assert rig.stats().ok == 1 and rig.stats().failed == 0 and rig.stats().skipped == 0  # refused: not counted
    assert rig.budget.in_use == (0, 0)
    rig.pipeline.close_run("a", LIMIT)
    assert leases.calls[-1] == ("release", "a", None)


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread nice values are Linux's")
def test_the_thread_that_writes_a_saves_files_takes_the_writer_pools_priority() -> None:
    from checkpointd.saves.pool import WriterPool
    from checkpointd.saves.sinks import AtWriterPriority

    kept: list[tuple[int, int, bytes]] = []

    class Kept:
        def write(self, part: int, offset: int, data: object, crc: int | None = None) -> None:
            kept.append((part, offset, bytes(memoryview(data))))  # type: ignore[arg-type]

        def finish(self) -> object:
            return None

        def close(self) -> None:
            pass

    pool = WriterPool(nice=7)
    try:
        sink = AtWriterPriority(Kept(), pool)  # type: ignore[arg-type]
        seen: list[int] = []

        def receiver() -> None:  # a thread of its own, as the upload's reader is
            tid = threading.get_native_id()
            seen.append(os.getpriority(os.PRIO_PROCESS, tid))
            sink.write(0, 0, b"ab")
            sink.write(0, 2, b"cd")
            seen.append(os.getpriority(os.PRIO_PROCESS, tid))

        thread = threading.Thread(target=receiver)
        thread.start()
        thread.join(LIMIT)
        assert kept == [(0, 0, b"ab"), (0, 2, b"cd")]
        assert seen[0] < 7 and seen[1] == 7
    finally:
        pool.close()


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread nice values are Linux's")
def test_the_writer_pool_runs_work_inline_on_a_thread_at_its_priority_and_elsewhere_on_its_own() -> None:
    from checkpointd.saves.pool import WriterPool

    pool = WriterPool(nice=7)
    try:
        # (the caller's thread, (the thread the work ran on, its nice value)); the caller's own nice after
        ran: dict[str, tuple[int, tuple[int, int]]] = {}
        after: list[int] = []

        def where() -> tuple[int, int]:
            return threading.get_ident(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

        def lowered() -> None:  # the upload's reader, once it has written a save
            pool.initializer()
            ran["lowered"] = (threading.get_ident(), pool.run(where))

        def normal() -> None:  # a gRPC handler: its priority is never touched
            ran["normal"] = (threading.get_ident(), pool.run(where))
            after.append(where()[1])

        for target in (lowered, normal):
            thread = threading.Thread(target=target)
            thread.start()
            thread.join(LIMIT)
        assert ran["lowered"][1] == (ran["lowered"][0], 7)  # no hand-off
        on, nice = ran["normal"][1]
        assert on != ran["normal"][0] and nice == 7
        assert after[0] < 7
    finally:
        pool.close()


# Saves on notice: a trainer's last snapshot before it is stopped.


def test_a_save_on_notice_is_never_skipped_and_is_counted_with_its_notice_to_durable_time(
    make_rig: MakeRig,
) -> None:
    phases = _Preemptions()
    rig = make_rig(phases=phases)
    rig.register("a")
    held, gate = rig.hold(request("held", step=1))
    # Sent without blocking: on_notice alone makes it wait its turn, as the header's contract says.
    header = pb.SaveHeader(run="a", kind=to_wire(SaveKind.SAVED_MODEL), export_dir="last", step=2, on_notice=True,
                           notice_unix_seconds=time.time() - 2.0)  # fmt: skip
    last = messages.save_request(header)
    assert last.blocking and last.on_notice
    queued = threading.Event()

    def is_active() -> bool:
        queued.set()  # first asked once the save is queued, before it waits
        return True

    waiter = rig.in_background(replace(last, variables=VARIABLES, snapshot_bytes=SNAPSHOT_BYTES), is_active=is_active)
    assert queued.wait(LIMIT)
    assert rig.view().waiting == 1  # queued behind the save in flight, not skipped
    gate.release()
    held.result(LIMIT)
    (accepted, result) = waiter.result(LIMIT)

    assert accepted == ACCEPTED and isinstance(result, Result) and result.step == 2
    [(outcome, seconds)] = phases.saves  # the save held in flight was no save on notice
    assert outcome == "ok" and seconds is not None and 2.0 <= seconds < 2.0 + LIMIT


class _Preemptions(NullPhases):
    """Records the saves on notice the pipeline reports."""

    def __init__(self) -> None:
        self.saves: list[tuple[str, float | None]] = []

    def preemption_save(self, outcome: str, notice_to_durable: float | None) -> None:
        self.saves.append((outcome, notice_to_durable))


def test_a_save_on_notice_cannot_claim_the_trainers_busy_lock() -> None:
    header = pb.SaveHeader(run="a", kind=to_wire(SaveKind.SAVED_MODEL), export_dir="last", on_notice=True,
                           held=pb.HeldSave(segment_path="/dev/shm/s", lock_path="/dev/shm/l"))  # fmt: skip
    with pytest.raises(InvalidRequestError, match="held is for non-blocking saves only"):
        messages.save_request(header)
