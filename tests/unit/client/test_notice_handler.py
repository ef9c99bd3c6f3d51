"""The save on notice without TensorFlow: its state machine, and its SIGTERM handler in this process.

The handler tests send this process a real SIGTERM with a fresh watch and a
Python handler installed first (the "user's"), so the notice ends in that
handler, never in the default action; checkpointers are fakes that record
when they are asked to save.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from checkpointd_client import notice
from checkpointd_client.notice import Action, Notice, NoticeMachine, NoticeOutcome, State

LIMIT = 10.0


# The state machine.


def test_a_notice_outside_the_client_saves_at_once_and_a_second_one_ends_the_process() -> None:
    machine = NoticeMachine()
    first = Notice(100.0, 5.0)
    assert machine.signalled(inside_client=False, notice=first) is Action.SAVE
    assert (machine.state, machine.notice) == (State.SAVING, first)
    assert machine.signalled(inside_client=False, notice=Notice(101.0, 6.0)) is Action.END_NOW
    assert machine.notice == first  # the first notice's time is the one the save reports
    machine.saved()
    assert machine.state is State.ENDED
    assert machine.signalled(inside_client=False, notice=first) is Action.NONE


def test_a_notice_inside_a_client_call_waits_for_it_to_return() -> None:
    machine = NoticeMachine()
    assert machine.left_client() is Action.NONE  # no notice: leaving a call does nothing
    assert machine.signalled(inside_client=True, notice=Notice(100.0, 5.0)) is Action.DEFER
    assert machine.state is State.PENDING
    assert machine.signalled(inside_client=True, notice=Notice(101.0, 6.0)) is Action.END_NOW  # even while waiting
    assert machine.left_client() is Action.SAVE
    assert machine.state is State.SAVING
    assert machine.left_client() is Action.NONE  # the save's own client calls return: no second save


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "25", None])
def test_a_deadline_must_be_a_finite_positive_number_of_seconds(bad: object) -> None:
    with pytest.raises(ValueError, match="notice_deadline must be a finite number of seconds > 0"):
        notice.check_deadline(bad)
    assert notice.check_deadline(2) == 2.0


def test_the_outcome_line_says_the_step_and_either_the_time_to_durable_or_what_was_lost() -> None:
    saved = NoticeOutcome("job.train", 57, True, durable_ms=412.4)
    assert saved.line() == "run job.train: preempted at step 57: saved, durable in 412 ms"
    lost = NoticeOutcome("job.train", 57, False, lost="UnavailableError: down; lost: the 17 step(s) after step 40")
    assert lost.line() == (
        "run job.train: preempted at step 57: not saved: UnavailableError: down; lost: the 17 step(s) after step 40"
    )


# The handler, with a real SIGTERM.


class FakeCheckpointer:
    """Records its saves on notice; `during` runs inside the save (a second signal, say)."""

    def __init__(
        self, run: str, events: list[str], during: Callable[[], None] = lambda: None, deadline: float = LIMIT
    ) -> None:
        self.run = run
        self.events = events
        self.during = during
        self.notice_deadline = deadline
        self.notices: list[Notice] = []

    def _save_on_notice(self, on_notice: Notice) -> NoticeOutcome:
        self.events.append(f"save {self.run}")
        self.notices.append(on_notice)
        self.during()
        return NoticeOutcome(self.run, 3, True, durable_ms=1.0)


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """A fresh watch, with a user's SIGTERM handler installed first; yields the events, in order."""
    events: list[str] = []
    fresh = notice._Watch()  # noqa: SLF001 - a fresh process-wide watch
    monkeypatch.setattr(notice, "_WATCH", fresh)
    original = signal.getsignal(signal.SIGTERM)

    def users(signum: int, frame: Any) -> None:
        events.append(f"user's handler {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, users)
    try:
        yield events
    finally:
        fresh._stop_backstop()  # noqa: SLF001 - its thread ends with the test
        signal.signal(signal.SIGTERM, original)


def _sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    _between_bytecodes()


def _between_bytecodes() -> None:
    """A call: Python runs pending signal handlers at the latest here."""


def test_sigterm_saves_every_watched_checkpointer_then_runs_the_users_handler_and_gives_it_sigterm_back(
    watch: list[str],
) -> None:
    users = signal.getsignal(signal.SIGTERM)
    first, second = FakeCheckpointer("a", watch), FakeCheckpointer("b", watch)
    notice.join(first)
    notice.join(second)
    assert signal.getsignal(signal.SIGTERM) is not users  # installed, chained to the user's

    _sigterm()

    assert watch == ["save a", "save b", "user's handler SIGTERM"]
    assert first.notices == second.notices  # one notice, one time
    assert signal.getsignal(signal.SIGTERM) is users  # a later SIGTERM is the user's alone


def test_sigterm_inside_a_client_call_is_saved_when_the_outermost_call_returns(watch: list[str]) -> None:
    notice.join(FakeCheckpointer("a", watch))

    @notice.client_call
    def call(inner: bool) -> None:
        if inner:
            call(inner=False)  # nested: the outermost one's return saves
            watch.append("inner call returned")
            return
        _sigterm()
        watch.append("signalled inside the call")

    call(inner=True)

    assert watch == ["signalled inside the call", "inner call returned", "save a", "user's handler SIGTERM"]


def test_a_second_sigterm_during_the_save_ends_at_once(watch: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    ended: list[int] = []
    monkeypatch.setattr(notice, "_end_now", ended.append)  # instead of the default action, which ends pytest
    notice.join(FakeCheckpointer("a", watch, during=_sigterm))

    _sigterm()

    assert ended == [signal.SIGTERM]
    assert watch == ["save a", "user's handler SIGTERM"]  # the first notice's end goes on only because of the fake


def test_preempted_saves_every_watched_checkpointer_and_returns_what_happened_without_ending(
    watch: list[str],
) -> None:
    notice.join(FakeCheckpointer("a", watch))
    installed = signal.getsignal(signal.SIGTERM)

    outcomes = notice.preempted()

    assert [(o.run, o.saved) for o in outcomes] == [("a", True)]
    assert watch == ["save a"]  # the user's handler did not run: the process goes on
    assert signal.getsignal(signal.SIGTERM) is installed  # and SIGTERM still saves


def test_preempted_inside_a_client_call_on_the_main_thread_is_refused(watch: list[str]) -> None:
    notice.join(FakeCheckpointer("a", watch))

    @notice.client_call
    def call() -> None:
        notice.preempted()

    with pytest.raises(RuntimeError, match="inside a checkpointd_client call on the main thread"):
        call()
    assert watch == []


def test_the_last_checkpointer_to_leave_gives_the_previous_handler_back(watch: list[str]) -> None:
    users = signal.getsignal(signal.SIGTERM)
    first, second = FakeCheckpointer("a", watch), FakeCheckpointer("b", watch)
    notice.join(first)
    notice.join(second)
    notice.leave(first)
    assert signal.getsignal(signal.SIGTERM) is not users
    notice.leave(second)
    assert signal.getsignal(signal.SIGTERM) is users

    _sigterm()

    assert watch == ["user's handler SIGTERM"]  # nothing watched: no save


def test_a_checkpointer_made_on_another_thread_installs_nothing_says_so_and_is_saved_by_preempted(
    watch: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    users = signal.getsignal(signal.SIGTERM)
    fake = FakeCheckpointer("a", watch)
    with caplog.at_level(logging.WARNING, logger=notice.__name__):
        thread = threading.Thread(target=notice.join, args=(fake,), name="builder")
        thread.start()
        thread.join(LIMIT)
    assert signal.getsignal(signal.SIGTERM) is users
    assert any("made in thread 'builder'" in r.getMessage() and "preempted()" in r.getMessage() for r in caplog.records)

    assert [o.run for o in notice.preempted()] == ["a"]


def test_after_a_notice_the_process_went_on_from_a_checkpointer_made_later_saves_on_the_next_sigterm(
    watch: list[str],
) -> None:
    users = signal.getsignal(signal.SIGTERM)
    notice.join(FakeCheckpointer("a", watch))
    _sigterm()  # the user's handler returns: the process goes on
    assert signal.getsignal(signal.SIGTERM) is users

    notice.join(FakeCheckpointer("b", watch))  # installs again, chained to the user's
    _sigterm()

    assert watch == ["save a", "user's handler SIGTERM", "save a", "save b", "user's handler SIGTERM"]


def test_a_notice_held_inside_a_client_call_past_its_deadline_is_ended_by_the_backstop(
    watch: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ended: list[int] = []
    released = threading.Event()

    def end_now(signum: int) -> None:  # instead of the default action, which ends pytest
        ended.append(signum)
        released.set()

    monkeypatch.setattr(notice, "_end_now", end_now)
    monkeypatch.setattr(notice, "BACKSTOP_GRACE", 0.0)
    notice.join(FakeCheckpointer("a", watch, deadline=0.1))

    @notice.client_call
    def stuck() -> None:
        _sigterm()
        assert released.wait(LIMIT)  # a call that would not return by the deadline: the backstop's SIGTERM ends it
        watch.append("call returned")

    with caplog.at_level(logging.ERROR, logger=notice.__name__):
        stuck()

    assert ended == [signal.SIGTERM]
    [record] = [r for r in caplog.records if "has not ended" in r.getMessage()]
    assert "the main thread is still inside a checkpointd_client call" in record.getMessage()
    assert watch[0] == "call returned"  # what follows happens only because the fake did not end the process
