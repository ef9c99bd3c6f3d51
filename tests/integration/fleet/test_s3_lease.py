"""Run leases between two real daemons on one bucket prefix (Ceph's radosgw, tests/integration/support/rgw.py).

Two daemons on loopback share nothing but the prefix, with 3-second leases.
A run one daemon holds is refused ABORTED on the other, naming the holder,
after the RegisterRun waited what its deadline allowed; a closed run is
taken at once; a SIGKILLed daemon's run is taken once its lease expired;
concurrent registrations of one run never give two writers, and every
committed manifest's "writer" is the holder of its time; a daemon paused
(SIGSTOP) past its lease commits nothing after it wakes. The raw gRPC client
drives the saves (no TF trainer is needed).
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from checkpointd.storage.s3 import LEASES_DIR, S3Store
from checkpointd.v1 import checkpointd_pb2 as pb
from tests.integration.support import policies, scrape
from tests.integration.support.daemon import Daemon, start_daemon
from tests.integration.support.raw import TIMEOUT, RawSave, Run, Stub, Template, export_template, register_requests
from tests.integration.support.rgw import Rgw

MANIFEST = "checkpointd.manifest.json"
TTL = 3.0


class Fleet:
    """Daemons on one prefix of the bucket, each with its stub; all stopped at teardown."""

    def __init__(self, server: Rgw, tmp: Path) -> None:
        self.rgw = server
        self.tmp = tmp
        self.prefix = f"lease-{secrets.token_hex(4)}"
        self.client: Any = server.client()
        self.daemons: list[Daemon] = []
        self._channels: list[grpc.Channel] = []
        self._lock = threading.Lock()

    def start(self, count: int) -> list[Daemon]:
        """Starts `count` daemons at once (each loads TensorFlow for seconds)."""
        with ThreadPoolExecutor(count) as pool:
            return list(pool.map(lambda n: self._daemon(n), range(len(self.daemons), len(self.daemons) + count)))

    def daemon(self) -> Daemon:
        (d,) = self.start(1)
        return d

    def _daemon(self, n: int) -> Daemon:
        d = start_daemon(
            f"s3://{self.rgw.bucket}/{self.prefix}",  # type: ignore[arg-type]  # passed to --root as str(root)
            self.tmp / f"work{n}",
            "--work-dir", str(self.tmp / f"state{n}"),
            "--s3-endpoint-url", self.rgw.endpoint, "--s3-region", "us-east-1",
            "--lease-seconds", str(TTL), "--lease-idle-seconds", "60", "--no-shm",
            env=self.rgw.daemon_env(),
        )  # fmt: skip
        with self._lock:
            self.daemons.append(d)
        return d

    def stub(self, d: Daemon) -> Stub:
        channel = d.channel()
        self._channels.append(channel)
        return Stub(channel)

    def manifest(self, run: str, export_dir: str) -> dict[str, Any] | None:
        key = f"{self.prefix}/{run}/{export_dir}/{MANIFEST}"
        try:
            body = self.client.get_object(Bucket=self.rgw.bucket, Key=key)["Body"].read()
        except Exception as e:  # noqa: BLE001 - a missing manifest is an answer
            if "NoSuchKey" in type(e).__name__ or "NoSuchKey" in str(e):
                return None
            raise
        return dict(json.loads(body))

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        running = [d for d in self.daemons if d.proc.poll() is None]
        for d in running:
            os.kill(d.proc.pid, signal.SIGCONT)  # a test may have left it stopped
        with ThreadPoolExecutor(max(1, len(running))) as pool:  # drains at once, not one after another
            list(pool.map(lambda d: d.terminate(), running))


@pytest.fixture(scope="module")
def fleet(rgw: Rgw, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One prefix for the module (each test its own run), and daemons A and B on it, started at once."""
    env = Fleet(rgw, tmp_path_factory.mktemp("fleet"))
    try:
        env.start(2)
        yield env
    finally:
        env.close()


@pytest.fixture(scope="module")
def pair(fleet: Fleet) -> tuple[Daemon, Daemon]:
    a, b = fleet.daemons[:2]
    return a, b


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    return export_template(policies.build(policies.q(hidden=(4,))), tmp_path_factory.mktemp("template"))


def _register(stub: Stub, run: str, template: Template, timeout: float = TIMEOUT) -> Run:
    requests = register_requests(run, template.dir, template.bindings.protos(), template.bindings.object_graph)
    stub.RegisterRun(requests, timeout=timeout)
    return Run(run, template)


def _refused(stub: Stub, run: str, template: Template, timeout: float) -> tuple[grpc.StatusCode, str, float]:
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        _register(stub, run, template, timeout)
    return caught.value.code(), caught.value.details() or "", time.monotonic() - started


def _save(stub: Stub, run: Run, export_dir: str) -> pb.SaveResult:
    with RawSave(stub, pb.SaveRequest(header=run.header(export_dir, blocking=True))) as call:
        assert call.decision().accepted
        return call.finish(run.chunks())


def _save_refused(stub: Stub, run: Run, export_dir: str) -> tuple[grpc.StatusCode, str]:
    with RawSave(stub, pb.SaveRequest(header=run.header(export_dir, blocking=True))) as call:
        with pytest.raises(grpc.RpcError) as caught:
            if call.decision().accepted:
                call.finish(run.chunks())
    return caught.value.code(), caught.value.details() or ""


def _writer_pid(manifest: dict[str, Any]) -> int:
    """The pid in a manifest's writer (`<host>-<pid>-<hex>`)."""
    return int(str(manifest["writer"]).rsplit("-", 2)[1])


def test_a_held_run_is_refused_on_another_daemon_after_its_wait_then_taken_at_once_when_closed(
    fleet: Fleet, pair: tuple[Daemon, Daemon], template: Template
) -> None:
    a, b = pair
    on_a, on_b = fleet.stub(a), fleet.stub(b)
    run = _register(on_a, "held", template)
    _save(on_a, run, "one")
    code, details, waited = _refused(on_b, "held", template, timeout=2.0)
    assert code == grpc.StatusCode.ABORTED, details
    assert f"pid {a.proc.pid}" in details and "expires in" in details and "close the run there" in details
    assert waited >= 1.0  # it waited for the lease within its deadline before giving up
    on_a.CloseRun(pb.CloseRunRequest(run="held", timeout_seconds=10), timeout=TIMEOUT)
    started = time.monotonic()
    run_b = _register(on_b, "held", template, timeout=TIMEOUT)
    assert time.monotonic() - started < TTL  # released: no wait for an expiry
    _save(on_b, run_b, "two")
    one, two = fleet.manifest("held", "one"), fleet.manifest("held", "two")
    assert one is not None and two is not None
    assert (_writer_pid(one), _writer_pid(two)) == (a.proc.pid, b.proc.pid)
    code, details, _ = _refused(on_a, "held", template, timeout=1.0)
    assert code == grpc.StatusCode.ABORTED and f"pid {b.proc.pid}" in details


@pytest.mark.skipif(
    os.environ.get("CHECKPOINTD_FLEET") != "1",
    reason="test_fleet's move covers a killed daemon's lease in the default suite; CHECKPOINTD_FLEET=1 runs this too",
)
def test_a_killed_daemons_run_is_taken_once_its_lease_expired_and_saves_commit(
    fleet: Fleet, pair: tuple[Daemon, Daemon], template: Template
) -> None:
    a, b = fleet.daemon(), pair[1]
    on_a, on_b = fleet.stub(a), fleet.stub(b)
    _save(on_a, _register(on_a, "moved", template), "before")
    a.proc.kill()
    a.proc.wait()
    started = time.monotonic()
    run = _register(on_b, "moved", template, timeout=TIMEOUT)  # waits inside the call
    waited = time.monotonic() - started
    assert waited >= TTL - 0.5, waited  # B saw A's lease unchanged for a full ttl first
    result = _save(on_b, run, "after")
    assert result.bytes_written > 0
    after = fleet.manifest("moved", "after")
    assert after is not None and _writer_pid(after) == b.proc.pid


def _together(*calls: Callable[[], Any]) -> list[Any]:
    """Runs the calls at once (released together by a barrier); each one's result or exception."""
    barrier = threading.Barrier(len(calls))
    out: list[Any] = [None] * len(calls)

    def one(i: int) -> None:
        barrier.wait(timeout=TIMEOUT)
        try:
            out[i] = calls[i]()
        except (grpc.RpcError, AssertionError) as e:
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    return out


def test_racing_registrations_of_one_run_never_make_two_writers(
    fleet: Fleet, pair: tuple[Daemon, Daemon], template: Template
) -> None:
    daemons = list(pair)
    stubs = [fleet.stub(d) for d in daemons]
    # Each call's deadline stays under TTL, so the loser cannot see the lease
    # unchanged for a full ttl (and take it) before its deadline refuses it;
    # the winner's registration must fit in it too, on a loaded machine.
    for round_ in range(4):
        outcomes = _together(*(functools.partial(_register, s, "race", template, TTL - 0.5) for s in stubs))
        winners = [i for i, o in enumerate(outcomes) if isinstance(o, Run)]
        assert len(winners) == 1, outcomes
        (won,) = winners
        lost = 1 - won
        error = outcomes[lost]
        assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.ABORTED, error
        assert f"pid {daemons[won].proc.pid}" in (error.details() or "")
        # Both save at once: only the holder's commits; the loser writes nothing.
        names = [f"r{round_}-d{i}" for i in range(2)]
        results = _together(
            *(functools.partial(_save, s, Run("race", template), n) for s, n in zip(stubs, names, strict=True))
        )
        assert isinstance(results[won], pb.SaveResult), results[won]
        assert not isinstance(results[lost], pb.SaveResult)
        committed = fleet.manifest("race", names[won])
        assert committed is not None and _writer_pid(committed) == daemons[won].proc.pid
        assert fleet.manifest("race", names[lost]) is None
        stubs[won].CloseRun(pb.CloseRunRequest(run="race", timeout_seconds=10), timeout=TIMEOUT)


def test_a_daemon_paused_past_its_lease_commits_nothing_after_it_wakes(
    fleet: Fleet, pair: tuple[Daemon, Daemon], template: Template
) -> None:
    a, b = pair  # A serves on once it wakes: its other runs' leases are renewed or taken again
    on_a, on_b = fleet.stub(a), fleet.stub(b)
    run = _register(on_a, "paused", template)
    _save(on_a, run, "first")
    held = RawSave(on_a, pb.SaveRequest(header=run.header("in-flight", blocking=True)))
    try:
        assert held.decision().accepted  # accepted under A's lease; its snapshot comes later
        os.kill(a.proc.pid, signal.SIGSTOP)
        try:
            run_b = _register(on_b, "paused", template, timeout=TIMEOUT)  # A's lease expires meanwhile
            _save(on_b, run_b, "by-b")
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        with pytest.raises(grpc.RpcError) as caught:
            held.finish(run.chunks())
        assert caught.value.code() == grpc.StatusCode.ABORTED, caught.value.details()
    finally:
        held.close()
    assert fleet.manifest("paused", "in-flight") is None
    code, details = _save_refused(on_a, run, "next")
    assert code == grpc.StatusCode.ABORTED and f"pid {b.proc.pid}" in details, details
    assert fleet.manifest("paused", "next") is None
    by_b = fleet.manifest("paused", "by-b")
    assert by_b is not None and _writer_pid(by_b) == b.proc.pid
    assert scrape.Metrics(a.metrics_url)("checkpointd_leases_lost_total") >= 1
    on_b_metrics = scrape.Metrics(b.metrics_url)
    assert on_b_metrics("checkpointd_leases_held") >= 1
    assert on_b_metrics("checkpointd_save_phase_duration_seconds_count", kind="saved_model", phase="upload") >= 1
    assert on_b_metrics("checkpointd_store_uploaded_bytes_total", kind="saved_model") > 0


def test_lease_objects_are_neither_runs_nor_leftovers_for_listing_and_recovery(
    fleet: Fleet, pair: tuple[Daemon, Daemon], tmp_path: Path, template: Template
) -> None:
    a, _ = pair
    on_a = fleet.stub(a)
    _save(on_a, _register(on_a, "tidy", template), "kept")
    leases = f"{fleet.prefix}/{LEASES_DIR}/"
    before = {o["Key"] for o in fleet.client.list_objects_v2(Bucket=fleet.rgw.bucket, Prefix=leases)["Contents"]}
    assert f"{leases}tidy.json" in before
    store = S3Store(
        f"s3://{fleet.rgw.bucket}/{fleet.prefix}", tmp_path / "staging", grace_seconds=0, client=fleet.client
    )
    try:
        folders = store.folders()
        assert "tidy" in folders and not any(f.startswith(".") for f in folders)
        store.tidy(lambda: False)  # every object past the grace age: the leases are none of its business
    finally:
        store.close()
    after = {o["Key"] for o in fleet.client.list_objects_v2(Bucket=fleet.rgw.bucket, Prefix=leases)["Contents"]}
    assert before <= after
    assert fleet.manifest("tidy", "kept") is not None
