"""`checkpointd fetch` against a real S3 server: a training-checkpoint dir, and progress on a terminal.

`fetch RUN/train` names the dir `RemoteCheckpointer("train", ...)` saves
into, as `tf.train.latest_checkpoint` takes a dir: its newest committed
checkpoint comes down. On a terminal the fetch shows a progress line
(bytes, rate); piped, only the closing line.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from checkpointd_client import RemoteCheckpointer
from tests.integration.support.daemon import Daemon, start_daemon
from tests.integration.support.raw import TIMEOUT
from tests.integration.support.rgw import Rgw
from tests.terminal import stderr_on_a_terminal

VALUES = 2 << 20  # float32s: an 8 MiB variable, so the fetch takes more than one progress tick


@pytest.fixture
def stored(rgw: Rgw, tmp_path: Path) -> Iterator[tuple[Rgw, str]]:
    """Three training checkpoints (steps 1, 2, 3) of run `cf.train` in folder `cf`, on a fresh prefix."""
    url = f"s3://{rgw.bucket}/t-{secrets.token_hex(4)}"
    daemon: Daemon = start_daemon(
        url,  # type: ignore[arg-type]  # passed to --root as str(root)
        tmp_path / "daemon",
        "--work-dir",
        str(tmp_path / "state"),
        "--s3-endpoint-url",
        rgw.endpoint,
        "--s3-region",
        "us-east-1",
        env=rgw.daemon_env(),
    )
    try:
        step = tf.Variable(0, dtype=tf.int64)
        weights = tf.Variable(tf.zeros([VALUES]))
        with RemoteCheckpointer(
            "train", daemon.address, run="cf.train", folder="cf", timeout=TIMEOUT, global_step=step, weights=weights
        ) as checkpointer:
            for n in (1, 2, 3):
                step.assign(n)
                weights.assign(tf.fill([VALUES], float(n)))
                checkpointer.save(step, blocking=True).result(TIMEOUT)
        yield rgw, url
    finally:
        daemon.terminate()


def _fetch_command(rgw: Rgw, url: str, save: str, dest: Path) -> list[str]:
    return [sys.executable, "-m", "checkpointd", "fetch", "--root", url, save, str(dest)] + [
        "--s3-endpoint-url",
        rgw.endpoint,
        "--s3-region",
        "us-east-1",
    ]


def _env(rgw: Rgw) -> dict[str, str]:
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **rgw.daemon_env()}


def test_fetch_of_a_training_checkpoint_dir_brings_its_newest_checkpoint(
    stored: tuple[Rgw, str], tmp_path: Path
) -> None:
    rgw, url = stored
    dest = tmp_path / "train"
    done = subprocess.run(
        _fetch_command(rgw, url, "cf/train", dest), capture_output=True, text=True, timeout=120, env=_env(rgw)
    )
    assert done.returncode == 0, done.stderr
    assert "/cf/train/ckpt-3 (" in done.stderr and ", step 3) to " in done.stderr, done.stderr
    assert "\r" not in done.stderr  # piped: no progress line
    latest = tf.train.latest_checkpoint(str(dest))
    assert latest is not None and Path(latest).name == "ckpt-3"
    reader = tf.train.load_checkpoint(latest)
    keys = [k for k in reader.get_variable_to_shape_map() if k.startswith("weights/")]
    assert len(keys) == 1
    np.testing.assert_array_equal(reader.get_tensor(keys[0]), np.full([VALUES], 3.0, np.float32))
    missing = subprocess.run(
        _fetch_command(rgw, url, "cf/nothing", tmp_path / "n"),
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(rgw),
    )
    assert missing.returncode == 1 and "no committed save in" in missing.stderr and "cf/nothing" in missing.stderr


def test_fetch_shows_progress_on_a_terminal(stored: tuple[Rgw, str], tmp_path: Path) -> None:
    rgw, url = stored
    code, _, shown = stderr_on_a_terminal(_fetch_command(rgw, url, "cf/train/ckpt-2", tmp_path / "two"), 120, _env(rgw))
    assert code == 0, shown
    assert "\rfetched " in shown and " of " in shown and "MiB/s" in shown, shown
    assert tf.train.latest_checkpoint(str(tmp_path / "two")).endswith("ckpt-2")
