"""Save on notice: one last checkpoint when the trainer is told it will be stopped.

Kubernetes, spot VMs and most schedulers announce a preemption with SIGTERM
and wait a grace period (30 s by default) before SIGKILL. Every
`RemoteCheckpointer` made with `save_on_notice=True` (the default) joins this
process's watch; the first one made on the main thread installs a SIGTERM
handler, chained to the handler that was there before it. On SIGTERM each
watched checkpointer takes a point-in-time snapshot at the step reached,
hands it to the daemon as a blocking save marked `on_notice` (never skipped:
it waits for the save in flight), waits until it is durable within its
`notice_deadline` (25 s from the notice by default), and logs one line per
run: "run R: preempted at step N: saved, durable in X ms", or what was lost
and why. Then the process ends as SIGTERM would have ended it: the previous
handler is put back and called (a user's handler still runs), or, if there
was none, the signal is raised again with the default action, so the exit
status is that of a process killed by SIGTERM. A second SIGTERM while the
notice is handled ends the process at once, with the default action.

Where the snapshot is taken (the safe point). Python runs a signal handler
on the main thread, between two bytecodes of whatever the main thread was
running; never inside a TensorFlow op or a compiled `tf.function` call (C++
returns first). So the handler itself is between TensorFlow calls, and it
saves right there, unless the main thread is inside a call of this client
(a save, flush, close, restore or construction): those hold the client's
locks (`DaemonSession.lock`, not reentrant) and its calls in flight, and a
save started from inside one would wait on the very call it interrupted.
Then the handler only records the notice, and the save runs when that
outermost client call returns (`client_call` counts them). A save that was
in flight when the notice came is waited for: a save on notice at the step
of the save just made waits for that save instead of sending another, by
looking at its ticket rather than on the ticket's lock, which a
`ticket.result()` the notice interrupted may hold (a ticket's wait is not a
client call: it may last as long as the save, and the notice must not). The
save itself runs under `tf.init_scope()`, so a notice that lands while a
`tf.function` is being traced, or under a gradient tape, takes its snapshot
eagerly and records nothing into the trace or the tape.

What the handler does before deciding is reentrancy-safe: the notice's
state (`NoticeMachine`) changes in a few bytecodes without calls, and the
handler takes no lock; a second signal that lands during the save sees the
state and ends the process. Two limits, stated rather than hidden: the
snapshot is point-in-time with respect to the main thread, so a trainer
whose training loop runs on another thread should call `preempted()` from
that thread between steps; and a step written as many eager ops (an
optimizer's update without `tf.function`) may be caught between two of them,
as any Python handler would catch it (TF-Agents' Learner and examples wrap
their train step in a function). Python locks the interrupted code holds
outside this client are the remaining risk of saving from a handler.

Whatever holds the save up (a main thread that stays inside a client call,
a daemon that does not answer, such a lock), the process ends by the
notice's deadline: a backstop thread, told of the notice through a pipe,
sends SIGTERM again `BACKSTOP_GRACE` seconds past the longest deadline if
the notice has not ended, and that ends the process at once (see `_Watch`).

Schedulers that announce a preemption otherwise (a preStop hook, a file or
metadata watcher, a cloud maintenance event) call `preempted()`, which saves
every watched checkpointer in the same way and returns what happened,
without ending the process. A checkpointer made outside the main thread
cannot install the handler: it joins the watch (so `preempted()` saves it)
and says so in the log.

Nothing here imports TensorFlow; the checkpointer takes the snapshot.
"""

from __future__ import annotations

import enum
import functools
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

_LOGGER = logging.getLogger(__name__)

DEFAULT_DEADLINE = 25.0  # seconds from the notice: Kubernetes' 30 s grace, less room to exit
BACKSTOP_GRACE = 3.0  # seconds past the longest deadline before the backstop ends the process (see _Watch)
NOTICE_OPTIONS = ("save_on_notice", "notice_deadline")
"""The keywords of a checkpointer's save on notice, as the Learner and common_module swaps pass them on."""

_F = TypeVar("_F", bound=Callable[..., Any])
_Handler = Callable[[int, Any], Any] | int | signal.Handlers | None


def check_deadline(notice_deadline: Any) -> float:
    """`notice_deadline`, checked: a finite number of seconds > 0.

    Raises:
        ValueError: naming the argument.
    """
    if (
        not isinstance(notice_deadline, int | float)
        or isinstance(notice_deadline, bool)
        or not 0 < notice_deadline < math.inf
    ):
        raise ValueError(f"notice_deadline must be a finite number of seconds > 0, got {notice_deadline!r}")
    return float(notice_deadline)


@dataclass(frozen=True)
class Notice:
    """When a notice came: the trainer's wall clock (sent to the daemon) and monotonic clock."""

    unix_seconds: float
    monotonic: float

    @staticmethod
    def now() -> Notice:
        return Notice(time.time(), time.monotonic())


@dataclass(frozen=True)
class NoticeOutcome:
    """What one checkpointer's save on notice came to.

    Attributes:
        run: the checkpointer's run.
        step: the step reached (None: no step variable among its objects).
        saved: True once a checkpoint of `step` is durable.
        durable_ms: notice to durable, in milliseconds (None unless saved).
        lost: for people, what is not in a durable checkpoint and why ("" if nothing).
    """

    run: str
    step: int | None
    saved: bool
    durable_ms: float | None = None
    lost: str = ""

    def line(self) -> str:
        """The one log line of the outcome."""
        at = f"step {self.step}" if self.step is not None else "an unknown step"
        if self.saved:
            return f"run {self.run}: preempted at {at}: saved, durable in {self.durable_ms:.0f} ms"
        return f"run {self.run}: preempted at {at}: not saved: {self.lost}"


class NoticeSaver(Protocol):
    """A checkpointer as the watch uses it (`RemoteCheckpointer`)."""

    @property
    def run(self) -> str: ...

    @property
    def notice_deadline(self) -> float:
        """Seconds from the notice within which its save must be durable."""

    def _save_on_notice(self, notice: Notice) -> NoticeOutcome:
        """Saves the step reached as a save on notice, within the checkpointer's deadline; never raises."""


class State(enum.Enum):
    WATCHING = "watching"  # no notice yet
    PENDING = "pending"  # noticed inside a client call: the save waits for it to return
    SAVING = "saving"  # the save on notice runs
    ENDED = "ended"  # saved (or not) and handed to the previous handler


class Action(enum.Enum):
    SAVE = "save"  # save now, here, then end as SIGTERM would
    DEFER = "defer"  # the outermost client call saves when it returns
    END_NOW = "end now"  # a second notice: end at once
    NONE = "none"


class NoticeMachine:
    """The notice's states and transitions; pure (no signals, no threads), for the handler to consult.

    Each transition reads and writes `state` without a call in between, so
    a handler running between two bytecodes of another sees either state.
    """

    def __init__(self) -> None:
        self.state = State.WATCHING
        self.notice: Notice | None = None

    def signalled(self, inside_client: bool, notice: Notice) -> Action:
        """A SIGTERM came; `inside_client`: the main thread is inside a client call."""
        if self.state is State.WATCHING:
            self.state = State.PENDING if inside_client else State.SAVING
            self.notice = notice
            return Action.DEFER if inside_client else Action.SAVE
        if self.state in (State.PENDING, State.SAVING):
            return Action.END_NOW
        return Action.NONE  # ended: the previous handler has SIGTERM back

    def left_client(self) -> Action:
        """The outermost client call of the main thread returned."""
        if self.state is State.PENDING:
            self.state = State.SAVING
            return Action.SAVE
        return Action.NONE

    def saved(self) -> None:
        """The save on notice ended (durable or not)."""
        if self.state is State.SAVING:
            self.state = State.ENDED


class _Watch:
    """The process's watched checkpointers, its SIGTERM handler and the main thread's client calls."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards `savers` changes and installing; never taken by the handler
        self.savers: list[NoticeSaver] = []
        self.machine = NoticeMachine()
        self.depth = 0  # client calls the main thread is inside; only the main thread changes it
        self.installed = False
        self.previous: _Handler = None
        self.overdue = False  # the backstop sent the SIGTERM that ends the process
        self._wake: int | None = None  # the backstop's pipe, written by the handler (a write takes no lock)

    def join(self, saver: NoticeSaver) -> None:
        """Watches `saver`; installs the handler if this is the main thread and it is not installed."""
        with self.lock:
            self.savers = [*self.savers, saver]  # a new list: the handler reads it without the lock
            if self.installed:
                return
            if threading.current_thread() is not threading.main_thread():
                _LOGGER.warning(
                    "run %s: made in thread %r: only the main thread can install the SIGTERM handler of the "
                    "save on notice, and none is installed; call checkpointd_client.preempted() when the "
                    "trainer gets notice (it saves this checkpointer too)",
                    saver.run, threading.current_thread().name,
                )  # fmt: skip
                return
            previous = signal.getsignal(signal.SIGTERM)
            if previous == signal.SIG_IGN or previous is None:
                _LOGGER.warning(
                    "run %s: SIGTERM is %s: no handler for the save on notice is installed; call "
                    "checkpointd_client.preempted() when the trainer gets notice",
                    saver.run, "ignored" if previous == signal.SIG_IGN else "handled outside Python",
                )  # fmt: skip
                return
            signal.signal(signal.SIGTERM, _on_sigterm)
            self.previous, self.installed = previous, True
            if self.machine.state is State.ENDED:  # a notice was handled and the process went on: watch anew
                self.machine = NoticeMachine()
            self._start_backstop()
        _LOGGER.debug("run %s: SIGTERM saves on notice (chained to %r)", saver.run, previous)

    def leave(self, saver: NoticeSaver) -> None:
        """Stops watching `saver`; the last one out puts the previous handler back (main thread only)."""
        with self.lock:
            self.savers = [s for s in self.savers if s is not saver]
            if self.savers or not self.installed or threading.current_thread() is not threading.main_thread():
                return
            if signal.getsignal(signal.SIGTERM) is _on_sigterm:
                signal.signal(signal.SIGTERM, self.previous if self.previous is not None else signal.SIG_DFL)
            self.installed, self.previous = False, None
            self._stop_backstop()

    def give_back(self) -> _Handler:
        """Puts the previous SIGTERM handler back; returns it (the handler is on the main thread)."""
        previous = self.previous if self.previous is not None else signal.SIG_DFL
        signal.signal(signal.SIGTERM, previous)
        self.installed, self.previous = False, None
        self._stop_backstop()
        return previous

    # The backstop: a notice ends the process by its deadline even if the save cannot start or end.
    #
    # A main thread that stays inside a client call (a flush or close without
    # a timeout, a daemon that does not answer) would hold the deferred save,
    # and the process would no longer end on SIGTERM. A thread started with
    # the handler waits on a pipe; the handler writes to it (no lock, so no
    # thread is started from a handler), and if the notice has not ended
    # `BACKSTOP_GRACE` seconds past the longest deadline it sends the process
    # SIGTERM again, which ends it at once.

    def _start_backstop(self) -> None:
        read, self._wake = os.pipe()
        os.set_blocking(self._wake, False)
        threading.Thread(target=self._backstop, args=(read,), name="checkpointd-notice-backstop", daemon=True).start()

    def _stop_backstop(self) -> None:
        wake, self._wake = self._wake, None
        if wake is not None:
            os.close(wake)  # the backstop reads the end of the pipe and ends

    def noticed(self) -> None:
        """Tells the backstop a notice came; from the handler."""
        wake = self._wake
        if wake is not None:
            try:
                os.write(wake, b"n")
            except OSError:  # full (it was told already) or closed: nothing to add
                pass

    def _backstop(self, read: int) -> None:
        with os.fdopen(read, "rb", buffering=0) as pipe:
            while pipe.read(1):
                machine, notice = self.machine, self.machine.notice
                if notice is None:
                    continue
                longest = max((s.notice_deadline for s in self.savers), default=0.0)
                time.sleep(max(0.0, notice.monotonic + longest + BACKSTOP_GRACE - time.monotonic()))
                if machine is self.machine and machine.state in (State.PENDING, State.SAVING):
                    _LOGGER.error(
                        "the save on notice has not ended %.1f s after the notice (%s); ending the process, as a "
                        "second SIGTERM does: what was not durable is lost",
                        time.monotonic() - notice.monotonic,
                        "the main thread is still inside a checkpointd_client call"
                        if machine.state is State.PENDING else "the save still runs",
                    )  # fmt: skip
                    self.overdue = True
                    os.kill(os.getpid(), signal.SIGTERM)


_WATCH = _Watch()


def join(saver: NoticeSaver) -> None:
    """Watches a checkpointer made with save_on_notice=True (see the module docstring)."""
    _WATCH.join(saver)


def leave(saver: NoticeSaver) -> None:
    """Stops watching a checkpointer (it was closed)."""
    _WATCH.leave(saver)


def client_call(method: _F) -> _F:
    """Marks a client method: a notice that lands inside it is saved when the outermost one returns."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return method(*args, **kwargs)
        _WATCH.depth += 1
        try:
            return method(*args, **kwargs)
        finally:
            _WATCH.depth -= 1
            if not _WATCH.depth and _WATCH.machine.left_client() is Action.SAVE:
                _save_then_end(signal.SIGTERM, None)

    return wrapper  # type: ignore[return-value]


def preempted() -> list[NoticeOutcome]:
    """Saves every watched checkpointer as on SIGTERM, for notices that come another way; returns the outcomes.

    Each saves the step reached as a save on notice (never skipped), waits
    until it is durable within its `notice_deadline`, and logs its line. The
    process goes on: ending it is the caller's. Call it from the training
    thread between steps for a point-in-time snapshot; from another thread
    (a watcher) the values are read while training goes on.

    Raises:
        RuntimeError: called on the main thread from inside a client call (a
            signal handler of the caller's that interrupted one): the save
            would wait on the call it interrupted.
    """
    if threading.current_thread() is threading.main_thread() and _WATCH.depth:
        raise RuntimeError(
            "checkpointd_client.preempted() was called inside a checkpointd_client call on the main thread (from a "
            "signal handler?); its save would wait on that call. Leave SIGTERM to the save on notice "
            "(save_on_notice=True), or call preempted() from the training loop"
        )
    return _save_all(Notice.now())


def _save_all(notice: Notice) -> list[NoticeOutcome]:
    outcomes = []
    for saver in _WATCH.savers:  # a list never changed in place: safe to read in a handler
        outcome = saver._save_on_notice(notice)  # noqa: SLF001 - the watch's side of the checkpointer
        (_LOGGER.warning if outcome.saved else _LOGGER.error)("%s", outcome.line())
        outcomes.append(outcome)
    return outcomes


def _on_sigterm(signum: int, frame: Any) -> None:
    notice = Notice.now()
    action = _WATCH.machine.signalled(_WATCH.depth > 0, notice)
    if action in (Action.SAVE, Action.DEFER):
        _WATCH.noticed()
    if action is Action.END_NOW:
        _end_now(signum)
    elif action is Action.SAVE:
        _save_then_end(signum, frame)
    elif action is Action.DEFER:
        _LOGGER.info("SIGTERM inside a checkpointd_client call: the save on notice follows when it returns")
    else:  # handled already and still installed (the previous handler went on): SIGTERM is that handler's
        _end(signum, frame)


def _save_then_end(signum: int, frame: Any) -> None:
    notice = _WATCH.machine.notice
    assert notice is not None
    savers = _WATCH.savers
    _LOGGER.warning(
        "SIGTERM: saving %s on notice (runs %s), each within its deadline",
        f"{len(savers)} checkpointer(s)", ", ".join(s.run for s in savers) or "none",
    )  # fmt: skip
    try:
        _save_all(notice)
    finally:
        _WATCH.machine.saved()
    _end(signum, frame)


def _end(signum: int, frame: Any) -> None:
    """Ends as SIGTERM would have without the save: the previous handler's way, or the default action."""
    previous = _WATCH.give_back()
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        os.kill(os.getpid(), signum)  # SIG_DFL again: killed by the signal, its exit status


def _end_now(signum: int) -> None:
    """A second notice while the first is handled: the default action, at once."""
    if not _WATCH.overdue:
        _LOGGER.error("a second SIGTERM during the save on notice: ending at once; that save is lost")
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
