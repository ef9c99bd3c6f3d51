"""Crash consistency on S3: SIGKILL of the daemon during uploads and commits, against radosgw.

A short subset of `tests.integration.s3_crash_harness` (read its docstring
for what each trial does and checks): CHECKPOINTD_CRASH_TRIALS trials,
default 4, with the large policy and training state, whose variables go up
in two multipart parts; CHECKPOINTD_FUZZ_SEED picks another seeded sequence
of kill moments (default 0). The long mode, at least 50 trials, prints the
kills per phase:

    python -m tests.integration.s3_crash_harness --trials 50
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from tests.integration import s3_crash_harness
from tests.integration.rgw import Rgw, rgw  # noqa: F401  (the session fixture)

TRIALS = int(os.environ.get("CHECKPOINTD_CRASH_TRIALS", "4"))
SEED = int(os.environ.get("CHECKPOINTD_FUZZ_SEED", "0"))


def test_kill_9_during_s3_uploads_and_commits_leaves_only_whole_saves_and_recovery_cleans_the_rest(
    rgw: Rgw,  # noqa: F811
    tmp_path: Path,
    record_property: Callable[[str, object], None],
) -> None:
    figures = s3_crash_harness.run_trials(TRIALS, rgw, tmp_path, size="large", seed=SEED)
    record_property("s3_crash_figures", figures.summary())
    print(figures.summary())  # shown with -s; the long mode prints the same line
    assert figures.failures == [], "\n".join(figures.failures)
    assert figures.trials == TRIALS
    assert sum(n for phase, n in figures.kills.items() if phase.startswith("policy ")) == TRIALS
    assert sum(n for phase, n in figures.kills.items() if phase.startswith("training ")) == TRIALS
    assert figures.saves_durable > 0 and figures.save_checks > 0 and figures.loads > 0
    # The kills cut uploads short, so recovery had objects or multipart uploads to clean (and did).
    assert figures.leftover_objects + figures.leftover_uploads > 0
