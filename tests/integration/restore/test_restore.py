"""GetLatest and Restore against the real daemon: the newest save, streamed back and assigned.

A trainer that restarts (tests/integration/training/test_trigger.py kills one) asks
the daemon for its run's newest committed save and restores it. Here: which
save is "newest", what the stream looks like on the wire, what lands in the
live variables, the errors, and a daemon restart in between.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import crc32c
import grpc
import numpy as np
import pytest
import tensorflow as tf

from checkpointd.protocol.kinds import SaveKind
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc
from checkpointd_client import InvalidRequestError, RemotePolicySaver, RunNotFoundError
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon
from tests.integration.support.raw import TIMEOUT

MiB = 1 << 20


class Env:
    """Savers and a raw stub for one test; closes them at teardown."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self._savers: list[RemotePolicySaver] = []
        self._channel = grpc.insecure_channel(daemon.address)
        self.stub = checkpointd_pb2_grpc.CheckpointServiceStub(self._channel)

    def saver(self, policy: object, run: str, **kwargs: object) -> tuple[RemotePolicySaver, tf.Variable]:
        train_step = tf.Variable(0, dtype=tf.int64)
        saver = RemotePolicySaver(
            policy, self.daemon.address, run=run, train_step=train_step, timeout=TIMEOUT, **kwargs
        )
        self._savers.append(saver)
        return saver, train_step

    def close(self) -> None:
        for saver in self._savers:
            saver.close(timeout=10)
        self._channel.close()


@pytest.fixture
def env(daemon: Daemon) -> Iterator[Env]:
    e = Env(daemon)
    try:
        yield e
    finally:
        e.close()


@pytest.fixture(scope="module")
def policy() -> object:
    return policies.build(policies.q(hidden=(8,)))


def test_latest_is_the_newest_committed_save_of_the_run(env: Env, policy: object) -> None:
    saver, step = env.saver(policy, "lt")
    other, _ = env.saver(policy, "lt.other", folder="lt")  # shares the folder, not the run
    assert saver.latest() is None

    step.assign(1)
    model = saver.save("policies/policy", blocking=True).result()
    for n in (2, 3):
        step.assign(n)
        saver.save_checkpoint(f"policies/checkpoints/policy_checkpoint_{n:010d}", blocking=True).result()
    other.save("policies/other", blocking=True).result()  # newer, but another run's
    torn = env.daemon.root / "lt" / "policies" / "checkpoints" / "policy_checkpoint_0000000009"
    (torn / "variables").mkdir(parents=True)  # no manifest: not a committed save

    newest = saver.latest()
    assert newest is not None
    assert (newest.export_dir, newest.step, newest.kind) == (
        "policies/checkpoints/policy_checkpoint_0000000003", 3, SaveKind.CHECKPOINT,
    )  # fmt: skip
    assert Path(newest.path) == env.daemon.root.resolve() / "lt" / newest.export_dir
    only_models = saver.latest(SaveKind.SAVED_MODEL)
    assert (only_models.export_dir, only_models.step, only_models.path) == ("policies/policy", 1, model.path)
    assert other.latest().export_dir == "policies/other"
    assert (env.daemon.root / "lt" / "policies" / "other").is_dir()


def test_restore_assigns_the_saved_values_to_policy_train_step_and_metadata(env: Env, policy: object) -> None:
    metadata = {"env_steps": tf.Variable(0, dtype=tf.int64), "score": tf.Variable(0.0)}
    saver, step = env.saver(policy, "rs", metadata=metadata)
    saved = {}
    for kind, n in ((SaveKind.SAVED_MODEL, 5), (SaveKind.CHECKPOINT, 6)):
        policies.perturb(policy, seed=n)
        step.assign(n)
        metadata["env_steps"].assign(100 * n)
        metadata["score"].assign(n / 4)
        save = saver.save if kind is SaveKind.SAVED_MODEL else saver.save_checkpoint
        save(f"{kind.value}_{n}", blocking=True).result()
        saved[kind] = (policies.values(policy), n)

    for kind, (values, n) in saved.items():
        policies.perturb(policy, seed=99)
        step.assign(0)
        metadata["env_steps"].assign(-1)
        restored = saver.restore(f"{kind.value}_{n}")
        assert (restored.kind, restored.step, restored.export_dir) == (kind, n, f"{kind.value}_{n}")
        assert int(step.numpy()) == n
        assert int(metadata["env_steps"].numpy()) == 100 * n
        assert float(metadata["score"].numpy()) == n / 4
        for got, want in zip(policies.values(policy), values, strict=True):
            assert got.tobytes() == want.tobytes()
    assert saver.restore().step == 6  # None: the newest


def test_restore_streams_checked_chunks_of_at_most_1_mib(env: Env) -> None:
    big = policies.build(policies.q(hidden=(600, 600)))  # about 1.4 MiB of variables
    saver, step = env.saver(big, "rs-big")
    step.assign(3)
    path = Path(saver.save_checkpoint("ckpt", blocking=True).result().path)

    responses = list(env.stub.Restore(pb.RestoreRequest(run="rs-big"), timeout=TIMEOUT))

    header = responses[0].header
    assert responses[0].WhichOneof("item") == "header"
    assert (header.export_dir, header.step, header.kind) == ("ckpt", 3, pb.CHECKPOINT)
    assert not header.HasField("numpy_state")
    chunks = [r.chunk for r in responses[1:]]
    assert len(chunks) >= 2 and all(len(c.data) <= MiB for c in chunks)
    assert [c.offset for c in chunks] == list(np.cumsum([0] + [len(c.data) for c in chunks[:-1]]))
    assert all(crc32c.crc32c(c.data) == c.crc32c for c in chunks)
    payload = b"".join(c.data for c in chunks)
    reader = tf.train.load_checkpoint(str(path / "variables" / "variables"))
    expected = b"".join(reader.get_tensor(v.checkpoint_key).tobytes() for v in header.variables)
    assert len(payload) == header.snapshot_bytes == len(expected)
    assert payload == expected


def test_restore_refuses_unknown_runs_missing_saves_and_saves_of_another_policy(env: Env, policy: object) -> None:
    def code(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as raised:
            call()
        return raised.value.code(), raised.value.details()

    assert code(lambda: list(env.stub.Restore(pb.RestoreRequest(run="never"), timeout=TIMEOUT)))[0] == (
        grpc.StatusCode.NOT_FOUND
    )
    assert code(lambda: env.stub.GetLatest(pb.LatestRequest(run="x", kind=7), timeout=TIMEOUT))[0] == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    first, _ = env.saver(policy, "rs-bad")
    first.register()
    status, details = code(lambda: list(env.stub.Restore(pb.RestoreRequest(run="rs-bad"), timeout=TIMEOUT)))
    assert status == grpc.StatusCode.NOT_FOUND and "no committed save" in details
    with pytest.raises(RunNotFoundError):
        first.restore()
    with pytest.raises(RunNotFoundError):
        first.restore("nothing/here")
    path = Path(first.save_checkpoint("ckpt", blocking=True).result().path)

    # The run registered again with another policy: its manifest no longer fits the save. (While the
    # first saver is open, another policy's saver of the job would be a run of its own: streams.PolicyRuns.)
    first.close(timeout=TIMEOUT)
    wider = policies.build(policies.q(hidden=(8, 4)))
    second, _ = env.saver(wider, "rs-bad")
    assert second.run == "rs-bad"
    second.register()
    stored = tf.train.load_checkpoint(str(path / "variables" / "variables")).get_variable_to_shape_map()
    offending = next(
        b.checkpoint_key
        for b in second._bindings.variables  # noqa: SLF001 - the run's manifest, in order
        if b.checkpoint_key not in stored or tuple(stored[b.checkpoint_key]) != b.shape
    )
    before = policies.values(wider)
    with pytest.raises(InvalidRequestError) as raised:
        second.restore("ckpt")  # by location: the save another run of the job committed
    assert repr(offending) in str(raised.value)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(policies.values(wider), before, strict=True))


def test_latest_and_restore_after_a_daemon_restart(fresh_daemon: Callable[..., Daemon], policy: object) -> None:
    first = fresh_daemon()
    train_step = tf.Variable(4, dtype=tf.int64)
    saver = RemotePolicySaver(policy, first.address, run="rr", train_step=train_step, timeout=TIMEOUT)
    policies.perturb(policy, seed=4)
    want = policies.values(policy)
    saver.save_checkpoint("ckpt_4", blocking=True).result()
    assert first.terminate() == 0

    second = fresh_daemon("--port", str(first.port))  # same root and port, nothing registered
    late = RemotePolicySaver(policy, second.address, run="rr", train_step=tf.Variable(0, dtype=tf.int64))
    found = late.latest()  # before any registration
    assert found is not None and (found.export_dir, found.step) == ("ckpt_4", 4)
    late.close()

    # The first saver still holds its bindings; the restarted daemon never saw the run.
    policies.perturb(policy, seed=5)
    train_step.assign(0)
    assert saver.restore().step == 4
    assert int(train_step.numpy()) == 4
    assert all(a.tobytes() == b.tobytes() for a, b in zip(policies.values(policy), want, strict=True))
    saver.close(timeout=TIMEOUT)
