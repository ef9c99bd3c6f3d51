"""CheckpointManager's retention, kept by the daemon: max_to_keep, keep_checkpoint_every_n_hours.

After every save, once retention (off the save path) has run: the dir's
`checkpoint` file, as TensorFlow parses it, names exactly the committed
checkpoints of the active set, newest last, and the files on disk are those
and the ones kept for good. keep_checkpoint_every_n_hours is checked against
a line-for-line model of CheckpointManager fed the daemon's own commit times.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import tensorflow as tf

from checkpointd.core.checkpoint_spec import CheckpointRetention
from checkpointd_client import RemoteCheckpointer
from tests.integration.support.daemon import Daemon, wait_until
from tests.unit.core.test_checkpoint_state import _Manager

LIMIT = 60.0


def committed(directory: Path) -> list[str]:
    """Checkpoint prefixes with a manifest, by name."""
    return sorted(p.name.split(".")[0] for p in directory.glob("*.checkpointd.manifest.json"))


def files(directory: Path) -> list[str]:
    """Checkpoint prefixes with any file on disk (the state file and temp files aside)."""
    return sorted({p.split(".")[0] for p in os.listdir(directory) if p.startswith("ckpt-")})


def state(directory: Path) -> tuple[str, list[str]]:
    """(model_checkpoint_path, all_model_checkpoint_paths) as TensorFlow reads the state file."""
    parsed = tf.train.get_checkpoint_state(str(directory))
    assert parsed is not None
    return Path(parsed.model_checkpoint_path).name, [Path(p).name for p in parsed.all_model_checkpoint_paths]


def created(prefix: Path) -> float:
    return float(
        json.loads(prefix.with_name(prefix.name + ".checkpointd.manifest.json").read_text())["created_unix_seconds"]
    )


def test_max_to_keep_keeps_the_newest_and_the_state_file_agrees_after_every_save(daemon: Daemon) -> None:
    w = tf.Variable(np.zeros(16, np.float32))
    directory = daemon.root / "ret-max" / "train"
    with RemoteCheckpointer("train", daemon.address, run="ret-max", max_to_keep=2, timeout=LIMIT, w=w) as ckpt:
        for step in range(1, 6):
            w.assign_add(tf.ones(16))
            ckpt.save(step, blocking=True)
            want = [f"ckpt-{s}" for s in range(max(1, step - 1), step + 1)]
            wait_until(lambda want=want: files(directory) == sorted(want), f"retention after step {step}")
            assert committed(directory) == sorted(want)
            assert state(directory) == (f"ckpt-{step}", want)
            assert ckpt.manager.checkpoints == [str(directory.resolve() / n) for n in want]
    assert tf.train.latest_checkpoint(str(directory)) == str(directory / "ckpt-5")


def test_keep_checkpoint_every_n_hours_keeps_for_good_what_checkpoint_manager_keeps(daemon: Daemon) -> None:
    hours = 0.6 / 3600  # 0.6 s: saves a few tenths of a second apart cross it now and then
    w = tf.Variable(0.0)
    directory = daemon.root / "ret-hours" / "ckpts"
    rules = CheckpointRetention(1, hours)
    times: dict[str, float] = {}
    with RemoteCheckpointer(
        "ckpts", daemon.address, run="ret-hours", max_to_keep=1, keep_checkpoint_every_n_hours=hours, timeout=LIMIT, w=w
    ) as ckpt:
        for step in range(10):
            ckpt.save(step, blocking=True)
            times[f"ckpt-{step}"] = created(directory / f"ckpt-{step}")  # the newest is never deleted
            time.sleep(0.2)  # the rule is about time passing between saves
    manager = _Manager(rules.max_to_keep, hours, now=times["ckpt-0"])
    for name, t in times.items():
        manager.save(name, t)
    expected = sorted(set(times) - set(manager.deleted))
    assert len(expected) > 2  # some were kept for good, so the test means something
    wait_until(lambda: files(directory) == expected, "retention of the last save")
    assert state(directory) == ("ckpt-9", ["ckpt-9"])  # kept-for-good ones leave the active set
    text = (directory / "checkpoint").read_text()
    assert f"last_preserved_timestamp: {manager.last_preserved!r}" in text
