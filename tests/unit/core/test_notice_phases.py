"""The daemon on notice: the pure phases (`core.notice`), then Lanes waiting out the window with real threads.

Times given to `Notice` are plain numbers; the Lanes tests bound every wait
with LIMIT, so a failing test ends instead of hanging.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from checkpointd.core.lane import SaveSpec, Ticket, TicketState, Written
from checkpointd.core.notice import Notice, Phase, WindowEnd
from checkpointd.core.variable_manifest import Manifest, VariableSpec
from checkpointd.protocol.errors import UnavailableError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.saves.runs import Lanes

LIMIT = 5.0
MANIFEST = Manifest((VariableSpec("w", "w/.ATTRIBUTES/VARIABLE_VALUE", "float32", (2, 3)),))
DAEMON = "daemon node-a (pid 7, port 7431)"


def spec(export_dir: str = "policy", *, blocking: bool = False, on_notice: bool = False) -> SaveSpec:
    return SaveSpec(SaveKind.SAVED_MODEL, export_dir, blocking=blocking, step=1, on_notice=on_notice)


# The phases, pure.


def test_notice_opens_the_window_then_drain_ends_it() -> None:
    notice = Notice(5.0, DAEMON)
    assert (notice.phase, notice.draining, notice.refuses_saves(100.0), notice.left(100.0)) == (
        Phase.SERVING,
        False,
        False,
        0,
    )
    notice.give(100.0)
    assert (notice.phase, notice.draining, notice.refuses_saves(100.0)) == (Phase.ON_NOTICE, True, False)
    assert notice.refuses_saves(105.0)  # at the window's end, before anything drains
    assert notice.left(101.5) == 3.5
    notice.give(104.0)  # a second notice does not move the window
    assert notice.left(104.0) == 1.0
    notice.drain()
    assert (notice.phase, notice.refuses_saves(101.0), notice.left(101.0)) == (Phase.DRAINING, True, 0)


def test_a_zero_window_drains_at_once() -> None:
    notice = Notice(0.0)
    notice.give(100.0)
    assert notice.phase is Phase.DRAINING and notice.refuses_saves(100.0)
    assert notice.window_end(["a"], 100.0) is WindowEnd.NO_WINDOW


@pytest.mark.parametrize("window", [-1.0, float("inf"), float("nan")])
def test_a_window_must_be_finite_and_not_negative(window: float) -> None:
    with pytest.raises(ValueError, match="notice window"):
        Notice(window)


def test_the_window_lasts_while_an_open_run_may_still_send_its_final_save() -> None:
    notice = Notice(5.0)
    assert notice.window_end(["a"], 0.0) is None  # serving: no window to end
    notice.give(100.0)
    assert notice.window_end(["a", "b"], 101.0) is None
    notice.final_save("a")
    assert notice.window_end(["a", "b"], 101.0) is None  # b has not sent one
    assert notice.window_end(["a", "b"], 105.0) is WindowEnd.ELAPSED
    notice.final_save("b")
    assert notice.window_end(["a", "b"], 101.0) is WindowEnd.FINAL_SAVES_IN
    assert notice.window_end([], 100.0) is WindowEnd.FINAL_SAVES_IN  # nothing registered: nothing to wait for


def test_a_final_save_before_the_notice_does_not_count() -> None:
    notice = Notice(5.0)
    notice.final_save("a")  # a trainer told to stop before the daemon was
    notice.give(100.0)
    assert notice.window_end(["a"], 101.0) is None


def test_registration_on_notice_only_of_runs_open_here_and_none_once_draining() -> None:
    now = 101.0  # inside the window given at 100
    notice = Notice(5.0, DAEMON)
    notice.check_register("new", open_here=False, now=now)  # serving: anything
    notice.give(100.0)
    notice.check_register("held", open_here=True, now=now)  # a trainer registering its run again
    with pytest.raises(UnavailableError) as refused:
        notice.check_register("new", open_here=False, now=now)
    message = str(refused.value)
    assert DAEMON in message and "takes no new runs" in message and "register run 'new' on another daemon" in message
    with pytest.raises(UnavailableError, match="no runs or saves any more"):
        notice.check_register("held", open_here=True, now=105.0)  # the window's end, not yet drained
    notice.drain()
    with pytest.raises(UnavailableError, match="no runs or saves any more"):
        notice.check_register("held", open_here=True, now=now)


# Lanes: the window with real threads.


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=2)
    yield pool
    pool.shutdown(wait=True, cancel_futures=True)


def noticed(window: float, *runs: str) -> Lanes:
    lanes = Lanes(notice_window=window)
    for run in runs:
        lanes.register(run, MANIFEST)
    lanes.give_notice(DAEMON)
    return lanes


def test_on_notice_a_held_runs_saves_are_taken_a_new_run_is_refused_and_after_the_window_every_save() -> None:
    lanes = noticed(LIMIT, "held")
    assert lanes.draining and 0 < lanes.notice_left() <= LIMIT
    first = lanes.begin("held", spec("ordinary"))  # an ordinary save of a held run: still taken
    assert isinstance(first, Ticket) and first.state is TicketState.ACTIVE
    lanes.finish("held", first, Written("p", 1))
    lanes.register("held", MANIFEST)  # registering a held run again
    with pytest.raises(UnavailableError, match=DAEMON.replace("(", r"\(").replace(")", r"\)")):
        lanes.register("new", MANIFEST)
    with pytest.raises(UnavailableError):
        lanes.check_registration("new", None)
    lanes.drain()
    assert lanes.notice_left() == 0
    with pytest.raises(UnavailableError, match="shutting down"):
        lanes.begin("held", spec("late", blocking=True))


def test_the_window_ends_once_every_open_run_sent_its_save_on_notice(pool: ThreadPoolExecutor) -> None:
    lanes = noticed(LIMIT, "a", "b")
    waiting = pool.submit(lanes.wait_window)
    final = lanes.begin("a", spec("final-a", blocking=True, on_notice=True))
    assert isinstance(final, Ticket)
    with pytest.raises(TimeoutError):
        waiting.result(timeout=0.05)  # b may still send one
    lanes.close("b", timeout=0)  # b's trainer closed its run instead
    assert waiting.result(timeout=LIMIT) is WindowEnd.FINAL_SAVES_IN
    assert lanes.views("a")[0].in_flight is not None  # the final save is still drained after the window
    lanes.finish("a", final, Written("p", 1))


def test_a_queued_save_on_notice_counts_as_in(pool: ThreadPoolExecutor) -> None:
    lanes = noticed(LIMIT, "a")
    busy = lanes.begin("a", spec("busy"))
    assert isinstance(busy, Ticket)
    queued = pool.submit(lanes.begin, "a", spec("final", blocking=True, on_notice=True), timeout=LIMIT)
    assert lanes.wait_window() is WindowEnd.FINAL_SAVES_IN  # queued behind busy, so drained with it
    lanes.drain()
    lanes.finish("a", busy, Written("p", 1))
    ticket = queued.result(timeout=LIMIT)
    assert isinstance(ticket, Ticket) and ticket.state is TicketState.ACTIVE  # started though draining
    lanes.finish("a", ticket, Written("p", 1))


def test_without_final_saves_the_window_lasts_its_length() -> None:
    lanes = noticed(0.3, "quiet")
    started = time.monotonic()
    assert lanes.wait_window() is WindowEnd.ELAPSED
    assert 0.29 <= time.monotonic() - started < LIMIT


def test_with_no_run_registered_the_window_ends_at_once() -> None:
    lanes = noticed(LIMIT)
    started = time.monotonic()
    assert lanes.wait_window() is WindowEnd.FINAL_SAVES_IN
    assert time.monotonic() - started < 1.0


def test_waiting_for_a_window_before_the_notice_is_a_mistake_not_a_spin() -> None:
    with pytest.raises(RuntimeError, match="before give_notice"):
        Lanes(notice_window=LIMIT).wait_window()
