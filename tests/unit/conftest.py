"""Fakes shared by the unit tests: a clock the test moves and a sink that records."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest


class FakeClock:
    """A Clock (seconds since the epoch) that only moves when the test says so."""

    def __init__(self, start: float = 1_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class RecordingSink:
    """A MetricsSink that keeps every call, in order, as a tuple."""

    calls: list[tuple] = field(default_factory=list)

    def save_skipped(self, run: str, kind: str) -> None:
        self.calls.append(("skipped", run, kind))

    def save_written(self, run: str, kind: str, bytes_written: int, seconds: float, at: float) -> None:
        self.calls.append(("written", run, kind, bytes_written, seconds, at))

    def save_failed(self, run: str, kind: str, seconds: float) -> None:
        self.calls.append(("failed", run, kind, seconds))

    def save_cancelled(self, run: str, kind: str, seconds: float) -> None:
        self.calls.append(("cancelled", run, kind, seconds))

    def in_flight_changed(self, delta: int) -> None:
        self.calls.append(("in_flight", delta))

    def run_closed(self, run: str) -> None:
        self.calls.append(("closed", run))

    def named(self, name: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == name]

    @property
    def in_flight(self) -> int:
        """The in-flight gauge a real sink would show now."""
        return sum(c[1] for c in self.named("in_flight"))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def sink() -> RecordingSink:
    return RecordingSink()
