"""A lease that cannot be renewed past its ttl fences the run: the daemon writes nothing of it afterwards.

Two daemons on one prefix of the bucket (two nodes): A reaches radosgw only
through `fault_proxy.FaultProxy`, B directly, both with a short lease ttl.
A's trainer commits a few saves, then the proxy stalls every connection
(accepted, never answered: A's node cut off from the bucket, its requests
hanging until its read timeout) while A's trainer offers a save. B's
trainer registers the run: B waits out A's lease, which A cannot renew,
takes the run, restores A's newest committed save and commits one of its
own. Then A's path comes back, and A's trainer saves again. A must not
write a byte of that run from then on: the run's objects, read straight from
the bucket with boto3, are exactly as B left them; A's saves fail naming the
lease; and A says so (checkpointd_leases_lost, its log). The save A's
trainer offered during the outage, whose requests A retries, is included:
it may still be retrying when the path comes back, and must not land.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from checkpointd_client import RemoteCheckpointer
from tests.integration.support.daemon import Daemon, start_daemon, wait_until
from tests.integration.support.fault_proxy import FaultProxy
from tests.integration.support.rgw import Rgw
from tests.integration.support.scrape import Metrics

LEASE_SECONDS = 3.0
READ_TIMEOUT = 8.0  # A's --s3-read-timeout: a request stalled by the proxy is retried after this
SAVE_TIMEOUT = 30.0  # A's trainer's per-call deadline: longer than the ttl, so a save can outlive the lease
WAIT = 120.0
RUN = "fenced"
MANIFEST = ".checkpointd.manifest.json"


def _node(rgw: Rgw, url: str, work: Path, endpoint: str, *extra: str) -> Daemon:
    return start_daemon(
        url,  # type: ignore[arg-type]  # passed to --root as str(root)
        work, "--work-dir", str(work / "state"),
        "--s3-endpoint-url", endpoint, "--s3-region", "us-east-1",
        "--lease-seconds", f"{LEASE_SECONDS:g}", *extra,
        env=rgw.daemon_env(),
    )  # fmt: skip


def _objects(client: Any, bucket: str, prefix: str) -> dict[str, str]:
    """Every object under `prefix` with its ETag, read from the bucket itself."""
    found = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        found.update({o["Key"]: o["ETag"] for o in page.get("Contents", [])})
    return found


def _steps(objects: dict[str, str]) -> set[int]:
    """The steps of the training checkpoints committed among `objects` (a manifest each)."""
    names = (k.rpartition("/")[2] for k in objects)
    return {int(n[len("ckpt-") : -len(MANIFEST)]) for n in names if n.startswith("ckpt-") and n.endswith(MANIFEST)}


@pytest.fixture
def nodes(rgw: Rgw, tmp_path: Path) -> Iterator[tuple[FaultProxy, Daemon, Daemon, str]]:
    prefix = f"fence-{secrets.token_hex(4)}"
    url = f"s3://{rgw.bucket}/{prefix}"
    with FaultProxy(rgw.endpoint) as proxy:
        a = _node(rgw, url, tmp_path / "a", proxy.endpoint, "--s3-read-timeout", f"{READ_TIMEOUT:g}")
        try:
            b = _node(rgw, url, tmp_path / "b", rgw.endpoint)
            try:
                yield proxy, a, b, prefix
            finally:
                b.terminate()
        finally:
            proxy.clear()
            a.terminate()


def test_a_lease_not_renewed_past_its_ttl_stops_the_daemon_writing_that_run_and_it_says_so(
    rgw: Rgw, nodes: tuple[FaultProxy, Daemon, Daemon, str]
) -> None:
    proxy, a, b, prefix = nodes
    client = rgw.client()
    run_prefix = f"{prefix}/{RUN}/"
    weights = tf.Variable(np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32))
    step = tf.Variable(0, dtype=tf.int64)
    on_a = RemoteCheckpointer(
        "train", a.address, run=RUN, max_to_keep=1000, timeout=SAVE_TIMEOUT, save_on_notice=False,
        weights=weights, global_step=step,
    )  # fmt: skip
    try:
        for s in (1, 2, 3):
            step.assign(s)
            weights.assign_add(tf.ones_like(weights))
            on_a.save(step, blocking=True).result(WAIT)
        assert _steps(_objects(client, rgw.bucket, run_prefix)) == {1, 2, 3}

        proxy.fault("stall")  # node A cut off from the bucket: its lease can no longer be renewed
        step.assign(4)
        during = on_a.save(step)  # offered in the outage; A retries its requests within the save's deadline

        # Node B's trainer takes the run: B waits out A's lease (ttl from its own first sight of it).
        weights_b = tf.Variable(tf.zeros_like(weights))
        step_b = tf.Variable(0, dtype=tf.int64)
        on_b = RemoteCheckpointer(
            "train", b.address, run=RUN, max_to_keep=1000, timeout=WAIT, save_on_notice=False,
            weights=weights_b, global_step=step_b,
        )  # fmt: skip
        with on_b:
            assert int(step_b.numpy()) == 3  # A's newest committed save
            as_a_left_it = _objects(client, rgw.bucket, run_prefix)
            proxy.clear()  # A reaches the bucket again, its outage save perhaps still retrying
            step_b.assign(1001)
            on_b.save(step_b, blocking=True).result(WAIT)
            during.exception(SAVE_TIMEOUT)  # ended, one way or the other, within its deadline
            assert during.done() and during.exception(0) is not None, "A committed a save of a run it lost"
            # A's next save (not skipped: its previous one has ended) is refused for the lease.
            step.assign(5)
            after = on_a.save(step)
            refused = after.exception(SAVE_TIMEOUT)
            assert refused is not None and "lease" in str(refused), refused

            # A says so: its renewal, answered again, finds B's lease (checkpointd_leases_lost, its log).
            lost = lambda: Metrics(a.metrics_url).total("checkpointd_leases_lost_total")  # noqa: E731
            wait_until(lambda: lost() >= 1, "A counts the lease it lost (checkpointd_leases_lost_total)", WAIT)
            assert f"lease: lost run={RUN}" in a.log()
            # Once A holds no save in flight (the outage save's retries over), the run's objects are those A
            # left before B took it and B's save: A wrote nothing of the run since.
            wait_until(
                lambda: Metrics(a.metrics_url).total("checkpointd_saves_in_flight") == 0,
                "A has no save in flight",
                WAIT,
            )
            now = _objects(client, rgw.bucket, run_prefix)
            changed = {k for k in now.keys() | as_a_left_it.keys() if now.get(k) != as_a_left_it.get(k)}
            by_b = {k for k in changed if k.rpartition("/")[2].startswith("ckpt-1001.") or k.endswith("/checkpoint")}
            assert changed - by_b == set(), (repr(during.exception(0)), sorted(changed))
            assert _steps(now) == {1, 2, 3, 1001}
            state = client.get_object(Bucket=rgw.bucket, Key=f"{run_prefix}train/checkpoint")["Body"].read().decode()
            assert "ckpt-1001" in state and "ckpt-4" not in state and "ckpt-5" not in state, state
    finally:
        try:
            on_a.close(timeout=5.0)
        except Exception:  # noqa: BLE001 - its run is B's now: closing it on A may fail, as it should
            pass


def test_a_daemon_whose_lease_lapses_sends_no_write_of_that_run_not_even_a_retry(rgw: Rgw, tmp_path: Path) -> None:
    # One daemon; from the cut on, the proxy stalls its lease's renewals and
    # every write of the run (each attempt is seen, never answered), so a
    # save's requests are retried after each read timeout past the lease's
    # ttl. No write attempt of the run may reach the store once the lease has
    # lapsed (at the latest a ttl after the cut): the fence is checked before
    # each request and each retry, not only where the commit starts.
    prefix = f"fence-{secrets.token_hex(4)}"
    read_timeout, run = 2.0, "lapsing"
    with FaultProxy(rgw.endpoint) as proxy:
        a = _node(rgw, f"s3://{rgw.bucket}/{prefix}", tmp_path / "a", proxy.endpoint,
                  "--s3-read-timeout", f"{read_timeout:g}")  # fmt: skip
        weights = tf.Variable(np.random.default_rng(1).standard_normal(5 << 18).astype(np.float32))  # 5 MiB
        step = tf.Variable(1, dtype=tf.int64)
        ckpt = RemoteCheckpointer(
            "train", a.address, run=run, max_to_keep=None, timeout=SAVE_TIMEOUT, save_on_notice=False,
            weights=weights, global_step=step,
        )  # fmt: skip
        try:
            ckpt.save(step, blocking=True).result(WAIT)
            proxy.fault("stall", only=rf"^(PUT|POST) /{rgw.bucket}/{prefix}/(\.checkpointd-leases/|{run}/)")
            cut = time.monotonic()
            offered = []
            while time.monotonic() < cut + LEASE_SECONDS + 3 * read_timeout:
                step.assign_add(1)
                offered.append(ckpt.save(step))
                threading.Event().wait(0.3)  # the trainer's pace
            for ticket in offered:
                ticket.exception(SAVE_TIMEOUT)  # each ends within its deadline
            writes = [(t - cut, line) for t, line in proxy.matched if "/.checkpointd-leases/" not in line]
            assert writes, "no write of the run was stalled: the test proved nothing"
            late = [(round(t, 2), line) for t, line in writes if t > LEASE_SECONDS + 0.5]
            assert late == [], f"write attempts after the lease lapsed: {late}"
            failed = [t.exception(0) for t in offered if t.exception(0) is not None]
            assert failed and any("lease" in str(e) for e in failed), failed
            proxy.clear()  # the store back: the daemon takes the run's lease again, and saves commit
            step.assign_add(1)
            assert ckpt.save(step, blocking=True).exception(WAIT) is None
            print(f"\nstalled writes at {[round(t, 2) for t, _ in writes]} s after the cut; {len(failed)} saves failed")
        finally:
            proxy.clear()
            try:
                ckpt.close(timeout=5.0)
            finally:
                a.terminate()
