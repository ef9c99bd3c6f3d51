"""Continuous saves: `save()` after every step, each call deciding locally whether it saves, within a budget.

A checkpointer made with `continuous=True` may be called after every train
step. Each call decides here, without an RPC and without a snapshot, whether
it saves; one that does not returns a skipped ticket in microseconds. The
rule (`SaveBudget`):

- The cost of a save is the time the training thread spent inside `save()`
  (the snapshot and the hand-over to the daemon), read with
  `time.perf_counter`, plus the CPU the save took off the training thread
  once it is durable (`SaveBudget.charge`): producing its requests, and on
  the same host the daemon's work that idle cores could not have run
  (`checkpointd_client.daemon_cpu`). On busy cores shared with training that
  CPU slows training as the stall does (the daemon's CPU for a save is
  often several times the trainer's stall). The calls that decided not to
  save cost their few microseconds too. So are its after-effects on training: the steps taken
  while a durable save is in flight (and the one during which it ended), and
  the first `AFTER_STEPS` steps after a hand-over, are each charged what
  they took beyond the mean of the quiet steps (neither; kept once
  `QUIET_LEAST` were seen; summed over the interval, so that the noise of
  single steps cancels, and only a sum above zero counts; a pause between
  calls, e.g. an evaluation, counts as at most `PAUSE` steps), and that extra
  time is not counted as training:
  the upload thread's and the daemon's share of the cores, the caches the
  copy emptied, whatever slows those steps. Training time is the wall time
  between calls, outside `save()`. The first save is not charged: its one-time costs (the graph
  described, the segment made and first touched, everything copied) are
  paid once whatever the budget.
- After a save that cost `s`, the next save waits until the training done
  since it is at least `s / budget` (the calls in between added to `s`), so
  every interval from one save to the next spends at most `budget` of its
  training on checkpointing, whatever a save costs: slow saves get rarer.
  It spends `HEADROOM` (90 %) of the budget so counted: the rest is for the
  costs it cannot see.
  Only the newest save's cost is not yet paid for by training after it.
- Within the budget, a call saves unless this checkpointer's previous save
  is still in flight (the daemon would skip it anyway): as often as the
  previous save allows. A slow disk keeps saves in flight longer, so they
  get rarer too, and training does not wait for them.

On the daemon's host (a save went through its shared memory), a call that
does not save may hand a standby snapshot over instead
(`checkpointd_client.standby`): a copy of what changed into a slot the
daemon writes only if this process ends before its next save. The budget is
then shared: hand-overs get `STANDBY_SHARE` of it and durable saves the
rest, each by the rule above (a hand-over costs its stall: the daemon does no
work for it). A hand-over is far cheaper than a durable save, so it comes
far more often, and a SIGKILL loses about the time since the last one.

A blocking save always saves (its stall counts, so the continuous saves after
it wait for training to pay for it). The last call that did not save is never
lost to this rule: `flush()`, `close()` and a save on notice save it first
(`ContinuousSaves.take_pending`); so is a call whose save the daemon skipped
or that failed at once (an outage's fail-fast).

The decisions are counted (`Decisions`), on the checkpointer only: they are
not reported to the daemon as its `local_skips`, which it counts as skipped
saves (the skip-ratio alert): with a save after every step nearly every call
is skipped by design, and that is not a save lost.

Nothing here imports TensorFlow.
"""

from __future__ import annotations

import contextlib
import enum
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from checkpointd.protocol.kinds import SaveKind
from checkpointd_client.ticket import SaveTicket

# Of training time, what a save may cost: the training thread's time in save(), and the CPU the
# save takes off it (requests produced, a same-host daemon's work beyond the idle cores').
DEFAULT_BUDGET = 0.05
# Of the budget, what the rule spends: it sees the stalls, the CPU a save takes off the training thread and
# the steps just after one, not all of its cost (the caches a copy or the daemon emptied beyond those steps,
# the allocator, the interpreter's own warming after a save); the rest is left for that (bench/README.md,
# "Continuous saves", has the runs that showed it).
HEADROOM = 0.9
# A checkpointer's continuous-save options, passed on by the module swaps (`checkpointd_client.learner`).
CONTINUOUS_OPTIONS = ("continuous", "budget")


class Choice(enum.Enum):
    """What one `save()` call of a continuous checkpointer does."""

    SAVE = "saved"
    SKIP_BUDGET = "skipped_by_budget"
    SKIP_BUSY = "skipped_busy"
    HAND_OVER = "handed_over"


_BUDGET_REASON = "within the checkpointing budget: the last save is not yet paid for by training"
_BUSY_REASON = "this checkpointer's previous save is still in flight"
HANDED_OVER_REASON = (
    "handed over as a standby snapshot, not yet durable: the daemon writes it if this process ends before its "
    "next save"
)
# Of the budget, the share that standby hand-overs may cost where they are made (the rest: durable
# saves). More than half: a process dies (SIGKILL, the OOM killer, a crash) far more often than a node,
# and a hand-over costs only its copy (no write, no daemon CPU), far less than a durable save.
STANDBY_SHARE = 0.7


@dataclass(frozen=True)
class Decisions:
    """How a continuous checkpointer's `save()` calls decided so far.

    Attributes:
        saved: calls that went to the daemon (their ends are in `counts`).
        skipped_by_budget: calls that did not save to keep within the budget.
        skipped_busy: calls within the budget that did not save because the
            previous save was still in flight.
        charged_seconds: the seconds charged to the budget beside the
            training thread's time in save(): what the saves cost off it,
            producing requests and (same host) the daemon's work, and the
            steps they slowed beyond the quiet steps' mean.
        handed_over: calls that did not save but handed a standby snapshot
            over (`checkpointd_client.standby`): written by the daemon only
            if the process ends before its next save.
    """

    saved: int = 0
    skipped_by_budget: int = 0
    skipped_busy: int = 0
    charged_seconds: float = 0.0
    handed_over: int = 0

    @property
    def calls(self) -> int:
        """Every `save()` call decided: saved, skipped either way, or handed over."""
        return self.saved + self.skipped_by_budget + self.skipped_busy + self.handed_over


def check_budget(budget: Any) -> float:
    """`budget`, checked: a fraction of training time, 0 < budget < 1.

    Raises:
        ValueError: naming the argument.
    """
    if not isinstance(budget, int | float) or isinstance(budget, bool) or not 0 < budget < 1 or math.isnan(budget):
        raise ValueError(
            f"budget must be the fraction of training time checkpointing may cost, 0 < budget < 1 "
            f"(e.g. 0.05 for 5 %), got {budget!r}"
        )
    return float(budget)


class _Pool:
    """One kind of save's share of the budget: what its last one and the calls since cost, and the training since."""

    def __init__(self, free: int) -> None:
        self.spent = 0.0  # seconds in save() since its last save began, that save included, and its charges
        self.trained = 0.0  # seconds of training since its last save returned
        self.saves = 0  # its saves so far: the first `free` are not charged
        self.free = free
        self.slowed = 0.0  # its slowed steps' time beyond the quiet steps' since its last save (signed: noise)

    def over(self, budget: float) -> bool:
        slowed = max(0.0, self.slowed)  # that time was checkpointing, not training
        return self.spent + slowed > budget * (self.trained - slowed)

    def saved(self, stall: float) -> float:
        """A new interval: this save is paid for by the training after it; returns the last one's slowed time."""
        slowed = max(0.0, self.slowed)
        self.saves += 1
        self.spent, self.trained, self.slowed = (stall if self.saves > self.free else 0.0), 0.0, 0.0
        return slowed

    def after(self, seconds: float) -> None:
        """Adds a step's time beyond the quiet steps' mean (negative: less) to this interval."""
        if self.saves > self.free:
            self.slowed += seconds


# After-effects: the steps taken while a durable save is in flight, and the first AFTER_STEPS steps after a
# hand-over, are compared with the quiet steps (neither), whose mean is kept over about 1 / QUIET_WEIGHT of
# them once QUIET_LEAST were seen. A step over PAUSE quiet steps is a pause between calls (an evaluation, a
# log, the loop doing other work), not a step a save slowed: it is charged at most (PAUSE - 1) quiet steps,
# and a quiet one does not move the mean. Else one evaluation of seconds just after a hand-over would be
# charged whole, and hold off every hand-over for a minute of training at a 5 % budget.
AFTER_STEPS = 3
QUIET_WEIGHT = 0.05
QUIET_LEAST = 20
PAUSE = 4.0


class SaveBudget:
    """The decision of each call (see the module docstring); `clock` is seconds, monotonic. Thread-safe."""

    def __init__(self, budget: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self._budget = check_budget(budget)
        self._clock = clock
        self._lock = threading.Lock()
        self._left_at: float | None = None  # when the last call returned
        # The first durable save's one-time costs (the graph described, the segment made and first
        # touched, everything copied) are paid once whatever the budget: charged, a first save of a
        # second would hold off the next one for 20 s of training at 5 %. So are the first hand-over
        # into each of the two standby slots (made, touched, copied whole).
        self._durable, self._standby = _Pool(free=1), _Pool(free=2)
        self._charged = 0.0  # seconds charged so far
        self._counts = [0, 0, 0, 0]  # saved, skipped by the budget, skipped busy, handed over
        self._quiet = 0.0  # the mean time of a quiet step (see AFTER_STEPS)
        self._quiet_seen = 0
        self._since_hand_over = AFTER_STEPS  # calls since the last hand-over
        self._in_flight = False  # the last call saw a save in flight

    @property
    def budget(self) -> float:
        return self._budget

    @property
    def decisions(self) -> Decisions:
        with self._lock:
            saved, by_budget, busy, handed = self._counts
            return Decisions(saved, by_budget, busy, self._charged, handed)

    def enter(
        self, in_flight: bool, forced: bool = False, counted: bool = True, standby: bool = False
    ) -> tuple[Choice, float]:
        """Decides a call at its start; returns the choice and the time it began (for `leave`).

        Args:
            in_flight: this checkpointer's previous save has not ended.
            forced: a save that never waits for the budget (blocking).
            counted: a `save()` call, counted in `decisions` (flush()'s save of
                the last call not saved is not one).
            standby: the call may hand over a standby snapshot instead: the
                budget is then shared between durable saves and hand-overs.
        """
        with self._lock:
            now = self._clock()
            if self._left_at is not None:
                trained = max(0.0, now - self._left_at)
                self._durable.trained += trained
                self._standby.trained += trained
                self._after(trained, in_flight)
            spend = self._budget * HEADROOM
            durable = spend * (1 - STANDBY_SHARE) if standby else spend
            # Counted by index, in Decisions' order: an Enum's hash is Python code, and this runs every step.
            over = self._durable.over(durable)
            if forced or not (in_flight or over):
                choice, index = Choice.SAVE, 0
            elif standby and not self._standby.over(spend * STANDBY_SHARE):
                choice, index = Choice.HAND_OVER, 3
            elif over:
                choice, index = Choice.SKIP_BUDGET, 1
            else:
                choice, index = Choice.SKIP_BUSY, 2
            self._counts[index] += counted
            return choice, now

    def _after(self, step: float, in_flight: bool) -> None:
        """Charges a step slowed by a save in flight or a hand-over just made, against the quiet steps' mean."""
        after_hand_over = self._since_hand_over < AFTER_STEPS
        self._since_hand_over += 1
        # A save that ended during this step slowed it too: the step after the last one that saw it in flight.
        in_flight, self._in_flight = in_flight or self._in_flight, in_flight
        known = self._quiet_seen >= QUIET_LEAST
        if not (in_flight or after_hand_over):
            if not known or step <= PAUSE * self._quiet:  # a pause does not move the mean
                self._quiet_seen += 1
                self._quiet += (step - self._quiet) / min(self._quiet_seen, 1 / QUIET_WEIGHT)
            return
        if known:
            extra = min(step - self._quiet, (PAUSE - 1) * self._quiet)
            (self._durable if in_flight else self._standby).after(extra)

    def charge(self, seconds: float) -> None:
        """Adds what the last save cost off the training thread (known once it is durable) to its interval."""
        with self._lock:
            if self._durable.saves > self._durable.free:
                self._durable.spent += max(0.0, seconds)
                self._charged += max(0.0, seconds)

    def leave(self, choice: Choice, entered: float, handed_over: bool = True) -> None:
        """Counts the call's time in save() against the budget, once it returns (or raises).

        `handed_over`: a HAND_OVER call did hand one over (else it counts as a skip).
        """
        with self._lock:
            now = self._clock()
            stall = max(0.0, now - entered)
            if choice is Choice.SAVE:
                self._charged += self._durable.saved(stall)
            elif choice is Choice.HAND_OVER and handed_over:
                self._charged += self._standby.saved(stall)
                self._since_hand_over = 0
            else:
                if choice is Choice.HAND_OVER:  # not made after all: a skip by the budget
                    self._counts[3] -= 1
                    self._counts[1] += 1
                self._durable.spent += stall
            self._left_at = now


class NotSavedTicket(SaveTicket):
    """The skipped ticket of a call that did not save; its step is read when first asked.

    Reading a step variable costs more than the decision itself (tens of
    microseconds), so a call that does not save does not read it: `step`
    and `export_dir` are those of `global_step` when first asked (an int
    given is that int; a variable, its value then).
    """

    def __init__(self, global_step: Any, export_dir: Callable[[int], str], kind: SaveKind, reason: str) -> None:
        super().__init__("", kind, -1, skipped=reason)
        self._global_step: Any = global_step
        self._name = export_dir

    def _read(self) -> None:
        if self._global_step is not None:
            step = int(np.asarray(self._global_step))
            self._step, self._export_dir, self._global_step = step, self._name(step), None

    @property
    def step(self) -> int:
        self._read()
        return self._step

    @property
    def export_dir(self) -> str:
        self._read()
        return self._export_dir

    def __repr__(self) -> str:
        self._read()
        return super().__repr__()


class _Ticket(Protocol):
    @property
    def skipped(self) -> bool: ...

    def done(self) -> bool: ...

    def exception(self, timeout: float | None = None) -> BaseException | None: ...


T = TypeVar("T", bound=_Ticket)


class ContinuousSaves:
    """What `continuous=True` adds to a checkpointer's `save()`: the decision, its count, the last call not saved."""

    def __init__(self, budget: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self._budget = SaveBudget(budget, clock)
        self._lock = threading.Lock()
        self._pending: Any = None  # the global_step of the last call that did not save, if no save came after

    @property
    def budget(self) -> float:
        return self._budget.budget

    @property
    def decisions(self) -> Decisions:
        return self._budget.decisions

    def save(
        self,
        global_step: Any,
        blocking: bool,
        in_flight: bool,
        save: Callable[[Any, bool], T],
        skip: Callable[[Any, str], T],
        hand_over: Callable[[Any], bool] | None = None,
    ) -> T:
        """One `save()` call: `save(global_step, blocking)` if it saves, else `skip(global_step, reason)`.

        `hand_over(global_step)`: hands a standby snapshot over, False if it
        cannot; given, a call that does not save may do that instead.
        """
        choice, entered = self._budget.enter(in_flight, forced=blocking, standby=hand_over is not None)
        handed = True
        try:
            if choice is Choice.HAND_OVER:
                assert hand_over is not None
                self._set_pending(global_step)  # not durable: flush() and close() still save it
                handed = False
                handed = hand_over(global_step)
                return skip(global_step, HANDED_OVER_REASON if handed else _BUDGET_REASON)
            if choice is not Choice.SAVE:
                self._set_pending(global_step)
                return skip(global_step, _BUDGET_REASON if choice is Choice.SKIP_BUDGET else _BUSY_REASON)
            ticket = save(global_step, blocking)
            # Skipped by the daemon (another saver's save of the run in flight), or failed
            # at once (the daemon unreachable: the outage's rule): still the last call not saved.
            failed = ticket.done() and ticket.exception(0) is not None
            self._set_pending(global_step if ticket.skipped or failed else None)
            return ticket
        finally:
            self._budget.leave(choice, entered, handed)

    def charge(self, seconds: float) -> None:
        """What the last save cost off the training thread, once known (`SaveBudget.charge`)."""
        self._budget.charge(seconds)

    @contextlib.contextmanager
    def saving_pending(self) -> Iterator[None]:
        """Around flush()'s or close()'s save of the last call not saved: a save whose stall counts, as a
        blocking one's does, not training (uncounted in `decisions`)."""
        choice, entered = self._budget.enter(False, forced=True, counted=False)
        try:
            yield
        finally:
            self._budget.leave(choice, entered)

    def take_pending(self) -> Any:
        """The global_step of the last call that did not save (None if a save came after it), now taken."""
        with self._lock:
            pending, self._pending = self._pending, None
            return pending

    def put_back(self, global_step: Any) -> None:
        """A taken pending save that did not happen, unless a newer call is pending."""
        with self._lock:
            if self._pending is None:
                self._pending = global_step

    def _set_pending(self, global_step: Any) -> None:
        with self._lock:
            self._pending = global_step
