"""How a save's outcome is logged, and labelled for the preemption metric."""

from __future__ import annotations

import logging
import time

from checkpointd.core.lane import Cancelled, Failed, Written
from checkpointd.saves.requests import SaveRequest

_LOGGER = logging.getLogger("checkpointd.saves.pipeline")  # the pipeline's log lines, as operators grep them


def log_outcome(
    request: SaveRequest, run: str, outcome: Written | Failed | Cancelled, seconds: float, transport: str
) -> None:
    if isinstance(outcome, Written):
        # held=yes: the trainer decided it under the run's busy lock (no skip decision here).
        _LOGGER.info(
            "saved run=%s kind=%s export_dir=%s step=%d bytes=%d duration=%.3fs%s%s transport=%s",
            run, request.kind.value, request.export_dir, request.step, outcome.bytes_written,
            seconds, " held=yes" if request.trainer_decided is not None else "",
            " on_notice=yes" if request.on_notice else "", transport,
        )  # fmt: skip
    elif isinstance(outcome, Cancelled):
        _LOGGER.info(
            "cancelled run=%s kind=%s export_dir=%s step=%d duration=%.3fs: %s; nothing was written",
            run, request.kind.value, request.export_dir, request.step, seconds, outcome.reason,
        )  # fmt: skip
    else:
        _LOGGER.warning(
            "failed run=%s kind=%s export_dir=%s step=%d duration=%.3fs: %s",
            run, request.kind.value, request.export_dir, request.step, seconds, outcome.error,
        )  # fmt: skip


def notice_outcome(request: SaveRequest, outcome: Written | Failed | Cancelled) -> tuple[str, float | None]:
    """A save on notice's outcome label, and seconds from its notice to durable (None: not written, or unknown)."""
    if not isinstance(outcome, Written):
        return ("failed" if isinstance(outcome, Failed) else "cancelled"), None
    if request.notice_unix_seconds <= 0:
        return "ok", None
    return "ok", max(0.0, time.time() - request.notice_unix_seconds)  # two hosts' clocks: never negative
