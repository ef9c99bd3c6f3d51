"""`checkpointd status --stored` lists the runs in the store, whichever daemon wrote them.

On S3: two daemons on one bucket prefix, as two nodes of a fleet. A save
made through daemon A is listed by daemon B, which never registered the
run, with the newest save's export dir, step, age and object key, read from
the manifests; after A is SIGKILLed too. On a local root: a daemon started
after another lists the saves the first one committed.

The real CLI runs as a subprocess (`--json` and the table), as an operator
would run it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tensorflow as tf

from checkpointd_client import RemotePolicySaver
from tests.integration.s3.test_s3 import S3, policy, s3  # noqa: F401  (test_s3's fixtures)
from tests.integration.support.daemon import Daemon
from tests.integration.support.raw import TIMEOUT


def status(d: Daemon, *extra: str) -> subprocess.CompletedProcess[str]:
    """`checkpointd status --stored` against `d`, as a person runs it."""
    return subprocess.run(
        [sys.executable, "-m", "checkpointd", "status", "--address", d.address, "--stored", *extra],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def stored(d: Daemon, *extra: str) -> dict[str, Any]:
    """The stored runs `d` lists (`status --stored --json`), by run."""
    done = status(d, "--json", *extra)
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["stored_truncated"] is False
    return {row["run"]: row for row in document["stored_runs"]}


def test_a_save_through_daemon_a_is_listed_by_daemon_b_on_one_bucket(s3: S3, policy: object) -> None:  # noqa: F811
    a, b = s3.daemon(), s3.daemon()
    saver, step = s3.saver(a, policy, "moving")
    step.assign(5)
    saver.save("policies/p5", blocking=True).result()
    step.assign(6)
    saver.save_checkpoint("policies/c6", blocking=True).result()
    other, other_step = s3.saver(b, policy, "on-b")
    other_step.assign(2)
    other.save("policy", blocking=True).result()

    before = time.time()
    rows = stored(b)
    assert set(rows) == {"moving", "on-b"}
    row = rows["moving"]
    assert (row["folder"], row["saves"], row["kind"]) == ("moving", 2, "CHECKPOINT")
    assert (row["export_dir"], row["step"]) == ("policies/c6", "6")
    assert row["path"] == f"{s3.url}/moving/policies/c6"  # s3://BUCKET/KEY, as fetch and verify take it
    assert before - 60 < row["unix_seconds"] <= before
    # With run leases (a fleet's store), A writes the run and says so; B
    # names A. A build without leases leaves the holder unset everywhere.
    holder_a = stored(a, "--run", "moving")["moving"].get("lease_holder")
    holder_b = row.get("lease_holder")
    assert (holder_a, holder_b) == (None, None) or (holder_a == "" and holder_b), (holder_a, holder_b)

    table = status(b)
    assert table.returncode == 0, table.stderr
    (line,) = [ln for ln in table.stdout.splitlines() if ln.startswith("moving ")]
    assert line.split()[:5] == ["moving", "moving", "checkpoint", "policies/c6", "6"]

    saver.close(timeout=10)
    a.proc.kill()  # A is gone: B still lists what it committed
    a.proc.wait()
    again = stored(b, "--run", "moving")
    assert list(again) == ["moving"] and again["moving"]["export_dir"] == "policies/c6"


def test_a_daemon_on_a_local_root_lists_what_an_earlier_daemon_committed(
    fresh_daemon: Callable[..., Daemon],
    policy: object,  # noqa: F811
) -> None:
    first = fresh_daemon()
    step = tf.Variable(3, dtype=tf.int64)
    saver = RemotePolicySaver(policy, first.address, run="local-run", train_step=step, timeout=TIMEOUT)
    try:
        saver.save("exported", blocking=True).result()
    finally:
        saver.close(timeout=10)
    assert first.terminate() == 0
    second = fresh_daemon()
    rows = stored(second)
    assert list(rows) == ["local-run"]
    row = rows["local-run"]
    assert (row["export_dir"], row["step"], row["kind"], row["saves"]) == ("exported", "3", "SAVED_MODEL", 1)
    assert Path(row["path"]) == (second.root / "local-run" / "exported").resolve()
    assert "lease_holder" not in row  # one daemon per local root: no leases
