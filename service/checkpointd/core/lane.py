"""One lane per run: the AsyncPolicySaver rules as an explicit state machine.

The lane decides; it never waits. Its caller (`checkpointd.saves.runs.Lanes`)
holds one lock around every call and waits on its own condition variable for
`Ticket.state` to change. Rules:
- one save in flight per run ("in flight" = receiving the snapshot + writing);
- a non-blocking save while another is in flight (or queued) is skipped, and
  the skip is returned and counted, never just logged;
- a blocking save queues behind the in-flight one, FIFO, and is never skipped;
- an accepted save is never replaced or dropped: it ends written or failed;
- a failure is reported to its caller and the lane keeps serving;
- close() refuses new saves at once; queued and in-flight saves still finish.
A save can also be in flight outside the lane's sight: a trainer that took
the run's busy lock itself (`checkpointd.transport.shm`) and has not sent its
header yet. Its caller then skips with `skip()`, and counts the saves a
trainer skipped on its own with `skipped_elsewhere()`.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field

from checkpointd.core.ports import Clock, MetricsSink
from checkpointd.protocol.errors import RunClosedError, UnavailableError
from checkpointd.protocol.kinds import SaveKind


class LaneState(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"  # close() called; saves still in flight or queued
    CLOSED = "closed"


class TicketState(enum.Enum):
    WAITING = "waiting"  # a blocking save queued behind the in-flight one
    ACTIVE = "active"  # accepted: the lane's one save in flight
    WRITTEN = "written"
    FAILED = "failed"
    CANCELLED = "cancelled"  # accepted, then its caller went away before it was written
    WITHDRAWN = "withdrawn"  # gave up while waiting; never accepted


@dataclass(frozen=True)
class SaveSpec:
    kind: SaveKind
    export_dir: str
    blocking: bool = False
    step: int = -1
    on_notice: bool = False  # a trainer's last save before it stops (SaveHeader.on_notice)


@dataclass(frozen=True)
class Skipped:
    """A non-blocking save that found the lane busy."""

    spec: SaveSpec
    reason: str


@dataclass(frozen=True)
class Written:
    path: str
    bytes_written: int
    bytes_received: int = 0  # of the payload: received (an incremental save's changed chunks)
    bytes_copied: int = 0  # of the payload: copied from its base


@dataclass(frozen=True)
class Failed:
    error: str


@dataclass(frozen=True)
class Cancelled:
    """An accepted save whose caller went away (Ctrl-C, a cancelled call) before it was written: not a failure."""

    reason: str


@dataclass
class Ticket:
    """One save request on a lane, from queueing or acceptance to its end."""

    id: int
    spec: SaveSpec
    state: TicketState
    requested_at: float
    accepted_at: float | None = None
    outcome: Written | Failed | Cancelled | None = None


@dataclass(frozen=True)
class LastSuccess:
    kind: SaveKind
    path: str
    step: int
    at: float
    bytes_received: int = 0
    bytes_copied: int = 0


@dataclass
class LaneStats:
    ok: int = 0
    skipped: int = 0
    failed: int = 0
    cancelled: int = 0
    last_success: LastSuccess | None = None
    last_error: str = ""


_ids = itertools.count(1)


@dataclass
class Lane:
    """The save lane of one run. Not thread-safe: callers hold one lock."""

    run: str
    clock: Clock
    sink: MetricsSink
    state: LaneState = LaneState.OPEN
    in_flight: Ticket | None = None
    waiting: deque[Ticket] = field(default_factory=deque)
    stats: LaneStats = field(default_factory=LaneStats)

    @property
    def idle(self) -> bool:
        """True when no save is in flight or queued."""
        return self.in_flight is None and not self.waiting

    def request(self, spec: SaveSpec, *, draining: bool = False) -> Ticket | Skipped:
        """Accepts, queues (blocking) or skips a save.

        Returns:
            An ACTIVE ticket (accepted), a WAITING ticket (blocking, queued),
            or Skipped.

        Raises:
            RunClosedError: if close() was called on the lane.
            UnavailableError: if `draining` (the daemon is shutting down).
        """
        self.check_open(spec, draining)
        ticket = Ticket(next(_ids), spec, TicketState.WAITING, requested_at=self.clock())
        if self.idle:
            self._start(ticket)
            return ticket
        if spec.blocking:
            self.waiting.append(ticket)
            return ticket
        busy = self.in_flight or self.waiting[0]
        self.stats.skipped += 1
        self.sink.save_skipped(self.run, spec.kind.value)
        return Skipped(
            spec,
            f"a {busy.spec.kind.value} save to {busy.spec.export_dir!r} is in flight",
        )

    def skip(self, spec: SaveSpec, reason: str, *, draining: bool = False) -> Skipped:
        """Skips (and counts) a non-blocking save that found the run busy elsewhere.

        Raises:
            RunClosedError, UnavailableError: as `request` does.
        """
        self.check_open(spec, draining)
        self.stats.skipped += 1
        self.sink.save_skipped(self.run, spec.kind.value)
        return Skipped(spec, reason)

    def skipped_elsewhere(self, kind: SaveKind, count: int = 1) -> None:
        """Counts saves a trainer skipped on its own (it found the busy lock taken)."""
        self.stats.skipped += count
        for _ in range(count):
            self.sink.save_skipped(self.run, kind.value)

    def finish(self, ticket: Ticket, outcome: Written | Failed | Cancelled) -> Ticket | None:
        """Ends the in-flight save and starts the next queued one, if any.

        Returns:
            The ticket that became ACTIVE, or None.
        """
        if ticket is not self.in_flight:
            raise ValueError(f"ticket {ticket.id} is not the in-flight save of {self.run!r}")
        now = self.clock()
        ticket.outcome = outcome
        duration = now - ticket.accepted_at if ticket.accepted_at is not None else 0.0
        kind = ticket.spec.kind.value
        if isinstance(outcome, Written):
            ticket.state = TicketState.WRITTEN
            self.stats.ok += 1
            self.stats.last_success = LastSuccess(
                ticket.spec.kind, outcome.path, ticket.spec.step, now, outcome.bytes_received, outcome.bytes_copied
            )
            self.sink.save_written(self.run, kind, outcome.bytes_written, duration, now)
        elif isinstance(outcome, Cancelled):
            ticket.state = TicketState.CANCELLED
            self.stats.cancelled += 1
            self.sink.save_cancelled(self.run, kind, duration)
        else:
            ticket.state = TicketState.FAILED
            self.stats.failed += 1
            self.stats.last_error = outcome.error
            self.sink.save_failed(self.run, kind, duration)
        self.in_flight = None
        self.sink.in_flight_changed(-1)
        if self.waiting:
            nxt = self.waiting.popleft()
            self._start(nxt)
            return nxt
        if self.state is LaneState.CLOSING:
            self._closed()
        return None

    def withdraw(self, ticket: Ticket) -> None:
        """Removes a queued blocking save whose caller gave up."""
        if ticket.state is TicketState.WAITING:
            self.waiting.remove(ticket)
            ticket.state = TicketState.WITHDRAWN
            if self.idle and self.state is LaneState.CLOSING:
                self._closed()

    def close(self) -> None:
        """Refuses new saves; the lane is CLOSED once queued saves end."""
        if self.state is LaneState.OPEN:
            self.state = LaneState.CLOSING
            if self.idle:
                self._closed()

    def reopen(self) -> None:
        """Opens a closed lane again (the run was registered anew)."""
        self.state = LaneState.OPEN

    def check_open(self, spec: SaveSpec, draining: bool) -> None:
        """Raises RunClosedError (closed) or UnavailableError (`draining`) as `request` does."""
        if self.state is not LaneState.OPEN:
            raise RunClosedError(
                f"run {self.run!r} is closed; register it again to save "
                f"({spec.kind.value} {spec.export_dir!r} refused)"
            )
        if draining:
            raise UnavailableError(
                f"the daemon is shutting down; save of run {self.run!r} to "
                f"{spec.export_dir!r} refused, retry against a running daemon"
            )

    def _closed(self) -> None:
        self.state = LaneState.CLOSED
        self.sink.run_closed(self.run)  # a finished run must not look stalled

    def _start(self, ticket: Ticket) -> None:
        ticket.state = TicketState.ACTIVE
        ticket.accepted_at = self.clock()
        self.in_flight = ticket
        self.sink.in_flight_changed(+1)
