"""A trainer on a fresh daemon's host restores from the bucket with the files staged on that host.

The daemon lands the ranged GETs in files in its staging dir (a tmpfs), the
client links them into a dir of its own; no file byte crosses the
connection. Against a real radosgw and real daemons:
- every value restored bit for bit, the staged files gone once it is done;
- a stored file that does not match its manifest is refused (DATA_LOSS, no
  variable changes), and nothing stays staged;
- a client killed while it holds staged files: the daemon deletes them;
- a client that may not use the same-host path (another host) gets the
  bytes over the connection; so does one of a daemon without a staging dir,
  which refuses a staged call with INVALID_ARGUMENT.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tensorflow as tf

from checkpointd.protocol.errors import ChecksumError
from checkpointd.storage.s3 import restore as s3_restore
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc
from checkpointd_client import RemoteCheckpointer
from checkpointd_client.restore import checkpoints as checkpoint_restore
from checkpointd_client.restore import files
from checkpointd_client.transport.connection import ConnectionOptions
from checkpointd_client.transport.session import DaemonSession
from tests.integration.support.daemon import Daemon, start_daemon, wait_until

LIMIT = 120.0
RUN = "rs-s3"
EXPORT_DIR = "train/ckpt-9"
CHILDREN = {"big", "step", "save_counter"}
# Not a multiple of one staged GET: pieces land out of order at their offsets.
BIG_FLOATS = 5 * s3_restore.STAGE_GET_BYTES // 8 + 12345


@pytest.fixture(scope="module")
def bucket(rgw: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Saves RUN's train/ckpt-9 through a daemon that then stops; returns where, and the saved values."""
    base = tmp_path_factory.mktemp("staged")
    url = f"s3://{rgw.bucket}/rs-{os.getpid()}"
    rng = np.random.default_rng(11)
    big = tf.Variable(rng.standard_normal(BIG_FLOATS).astype(np.float32))
    step = tf.Variable(9, dtype=tf.int64)
    first = _daemon(rgw, url, base / "first")
    try:
        with RemoteCheckpointer("train", first.address, run=RUN, timeout=LIMIT, big=big, step=step) as ckpt:
            ckpt.save(step, blocking=True).result()
    finally:
        first.terminate()
    return {"url": url, "base": base, "big": big.numpy().tobytes(), "prefix": url.split("/", 3)[3]}


def _daemon(rgw: Any, url: str, work: Path, *extra: str) -> Daemon:
    return start_daemon(
        url, work, "--work-dir", str(work / "state"), "--s3-endpoint-url", rgw.endpoint, "--s3-region", "us-east-1",
        *extra, env=rgw.daemon_env(),
    )  # type: ignore[arg-type]  # fmt: skip  # the root goes to --root as str(root)


@pytest.fixture
def fresh(rgw: Any, bucket: dict[str, Any], tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Starts daemons on the bucket that never saw the run; stops them."""
    started: list[Daemon] = []

    def start(*extra: str) -> Daemon:
        started.append(_daemon(rgw, bucket["url"], tmp_path / f"d{len(started)}", *extra))
        return started[-1]

    yield start
    for d in started:
        d.terminate()


def _objects() -> dict[str, tf.Variable]:
    return {"big": tf.Variable(tf.zeros([BIG_FLOATS])), "step": tf.Variable(0, dtype=tf.int64)}


def _session(daemon: Daemon) -> DaemonSession:
    return DaemonSession(daemon.address, RUN, ConnectionOptions(timeout=LIMIT), owner="checkpointer", upload_threads=1)


def _staging_dir(daemon: Daemon) -> Path:
    stub = checkpointd_pb2_grpc.CheckpointServiceStub(daemon.channel())
    probe = pb.RestoreFilesRequest(run=RUN, export_dir=EXPORT_DIR, header_only=True)
    header = next(iter(stub.RestoreFiles(probe, timeout=LIMIT))).header
    assert header.staging_dir
    return Path(header.staging_dir)


def _staged(staging: Path) -> list[str]:
    return [n for n in os.listdir(staging) if n.startswith("restore-")]


def test_a_fresh_daemon_stages_the_files_on_its_host_and_every_value_comes_back_bit_for_bit(
    fresh: Callable[..., Daemon], bucket: dict[str, Any]
) -> None:
    daemon = fresh()
    staging = _staging_dir(daemon)
    objects = _objects()
    session = _session(daemon)
    try:
        restored = checkpoint_restore.restore(session, tf.train.Checkpoint(**objects), CHILDREN, EXPORT_DIR, "")
    finally:
        session.shutdown()
    restored.status.assert_consumed()
    assert restored.received < 4096  # the index and the object graph: the data file was staged, not sent
    assert not restored.in_place and restored.copy is None
    assert objects["big"].numpy().tobytes() == bucket["big"]
    assert int(objects["step"].numpy()) == 9
    wait_until(lambda: _staged(staging) == [], "the daemon to delete the staged files")


def test_a_whole_fetch_is_staged_and_links_the_files_the_daemon_checked(fresh: Callable[..., Daemon]) -> None:
    daemon = fresh()
    stub = checkpointd_pb2_grpc.CheckpointServiceStub(daemon.channel())
    fetched = files.fetch(stub, RUN, EXPORT_DIR, LIMIT)
    try:
        assert fetched.staged and fetched.received == 0 and not fetched.in_place
        data = Path(f"{fetched.prefix}.data-00000-of-00001")
        assert data.stat().st_size == {f.path: f.size for f in fetched.header.files}[data.name]
        assert not str(data).startswith(fetched.header.staging_dir)  # the client's own name for it
        reader = tf.train.load_checkpoint(fetched.prefix)
        assert int(reader.get_tensor("step/.ATTRIBUTES/VARIABLE_VALUE")) == 9
    finally:
        fetched.close()
    assert not data.exists()
    wait_until(lambda: _staged(Path(fetched.header.staging_dir)) == [], "the daemon to delete the staged files")


@pytest.fixture
def corrupt(rgw: Any, bucket: dict[str, Any]) -> Iterator[None]:
    """Rewrites the stored data file with one byte flipped (same size, manifest unchanged), then puts it back."""
    client: Any = rgw.client()
    key = f"{bucket['prefix']}/{RUN}/{EXPORT_DIR}.data-00000-of-00001"
    body = client.get_object(Bucket=rgw.bucket, Key=key)["Body"].read()
    flipped = bytearray(body)
    flipped[len(body) // 2] ^= 0xFF
    client.put_object(Bucket=rgw.bucket, Key=key, Body=bytes(flipped))
    yield
    client.put_object(Bucket=rgw.bucket, Key=key, Body=body)


def test_a_stored_file_that_fails_its_crc_is_refused_when_staged_and_no_variable_changes(
    fresh: Callable[..., Daemon], corrupt: None
) -> None:
    daemon = fresh()
    staging = _staging_dir(daemon)
    objects = _objects()
    before = [v.numpy().tobytes() for v in objects.values()]
    session = _session(daemon)
    try:
        with pytest.raises(ChecksumError, match="CRC32C"):
            checkpoint_restore.restore(session, tf.train.Checkpoint(**objects), CHILDREN, EXPORT_DIR, "")
    finally:
        session.shutdown()
    assert [v.numpy().tobytes() for v in objects.values()] == before
    wait_until(lambda: _staged(staging) == [], "the daemon to delete the refused staged files")
    stub = checkpointd_pb2_grpc.CheckpointServiceStub(daemon.channel())
    with pytest.raises(grpc.RpcError) as raised:
        for _ in stub.RestoreFiles(pb.RestoreFilesRequest(run=RUN, export_dir=EXPORT_DIR, stage=True), timeout=LIMIT):
            pass
    assert raised.value.code() == grpc.StatusCode.DATA_LOSS
    assert "corrupt" in (raised.value.details() or "")


_HOLDER = """
import sys, grpc
from checkpointd.v1 import checkpointd_pb2 as pb, checkpointd_pb2_grpc
stub = checkpointd_pb2_grpc.CheckpointServiceStub(grpc.insecure_channel(sys.argv[1]))
responses = stub.RestoreFiles(pb.RestoreFilesRequest(run=sys.argv[2], export_dir=sys.argv[3], stage=True))
next(responses)
print(next(responses).staged.dir, flush=True)
sys.stdin.read()  # holds the call open until killed
"""


def test_staged_files_of_a_client_killed_while_it_holds_them_are_deleted_by_the_daemon(
    fresh: Callable[..., Daemon],
) -> None:
    daemon = fresh()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, daemon.address, RUN, EXPORT_DIR],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ),
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        staged = Path(holder.stdout.readline().strip())
        assert staged.name.startswith("restore-")
        assert (staged / f"{Path(EXPORT_DIR).name}.data-00000-of-00001").is_file()  # held while the call is open
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=LIMIT)
    wait_until(lambda: not staged.exists(), "the daemon to delete a killed client's staged files")


def test_a_client_that_may_not_use_the_same_host_path_gets_the_bytes_over_the_connection(
    fresh: Callable[..., Daemon], bucket: dict[str, Any]
) -> None:
    daemon = fresh()
    objects = _objects()
    session = _session(daemon)
    try:
        restored = checkpoint_restore.restore(
            session, tf.train.Checkpoint(**objects), CHILDREN, EXPORT_DIR, "", in_place=False
        )
    finally:
        session.shutdown()
    assert restored.received > BIG_FLOATS * 4  # the data file came over the connection
    assert objects["big"].numpy().tobytes() == bucket["big"]


def test_a_daemon_without_a_staging_dir_sends_the_bytes_and_refuses_a_staged_call(
    fresh: Callable[..., Daemon], bucket: dict[str, Any]
) -> None:
    daemon = fresh("--no-shm")
    stub = checkpointd_pb2_grpc.CheckpointServiceStub(daemon.channel())
    fetched = files.fetch(stub, RUN, EXPORT_DIR, LIMIT)
    try:
        assert not fetched.staged and fetched.received > BIG_FLOATS * 4
        assert fetched.header.staging_dir == ""
    finally:
        fetched.close()
    with pytest.raises(grpc.RpcError) as raised:
        for _ in stub.RestoreFiles(pb.RestoreFilesRequest(run=RUN, export_dir=EXPORT_DIR, stage=True), timeout=LIMIT):
            pass
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "without stage" in (raised.value.details() or "")
    assert _staged_count_ok(daemon)


def _staged_count_ok(daemon: Daemon) -> bool:
    """The daemon still serves after the refusal."""
    stub = checkpointd_pb2_grpc.CheckpointServiceStub(daemon.channel())
    probe = pb.RestoreFilesRequest(run=RUN, export_dir=EXPORT_DIR, header_only=True)
    return next(iter(stub.RestoreFiles(probe, timeout=LIMIT))).header.export_dir == EXPORT_DIR
