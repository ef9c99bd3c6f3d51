"""Every run's lane behind one lock: the threads and the waiting live here.

The core `Lane` decides (accept, queue, skip); this module makes callers wait
for those decisions with deadlines, and never holds the lock while a save is
received or written. Lock discipline: `_cond` guards `_runs`, every lane in
it, and `_notice` (the daemon's phase, `checkpointd.core.notice`); it is
released by `wait`, and notified whenever a lane or the phase changes state.

Busy locks (`checkpointd.transport.shm.RunLock`, when the daemon has shared
memory): the daemon holds a run's lock from the accept of each save it
decides (its lane goes from idle to busy) until the lane is idle again, so
a trainer that takes the lock itself never meets a busy lane. While a
trainer holds it, an ordinary non-blocking save is skipped and a blocking
one waits here, polling the lock with a short back-off (a flock cannot be
waited on together with the condition), within its deadline; blocking
saves therefore queue FIFO behind saves the daemon holds the lock for, but
not behind a trainer's. A trainer-decided save (the trainer took the lock
and decided skip-if-busy itself; `held` on the wire) is started on an idle
lane without a decision.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from checkpointd.core.lane import (
    Cancelled,
    Failed,
    Lane,
    LaneState,
    SaveSpec,
    Skipped,
    Ticket,
    TicketState,
    Written,
)
from checkpointd.core.notice import Notice, WindowEnd
from checkpointd.core.ports import Clock, MetricsSink, NullSink
from checkpointd.core.variable_manifest import Manifest
from checkpointd.protocol.errors import DeadlineError, RunClosedError, RunNotFoundError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.saves.registrations import RunEntry, RunView, check_registration, unknown_run
from checkpointd.transport.shm import RunLock

_LOGGER = logging.getLogger(__name__)


class TrainerDecidedError(RunClosedError):
    """A trainer-decided save (the trainer holds the busy lock) met a busy lane or a stale lock: FAILED_PRECONDITION."""


# Back-off of a blocking save polling a busy lock a trainer holds: first and longest wait, seconds.
_POLL_FIRST, _POLL_MOST = 0.001, 0.02


class Lanes:
    """The daemon's runs: register, begin/finish saves, flush, close, drain."""

    def __init__(self, clock: Clock = time.time, sink: MetricsSink | None = None, notice_window: float = 0.0) -> None:
        """`notice_window`: seconds the runs registered here keep saving after `give_notice`."""
        self._clock = clock
        self._sink = sink or NullSink()
        self._cond = threading.Condition()
        self._runs: dict[str, RunEntry] = {}
        self._notice = Notice(notice_window)
        self._registering: dict[str, str] = {}  # run -> the folder its registration in progress names

    @property
    def draining(self) -> bool:
        """True from the notice on: new runs are refused (and every save once the window is over)."""
        return self._notice.draining

    @property
    def _draining(self) -> bool:
        """Every save is refused (the window is over); the caller holds the lock."""
        return self._notice.refuses_saves(time.monotonic())

    def count(self) -> int:
        """How many runs are registered."""
        with self._cond:
            return len(self._runs)

    def register(
        self,
        run: str,
        manifest: Manifest,
        folder: str | None = None,
        claim: str | None = None,
        kinds: tuple[SaveKind, ...] = (),
    ) -> None:
        """Adds a run, or reopens it for its restarted trainer with a new manifest.

        An open run registered again is the same stream only if it writes
        the same folder, the same kinds and the same claimed dir (a trainer
        that restarted without closing); anything else is another stream
        that happens to have its name, refused so that neither moves or
        breaks the other. A closed run takes whatever it is registered with.

        Args:
            run: the run.
            manifest: what its saves must match.
            folder: where the run's saves land under the root; None: the run's name.
            claim: the checkpoint dir of the folder the run alone writes while
                it is open (a training run's); None: none.
            kinds: the saves the run makes; () leaves them unchecked.

        Raises:
            AlreadyExistsError: another open run of the folder claims `claim`,
                or the run is open for another folder, kind of save or dir;
                nothing changes.
            UnavailableError: the daemon is on notice and the run is not open
                here, or the daemon is draining.
        """
        folder = folder or run
        with self._cond:
            self._check_registration(run, folder, claim, kinds)
            entry = self._runs.get(run)
            if entry is None:
                self._runs[run] = RunEntry(Lane(run, self._clock, self._sink), manifest, folder, claim, kinds)
            else:
                entry.manifest = manifest
                entry.folder = folder
                entry.claim = claim
                entry.kinds = kinds or entry.kinds
                entry.lane.reopen()
            self._cond.notify_all()

    @contextlib.contextmanager
    def registering(self, run: str, folder: str) -> Iterator[None]:
        """For the length of a registration: the folder it names, for `registering_folder`.

        The run's lease is taken before the run is registered here, and
        whatever acts on a lease just taken (a takeover's retention) needs
        the run's folder, which is not the run's name for most runs.
        """
        with self._cond:
            self._registering[run] = folder
        try:
            yield
        finally:
            with self._cond:
                self._registering.pop(run, None)

    def registering_folder(self, run: str) -> str | None:
        """The folder a registration of `run` in progress names; None if none is."""
        with self._cond:
            return self._registering.get(run)

    def check_registration(
        self, run: str, folder: str | None, claim: str | None = None, kinds: tuple[SaveKind, ...] = ()
    ) -> None:
        """Raises what `register` would raise for these arguments; nothing changes.

        The pipeline asks before it takes the run's lease or stores its
        template, so a refused registration leaves the open run as it was.

        Raises:
            AlreadyExistsError, UnavailableError: see `register`.
        """
        with self._cond:
            self._check_registration(run, folder or run, claim, kinds)

    def _check_registration(self, run: str, folder: str, claim: str | None, kinds: tuple[SaveKind, ...]) -> None:
        """See `register`; the caller holds the lock."""
        entry = self._runs.get(run)
        # A daemon on notice takes no new run (UNAVAILABLE, naming it) before anything else is said.
        self._notice.check_register(run, entry is not None and entry.lane.state is LaneState.OPEN, time.monotonic())
        check_registration(self._runs, run, folder, claim, kinds)

    def claim(self, run: str) -> str | None:
        """The checkpoint dir the run claims (None: none).

        Raises:
            RunNotFoundError: if the run was never registered.
        """
        with self._cond:
            return self._get(run).claim

    def manifest(self, run: str) -> Manifest:
        """The run's manifest.

        Raises:
            RunNotFoundError: if the run was never registered.
        """
        with self._cond:
            return self._get(run).manifest

    def folder(self, run: str) -> str:
        """The folder the run's saves land in, under the root.

        Raises:
            RunNotFoundError: if the run was never registered.
        """
        with self._cond:
            return self._get(run).folder

    def begin(
        self,
        run: str,
        spec: SaveSpec,
        *,
        timeout: float | None = None,
        is_active: Callable[[], bool] = lambda: True,
        lock: RunLock | None = None,
        trainer_decided: bool = False,
    ) -> Ticket | Skipped:
        """Asks the run's lane for a save; a blocking save waits its turn here.

        Args:
            run: the run.
            spec: the save.
            timeout: seconds a blocking save may wait for the in-flight one.
            is_active: False once the caller has gone away; the caller's
                RPC calls `wake` when it does, so the wait need not poll.
            lock: the run's busy lock (kept from the first save that gives
                one); None: the daemon has no shared memory.
            trainer_decided: the caller's trainer decided the save under the busy lock it holds: start it
                on the idle lane, or TrainerDecidedError.

        Returns:
            An ACTIVE ticket (the caller must `finish` it) or Skipped.

        Raises:
            RunNotFoundError, RunClosedError, UnavailableError: as the lane says.
            DeadlineError: a blocking save waited longer than `timeout`, or
                its caller went away.
            TrainerDecidedError: `trainer_decided`, and the lane has a save in flight or queued.
        """
        # gRPC reports a call without a deadline as ~292 years left, past what a
        # lock can wait (threading.TIMEOUT_MAX): that is no deadline.
        deadline = None if timeout is None or timeout >= threading.TIMEOUT_MAX else time.monotonic() + timeout
        poll = _POLL_FIRST
        with self._cond:
            while True:
                entry = self._get(run)
                lane = entry.lane
                lane.check_open(spec, draining=self._draining)  # a closed run's lock is not touched
                if lock is not None and not lock.closed and (entry.lock is None or entry.lock.closed):
                    entry.lock = lock
                lock = entry.lock if entry.lock is not None and not entry.lock.closed else None
                if trainer_decided:
                    return self._begin_trainer_decided(run, entry, spec)
                trainers = lane.in_flight is not None and lane.in_flight is entry.decided_ticket
                if lock is not None and not entry.locked and (lane.idle or trainers):
                    # Free, or held by a trainer: now, or for a trainer-decided save in flight.
                    if lane.idle and lock.try_hold():
                        pass  # held by the daemon for this save from now on
                    elif not spec.blocking:
                        if lane.idle:
                            return lane.skip(spec, _HELD_REASON, draining=self._draining)
                        # else the lane skips it below, naming the save in flight
                    else:
                        lane.check_open(spec, draining=self._draining)
                        self._wait_poll(run, spec, deadline, poll, is_active)
                        poll = min(2 * poll, _POLL_MOST)
                        continue
                try:
                    decision = lane.request(spec, draining=self._draining)
                except BaseException:
                    self._unlock_idle(entry)
                    raise
                break
            if isinstance(decision, Ticket) and spec.on_notice:
                self._notice.final_save(run)  # accepted or queued: it is drained
                self._cond.notify_all()
            if isinstance(decision, Skipped) or decision.state is TicketState.ACTIVE:
                return decision
            while decision.state is TicketState.WAITING:
                remaining = None if deadline is None else deadline - time.monotonic()
                if (remaining is not None and remaining <= 0) or not is_active():
                    self._runs[run].lane.withdraw(decision)
                    self._unlock_idle(self._runs[run])
                    self._cond.notify_all()
                    raise DeadlineError(
                        f"blocking save of run {run!r} to {spec.export_dir!r} gave up waiting for the save in flight"
                    )
                self._cond.wait(remaining)  # `wake` when a caller goes away
            return decision

    def _begin_trainer_decided(self, run: str, entry: RunEntry, spec: SaveSpec) -> Ticket:
        lane = entry.lane
        lane.check_open(spec, draining=self._draining)  # a closed or draining run says so first
        if not lane.idle:
            busy = lane.in_flight or lane.waiting[0]
            raise TrainerDecidedError(
                f"run {run!r}: a save sent as holding the run's busy lock found a {busy.spec.kind.value} "
                f"save to {busy.spec.export_dir!r} in flight, so the client did not hold the lock "
                "the daemon offered; nothing was written. Send saves without `held` (or fix the client)"
            )
        if entry.lock is None or entry.lock.try_hold():
            if entry.lock is not None:
                entry.lock.release()
            raise TrainerDecidedError(
                f"run {run!r}: a save sent as holding the run's busy lock, but nobody holds it; "
                "nothing was written. Take the lock (SharedMemory.lock_path) before sending `held`, "
                "or send the save without it"
            )
        ticket = lane.request(spec, draining=self._draining)
        assert isinstance(ticket, Ticket) and ticket.state is TicketState.ACTIVE
        entry.decided_ticket = ticket
        if spec.on_notice:
            self._notice.final_save(run)
            self._cond.notify_all()
        return ticket

    def _wait_poll(
        self, run: str, spec: SaveSpec, deadline: float | None, poll: float, is_active: Callable[[], bool]
    ) -> None:
        """Waits up to `poll` seconds (under the lock's condition) for a busy lock a trainer holds."""
        remaining = None if deadline is None else deadline - time.monotonic()
        if (remaining is not None and remaining <= 0) or not is_active():
            raise DeadlineError(
                f"blocking save of run {run!r} to {spec.export_dir!r} gave up waiting for the save in flight"
            )
        self._cond.wait(poll if remaining is None else min(poll, remaining))

    def _unlock_idle(self, entry: RunEntry) -> None:
        """Lets go of the run's busy lock once its lane is idle."""
        if entry.lock is not None and entry.lane.idle:
            entry.lock.release()  # a no-op unless the daemon holds it

    def forget_lock(self, run: str) -> None:
        """Lets go of the run's busy lock (its run closed); the next save that may use shared memory brings a new one."""
        with self._cond:
            entry = self._runs.get(run)
            if entry is not None and entry.lock is not None:
                entry.lock.release()
                entry.lock = None

    def skipped_elsewhere(self, run: str, kinds: Sequence[SaveKind]) -> None:
        """Counts saves of `run` its trainer skipped on its own (one per kind listed).

        Raises:
            RunNotFoundError: the run is not registered.
        """
        with self._cond:
            lane = self._get(run).lane
            for kind in kinds:
                lane.skipped_elsewhere(kind)

    def wake(self) -> None:
        """Wakes waiting blocking saves to check their callers (one went away)."""
        with self._cond:
            self._cond.notify_all()

    def finish(self, run: str, ticket: Ticket, outcome: Written | Failed | Cancelled) -> None:
        """Ends an accepted save; the next queued blocking save starts."""
        with self._cond:
            entry = self._runs[run]
            if entry.decided_ticket is ticket:
                entry.decided_ticket = None
            started = entry.lane.finish(ticket, outcome)
            if started is not None and entry.lock is not None and not entry.locked:
                # A save queued before the run had a lock: it holds it from now on.
                if not entry.lock.try_hold():
                    _LOGGER.warning("run %s: its busy lock is held elsewhere while a save starts", run)
            self._unlock_idle(entry)  # before the caller hears the result
            self._cond.notify_all()

    def flush(self, run: str | None = None, timeout: float | None = None) -> list[str]:
        """Waits until no save is in flight or queued (one run, or all).

        Returns:
            The runs flushed.

        Raises:
            RunNotFoundError: `run` is unknown.
            DeadlineError: saves were still in flight after `timeout` seconds.
        """
        with self._cond:
            names = [run] if run else sorted(self._runs)
            for name in names:
                self._named(name)

            def idle() -> bool:
                return all(self._runs[n].lane.idle for n in names)

            if not self._cond.wait_for(idle, timeout):
                busy = [n for n in names if not self._runs[n].lane.idle]
                raise DeadlineError(
                    f"flush timed out after {timeout:g}s; saves still in flight for runs: " + ", ".join(busy)
                )
            return names

    def close(self, run: str, timeout: float | None = None) -> None:
        """Refuses new saves on `run` at once, then waits for its lane to end.

        Raises:
            RunNotFoundError: `run` is unknown.
            DeadlineError: saves were still in flight after `timeout` seconds;
                the run stays closing and closes when they end.
        """
        with self._cond:
            lane = self._named(run).lane
            lane.close()
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: lane.state is LaneState.CLOSED, timeout):
                raise DeadlineError(
                    f"close of run {run!r} timed out after {timeout:g}s; it closes when its " "save in flight ends"
                )

    def drain(self) -> None:
        """Refuses every new save from now on (the daemon is shutting down)."""
        with self._cond:
            self._notice.drain()
            self._cond.notify_all()

    # The daemon on notice (checkpointd.core.notice).

    def give_notice(self, daemon: str) -> None:
        """The daemon was told to stop: new runs are refused, the runs registered here keep saving for the window.

        Args:
            daemon: how refusals name this daemon (host, pid, port).
        """
        with self._cond:
            self._notice.daemon = daemon
            self._notice.give(time.monotonic())
            self._cond.notify_all()

    def notice_left(self) -> float:
        """Seconds left of the notice window (0 outside it)."""
        with self._cond:
            return self._notice.left(time.monotonic())

    def wait_window(self) -> WindowEnd:
        """Waits for the notice window to end (at most its length); returns why it ended.

        Raises:
            RuntimeError: no notice was given (there is no window to wait for).
        """
        with self._cond:
            if not self._notice.draining:
                raise RuntimeError("wait_window() before give_notice()")
            while True:
                now = time.monotonic()
                end = self._notice.window_end(self._open_runs(), now)
                if end is not None:
                    return end
                self._cond.wait(self._notice.left(now))  # woken by a save on notice or a close

    def _open_runs(self) -> list[str]:
        return [name for name, entry in self._runs.items() if entry.lane.state is LaneState.OPEN]

    def views(self, run: str | None = None) -> list[RunView]:
        """Copies of the runs' state, for status."""
        with self._cond:
            names = [run] if run else sorted(self._runs)
            return [RunView.of(name, self._named(name)) for name in names]

    def _get(self, run: str) -> RunEntry:
        """The run a trainer names (its saver registers it again on NOT_FOUND)."""
        entry = self._runs.get(run)
        if entry is None:
            raise RunNotFoundError(
                f"run {run!r} is not registered on this daemon (never registered, or the "
                "daemon restarted): register it first"
            )
        return entry

    def _named(self, run: str) -> RunEntry:
        """The run an operator names (flush, close, status): unknown ones are told apart from the rest."""
        entry = self._runs.get(run)
        if entry is None:
            raise unknown_run(run, self._runs)
        return entry


_HELD_REASON = "a save of this run is in flight (a trainer on the daemon's host holds its busy lock)"
