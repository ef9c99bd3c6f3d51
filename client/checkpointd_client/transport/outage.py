"""Training never dies of a checkpoint: which save errors a trainer survives, and when it tries again.

A NON-blocking save whose daemon cannot take it (unreachable, shutting down, out of time, failing inside, out of
budget; see `survivable`) returns a failed ticket instead of raising. The
first such failure starts an outage: logged once at WARNING with the address
and the time of the next try; until then non-blocking saves fail at once,
without network I/O; the first save after it dials a fresh channel (and
registers the run again if the daemon restarted). Every failure doubles the
wait, up to `Outage.most`; the first save that gets an answer ends the
outage (logged at INFO). A blocking save, `flush` and `close` always try,
and raise. Programming errors still raise at once from any save: a closed
saver (RunClosedError), bad arguments (ValueError, TypeError), and the
daemon's INVALID_ARGUMENT (InvalidRequestError: the request itself is wrong,
so trying again cannot help), FAILED_PRECONDITION (the run was closed on the
daemon) and UNAUTHENTICATED (the token is wrong).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from checkpointd.protocol.errors import (
    ChecksumError,
    DeadlineError,
    LimitExceededError,
    RunHeldError,
    RunNotFoundError,
    SaveFailedError,
    UnavailableError,
)

# Errors a non-blocking save turns into a failed ticket: the daemon cannot
# take the save now, and a later save may get through.
_SURVIVABLE = (UnavailableError, DeadlineError, SaveFailedError, LimitExceededError, ChecksumError, RunHeldError,
               RunNotFoundError)  # fmt: skip


def survivable(error: BaseException) -> bool:
    """Whether a non-blocking save returns `error` on a failed ticket instead of raising it."""
    return isinstance(error, _SURVIVABLE)


class Outage:
    """Whether the daemon is out of reach now, and when the next non-blocking save may try it.

    Pure: the clock is injected; the session logs what its answers mean.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, first: float = 1.0, most: float = 30.0) -> None:
        self._clock = clock
        self.first, self.most = first, most
        self.since: float | None = None  # when the outage began; None while reachable
        self.failures = 0  # saves failed in this outage
        self._wait = 0.0
        self._retry_at = 0.0

    @property
    def active(self) -> bool:
        return self.since is not None

    def retry_in(self) -> float:
        """Seconds until a non-blocking save may try the daemon again (0.0: now)."""
        return max(0.0, self._retry_at - self._clock()) if self.since is not None else 0.0

    def failed(self) -> bool:
        """Records a failure; True if it began the outage. Each one doubles the wait, up to `most`."""
        began = self.since is None
        if began:
            self.since, self.failures, self._wait = self._clock(), 0, self.first
        else:
            self._wait = min(self.most, self._wait * 2)
        self.failures += 1
        self._retry_at = self._clock() + self._wait
        return began

    def failed_fast(self) -> None:
        """Records a save failed without trying (inside the wait)."""
        self.failures += 1

    def ended(self) -> float | None:
        """Records an answer from the daemon; the outage's seconds if one was going on."""
        if self.since is None:
            return None
        lasted, self.since = self._clock() - self.since, None
        return lasted
