"""Continuous saves' decision with a fake clock: the budget holds, slow saves get rarer, never two in flight."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from checkpointd_client.continuous import (
    HEADROOM,
    STANDBY_SHARE,
    Choice,
    ContinuousSaves,
    Decisions,
    SaveBudget,
    check_budget,
)
from tests.unit.conftest import FakeClock


@dataclass
class Loop:
    """A training loop calling save() after every step, against a fake clock.

    A save's stall is `save_cost` seconds; it stays in flight for `flight`
    seconds of the clock after its call returns (the daemon's write).
    """

    budget: SaveBudget
    clock: FakeClock
    step_seconds: float
    save_cost: float
    flight: float = 0.0
    skip_cost: float = 2e-6
    in_flight_until: float = -1.0
    trained: float = 0.0
    in_save: float = 0.0
    saves_at: list[float] = field(default_factory=list)
    overlaps: int = 0

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.clock.advance(self.step_seconds)
            self.trained += self.step_seconds
            start = self.clock.now
            busy = self.clock.now < self.in_flight_until
            choice, entered = self.budget.enter(busy)
            if choice is Choice.SAVE:
                self.overlaps += busy
                self.saves_at.append(start)
                self.clock.advance(self.save_cost)
                self.in_flight_until = self.clock.now + self.flight
            else:
                self.clock.advance(self.skip_cost)
            self.budget.leave(choice, entered)
            self.in_save += self.clock.now - start


def _loop(budget: float = 0.05, *, step_seconds: float, save_cost: float, flight: float = 0.0) -> Loop:
    clock = FakeClock(0.0)
    return Loop(SaveBudget(budget, clock), clock, step_seconds, save_cost, flight)


@pytest.mark.parametrize("save_cost", [0.001, 0.01, 0.1, 1.0])
@pytest.mark.parametrize("budget", [0.01, 0.05, 0.2])
def test_time_in_save_stays_within_the_budget_of_training_time_plus_two_saves(budget: float, save_cost: float) -> None:
    loop = _loop(budget, step_seconds=0.003, save_cost=save_cost)
    loop.run(50_000)
    # The first save is not charged, the newest is not yet paid for.
    assert loop.in_save <= budget * loop.trained + 2 * save_cost + 1e-9
    assert len(loop.saves_at) >= 2  # it does save, repeatedly
    # Not far under it either: a save as soon as the spent share (HEADROOM of it) allows, give or take a step.
    per_interval = save_cost / (budget * HEADROOM) + 0.003 + save_cost
    assert len(loop.saves_at) >= 0.9 * loop.clock.now / per_interval


def test_slower_saves_are_rarer_and_cost_the_same_share() -> None:
    fast = _loop(step_seconds=0.003, save_cost=0.002)
    slow = _loop(step_seconds=0.003, save_cost=0.02)
    fast.run(20_000)
    slow.run(20_000)
    assert len(slow.saves_at) * 5 < len(fast.saves_at)
    for loop in (fast, slow):
        assert loop.in_save / loop.trained == pytest.approx(0.05, rel=0.25)


def _first_save(budget: SaveBudget, clock: FakeClock, seconds: float = 0.0) -> None:
    choice, entered = budget.enter(False)
    assert choice is Choice.SAVE
    clock.advance(seconds)
    budget.leave(choice, entered)


def test_the_first_save_is_not_charged_so_a_slow_one_does_not_hold_off_the_next() -> None:
    clock = FakeClock(0.0)
    budget = SaveBudget(0.05, clock)
    _first_save(budget, clock, 1.2)  # the graph described, the segment made and touched: once
    budget.charge(2.0)  # what the daemon spent writing it: not charged either
    clock.advance(0.003)
    choice, entered = budget.enter(False)
    assert choice is Choice.SAVE
    budget.leave(choice, entered)


def test_what_a_save_costs_off_the_training_thread_is_charged_once_known() -> None:
    clock = FakeClock(0.0)
    budget = SaveBudget(0.05, clock)
    _first_save(budget, clock)
    clock.advance(1.0)
    choice, entered = budget.enter(False)
    assert choice is Choice.SAVE
    clock.advance(0.010)  # its stall
    budget.leave(choice, entered)
    budget.charge(0.020)  # durable: the daemon's CPU and the requests'
    budget.charge(-1.0)  # a meter that went back charges nothing
    pays = (0.010 + 0.020) / (0.05 * HEADROOM)  # the training that pays for it: 0.67 s
    clock.advance(pays - 0.01)
    choice, entered = budget.enter(False)
    assert choice is Choice.SKIP_BUDGET
    budget.leave(choice, entered)
    clock.advance(0.011)
    assert budget.enter(False)[0] is Choice.SAVE


def test_the_first_call_saves_and_the_next_waits_for_its_cost_over_the_budget_in_training() -> None:
    clock = FakeClock(0.0)
    budget = SaveBudget(0.05, clock)
    _first_save(budget, clock)
    clock.advance(1.0)
    choice, entered = budget.enter(False)
    assert choice is Choice.SAVE
    clock.advance(0.010)  # the save's stall: 0.22 s of training pays for it
    budget.leave(choice, entered)
    clock.advance(0.010 / (0.05 * HEADROOM) - 0.01)
    choice, entered = budget.enter(False)
    assert choice is Choice.SKIP_BUDGET
    budget.leave(choice, entered)
    clock.advance(0.011)
    choice, entered = budget.enter(False)
    assert choice is Choice.SAVE
    budget.leave(choice, entered)


def test_never_two_in_flight_a_save_within_budget_waits_for_the_previous_to_end() -> None:
    # Saves cheap on the training thread but long in flight (a slowed disk): the
    # budget would allow one every 20 ms, the disk one every 500 ms.
    loop = _loop(step_seconds=0.003, save_cost=0.001, flight=0.5)
    loop.run(10_000)
    assert loop.overlaps == 0
    gaps = [b - a for a, b in zip(loop.saves_at, loop.saves_at[1:], strict=False)]
    assert min(gaps) >= 0.5
    assert max(gaps) <= 0.5 + 2 * 0.003 + 0.001  # the first step after it ends
    decisions = loop.budget.decisions
    assert decisions.skipped_busy > decisions.skipped_by_budget > 0
    assert decisions.saved == len(loop.saves_at)
    assert sum(vars(decisions).values()) == 10_000


def test_a_blocking_save_always_saves_and_its_stall_is_paid_by_the_training_after_it() -> None:
    clock = FakeClock(0.0)
    budget = SaveBudget(0.05, clock)
    _first_save(budget, clock)
    choice, entered = budget.enter(in_flight=True, forced=True)
    assert choice is Choice.SAVE
    clock.advance(1.0)  # waited its turn, then for durable
    budget.leave(choice, entered)
    clock.advance(1.0 / (0.05 * HEADROOM) - 1.0)  # 22 s of training pay for it
    assert budget.enter(False)[0] is Choice.SKIP_BUDGET
    budget.leave(Choice.SKIP_BUDGET, clock.now)
    clock.advance(1.01)
    assert budget.enter(False)[0] is Choice.SAVE
    assert budget.decisions == Decisions(saved=3, skipped_by_budget=1, skipped_busy=0)


@pytest.mark.parametrize("bad", [0, 1, -0.1, 1.5, float("nan"), float("inf"), True, "0.05", None])
def test_a_budget_outside_0_to_1_is_refused_naming_the_argument(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^budget must be"):
        check_budget(bad)


@dataclass
class _Ticket:
    step: object
    skipped: bool = False
    reason: str = ""
    error: BaseException | None = None

    def done(self) -> bool:
        return True

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self.error


def test_the_last_call_not_saved_is_pending_until_a_save_comes_after_it() -> None:
    clock = FakeClock(0.0)
    saves = ContinuousSaves(0.05, clock)
    made: list[object] = []

    def save(step: object, blocking: bool) -> _Ticket:
        made.append(step)
        clock.advance(0.01)
        return _Ticket(step)

    def skip(step: object, reason: str) -> _Ticket:
        return _Ticket(step, True, reason)

    assert not saves.save(0, False, False, save, skip).skipped  # the first: not charged
    clock.advance(1.0)
    assert not saves.save(1, False, False, save, skip).skipped
    assert saves.take_pending() is None
    clock.advance(0.003)
    ticket = saves.save(2, False, False, save, skip)
    assert ticket.skipped and "budget" in ticket.reason
    clock.advance(0.003)
    assert saves.save(3, False, False, save, skip).skipped
    assert made == [0, 1]
    assert saves.take_pending() == 3  # the newest call not saved, once
    assert saves.take_pending() is None
    saves.put_back(3)
    clock.advance(1.0)
    ticket = saves.save(4, False, True, save, skip)  # within the budget, but the previous is in flight
    assert ticket.skipped and "in flight" in ticket.reason
    saves.put_back(3)  # older than the pending one: dropped
    assert saves.take_pending() == 4
    clock.advance(1.0)
    saves.save(5, False, False, save, skip)
    assert saves.take_pending() is None
    assert saves.decisions == Decisions(saved=3, skipped_by_budget=2, skipped_busy=1)


def test_a_save_the_daemon_skipped_or_that_failed_at_once_stays_pending() -> None:
    clock = FakeClock(0.0)
    saves = ContinuousSaves(0.05, clock)
    ticket = saves.save(7, False, False, lambda s, b: _Ticket(s, True), lambda s, r: _Ticket(s, True))
    assert ticket.skipped
    assert saves.take_pending() == 7
    clock.advance(1.0)
    down = _Ticket(8, error=ConnectionError("the daemon is unreachable"))
    assert saves.save(8, False, False, lambda s, b: down, lambda s, r: _Ticket(s, True)) is down
    assert saves.take_pending() == 8


def test_flushs_save_of_the_last_call_counts_its_stall_not_as_training_nor_as_a_decision() -> None:
    clock = FakeClock(0.0)
    saves = ContinuousSaves(0.05, clock)
    saves.save(0, False, False, lambda s, b: _Ticket(s), lambda s, r: _Ticket(s, True))  # the first: not charged
    with saves.saving_pending():
        clock.advance(1.0)  # flush() waited for it
    clock.advance(0.003)
    ticket = saves.save(1, False, False, lambda s, b: _Ticket(s), lambda s, r: _Ticket(s, True, r))
    assert ticket.skipped and "budget" in ticket.reason  # 1 s of checkpointing: paid for by 20 s of training
    assert saves.decisions == Decisions(saved=1, skipped_by_budget=1, skipped_busy=0)


def test_with_standby_durable_saves_and_hand_overs_each_keep_to_their_share_of_the_budget() -> None:
    clock = FakeClock()
    budget = SaveBudget(0.05, clock)
    step, save_cost, hand_cost = 0.001, 0.010, 0.0005
    trained = saved_stall = handed_stall = 0.0
    handed_at: list[int] = []
    for i in range(20_000):
        clock.advance(step)
        trained += step
        choice, entered = budget.enter(False, standby=True)
        cost = {Choice.SAVE: save_cost, Choice.HAND_OVER: hand_cost}.get(choice, 0.0)
        clock.advance(cost)
        saved_stall += cost if choice is Choice.SAVE else 0.0
        handed_stall += cost if choice is Choice.HAND_OVER else 0.0
        if choice is Choice.HAND_OVER:
            handed_at.append(i)
        budget.leave(choice, entered)
    assert saved_stall <= 0.05 * (1 - STANDBY_SHARE) * trained + 2 * save_cost
    assert handed_stall <= 0.05 * STANDBY_SHARE * trained + 3 * hand_cost
    decisions = budget.decisions
    assert decisions.handed_over > 10 * decisions.saved, "hand-overs, far cheaper, come far more often"
    assert max(b - a for a, b in zip(handed_at, handed_at[1:], strict=False)) < 50, "a hand-over every few steps"


def test_a_hand_over_that_could_not_be_made_counts_as_a_skip_by_the_budget() -> None:
    clock = FakeClock()
    budget = SaveBudget(0.05, clock)
    for _ in range(2):  # the first save is not charged; the second is
        choice, entered = budget.enter(False, standby=True)
        assert choice is Choice.SAVE
        clock.advance(0.01)
        budget.leave(choice, entered)
    clock.advance(0.001)
    choice, entered = budget.enter(False, standby=True)
    assert choice is Choice.HAND_OVER
    budget.leave(choice, entered, handed_over=False)
    assert budget.decisions == Decisions(saved=2, skipped_by_budget=1, skipped_busy=0, handed_over=0)


def test_a_hand_over_call_is_pending_and_reads_as_handed_over() -> None:
    clock = FakeClock()
    saves = ContinuousSaves(0.05, clock)

    def save(step: object, blocking: bool) -> _Ticket:
        clock.advance(0.01)
        return _Ticket(step)

    for step in (1, 2):  # the first save is not charged; the second is
        assert not saves.save(step, False, False, save, lambda s, r: _Ticket(s, True, r), lambda s: True).skipped
    clock.advance(0.001)
    ticket = saves.save(3, False, False, save, lambda s, r: _Ticket(s, True, r), lambda s: True)
    assert ticket.skipped and "standby" in ticket.reason
    assert saves.take_pending() == 3, "a hand-over is not durable: flush() and close() still save its step"


def _slowed_loop(budget: SaveBudget, clock: FakeClock, standby: bool, steps: int) -> tuple[float, float]:
    """Steps of 1 ms, 1.5 ms while a durable save is in flight (20 ms) or for 3 steps after a hand-over; a save
    stalls 2 ms, a hand-over 0.5 ms. Returns (what checkpointing cost: stalls and the slowed steps' extra,
    the training those steps would have taken unslowed)."""
    cost = quiet = 0.0
    in_flight_until, slowed_for = -1.0, 0
    for _ in range(steps):
        in_flight = clock.now < in_flight_until
        slowed = in_flight or slowed_for > 0
        clock.advance(0.0015 if slowed else 0.001)
        cost += 0.0005 if slowed else 0.0
        quiet += 0.001
        slowed_for = max(0, slowed_for - 1)
        choice, entered = budget.enter(clock.now < in_flight_until, standby=standby)
        stall = {Choice.SAVE: 0.002, Choice.HAND_OVER: 0.0005}.get(choice, 0.0)
        clock.advance(stall)
        cost += stall
        if choice is Choice.SAVE:
            in_flight_until = clock.now + 0.020
        elif choice is Choice.HAND_OVER:
            slowed_for = 3
        budget.leave(choice, entered)
    return cost, quiet


@pytest.mark.parametrize("standby", [False, True])
def test_steps_slowed_by_a_save_in_flight_or_a_hand_over_count_against_the_budget(standby: bool) -> None:
    clock = FakeClock()
    budget = SaveBudget(0.05, clock)
    cost, quiet = _slowed_loop(budget, clock, standby, 50_000)
    assert cost <= 0.05 * quiet * 1.02, f"checkpointing cost {cost / quiet:.2%} of training"
    assert budget.decisions.charged_seconds > 0, "the slowed steps were charged"
    assert cost >= 0.05 * quiet * 0.9, "and the budget is still spent, not wasted"


@pytest.mark.parametrize("in_flight", [False, True])
def test_a_pause_just_after_a_save_is_not_charged_as_a_slowed_step_and_saves_go_on(in_flight: bool) -> None:
    # An evaluation of 2 s right after a hand-over (or while a durable save is in flight) is a pause, not a
    # step the save slowed: charged whole, it would hold off the next one for 2 s / 5 % = 40 s of training.
    clock = FakeClock()
    budget = SaveBudget(0.05, clock)
    choices: list[Choice] = []

    def call(step: float, busy: bool = False) -> Choice:
        clock.advance(step)
        choice, entered = budget.enter(busy, standby=True)
        clock.advance({Choice.SAVE: 0.002, Choice.HAND_OVER: 0.0005}.get(choice, 0.0))
        budget.leave(choice, entered)
        choices.append(choice)
        return choice

    for _ in range(2000):  # 2 s of 1 ms steps: the quiet mean known, both pools paid up
        call(0.001)
    kind = Choice.SAVE if in_flight else Choice.HAND_OVER
    while call(0.001) is not kind:
        pass
    call(2.0, busy=in_flight)  # the pause
    before = len(choices)
    for _ in range(1000):  # 1 s more training
        call(0.001)
    made = choices[before:].count(kind)
    # Without the pause: saves (2 ms, 30 % of 5 %) about 7 a second, hand-overs (0.5 ms, 70 %) about 70.
    assert made >= (5 if in_flight else 50), f"{made} {kind.value} in the second after a pause"
    assert abs(budget._quiet - 0.001) < 0.0002, "the pause moved the quiet steps' mean"  # noqa: SLF001
