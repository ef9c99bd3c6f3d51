"""Calls refused at a limit are logged once per period with the count since, not one line each; no TF."""

from __future__ import annotations

import logging

import pytest

from checkpointd.protocol.errors import LimitExceededError
from checkpointd.rpc import errors


def test_refusals_log_one_warning_per_period_with_the_count_of_the_quiet_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    refusals = errors._Refusals(every=60.0, clock=lambda: now[0])  # noqa: SLF001 - the class under test
    caplog.set_level(logging.DEBUG, logger=errors.__name__)
    exc = LimitExceededError("the daemon is at its limit of 32 saves at once")
    for _ in range(5):
        refusals.refused("Save", exc)
    now[0] += 61.0
    refusals.refused("Save", exc)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(warnings) == 2 and len(debug) == 4
    assert "0 more calls refused" in warnings[0] and "at its limit of 32" in warnings[0]
    assert "4 more calls refused" in warnings[1]
