"""Skipped saves in the log: a run's first at WARNING, later ones at DEBUG, a count at INFO.

A trainer that saves often skips often, by design (skip-if-busy); one
WARNING per skip drowns the log. Every skip is still returned to its caller
and counted in the metrics; the log says once that a run skips, then how
many, at most every `every` seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

REPORT_EVERY = 60.0
"""Seconds between a run's INFO counts of skips, while it keeps skipping."""


@dataclass
class _RunSkips:
    since_report: int = 0  # skips not yet in a count
    total: int = 0
    reported_at: float = 0.0


class SkipLog:
    """Logs skipped saves per run, as the module docstring says. Thread-safe."""

    def __init__(
        self,
        logger: logging.Logger,
        every: float = REPORT_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._every = every
        self._clock = clock
        self._lock = threading.Lock()
        self._runs: dict[str, _RunSkips] = {}

    def skipped(self, run: str, kind: str, export_dir: str, step: int, reason: str) -> None:
        """Logs one skipped save of `run`."""
        now = self._clock()
        with self._lock:
            skips = self._runs.get(run)
            first = skips is None
            if skips is None:
                skips = self._runs[run] = _RunSkips(reported_at=now)
            skips.total += 1
            skips.since_report += 0 if first else 1
            report = None
            if not first and now - skips.reported_at >= self._every:
                report = (skips.since_report, now - skips.reported_at, skips.total)
                skips.since_report, skips.reported_at = 0, now
        line = "skipped run=%s kind=%s export_dir=%s step=%d: %s"
        if first:
            self._logger.warning(
                line + " (this run's later skips are logged at DEBUG, with a count every %.0fs)",
                run, kind, export_dir, step, reason, self._every,
            )  # fmt: skip
            return
        self._logger.debug(line, run, kind, export_dir, step, reason)
        if report is not None:
            count, seconds, total = report
            self._logger.info(
                "run=%s skipped %d saves in the last %.0fs (%d since its first skip): it asks to save "
                "faster than its saves finish",
                run, count, seconds, total,
            )  # fmt: skip

    def forget(self, run: str) -> None:
        """Starts the run afresh (registered again): its next skip is a first one."""
        with self._lock:
            self._runs.pop(run, None)
