"""Where the daemon says a save is, and how big: locations a user can paste, sizes that match verify.

SaveResult.path, GetLatest's path (RemoteCheckpointer's
manager.latest_checkpoint) and status on an s3:// root are `s3://BUCKET/KEY`,
what `checkpointd verify` and `fetch --root` take, not a bare key; on a
local root, the path on the daemon's host. SaveResult.bytes_written is what
`checkpointd verify` counts for the save: its files as the manifest lists
them (the manifest itself not counted), on both stores.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tensorflow as tf

from checkpointd_client import CheckpointdError, RemoteCheckpointer, RemotePolicySaver
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon, start_daemon
from tests.integration.support.rgw import Rgw

TIMEOUT = 60.0


@pytest.fixture
def closers() -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for c in made:
        with contextlib.suppress(CheckpointdError):
            c.close()


@pytest.fixture
def stopped() -> Iterator[list[Daemon]]:
    started: list[Daemon] = []
    yield started
    for d in started:
        d.terminate()


def verify(*args: str, env: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """`checkpointd verify --json ARGS`: each save's report by path; every save OK."""
    done = subprocess.run(
        [sys.executable, "-m", "checkpointd", "verify", "--json", *args],
        capture_output=True, text=True, timeout=TIMEOUT, check=False, env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return {r["path"]: r for r in json.loads(done.stdout)["dirs"]}


def _saves(d: Daemon, closers: list[Any]) -> list[Any]:
    """A SavedModel, a policy checkpoint and a training checkpoint through `d`; their results."""
    step = tf.Variable(4, dtype=tf.int64)
    saver = RemotePolicySaver(policies.build(policies.q()), d.address, run="where", train_step=step, timeout=TIMEOUT)
    closers.append(saver)
    checkpointer = RemoteCheckpointer("train", d.address, run="where-train", global_step=step, timeout=TIMEOUT)
    closers.append(checkpointer)
    results = [
        saver.save("policies/policy", blocking=True).result(TIMEOUT),
        saver.save_checkpoint("policies/checkpoint", blocking=True).result(TIMEOUT),
        checkpointer.save(4, blocking=True).result(TIMEOUT),
    ]
    assert checkpointer.manager.latest_checkpoint == results[2].path
    return results


def test_on_a_local_root_paths_are_the_hosts_and_bytes_written_is_what_verify_counts(
    tmp_path: Path, closers: list[Any], stopped: list[Daemon]
) -> None:
    root = tmp_path / "root"
    d = start_daemon(root, tmp_path / "work", "--no-shm")
    stopped.append(d)
    results = _saves(d, closers)
    assert [r.path for r in results] == [
        str(root / "where" / "policies" / "policy"),
        str(root / "where" / "policies" / "checkpoint"),
        str(root / "where-train" / "train" / "ckpt-4"),
    ]
    reports = verify(str(root))
    for result in results:
        assert result.bytes_written == reports[result.path]["bytes"] > 0, (result, reports[result.path])


def test_on_an_s3_root_paths_are_s3_urls_that_verify_takes_and_bytes_agree(
    rgw: Rgw, tmp_path: Path, closers: list[Any], stopped: list[Daemon]
) -> None:
    url = f"s3://{rgw.bucket}/where-{secrets.token_hex(4)}"
    d = start_daemon(
        url,  # type: ignore[arg-type]  # passed to --root as str(root)
        tmp_path / "log", "--work-dir", str(tmp_path / "work"),
        "--s3-endpoint-url", rgw.endpoint, "--s3-region", "us-east-1", "--no-shm",
        env=rgw.daemon_env(),
    )  # fmt: skip
    stopped.append(d)
    results = _saves(d, closers)
    assert [r.path for r in results] == [
        f"{url}/where/policies/policy",
        f"{url}/where/policies/checkpoint",
        f"{url}/where-train/train/ckpt-4",
    ]
    reports = verify(url, "--s3-endpoint-url", rgw.endpoint, env=rgw.daemon_env())
    for result in results:
        assert result.bytes_written == reports[result.path]["bytes"] > 0, (result, reports[result.path])
