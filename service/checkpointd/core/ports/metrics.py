"""The counters the core and the save pipeline report to (`checkpointd.metrics.Metrics`), and the clock."""

from __future__ import annotations

from typing import Protocol


class Clock(Protocol):
    def __call__(self) -> float:
        """Seconds since the epoch."""


class MetricsSink(Protocol):
    """Receives every save outcome; `checkpointd.metrics` implements it."""

    def save_skipped(self, run: str, kind: str) -> None: ...

    def save_written(self, run: str, kind: str, bytes_written: int, seconds: float, at: float) -> None: ...

    def save_failed(self, run: str, kind: str, seconds: float) -> None: ...

    def save_cancelled(self, run: str, kind: str, seconds: float) -> None:
        """An accepted save's caller went away before it was written (no failure)."""

    def in_flight_changed(self, delta: int) -> None: ...

    def run_closed(self, run: str) -> None:
        """The run's lane closed: its per-run series can go."""


class NullSink:
    """A MetricsSink that records nothing."""

    def save_skipped(self, run: str, kind: str) -> None:
        pass

    def save_written(self, run: str, kind: str, bytes_written: int, seconds: float, at: float) -> None:
        pass

    def save_failed(self, run: str, kind: str, seconds: float) -> None:
        pass

    def save_cancelled(self, run: str, kind: str, seconds: float) -> None:
        pass

    def in_flight_changed(self, delta: int) -> None:
        pass

    def run_closed(self, run: str) -> None:
        pass


class PhaseSink(Protocol):
    """Times the phases of accepted saves and counts their transports (`checkpointd.metrics`)."""

    def observe_phase(self, kind: str, phase: str, seconds: float) -> None: ...

    def snapshot_received(self, kind: str, transport: str) -> None: ...

    def payload_bytes(self, kind: str, received: int, copied: int) -> None:
        """Counts one committed save's payload: bytes received, and bytes copied from its base."""

    def incremental_path(self, kind: str, path: str) -> None:
        """Counts one committed incremental save by its path (`checkpointd.core.incremental_path.PATHS`)."""

    def preemption_save(self, outcome: str, notice_to_durable: float | None) -> None:
        """Counts one accepted save on notice by outcome; `notice_to_durable`: seconds, if written and known."""

    def standby_save(self, outcome: str) -> None:
        """Counts one watched trainer's end by what became of its standby snapshot (`checkpointd.saves.standby`)."""


class NullPhases:
    """A PhaseSink that records nothing."""

    def observe_phase(self, kind: str, phase: str, seconds: float) -> None:
        pass

    def snapshot_received(self, kind: str, transport: str) -> None:
        pass

    def payload_bytes(self, kind: str, received: int, copied: int) -> None:
        pass

    def incremental_path(self, kind: str, path: str) -> None:
        pass

    def preemption_save(self, outcome: str, notice_to_durable: float | None) -> None:
        pass

    def standby_save(self, outcome: str) -> None:
        pass


class LeaseSink(Protocol):
    """Counts leases (`checkpointd.metrics.Metrics`)."""

    def leases_held(self, count: int) -> None: ...

    def lease_lost(self, run: str) -> None: ...


class NullLeaseSink:
    """A LeaseSink that counts nothing."""

    def leases_held(self, count: int) -> None:
        pass

    def lease_lost(self, run: str) -> None:
        pass
