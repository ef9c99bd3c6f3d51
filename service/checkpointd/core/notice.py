"""A daemon on notice: the phases from SIGTERM to exit, as a state machine.

A node being drained stops its trainers and its daemon at about the same
moment. The trainers' last snapshots (saves on notice) must still land, so
the daemon does not refuse saves at once:

- SERVING: everything is taken.
- ON_NOTICE: for `window` seconds the daemon keeps taking the saves of the
  runs registered on it (their trainers' final saves), and refuses every
  run it does not hold: a new run registers on another daemon. The window
  ends early once no open run can still send a final save: each has had a
  save on notice accepted, or was closed.
- DRAINING: every save is refused; accepted ones finish; then the server
  releases its leases and exits.

A window of 0 goes from SERVING to DRAINING at once (the behaviour before
the window existed). Decisions only: `checkpointd.saves.runs.Lanes` holds
its lock around every call and does the waiting.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection
from dataclasses import dataclass, field

from checkpointd.protocol.errors import UnavailableError


class Phase(enum.Enum):
    SERVING = "serving"
    ON_NOTICE = "on_notice"
    DRAINING = "draining"


class WindowEnd(enum.Enum):
    """Why the notice window ended (for the log)."""

    NO_WINDOW = "there is no window (--notice-window 0)"
    FINAL_SAVES_IN = "every run registered here has sent its save on notice or was closed"
    ELAPSED = "the window passed"


@dataclass
class Notice:
    """The daemon's phase. Not thread-safe: its caller holds one lock.

    Attributes:
        window: seconds ON_NOTICE lasts at most (`--notice-window`).
        daemon: how refusals name this daemon (host, pid, port).
    """

    window: float
    daemon: str = "this daemon"
    phase: Phase = Phase.SERVING
    ends_at: float | None = None  # monotonic end of the window, once on notice
    finals: set[str] = field(default_factory=set)  # runs whose save on notice was accepted

    def __post_init__(self) -> None:
        if not 0 <= self.window < math.inf:
            raise ValueError(f"notice window must be >= 0 and finite, got {self.window}")

    @property
    def draining(self) -> bool:
        """True from the notice on (health NOT_SERVING, new runs refused)."""
        return self.phase is not Phase.SERVING

    def refuses_saves(self, now: float) -> bool:
        """True once the window is over: every save is refused.

        Over at its end, whether or not the thread that drains has woken yet.
        """
        return self.phase is Phase.DRAINING or (
            self.phase is Phase.ON_NOTICE and self.ends_at is not None and now >= self.ends_at
        )

    def give(self, now: float) -> None:
        """The daemon was told to stop: ON_NOTICE for the window (DRAINING at once without one)."""
        if self.phase is not Phase.SERVING:
            return
        if self.window == 0:
            self.phase = Phase.DRAINING
            return
        self.phase = Phase.ON_NOTICE
        self.ends_at = now + self.window

    def left(self, now: float) -> float:
        """Seconds left of the window; 0 outside it."""
        if self.phase is not Phase.ON_NOTICE or self.ends_at is None:
            return 0.0
        return max(0.0, self.ends_at - now)

    def final_save(self, run: str) -> None:
        """A save on notice of `run` was accepted (or queued): its trainer needs no more of the window."""
        if self.phase is Phase.ON_NOTICE:
            self.finals.add(run)

    def window_end(self, open_runs: Collection[str], now: float) -> WindowEnd | None:
        """Why the window is over, or None while it lasts.

        Args:
            open_runs: the runs registered here and not closed.
            now: the monotonic time.
        """
        if self.phase is Phase.SERVING:
            return None
        if self.phase is Phase.DRAINING or self.ends_at is None:
            return WindowEnd.NO_WINDOW
        if not set(open_runs) - self.finals:
            return WindowEnd.FINAL_SAVES_IN
        if now >= self.ends_at:
            return WindowEnd.ELAPSED
        return None

    def drain(self) -> None:
        """The window is over: DRAINING."""
        self.phase = Phase.DRAINING

    def check_register(self, run: str, open_here: bool, now: float) -> None:
        """Refuses a registration the daemon must not take now.

        On notice, only a run registered (and open) here may register again;
        draining, none may.

        Raises:
            UnavailableError: naming this daemon, and where to retry.
        """
        over = self.refuses_saves(now)
        if self.phase is Phase.SERVING or (open_here and not over):
            return
        takes = "no runs or saves any more" if over else "no new runs"
        raise UnavailableError(
            f"{self.daemon} is draining (it was told to stop: its node is being drained, or the daemon is "
            f"restarting) and takes {takes}: register run {run!r} on another daemon (retry there; this one "
            "releases the runs it holds as it exits, so the next daemon takes them at once)"
        )
