"""The pure Lane state machine: every rule of one run's save lane, no threads."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import pytest

from checkpointd.core.lane import Failed, Lane, LaneState, SaveSpec, Skipped, Ticket, TicketState, Written
from checkpointd.protocol.errors import RunClosedError, UnavailableError
from checkpointd.protocol.kinds import SaveKind

if TYPE_CHECKING:
    from conftest import FakeClock, RecordingSink

RUN = "run-1"


def spec(
    export_dir: str = "policy",
    *,
    blocking: bool = False,
    step: int = 1,
    kind: SaveKind = SaveKind.SAVED_MODEL,
) -> SaveSpec:
    return SaveSpec(kind=kind, export_dir=export_dir, blocking=blocking, step=step)


@pytest.fixture
def lane(clock: FakeClock, sink: RecordingSink) -> Lane:
    return Lane(RUN, clock, sink)


def accept(lane: Lane, s: SaveSpec) -> Ticket:
    ticket = lane.request(s)
    assert isinstance(ticket, Ticket) and ticket.state is TicketState.ACTIVE
    return ticket


# --- accepting and skipping ---------------------------------------------------------


def test_idle_save_is_accepted(lane: Lane, clock: FakeClock, sink: RecordingSink) -> None:
    ticket = lane.request(spec())

    assert isinstance(ticket, Ticket)
    assert ticket.state is TicketState.ACTIVE
    assert ticket.accepted_at == clock.now
    assert lane.in_flight is ticket
    assert not lane.idle
    assert sink.calls == [("in_flight", +1)]


def test_non_blocking_save_while_in_flight_is_skipped_and_counted(lane: Lane, sink: RecordingSink) -> None:
    first = accept(lane, spec("first"))

    decision = lane.request(spec("second", kind=SaveKind.CHECKPOINT))

    assert isinstance(decision, Skipped)
    assert decision.spec.export_dir == "second"
    # The reason names what the lane is busy with.
    assert "'first'" in decision.reason and "saved_model" in decision.reason
    assert lane.stats.skipped == 1
    assert sink.named("skipped") == [("skipped", RUN, "checkpoint")]
    assert lane.in_flight is first
    assert not lane.waiting


def test_blocking_save_queues_and_becomes_active_when_in_flight_finishes(lane: Lane) -> None:
    first = accept(lane, spec("first"))

    second = lane.request(spec("second", blocking=True))

    assert isinstance(second, Ticket)
    assert second.state is TicketState.WAITING
    assert second.accepted_at is None
    assert list(lane.waiting) == [second]

    started = lane.finish(first, Written("/r/first", 10))

    assert started is second
    assert second.state is TicketState.ACTIVE
    assert lane.in_flight is second
    assert not lane.waiting


def test_two_blocking_waiters_start_in_fifo_order(lane: Lane) -> None:
    first = accept(lane, spec("first"))
    second = lane.request(spec("second", blocking=True))
    third = lane.request(spec("third", blocking=True))

    assert lane.finish(first, Written("/r/first", 1)) is second
    assert third.state is TicketState.WAITING
    assert lane.finish(second, Written("/r/second", 1)) is third
    assert lane.finish(third, Written("/r/third", 1)) is None
    assert lane.idle
    assert lane.stats.ok == 3


def test_non_blocking_save_while_a_blocking_one_waits_is_skipped(lane: Lane, sink: RecordingSink) -> None:
    first = accept(lane, spec("first"))
    waiter = lane.request(spec("waiter", blocking=True))

    decision = lane.request(spec("late"))

    assert isinstance(decision, Skipped)
    assert lane.stats.skipped == 1
    assert list(lane.waiting) == [waiter]
    # The skipped save did not sneak in ahead of the waiter.
    assert lane.finish(first, Written("/r/first", 1)) is waiter
    assert lane.finish(waiter, Written("/r/waiter", 1)) is None
    assert len(sink.named("skipped")) == 1


# --- no accepted save is ever lost ------------------------------------------------------


def test_back_to_back_saves_keep_the_first(lane: Lane) -> None:
    # TF-Agents' AsyncPolicySaver replaces a pending save with the newer one;
    # here the first save stays the one in flight and ends written.
    first = accept(lane, spec("first", step=1))
    second = lane.request(spec("second", step=2))

    assert isinstance(second, Skipped)
    assert lane.in_flight is first
    lane.finish(first, Written("/r/first", 5))
    assert first.state is TicketState.WRITTEN
    assert first.outcome == Written("/r/first", 5)
    assert lane.stats.last_success is not None
    assert lane.stats.last_success.step == 1


def test_back_to_back_blocking_saves_both_end_written(lane: Lane) -> None:
    first = accept(lane, spec("first", step=1, blocking=True))
    second = lane.request(spec("second", step=2, blocking=True))

    assert lane.finish(first, Written("/r/first", 5)) is second
    lane.finish(second, Written("/r/second", 5))

    assert (first.state, second.state) == (TicketState.WRITTEN, TicketState.WRITTEN)
    assert lane.stats.ok == 2


@pytest.mark.parametrize("seed", range(20))
def test_every_accepted_save_ends_written_or_failed(
    seed: int, lane: Lane, clock: FakeClock, sink: RecordingSink
) -> None:
    """A random mix of saves and finishes: nothing accepted vanishes."""
    rng = random.Random(seed)
    queued: list[Ticket] = []
    skipped = 0
    for i in range(200):
        clock.advance(rng.random())
        if lane.in_flight is not None and rng.random() < 0.4:
            ok = rng.random() < 0.8
            lane.finish(lane.in_flight, Written(f"/r/{i}", i) if ok else Failed(f"boom {i}"))
            continue
        decision = lane.request(spec(f"s{i}", blocking=rng.random() < 0.3, step=i))
        if isinstance(decision, Skipped):
            skipped += 1
        else:
            queued.append(decision)
    while lane.in_flight is not None:
        lane.finish(lane.in_flight, Written("/r/end", 0))

    assert lane.idle
    assert all(t.state in (TicketState.WRITTEN, TicketState.FAILED) for t in queued)
    assert all(t.outcome is not None for t in queued)
    assert lane.stats.ok + lane.stats.failed == len(queued)
    assert lane.stats.skipped == skipped == len(sink.named("skipped"))
    assert len(sink.named("written")) + len(sink.named("failed")) == len(queued)
    assert sink.in_flight == 0


# --- failure --------------------------------------------------------------------------


def test_failure_is_counted_and_the_lane_keeps_serving(lane: Lane, sink: RecordingSink) -> None:
    first = accept(lane, spec("first"))

    lane.finish(first, Failed("disk full"))

    assert first.state is TicketState.FAILED
    assert first.outcome == Failed("disk full")
    assert lane.stats.failed == 1
    assert lane.stats.last_error == "disk full"
    assert lane.stats.last_success is None
    assert len(sink.named("failed")) == 1
    assert lane.idle

    again = accept(lane, spec("again"))
    lane.finish(again, Written("/r/again", 3))
    assert lane.stats.ok == 1
    # The failure stays visible after a later success.
    assert lane.stats.last_error == "disk full"


# --- close, reopen, withdraw, drain -------------------------------------------------------


def test_close_refuses_new_saves_at_once_while_the_in_flight_one_finishes(lane: Lane) -> None:
    first = accept(lane, spec("first"))

    lane.close()

    assert lane.state is LaneState.CLOSING
    with pytest.raises(RunClosedError, match=RUN):
        lane.request(spec("late"))
    with pytest.raises(RunClosedError):
        lane.request(spec("late-blocking", blocking=True))
    lane.finish(first, Written("/r/first", 1))
    assert first.state is TicketState.WRITTEN
    assert lane.state is LaneState.CLOSED
    # Refused saves are not skips: they were never counted.
    assert lane.stats.skipped == 0


def test_close_lets_queued_saves_finish_before_closed(lane: Lane) -> None:
    first = accept(lane, spec("first"))
    waiter = lane.request(spec("waiter", blocking=True))

    lane.close()

    assert lane.finish(first, Written("/r/first", 1)) is waiter
    assert lane.state is LaneState.CLOSING
    lane.finish(waiter, Written("/r/waiter", 1))
    assert lane.state is LaneState.CLOSED


def test_close_when_idle_is_closed_at_once(lane: Lane) -> None:
    lane.close()

    assert lane.state is LaneState.CLOSED
    with pytest.raises(RunClosedError):
        lane.request(spec())


def test_reopen_accepts_saves_again(lane: Lane) -> None:
    lane.close()

    lane.reopen()

    assert lane.state is LaneState.OPEN
    accept(lane, spec())


def test_withdrawn_waiter_leaves_the_queue_and_is_never_started(lane: Lane) -> None:
    first = accept(lane, spec("first"))
    waiter = lane.request(spec("waiter", blocking=True))

    lane.withdraw(waiter)

    assert waiter.state is TicketState.WITHDRAWN
    assert not lane.waiting
    assert lane.finish(first, Written("/r/first", 1)) is None
    assert lane.idle
    assert waiter.state is TicketState.WITHDRAWN


def test_withdrawing_the_last_waiter_of_a_closing_lane_does_not_block_close(lane: Lane) -> None:
    first = accept(lane, spec("first"))
    waiter = lane.request(spec("waiter", blocking=True))
    lane.close()

    lane.withdraw(waiter)
    lane.finish(first, Written("/r/first", 1))

    assert lane.state is LaneState.CLOSED


def test_draining_refuses_with_draining_error(lane: Lane, sink: RecordingSink) -> None:
    with pytest.raises(UnavailableError, match=RUN):
        lane.request(spec(), draining=True)
    assert lane.idle
    assert sink.calls == []


def test_finish_with_a_ticket_that_is_not_in_flight_is_refused(
    lane: Lane, clock: FakeClock, sink: RecordingSink
) -> None:
    first = accept(lane, spec("first"))
    waiter = lane.request(spec("waiter", blocking=True))
    other = Lane("other", clock, sink)
    stranger = other.request(spec("stranger"))

    with pytest.raises(ValueError):
        lane.finish(waiter, Written("/r/waiter", 1))
    with pytest.raises(ValueError):
        lane.finish(stranger, Written("/r/stranger", 1))
    assert lane.in_flight is first
    lane.finish(first, Written("/r/first", 1))
    with pytest.raises(ValueError):
        lane.finish(first, Written("/r/first", 1))  # a second finish of the same save
    assert lane.stats.ok == 1


# --- what the sink and stats see ------------------------------------------------------


def test_durations_run_from_accept_to_finish_on_the_lane_clock(
    lane: Lane, clock: FakeClock, sink: RecordingSink
) -> None:
    first = accept(lane, spec("first", kind=SaveKind.CHECKPOINT))
    clock.advance(0.5)
    waiter = lane.request(spec("waiter", blocking=True))  # requested at +0.5
    clock.advance(2.0)
    lane.finish(first, Written("/r/first", 123))  # waiter accepted at +2.5
    clock.advance(1.25)
    lane.finish(waiter, Failed("boom"))

    assert sink.named("written") == [("written", RUN, "checkpoint", 123, 2.5, 1_002.5)]
    # Queueing time is not save time: 1.25, not 3.25.
    assert sink.named("failed") == [("failed", RUN, "saved_model", 1.25)]
    assert waiter.requested_at == 1_000.5
    assert waiter.accepted_at == 1_002.5
    assert sink.in_flight == 0


def test_duration_is_right_when_the_clock_reads_zero_at_accept(clock: FakeClock, sink: RecordingSink) -> None:
    clock.now = 0.0
    lane = Lane(RUN, clock, sink)
    ticket = accept(lane, spec())
    clock.advance(3.0)

    lane.finish(ticket, Written("/r/p", 1))

    assert sink.named("written")[0][4] == 3.0


def test_last_success_holds_kind_path_step_and_time(lane: Lane, clock: FakeClock) -> None:
    first = accept(lane, spec("ckpt", kind=SaveKind.CHECKPOINT, step=42))
    clock.advance(1.0)
    lane.finish(first, Written("/root/run-1/ckpt", 7))
    failing = accept(lane, spec("later", step=43))
    lane.finish(failing, Failed("no"))

    last = lane.stats.last_success
    assert last is not None
    assert (last.kind, last.path, last.step, last.at) == (
        SaveKind.CHECKPOINT,
        "/root/run-1/ckpt",
        42,
        1_001.0,
    )


def test_the_sink_hears_once_when_a_lane_closes_idle_or_after_its_save() -> None:
    from tests.unit.conftest import RecordingSink

    clock = iter(range(100)).__next__
    sink = RecordingSink()
    idle = Lane("idle", lambda: float(clock()), sink)
    idle.close()
    busy = Lane("busy", lambda: float(clock()), sink)
    ticket = busy.request(SaveSpec(SaveKind.CHECKPOINT, "a"))
    busy.close()
    assert sink.named("closed") == [("closed", "idle")]
    busy.finish(ticket, Written("/a", 1))
    assert sink.named("closed") == [("closed", "idle"), ("closed", "busy")]
