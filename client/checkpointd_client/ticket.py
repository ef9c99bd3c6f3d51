"""What a save call returns: a ticket that ends in a result, an error or a skip."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from checkpointd.protocol.kinds import SaveKind


@dataclass(frozen=True)
class SaveResult:
    """A save the daemon made durable.

    Attributes:
        path: absolute path of the published export dir on the daemon's host.
        bytes_written: bytes the daemon wrote for this save.
        duration_seconds: from the daemon's accept to durable on disk.
        step: the train step read in the save's snapshot.
        kind: SAVED_MODEL for `save()`, CHECKPOINT for `save_checkpoint()`.
        bytes_received: payload bytes the daemon received (sent, or from
            shared memory).
        bytes_copied: payload bytes the daemon copied from the base save
            instead (an incremental save's unchanged chunks).
        incremental_path: how an incremental save's unchanged chunks got
            there, as the daemon chose for this save: "clone", "copy",
            "server_copy", "receive" (sent like the rest: cheaper there),
            "no_base"; "" for a save sent in full (or an older daemon).
    """

    path: str
    bytes_written: int
    duration_seconds: float
    step: int
    kind: SaveKind
    bytes_received: int = 0
    bytes_copied: int = 0
    incremental_path: str = ""


class SaveCounts:
    """How this saver's saves ended so far: durable, skipped, failed. Thread-safe.

    A failed save is one whose ticket holds an error, including a
    non-blocking save that failed because the daemon could not take it
    (see `checkpointd_client.transport.session`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._durable = self._skipped = self._failed = 0

    @property
    def durable(self) -> int:
        return self._durable

    @property
    def skipped(self) -> int:
        return self._skipped

    @property
    def failed(self) -> int:
        return self._failed

    def _count(self, ticket: SaveTicket) -> None:
        with self._lock:
            if ticket.skipped:
                self._skipped += 1
            elif ticket._error is not None:  # noqa: SLF001 - the ticket reports its own end
                self._failed += 1
            else:
                self._durable += 1

    def __repr__(self) -> str:
        return f"SaveCounts(durable={self._durable}, skipped={self._skipped}, failed={self._failed})"


# The Event of every ticket skipped at its making: set once, never cleared.
_ENDED = threading.Event()
_ENDED.set()


class SaveTicket:
    """One `save()` or `save_checkpoint()` call, from the daemon's decision to its end.

    `skipped` and `reason` are known when the save call returns. An accepted
    save ends later, when the daemon reports it durable or failed: `result()`
    waits for that. A ticket is completed once; its error, if any, is raised
    by every `result()` call.
    """

    def __init__(
        self, export_dir: str, kind: SaveKind, step: int, counts: SaveCounts | None = None, skipped: str | None = None
    ) -> None:
        """`skipped`: the reason of a ticket skipped at its making (uncounted), which then needs no Event of its
        own: a continuous checkpointer makes one per call that does not save, after every train step."""
        self._export_dir = export_dir
        self._counts = counts
        self._kind = kind
        self._step = step
        self._skipped = skipped is not None
        self._reason = skipped or ""
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._done = threading.Event() if skipped is None else _ENDED

    @property
    def export_dir(self) -> str:
        return self._export_dir

    @property
    def kind(self) -> SaveKind:
        return self._kind

    @property
    def step(self) -> int:
        """The train step in the save's snapshot."""
        return self._step

    @property
    def skipped(self) -> bool:
        """True if the save was skipped because another save of the run was in flight.

        Decided by the daemon, or by the saver itself under the run's busy
        lock (`checkpointd_client.local_decision`); exact either way.
        """
        return self._skipped

    @property
    def reason(self) -> str:
        """The daemon's reason for a skip, for people; empty otherwise."""
        return self._reason

    def done(self) -> bool:
        """True once the save is skipped, durable or failed."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> SaveResult | None:
        """Waits until the save is durable.

        Args:
            timeout: seconds to wait; None waits as long as the save takes
                (itself bounded by the saver's `timeout`, if it has one).

        Returns:
            The daemon's SaveResult, or None if the save was skipped.

        Raises:
            TimeoutError: if the save has not ended within `timeout`.
            CheckpointdError: the save's own error (a subclass), e.g.
                SaveFailedError if the daemon could not write it.
        """
        self._wait(timeout)
        if self._error is not None:
            raise self._error
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Waits like `result()`; returns the save's error, or None if it has none.

        Raises:
            TimeoutError: if the save has not ended within `timeout`.
        """
        self._wait(timeout)
        return self._error

    def __repr__(self) -> str:
        if not self.done():
            state = "pending"
        elif self._skipped:
            state = f"skipped ({self._reason})"
        elif self._error is not None:
            state = f"failed ({type(self._error).__name__})"
        else:
            state = "durable"
        return f"SaveTicket({self._kind.value} {self._export_dir!r} step={self._step}: {state})"

    def _wait(self, timeout: float | None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"save of step {self._step} to {self._export_dir!r} did not end within {timeout} s")

    # Completion, by the saver only; each is called at most once per ticket.

    def _skip(self, reason: str) -> None:
        self._skipped, self._reason = True, reason
        self._end()

    def _succeed(self, result: SaveResult) -> None:
        self._result = result
        self._end()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._end()

    def _end(self) -> None:
        if self._counts is not None:
            self._counts._count(self)  # noqa: SLF001 - counted before anyone waiting sees the end
        self._done.set()
