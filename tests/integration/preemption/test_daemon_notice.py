"""A daemon on notice, as real `checkpointd serve` processes: SIGTERM while trainers still hold runs.

On a local root: the runs registered before the SIGTERM still save within
--notice-window (a RemotePolicySaver's ordinary blocking save, and a save on
notice sent raw, as the client's notice handler sends it), a new run is
refused UNAVAILABLE naming the daemon, `checkpointd status` says the daemon
is on notice, and the daemon exits 0 as soon as no run can still send a
final save. On a bucket (radosgw): daemon A, on notice, takes its run's final
save and releases the run's lease as it exits, so daemon B, whose
registration of the run started at A's SIGTERM, holds it well under the
lease's ttl.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from grpc_health.v1 import health_pb2, health_pb2_grpc

from checkpointd.protocol import wire
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client import CheckpointdError, RemotePolicySaver, UnavailableError
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon, start_daemon
from tests.integration.support.raw import RawSave, Stub, Template, export_template, register, saver_header
from tests.integration.support.rgw import Rgw

TIMEOUT = 60.0
SERVICE = "checkpointd.v1.CheckpointService"
CHECKPOINTD = str(Path(sys.executable).with_name("checkpointd"))
# Longer than any of these tests may take on notice: a daemon that exits
# sooner ended its window early, because no run could still send a final save.
WINDOW = 60.0
S3_TTL = 30.0  # the default --lease-seconds: what a daemon without a release would make the next one wait


def on_notice(daemon: Daemon) -> float:
    """SIGTERM; returns once health says NOT_SERVING (the notice was given), with the monotonic time of the signal."""
    with daemon.channel() as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=TIMEOUT
        )
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        sent = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
    return sent


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CHECKPOINTD, *args], capture_output=True, text=True, timeout=TIMEOUT, check=False)


@pytest.fixture
def savers() -> Iterator[list[RemotePolicySaver]]:
    made: list[RemotePolicySaver] = []
    yield made
    for saver in made:
        with contextlib.suppress(CheckpointdError):  # the daemon is gone by now: UNAVAILABLE
            saver.close(timeout=5)


def policy_saver(daemon: Daemon, run: str, train_step: tf.Variable, made: list[RemotePolicySaver]) -> RemotePolicySaver:
    saver = RemotePolicySaver(
        policies.build(policies.q()), daemon.address, run=run, train_step=train_step, timeout=TIMEOUT
    )
    made.append(saver)
    return saver


def test_on_notice_a_held_run_saves_and_commits_a_new_run_is_refused_and_the_daemon_exits_0_at_its_final_save(
    fresh_daemon, savers: list[RemotePolicySaver]
) -> None:
    daemon = fresh_daemon("--notice-window", str(WINDOW))
    step = tf.Variable(41, dtype=tf.int64)
    held = policy_saver(daemon, "held", step, savers)
    held.register()
    sent = on_notice(daemon)

    with pytest.raises(UnavailableError) as refused:
        policy_saver(daemon, "newcomer", tf.Variable(0, dtype=tf.int64), savers).register()
    message = str(refused.value)
    assert (
        f"pid {daemon.proc.pid}, port {daemon.port}" in message
        and "register run 'newcomer' on another daemon" in message
    )

    # The trainer's saves of its held run still land: an ordinary blocking save...
    result = held.save("before-notice-save", blocking=True).result(TIMEOUT)
    assert result.path == str(daemon.root / "held" / "before-notice-save") and result.step == 41
    # ...and its save on notice (the last snapshot, as the client's notice handler sends it).
    step.assign(42)
    header, snap = saver_header(held, step, "final")
    header.blocking, header.on_notice, header.notice_unix_seconds = True, True, time.time()
    with daemon.channel() as channel, RawSave(Stub(channel), pb.SaveRequest(header=header)) as final:
        assert final.decision().accepted
        final_result = final.finish(list(wire.chunks(snap.parts(), 1 << 20)))
    assert final_result.step == 42

    assert daemon.proc.wait(TIMEOUT) == 0
    assert time.monotonic() - sent < WINDOW  # every open run sent its save on notice: the window ended early
    loaded = tf.saved_model.load(final_result.path)
    assert int(loaded.get_train_step().numpy()) == 42
    reader = tf.train.load_checkpoint(str(Path(final_result.path) / "variables" / "variables"))
    for key, array in zip(snap.keys, snap.arrays, strict=True):
        np.testing.assert_array_equal(reader.get_tensor(key), array)
    assert sorted(p.name for p in (daemon.root / "held").iterdir()) == ["before-notice-save", "final"]
    log = daemon.log()
    assert re.search(r"notice window over after [\d.]+s \(every run registered here has sent its save on notice", log)
    assert "Traceback" not in log


def test_checkpointd_status_shows_the_daemon_on_notice_and_closing_its_last_run_ends_the_window(
    fresh_daemon, savers: list[RemotePolicySaver]
) -> None:
    daemon = fresh_daemon("--notice-window", str(WINDOW))
    saver = policy_saver(daemon, "watched", tf.Variable(3, dtype=tf.int64), savers)
    saver.save("first", blocking=True).result(TIMEOUT)
    sent = on_notice(daemon)

    shown = cli("status", "--address", daemon.address)
    assert shown.returncode == 0, shown.stderr
    (line,) = [line for line in shown.stdout.splitlines() if line.startswith("daemon is draining")]
    seconds = float(re.fullmatch(r".*saves of the runs above are taken for ([\d.]+)s more", line)[1])  # type: ignore[index]
    assert 0 < seconds <= WINDOW
    assert "watched" in shown.stdout
    as_json = json.loads(cli("status", "--address", daemon.address, "--json").stdout)
    assert as_json["draining"] is True and 0 < as_json["notice_seconds_left"] <= WINDOW

    closed = cli("close", "--address", daemon.address, "--run", "watched", "--timeout", "30")
    assert closed.returncode == 0, closed.stderr
    assert daemon.proc.wait(TIMEOUT) == 0  # no open run is left to send a final save
    assert time.monotonic() - sent < WINDOW
    assert "notice window over" in daemon.log() and "or was closed" in daemon.log()


# On a bucket: the next daemon takes the run at once.


@pytest.fixture
def fleet(rgw: Rgw, tmp_path: Path) -> Iterator[tuple[list[Daemon], str]]:
    prefix = f"notice-{secrets.token_hex(4)}"
    daemons: list[Daemon] = []

    def start(n: int) -> Daemon:
        return start_daemon(
            f"s3://{rgw.bucket}/{prefix}",  # type: ignore[arg-type]  # passed to --root as str(root)
            tmp_path / f"log{n}",
            "--work-dir", str(tmp_path / f"work{n}"),
            "--s3-endpoint-url", rgw.endpoint, "--s3-region", "us-east-1",
            "--lease-seconds", str(S3_TTL), "--notice-window", str(WINDOW), "--no-shm",
            env=rgw.daemon_env(),
        )  # fmt: skip

    try:
        with ThreadPoolExecutor(2) as pool:  # each loads TensorFlow for seconds
            daemons.extend(pool.map(start, range(2)))
        yield daemons, prefix
    finally:
        for d in daemons:
            if d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    return export_template(policies.build(policies.q(hidden=(4,))), tmp_path_factory.mktemp("template"))


def _writer_pid(rgw: Rgw, prefix: str, run: str, export_dir: str) -> int:
    client: Any = rgw.client()
    body = client.get_object(Bucket=rgw.bucket, Key=f"{prefix}/{run}/{export_dir}/checkpointd.manifest.json")
    return int(str(json.loads(body["Body"].read())["writer"]).rsplit("-", 2)[1])


def test_a_daemon_on_notice_hands_its_run_to_the_next_daemon_well_under_the_lease_ttl(
    rgw: Rgw, fleet: tuple[list[Daemon], str], template: Template, capsys: pytest.CaptureFixture[str]
) -> None:
    (a, b), prefix = fleet
    with a.channel() as to_a, b.channel() as to_b, ThreadPoolExecutor(1) as pool:
        on_a, on_b = Stub(to_a), Stub(to_b)
        run = register(on_a, "moving", template)
        sent = on_notice(a)
        # The trainer's replacement registers on B at once; B waits inside the call for A's lease.
        taken = pool.submit(lambda: (register(on_b, "moving", template), time.monotonic()))
        # Meanwhile the trainer's save on notice still lands through A, which holds the run.
        with RawSave(on_a, pb.SaveRequest(header=run.header("final", blocking=True, on_notice=True))) as final:
            assert final.decision().accepted
            assert final.finish(run.chunks()).bytes_written > 0
        assert a.proc.wait(TIMEOUT) == 0
        exited = time.monotonic()
        run_b, registered = taken.result(TIMEOUT)  # succeeded: no RunHeldError
        with RawSave(on_b, pb.SaveRequest(header=run_b.header("after", blocking=True))) as after:
            assert after.decision().accepted
            assert after.finish(run_b.chunks()).bytes_written > 0

    after_sigterm = registered - sent
    with capsys.disabled():
        print(
            f"\nB took the run {after_sigterm:.2f}s after A's SIGTERM; A exited {exited - sent:.2f}s after it (ttl {S3_TTL:g}s)"
        )
    assert after_sigterm < S3_TTL / 2, after_sigterm  # released, not expired
    assert registered - exited < 2.0  # at the latest B's next look at the lease (every 0.5 s) after A's exit
    assert _writer_pid(rgw, prefix, "moving", "final") == a.proc.pid
    assert _writer_pid(rgw, prefix, "moving", "after") == b.proc.pid
    assert re.search(r"lease: released run=moving \(the daemon is stopping\)", a.log()), a.log()
