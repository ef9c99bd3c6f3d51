"""Retention against the real daemon: `--keep-last` and `--keep-every-steps`."""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from checkpointd.cli import verify
from checkpointd_client import RemotePolicySaver
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon, wait_until

TIMEOUT = 60.0


def test_retention_keeps_the_newest_and_every_kth_per_kind(fresh_daemon: Callable[..., Daemon]) -> None:
    daemon = fresh_daemon("--keep-last", "2", "--keep-every-steps", "4")
    step = tf.Variable(0, dtype=tf.int64)
    saver = RemotePolicySaver(
        policies.build(policies.q()), daemon.address, run="kept", train_step=step, timeout=TIMEOUT
    )
    with saver:
        for value in range(1, 9):
            step.assign(value)
            saver.save_checkpoint(f"ck_{value}", blocking=True)
        for value in (9, 10, 11):
            step.assign(value)
            saver.save(f"sm_{value}", blocking=True)
    folder = daemon.root / "kept"
    (folder / "notes").mkdir()  # not a save: never touched
    expected = {"ck_4", "ck_7", "ck_8", "sm_10", "sm_11", "notes"}
    wait_until(lambda: {p.name for p in folder.iterdir()} == expected, f"the folder holds {sorted(expected)}")
    # Survivors are whole, and nothing half-deleted is left behind.
    reports = verify.verify_paths([folder])
    assert len(reports) == 5 and all(r.ok for r in reports), reports
    assert not [p for p in folder.rglob(".checkpointd-*")]
    assert "retention: deleted run=kept kind=checkpoint export_dir=ck_1 step=1" in daemon.log()
