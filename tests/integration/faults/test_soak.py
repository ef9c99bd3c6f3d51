"""The soak (tests.integration.support.soak): faults at random for CHECKPOINTD_SOAK_MINUTES (30), then the invariants.

Skipped unless CHECKPOINTD_SOAK=1: it runs for half an hour by default, so
it is not in the default suite. Run it with

    CHECKPOINTD_SOAK=1 CHECKPOINTD_SOAK_MINUTES=30 pytest tests/integration/faults/test_soak.py -s -n 0

It needs radosgw (the `rgw` fixture) and root for the local daemon's tmpfs
(without root the disk_full fault is left out, and the figures say so).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.integration.support import soak
from tests.integration.support.rgw import Rgw

pytestmark = pytest.mark.skipif(
    os.environ.get("CHECKPOINTD_SOAK") != "1", reason="the soak runs only with CHECKPOINTD_SOAK=1 (30 min by default)"
)


def test_soak_loses_nothing_under_faults_at_random(rgw: Rgw, tmp_path: Path, record_property) -> None:  # noqa: ANN001
    minutes = float(os.environ.get("CHECKPOINTD_SOAK_MINUTES", "30"))
    figures = soak.run_soak(rgw, minutes, tmp_path, seed=int(os.environ.get("CHECKPOINTD_SOAK_SEED", "0")))
    record_property("soak_figures", figures.summary())
    print(figures.summary())
    assert figures.violations == [], "\n".join(figures.violations)
    assert figures.saves["committed"] > 0
    if minutes >= 30:  # the schedule's rounds: every kind at least MIN_EACH times
        assert (
            min(figures.faults[k] for k in soak.fault_kinds("disk_full" in figures.faults)) >= soak.MIN_EACH
        ), figures.faults
    else:
        assert sum(figures.faults.values()) > 0
