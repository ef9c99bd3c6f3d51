"""Skipped saves in the log: the first of a run at WARNING, later ones at DEBUG, a count at INFO."""

from __future__ import annotations

import logging

import pytest

from checkpointd.saves.skip_log import SkipLog

LOGGER = "checkpointd.test.skips"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def records(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> tuple[SkipLog, Clock]:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    clock = Clock()
    return SkipLog(logging.getLogger(LOGGER), every=60.0, clock=clock), clock


def test_a_runs_first_skip_is_a_warning_and_later_ones_debug(log, caplog) -> None:  # noqa: ANN001
    skips, clock = log
    for step in range(1, 6):
        clock.now += 1
        skips.skipped("r", "checkpoint", f"ck{step}", step, "busy")
    levels = [level for level, _ in records(caplog)]
    assert levels == [logging.WARNING] + [logging.DEBUG] * 4
    first = records(caplog)[0][1]
    assert first.startswith("skipped run=r kind=checkpoint export_dir=ck1 step=1: busy")
    assert "later skips are logged at DEBUG, with a count every 60s" in first


def test_a_count_at_info_once_a_period_while_the_run_keeps_skipping(log, caplog) -> None:  # noqa: ANN001
    skips, clock = log
    skips.skipped("r", "checkpoint", "ck", 0, "busy")  # the WARNING
    for step in range(1, 131):  # one skip a second
        clock.now += 1
        skips.skipped("r", "checkpoint", "ck", step, "busy")
    infos = [message for level, message in records(caplog) if level == logging.INFO]
    assert infos == [
        "run=r skipped 60 saves in the last 60s (61 since its first skip): it asks to save faster than its saves finish",
        "run=r skipped 60 saves in the last 60s (121 since its first skip): it asks to save faster than its saves finish",
    ]
    assert sum(level == logging.WARNING for level, _ in records(caplog)) == 1


def test_runs_are_apart_and_a_registered_again_run_starts_afresh(log, caplog) -> None:  # noqa: ANN001
    skips, _ = log
    skips.skipped("a", "saved_model", "x", 1, "busy")
    skips.skipped("b", "saved_model", "x", 1, "busy")
    skips.skipped("a", "saved_model", "y", 2, "busy")
    skips.forget("a")
    skips.skipped("a", "saved_model", "z", 3, "busy")
    warned = [message.split(":")[0] for level, message in records(caplog) if level == logging.WARNING]
    assert warned == [
        "skipped run=a kind=saved_model export_dir=x step=1",
        "skipped run=b kind=saved_model export_dir=x step=1",
        "skipped run=a kind=saved_model export_dir=z step=3",
    ]
