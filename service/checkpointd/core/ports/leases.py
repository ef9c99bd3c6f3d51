"""The Leases seam: which daemon of a fleet writes a run, and what only some Leases offer."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable


class Leases(Protocol):
    """Who writes a run, when several daemons share one store (`checkpointd.storage.s3.S3Leases`).

    A run is written by one daemon at a time: the one holding its lease.
    One store per daemon (local disk) needs none (`NoLeases`). Every method
    is thread-safe; `hold` and `check` of a run this daemon holds send no
    request.
    """

    def hold(self, run: str, deadline: float | None, waiting: Callable[[str], None] | None = None) -> None:
        """Makes this daemon the run's holder, or confirms it is; called before a run's template or save is written.

        Waits (until `deadline`, time.monotonic() seconds; None: no wait) for
        another daemon's lease to be released or to expire. Before it waits,
        it logs at INFO and calls `waiting` (once) with the same sentence:
        how long, and who holds the lease.

        Raises:
            RunHeldError: another daemon still holds it at the deadline
                (the message names the holder and when its lease expires).
            UnavailableError: the store cannot be reached.
        """

    def check(self, run: str) -> None:
        """Raises RunHeldError unless this daemon's lease on the run is still valid: the fence before a commit."""

    def release(self, run: str) -> None:
        """Lets go of the run's lease (the run closed or went idle); another daemon may take it at once."""

    def holder(self, run: str) -> str | None:
        """Who holds the run's lease now ("" if this daemon), None if nobody; for status."""

    def close(self) -> None:
        """Releases every lease this daemon holds and stops renewing (daemon shutdown)."""


class NoLeases:
    """The Leases of a store that one daemon owns alone: every run is always this daemon's."""

    def hold(self, run: str, deadline: float | None, waiting: Callable[[str], None] | None = None) -> None:
        pass

    def check(self, run: str) -> None:
        pass

    def release(self, run: str) -> None:
        pass

    def holder(self, run: str) -> str | None:
        return None

    def close(self) -> None:
        pass


@runtime_checkable
class LeaseHolders(Protocol):
    """Leases that tell every run's holder in one call (one listing of the lease objects), for status."""

    def holders(self, runs: Sequence[str]) -> Mapping[str, str | None]:
        """Each run's holder, as `Leases.holder` tells it."""
        ...


@runtime_checkable
class Described(Protocol):
    """A seam that says what it is, for the daemon's start-up log line (the fleet's leases)."""

    def describe(self) -> str:
        """A short phrase; "" for nothing to say."""
        ...
