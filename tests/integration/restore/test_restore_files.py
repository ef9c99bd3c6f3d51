"""Restore moves bytes: RestoreFiles, and RemoteCheckpointer's restore over it, against a real daemon.

A DQN training state (Adam slots, a replay buffer, NumPy state, metrics) is
saved once through the daemon; each test restores it into fresh objects and
compares every value, bit for bit, with what was saved:
- in place: the client on the daemon's host reads the committed files where
  they are (no file byte crosses the connection);
- fetched: the files come over the connection into memory;
- partial: a checkpoint of the policy alone fetches only its tensors;
- a committed file changed on disk is refused (its tensors fail the CRC32C
  their checked index holds), and the objects keep their values; the chunk
  holding the changed byte carries the CRC32C recorded at commit;
- bad ranges and missing saves get the right status.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import grpc
import pytest
import tensorflow as tf

from checkpointd.protocol.errors import ChecksumError
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc
from checkpointd_client import RemoteCheckpointer
from checkpointd_client.restore import checkpoints as checkpoint_restore
from checkpointd_client.restore import files
from checkpointd_client.transport.connection import ConnectionOptions
from checkpointd_client.transport.session import DaemonSession
from tests.integration.support import training_state
from tests.integration.support.daemon import Daemon

LIMIT = 120.0
RUN = "rf-dqn"
EXPORT_DIR = "train/ckpt-5"
CHILDREN = {"agent", "policy", "replay_buffer", "global_step", "tf_metric", "py_metric", "save_counter"}


@pytest.fixture(scope="module")
def saved(daemon: Daemon) -> dict[str, bytes]:
    """Saves a trained state as RUN's train/ckpt-5; returns its values."""
    state = training_state.build(seed=0)
    state.collect(40)
    state.train(2)  # Adam's slots exist and hold values
    state.global_step.assign(5)
    with RemoteCheckpointer("train", daemon.address, run=RUN, timeout=LIMIT, **state.objects) as ckpt:
        assert ckpt.save(state.global_step, blocking=True).result() is not None
    global POLICY_VALUES
    POLICY_VALUES = _policy_values(state)
    return training_state.values(state.objects)


POLICY_VALUES: list[bytes] = []  # the saved policy's variables, set by `saved`


def _policy_values(state: training_state.State) -> list[bytes]:
    return [v.numpy().tobytes() for v in state.agent.policy.variables()]


@pytest.fixture
def session(daemon: Daemon) -> Iterator[DaemonSession]:
    session = DaemonSession(
        daemon.address, RUN, ConnectionOptions(timeout=LIMIT), owner="checkpointer", upload_threads=1
    )
    yield session
    session.shutdown()


def _fresh() -> training_state.State:
    state = training_state.build(seed=1)
    state.create_optimizer_variables()
    return state


def _data_file(daemon: Daemon) -> Path:
    return daemon.root / RUN / "train" / "ckpt-5.data-00000-of-00001"


def _private_dirs() -> set[str]:
    return {n for n in os.listdir(files.MEMORY_DIR) if n.startswith("checkpointd-restore-")}


def test_a_checkpointer_on_the_daemons_host_restores_every_value_from_the_committed_files_in_place(
    daemon: Daemon, saved: dict[str, bytes]
) -> None:
    fresh = _fresh()
    assert training_state.values(fresh.objects) != saved
    before = _private_dirs()
    with RemoteCheckpointer("train", daemon.address, run=RUN, timeout=LIMIT, **fresh.objects) as ckpt:
        assert ckpt.checkpoint_exists
        assert _private_dirs() == before  # nothing was copied
    assert training_state.values(fresh.objects) == saved


def test_files_on_the_daemons_host_are_read_in_place_with_no_file_byte_over_the_connection(
    daemon: Daemon, saved: dict[str, bytes]
) -> None:
    stub = checkpointd_pb2_grpc.CheckpointServiceStub(grpc.insecure_channel(daemon.address))
    fetched = files.fetch(stub, RUN, EXPORT_DIR, LIMIT)
    try:
        assert fetched.in_place
        index = daemon.root / RUN / "train" / "ckpt-5.index"
        assert os.path.realpath(fetched.prefix + ".index") == str(index.resolve())  # through the held file
        assert fetched.received == 0
        assert fetched.index == index.read_bytes()
    finally:
        fetched.close()


def test_a_fetched_restore_brings_every_value_into_memory_and_deletes_its_copy(
    session: DaemonSession, daemon: Daemon, saved: dict[str, bytes]
) -> None:
    fresh = _fresh()
    before = _private_dirs()
    restored = checkpoint_restore.restore(
        session, tf.train.Checkpoint(**fresh.objects), CHILDREN, EXPORT_DIR, "", in_place=False
    )
    restored.status.assert_consumed()
    assert not restored.in_place and restored.copy is None  # nothing left to defer: the copy went at once
    assert _private_dirs() == before
    data = _data_file(daemon).stat().st_size
    assert restored.received > data  # the data file whole, and the index
    assert training_state.values(fresh.objects) == saved


def test_deferred_slots_are_restored_from_the_fetched_copy_when_the_optimizer_builds_them(
    session: DaemonSession, saved: dict[str, bytes]
) -> None:
    fresh = training_state.build(seed=1)  # Adam has no slots yet
    restored = checkpoint_restore.restore(
        session, tf.train.Checkpoint(**fresh.objects), CHILDREN, EXPORT_DIR, "", in_place=False
    )
    assert restored.copy is not None  # kept: the slots are still to come
    try:
        fresh.create_optimizer_variables()  # TensorFlow restores them as they appear
        restored.status.assert_consumed()
        assert training_state.values(fresh.objects) == saved
    finally:
        restored.copy.close()


def test_a_policy_alone_fetches_only_its_own_tensors_from_a_checkpoint_with_a_replay_buffer(
    session: DaemonSession, daemon: Daemon, saved: dict[str, bytes]
) -> None:
    fresh = _fresh()
    restored = checkpoint_restore.restore(
        session, tf.train.Checkpoint(policy=fresh.agent.policy), {"policy", "save_counter"}, EXPORT_DIR, "",
        in_place=False,
    )  # fmt: skip
    try:
        restored.status.assert_existing_objects_matched()
        with pytest.raises(AssertionError):
            restored.status.assert_consumed()  # the buffer and the agent's optimizer stay in the checkpoint
    finally:
        if restored.copy is not None:
            restored.copy.close()
    assert _policy_values(fresh) == POLICY_VALUES != _policy_values(_fresh())
    policy_bytes = sum(len(v) for v in POLICY_VALUES)
    buffer_bytes = sum(len(v) for k, v in saved.items() if k.startswith("replay_buffer/"))
    index_bytes = (daemon.root / RUN / "train" / "ckpt-5.index").stat().st_size
    assert buffer_bytes > policy_bytes
    # The index, the object graph and the policy's tensors; none of the buffer's.
    assert policy_bytes < restored.received <= index_bytes + _data_file(daemon).stat().st_size - buffer_bytes


def _values_unchanged(fresh: training_state.State, before: dict[str, bytes]) -> None:
    assert training_state.values(fresh.objects) == before


@pytest.fixture
def tampered(daemon: Daemon, saved: dict[str, bytes]) -> Iterator[Path]:
    """Flips one byte in the middle of the committed data file (same size), then puts it back."""
    path = _data_file(daemon)
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    yield path
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(byte)


@pytest.mark.parametrize("in_place", [False, True], ids=["fetched", "in-place"])
def test_a_committed_file_changed_on_disk_is_refused_and_no_variable_changes(
    session: DaemonSession, tampered: Path, in_place: bool
) -> None:
    fresh = _fresh()
    before = training_state.values(fresh.objects)
    with pytest.raises(ChecksumError, match="corrupt"):
        checkpoint_restore.restore(
            session, tf.train.Checkpoint(**fresh.objects), CHILDREN, EXPORT_DIR, "", in_place=in_place
        )
    _values_unchanged(fresh, before)


def test_chunks_carry_the_crc32c_recorded_at_commit_so_a_byte_changed_since_fails_its_chunk(
    daemon: Daemon, tampered: Path
) -> None:
    data_file = "ckpt-5.data-00000-of-00001"
    flipped = tampered.stat().st_size // 2
    request = pb.RestoreFilesRequest(run=RUN, export_dir=EXPORT_DIR, ranges=[pb.FileRange(path=data_file)])
    with grpc.insecure_channel(daemon.address) as channel:
        stub = checkpointd_pb2_grpc.CheckpointServiceStub(channel)
        chunks = [r.chunk for r in stub.RestoreFiles(request, timeout=LIMIT) if r.WhichOneof("item") == "chunk"]
    bad = [c.offset for c in chunks if crc32c.crc32c(c.data) != c.crc32c]
    (holding,) = [c.offset for c in chunks if c.offset <= flipped < c.offset + len(c.data)]
    assert bad == [holding]  # the daemon did not recompute it from the bytes it read


def _call(stub: Any, **request: Any) -> grpc.StatusCode:
    try:
        for _ in stub.RestoreFiles(pb.RestoreFilesRequest(**request), timeout=LIMIT):
            pass
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_bad_ranges_and_missing_saves_get_their_status_and_the_daemon_keeps_serving(
    daemon: Daemon, saved: dict[str, bytes]
) -> None:
    stub = checkpointd_pb2_grpc.CheckpointServiceStub(grpc.insecure_channel(daemon.address))
    size = _data_file(daemon).stat().st_size
    data = "ckpt-5.data-00000-of-00001"
    assert _call(stub, run=RUN, export_dir=EXPORT_DIR, ranges=[pb.FileRange(path="ckpt-5.nope")]) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    past = pb.FileRange(path=data, offset=size - 10, length=11)
    assert _call(stub, run=RUN, export_dir=EXPORT_DIR, ranges=[past]) == grpc.StatusCode.INVALID_ARGUMENT
    assert _call(stub, run=RUN, export_dir="train/ckpt-6") == grpc.StatusCode.NOT_FOUND
    # By where it is: another run of the folder (a renamed job), or a reader naming no run, gets it.
    assert _call(stub, run="rf-other", export_dir=EXPORT_DIR, folder=RUN) == grpc.StatusCode.OK
    assert _call(stub, run="", export_dir=EXPORT_DIR, folder=RUN) == grpc.StatusCode.OK
    assert _call(stub, run="", export_dir=EXPORT_DIR) == grpc.StatusCode.INVALID_ARGUMENT  # no folder, no run
    assert _call(stub, run=RUN, export_dir="../x") == grpc.StatusCode.INVALID_ARGUMENT
    last = pb.FileRange(path=data, offset=size - 10, length=10)
    assert _call(stub, run=RUN, export_dir=EXPORT_DIR, ranges=[last]) == grpc.StatusCode.OK


def test_a_fresh_daemon_on_the_bucket_streams_a_checkpoint_it_never_saw_in_parallel_ranged_gets(
    rgw: Any, tmp_path: Path
) -> None:
    import numpy as np

    from checkpointd.storage.s3 import restore as s3_restore
    from tests.integration.support.daemon import start_daemon

    url = f"s3://{rgw.bucket}/rf-{os.getpid()}"
    args = ["--s3-endpoint-url", rgw.endpoint, "--s3-region", "us-east-1"]

    def daemon(n: int) -> Daemon:
        return start_daemon(
            url, tmp_path / f"work{n}", "--work-dir", str(tmp_path / f"state{n}"), *args, env=rgw.daemon_env()
        )  # type: ignore[arg-type]  # the root goes to --root as str(root)

    rng = np.random.default_rng(7)
    # Larger than a few GETs, and not a multiple of one: pieces arrive out of order and must be put back in order.
    big = tf.Variable(rng.standard_normal(3 * s3_restore.GET_BYTES // 4 + 12345).astype(np.float32))
    step = tf.Variable(9, dtype=tf.int64)
    first = daemon(0)
    try:
        with RemoteCheckpointer("train", first.address, run="rf-s3", timeout=LIMIT, big=big, step=step) as ckpt:
            ckpt.save(step, blocking=True).result()
    finally:
        first.terminate()
    saved = big.numpy().copy()
    big.assign(tf.zeros_like(big))
    step.assign(0)
    fresh = daemon(1)
    try:
        with RemoteCheckpointer("train", fresh.address, run="rf-s3", timeout=LIMIT, big=big, step=step) as ckpt:
            assert ckpt.checkpoint_exists
        staging = list((tmp_path / "state1").rglob("*ckpt*"))
        assert staging == []  # nothing staged on the daemon's disk
    finally:
        fresh.terminate()
    assert int(step.numpy()) == 9
    assert big.numpy().tobytes() == saved.tobytes()
