"""An object store that half-works, through a fault-injecting proxy in front of radosgw.

One daemon for the module, on S3 through `fault_proxy.FaultProxy`; each
test a trainer of its own (a run of its own) saving a training checkpoint
every 0.3 s while the proxy refuses, resets, answers 503/500 or stalls for
a few seconds. For each: the save loop never raises, every save ends within
its deadline, one commits within 10 s of the fault's end with no restart,
`checkpointd verify` passes for every committed save, a save that could
not commit failed UNAVAILABLE naming the endpoint and left no manifest,
and the daemon counted the store's failures (checkpointd_s3_errors_total).

The daemon runs with its default --s3-read-timeout (5 s): a silent request
is cut after it and retried, retries stop at the save's deadline (the call's,
less a reserve and a read timeout), and a fault shorter than its retries may
fail no save at all, which is right. Each test prints how long after the
fault's end the first save committed (figures, not asserted beyond the
RECOVERY_SECONDS bound).
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from checkpointd_client import RemoteCheckpointer, SaveTicket, UnavailableError
from tests.integration.support.daemon import Daemon, start_daemon, wait_until
from tests.integration.support.fault_proxy import FaultProxy
from tests.integration.support.rgw import Rgw
from tests.integration.support.scrape import Metrics

PERIOD = 0.3  # seconds between the trainer's saves
FAULT_SECONDS = 4.0
RECOVERY_SECONDS = 10.0  # the first commit after the fault ends comes within this
SAVE_TIMEOUT = 20.0  # the trainer's per-call deadline (RemoteCheckpointer timeout)
READ_TIMEOUT = 2.0  # --s3-read-timeout of the crowded-prefix test's daemon: its stalled listing is cut after this
PREFIX_MANIFEST = ".checkpointd.manifest.json"
COUNTED = {
    "refuse": "connections",
    "reset": "reset",
    "slowdown": "answered",
    "internal": "answered",
    "stall": "stalled",
}
ERROR_KIND = {
    "refuse": "connection", "reset": "connection", "slowdown": "throttled", "internal": "server", "stall": "timeout"
}  # fmt: skip


@dataclass
class Env:
    rgw: Rgw
    proxy: FaultProxy
    daemon: Daemon
    prefix: str
    client: Any

    @property
    def url(self) -> str:
        return f"s3://{self.rgw.bucket}/{self.prefix}"

    def manifests(self, under: str) -> set[str]:
        found: set[str] = set()
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.rgw.bucket, Prefix=f"{self.prefix}/{under}"
        )
        for page in pages:
            found.update(o["Key"].rpartition("/")[2] for o in page.get("Contents", []))
        return {k[: -len(PREFIX_MANIFEST)] for k in found if k.endswith(PREFIX_MANIFEST)}

    def verify(self, under: str) -> subprocess.CompletedProcess[str]:
        """`checkpointd verify` straight at radosgw (not through the proxy)."""
        return subprocess.run(
            [sys.executable, "-m", "checkpointd", "verify", f"{self.url}/{under}",
             "--s3-endpoint-url", self.rgw.endpoint, "--s3-region", "us-east-1"],
            capture_output=True, text=True, timeout=120, env={**_base_env(), **self.rgw.daemon_env()},
        )  # fmt: skip


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}


@pytest.fixture(scope="module")
def env(rgw: Rgw, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("s3-faults")
    prefix = f"f-{secrets.token_hex(4)}"
    with FaultProxy(rgw.endpoint) as proxy:
        daemon = start_daemon(
            f"s3://{rgw.bucket}/{prefix}",  # type: ignore[arg-type]  # passed to --root as str(root)
            tmp / "work",
            "--work-dir", str(tmp / "state"),
            "--s3-endpoint-url", proxy.endpoint, "--s3-region", "us-east-1",
            env=rgw.daemon_env(),
        )  # fmt: skip
        try:
            yield Env(rgw, proxy, daemon, prefix, rgw.client())
        finally:
            proxy.clear()
            code = daemon.terminate()
            assert code == 0, daemon.log()[-4000:]


@dataclass
class Offered:
    ticket: SaveTicket
    at: float  # monotonic time of the save call
    returned: float  # ... and of its return
    ended: float | None = None  # when the loop first saw the ticket done
    phase: str = ""  # "before", "fault", "after"


@dataclass
class Trainer:
    """Saves every PERIOD s, noting when each ticket is seen to end; never lets a save call raise past it."""

    ckpt: RemoteCheckpointer
    weights: tf.Variable
    step: tf.Variable
    offered: list[Offered] = field(default_factory=list)
    raised: list[BaseException] = field(default_factory=list)

    def tick(self, phase: str) -> None:
        now = time.monotonic()
        for o in self.offered:
            if o.ended is None and o.ticket.done():
                o.ended = now
        self.step.assign_add(1)
        self.weights.assign_add(tf.ones_like(self.weights))
        try:
            ticket = self.ckpt.save(self.step)
        except Exception as e:  # the assertion is that this never happens
            self.raised.append(e)
            return
        self.offered.append(Offered(ticket, now, time.monotonic(), phase=phase))

    def run_for(self, seconds: float, phase: str) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            started = time.monotonic()
            self.tick(phase)
            time.sleep(max(0.0, PERIOD - (time.monotonic() - started)))  # the trainer's own pace

    def run_until_commit_after(self, since: float, limit: float) -> float | None:
        """Saves until a save offered after `since` is seen durable; its end time, or None past `limit` s."""
        end = since + limit
        while time.monotonic() < end + PERIOD:
            started = time.monotonic()
            self.tick("after")
            for o in self.offered:
                if o.at >= since and o.ended is not None and _durable(o.ticket):
                    return o.ended
            time.sleep(max(0.0, PERIOD - (time.monotonic() - started)))
        return None


def _store_errors(env: Env, kind: str) -> float:
    """The daemon's checkpointd_s3_errors_total of `kind`, over every operation."""
    samples = Metrics(env.daemon.metrics_url).samples
    return sum(
        v for (name, labels), v in samples.items() if name == "checkpointd_s3_errors_total" and ("kind", kind) in labels
    )


def _durable(ticket: SaveTicket) -> bool:
    return ticket.done() and not ticket.skipped and ticket.exception(0) is None


@pytest.fixture
def trainer(env: Env) -> Iterator[Trainer]:
    size = 5 << 20  # 5 MiB: the data file goes up in requests far longer than the proxy's reset point
    weights = tf.Variable(np.random.default_rng(1).standard_normal(size // 4).astype(np.float32))
    step = tf.Variable(0, dtype=tf.int64)
    run = f"r{secrets.token_hex(3)}"
    ckpt = RemoteCheckpointer(
        "train", env.daemon.address, run=run, max_to_keep=1000, timeout=SAVE_TIMEOUT,
        save_on_notice=False, weights=weights, global_step=step,
    )  # fmt: skip
    t = Trainer(ckpt, weights, step)
    try:
        yield t
    finally:
        env.proxy.clear()
        try:
            ckpt.close(timeout=SAVE_TIMEOUT)
        except Exception:  # a failed last save is reported by the test, not here
            pass


@pytest.mark.parametrize("kind", ["refuse", "reset", "slowdown", "internal", "stall"])
def test_a_store_fault_fails_saves_clearly_and_saves_commit_again_after_it(
    env: Env, trainer: Trainer, kind: str
) -> None:
    env.proxy.reset_after = 1 << 20  # 1 MiB into a connection's uploads: mid-body of the data file
    trainer.run_for(1.5, "before")
    proxied, counted = dict(env.proxy.counts), _store_errors(env, ERROR_KIND[kind])
    with env.proxy.during(kind):
        trainer.run_for(FAULT_SECONDS, "fault")
    fault_end = time.monotonic()
    first = trainer.run_until_commit_after(fault_end, RECOVERY_SECONDS)
    assert not trainer.raised, trainer.raised
    # Every save call returned at once (non-blocking), and each save ended within its deadline.
    for o in trainer.offered:
        assert o.returned - o.at < SAVE_TIMEOUT, o
        o.ticket.exception(timeout=max(0.0, o.at + SAVE_TIMEOUT + 5 - time.monotonic()))
    assert first is not None, (
        f"no save offered after the {kind} fault ended was durable within {RECOVERY_SECONDS} s: "
        f"{[o.ticket for o in trainer.offered if o.phase == 'after']}\n{env.daemon.log()[-3000:]}"
    )
    assert first - fault_end <= RECOVERY_SECONDS

    run = trainer.ckpt  # its folder on the daemon is the run name
    durable = {f"ckpt-{o.ticket.step}" for o in trainer.offered if _durable(o.ticket)}
    failed = [o for o in trainer.offered if o.ticket.done() and o.ticket.exception(0) is not None]
    folder = f"{run._folder}/train/"  # noqa: SLF001 - where the run's checkpoints go in the bucket
    committed = env.manifests(folder)
    assert durable <= committed, durable - committed
    report = env.verify(folder)
    assert report.returncode == 0 and f"{len(committed)} OK, 0 FAILED" in report.stdout, report.stdout + report.stderr

    # Each save that failed was told UNAVAILABLE, naming the S3 endpoint (the
    # daemon's own, or the client's fast failure quoting it), and left no manifest.
    for o in failed:
        error = o.ticket.exception(0)
        assert isinstance(error, UnavailableError) and env.proxy.endpoint in str(error), (o.ticket, error)
        assert f"ckpt-{o.ticket.step}" not in committed, (o.ticket, error)
    # The fault happened, and the daemon counted what the store failed.
    if kind != "refuse":  # refused connects are the kernel's, not the proxy's
        assert env.proxy.counts[COUNTED[kind]] > proxied[COUNTED[kind]], env.proxy.counts
    assert _store_errors(env, ERROR_KIND[kind]) > counted
    outcome = {"durable": len(durable), "failed": len(failed), "offered": len(trainer.offered)}
    print(f"\n{kind}: {outcome}, first commit {first - fault_end:.1f} s after; proxy {env.proxy.counts}")
    for message in sorted({str(o.ticket.exception(0)) for o in failed})[:3]:
        print("  ", message[:400])


def test_a_daemon_restarted_on_a_crowded_prefix_behind_a_stalled_listing_serves_at_once(
    rgw: Rgw, tmp_path: Path
) -> None:
    # Many saves' leftovers (no manifest, past the grace age) and the run
    # folders' listing stalled: the bucket's tidy cannot finish, and must not
    # hold the bind. Once the listing answers, the tidy finishes and deletes them.
    prefix = f"crowd-{secrets.token_hex(4)}"
    client = rgw.client()
    leftovers = [f"{prefix}/run{i % 20}/train/ckpt-{i}.index" for i in range(300)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda key: client.put_object(Bucket=rgw.bucket, Key=key, Body=b"x"), leftovers))
    folders = rf"^GET /{rgw.bucket}\?(?=.*delimiter=%2F)(?=.*prefix={prefix}%2F(&| ))"
    with FaultProxy(rgw.endpoint) as proxy:
        proxy.fault("stall", only=folders)
        daemon = start_daemon(
            f"s3://{rgw.bucket}/{prefix}",  # type: ignore[arg-type]  # passed to --root as str(root)
            tmp_path / "work",
            "--work-dir", str(tmp_path / "state"),
            "--s3-endpoint-url", proxy.endpoint, "--s3-region", "us-east-1",
            "--s3-read-timeout", str(READ_TIMEOUT), "--s3-grace-seconds", "0",
            env=rgw.daemon_env(),
        )  # fmt: skip
        try:
            # It serves (start_daemon waited on its port file and health) with its tidy stuck...
            wait_until(lambda: proxy.counts["stalled"] > 0, "the tidy's listing stalled")
            assert Metrics(daemon.metrics_url)("checkpointd_recovery_done") == 0
            # ... and saves commit meanwhile.
            weights, step = tf.Variable(np.ones(1024, np.float32)), tf.Variable(7, dtype=tf.int64)
            ckpt = RemoteCheckpointer(
                "train", daemon.address, run="fresh", max_to_keep=None, timeout=SAVE_TIMEOUT,
                save_on_notice=False, weights=weights, global_step=step,
            )  # fmt: skip
            try:
                ticket = ckpt.save(step, blocking=True)
                assert ticket.exception(SAVE_TIMEOUT) is None and not ticket.skipped
            finally:
                ckpt.close(timeout=SAVE_TIMEOUT)
            proxy.clear()
            daemon.wait_recovered()
            assert "recovery done: tidied" in daemon.log()
            # A stall that outlasted the tidy's retries leaves leftovers to the next start (logged); none of ours go.
            kept = {o["Key"] for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=rgw.bucket, Prefix=f"{prefix}/fresh/") for o in page.get("Contents", [])}  # fmt: skip
            assert any(k.endswith("ckpt-7" + PREFIX_MANIFEST) for k in kept), kept
        finally:
            proxy.clear()
            assert daemon.terminate() == 0, daemon.log()[-4000:]


def test_a_state_file_read_failing_after_a_commit_leaves_the_save_written_and_the_next_save_mends_it(
    env: Env,
) -> None:
    # ckpt-2's manifest is committed, then every read of the dir's `checkpoint`
    # state file is answered 503: the save is durable, so it is reported
    # written (and the daemon logs that the state file lags); the next save,
    # the store answering again, rewrites it from the manifests.
    weights = tf.Variable(np.ones(1 << 12, np.float32))
    step = tf.Variable(1, dtype=tf.int64)
    ckpt = RemoteCheckpointer(
        "train", env.daemon.address, run=f"s{secrets.token_hex(3)}", max_to_keep=None, timeout=SAVE_TIMEOUT,
        save_on_notice=False, weights=weights, global_step=step,
    )  # fmt: skip
    folder = ckpt._folder  # noqa: SLF001 - where the run's checkpoints go in the bucket
    state_key = f"{env.prefix}/{folder}/train/checkpoint"

    def state() -> str:
        return str(env.client.get_object(Bucket=env.rgw.bucket, Key=state_key)["Body"].read().decode())

    try:
        assert ckpt.save(step, blocking=True).exception(SAVE_TIMEOUT) is None
        assert 'model_checkpoint_path: "ckpt-1"' in state()
        step.assign(2)
        with env.proxy.during("slowdown", only=rf"^GET /{env.rgw.bucket}/{state_key} "):
            written = ckpt.save(step, blocking=True)
            assert written.exception(SAVE_TIMEOUT) is None and not written.skipped
        assert any(state_key in line for _, line in env.proxy.matched), "the state file was never read"
        assert {"ckpt-1", "ckpt-2"} <= env.manifests(f"{folder}/train/")
        assert "ckpt-2" not in state()  # not updated: its read failed
        assert "its dir's checkpoint state file was not updated" in env.daemon.log()
        step.assign(3)
        assert ckpt.save(step, blocking=True).exception(SAVE_TIMEOUT) is None
        assert 'model_checkpoint_path: "ckpt-3"' in state() and '"ckpt-2"' in state(), state()
    finally:
        ckpt.close(timeout=SAVE_TIMEOUT)
