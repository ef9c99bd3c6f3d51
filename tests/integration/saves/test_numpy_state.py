"""A NumpyState saved with the policy through the real daemon.

The daemon writes `<export_dir>/numpy_state/numpy_state.*` from the bytes the
trainer serialized at the call; these tests hold it to TensorFlow's own
`Checkpoint(numpy_arrays=state).write`, byte for byte, and to TF-Agents'
documented restore, and check the policy loaders do not notice it.
"""

from __future__ import annotations

import filecmp
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tf_agents.policies import policy_loader, py_tf_eager_policy
from tf_agents.utils import numpy_storage

from checkpointd.cli import verify
from checkpointd.storage import save_manifest
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc
from checkpointd_client import RemotePolicySaver, RunNotFoundError
from checkpointd_client import numpy_state as client_numpy_state
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon, wait_until
from tests.integration.support.disk import saved_step
from tests.integration.support.raw import TIMEOUT, HeldSave, run_status

NUMPY_FILES = ("numpy_state.index", "numpy_state.data-00000-of-00001")


@pytest.fixture(scope="module")
def policy() -> object:
    return policies.build(policies.q(hidden=(8,)))


class Savers:
    """Savers for one test, each closed at teardown."""

    def __init__(self, daemon: Daemon, policy: object) -> None:
        self.daemon, self.policy = daemon, policy
        self._open: list[RemotePolicySaver] = []

    def __call__(
        self, run: str, state: numpy_storage.NumpyState, train_step: tf.Variable | None = None
    ) -> RemotePolicySaver:
        saver = RemotePolicySaver(
            self.policy, self.daemon.address, run=run,
            train_step=train_step if train_step is not None else tf.Variable(0, dtype=tf.int64),
            numpy_state=state, timeout=TIMEOUT,
        )  # fmt: skip
        self._open.append(saver)
        return saver

    def close(self) -> None:
        for saver in self._open:
            saver.close(timeout=10)


@pytest.fixture
def savers(daemon: Daemon, policy: object) -> Iterator[Savers]:
    made = Savers(daemon, policy)
    try:
        yield made
    finally:
        made.close()


def a_state() -> numpy_storage.NumpyState:
    state = numpy_storage.NumpyState()
    state.counts = np.arange(12, dtype=np.int64).reshape(3, 4)
    state.weights = np.linspace(0.0, 1.0, 5, dtype=np.float32)
    state.names = np.array(["cart", "pole"])
    setattr(state, "a/b.c", np.float64(2.5))  # a name TF escapes in its checkpoint keys
    return state


def test_the_numpy_state_checkpoint_is_byte_identical_to_checkpoint_write(savers: Savers, tmp_path: Path) -> None:
    state = a_state()
    saver = savers("np-bytes", state)
    reference = tmp_path / "reference" / "ckpt"
    tf.train.Checkpoint(numpy_arrays=state).write(str(reference))

    out = Path(saver.save("model", blocking=True).result().path)
    ck = Path(saver.save_checkpoint("ckpt", blocking=True).result().path)

    for save_dir in (out, ck):
        for name, ref in zip(NUMPY_FILES, ("ckpt.index", "ckpt.data-00000-of-00001"), strict=True):
            assert filecmp.cmp(save_dir / "numpy_state" / name, reference.parent / ref, shallow=False)
    # TF-Agents' documented restore, into a fresh NumpyState: it re-creates the attributes.
    restored = numpy_storage.NumpyState()
    status = tf.train.Checkpoint(numpy_arrays=restored).restore(str(ck / "numpy_state" / "numpy_state"))
    status.assert_nontrivial_match()
    np.testing.assert_array_equal(restored.counts, state.counts)
    np.testing.assert_array_equal(restored.weights, state.weights)
    np.testing.assert_array_equal(restored.names, state.names)
    assert getattr(restored, "a/b.c") == 2.5


def test_arrays_are_copied_at_the_call(daemon: Daemon, savers: Savers) -> None:
    state = numpy_storage.NumpyState()
    state.x = np.zeros(4)
    train_step = tf.Variable(0, dtype=tf.int64)
    saver = savers("np-copy", state, train_step)
    held = HeldSave(daemon, saver, train_step, "held")  # the run's lane is busy until released
    results: list = []
    blocked = threading.Thread(target=lambda: results.append(saver.save("copied", blocking=True)))
    blocked.start()

    def queued() -> bool:
        if run_status(daemon, "np-copy").in_flight.waiting == 1:
            return True
        assert blocked.is_alive(), "the blocking save never queued"
        return False

    wait_until(queued, "the blocking save queued", TIMEOUT)  # the daemon has no event for it

    state.x[:] = 7.0  # in place, after the call, while its snapshot waits for the lane
    state.y = np.ones(2)
    held.release()
    blocked.join(TIMEOUT)
    held.close()

    path = Path(results[0].result().path)
    restored = numpy_storage.NumpyState()
    tf.train.Checkpoint(numpy_arrays=restored).restore(str(path / "numpy_state" / "numpy_state"))
    np.testing.assert_array_equal(restored.x, np.zeros(4))
    assert not hasattr(restored, "y")


def test_the_arrays_may_change_between_saves_and_restore_brings_them_back(savers: Savers) -> None:
    state = numpy_storage.NumpyState()
    state.x = np.array([1, 2, 3])
    saver = savers("np-change", state)
    first = Path(saver.save_checkpoint("first", blocking=True).result().path)
    state.x = np.array([4, 5])
    state.y = np.eye(2)
    second = Path(saver.save_checkpoint("second", blocking=True).result().path)

    def keys(save_dir: Path) -> list[str]:
        return json.loads((save_dir / save_manifest.MANIFEST_NAME).read_text())["numpy_state"]["keys"]

    assert keys(first) == ["numpy_arrays/x/.ATTRIBUTES/py_state"]
    assert keys(second) == ["numpy_arrays/x/.ATTRIBUTES/py_state", "numpy_arrays/y/.ATTRIBUTES/py_state"]

    state.x, state.y = np.zeros(1), np.zeros(1)
    restored = saver.restore("second")
    np.testing.assert_array_equal(state.x, [4, 5])
    np.testing.assert_array_equal(state.y, np.eye(2))
    assert sorted(restored.numpy_arrays) == ["x", "y"]
    saver.restore("first")  # as TF's restore: y is not in this save, so it is left alone
    np.testing.assert_array_equal(state.x, [1, 2, 3])
    np.testing.assert_array_equal(state.y, np.eye(2))


def test_the_loaders_and_verify_do_not_notice_the_numpy_state(savers: Savers) -> None:
    train_step = tf.Variable(0, dtype=tf.int64)
    saver = savers("np-loaders", a_state(), train_step)
    model = Path(saver.save("model", blocking=True).result().path)
    train_step.assign(42)
    ck = Path(saver.save_checkpoint("ckpt", blocking=True).result().path)

    loaded = tf.saved_model.load(str(model))
    assert int(loaded.get_train_step()) == 0
    policy = py_tf_eager_policy.SavedModelPyTFEagerPolicy(str(model), load_specs_from_pbtxt=True)
    policy.update_from_checkpoint(str(ck))
    assert policy.get_train_step() == 42 == saved_step(ck)
    assert policy_loader.load(str(model), str(ck)).get_train_step() == 42
    reports = verify.verify_paths([model, ck])
    assert [r.ok for r in reports] == [True, True], [r.reason for r in reports]
    listed = {e.path for e in save_manifest.read_manifest(ck)["files"]}
    assert {f"numpy_state/{name}" for name in NUMPY_FILES} <= listed


def test_entries_that_disagree_with_the_object_graph_are_refused(daemon: Daemon, savers: Savers) -> None:
    state = numpy_storage.NumpyState()
    state.x, state.y = np.zeros(1), np.ones(1)
    saver = savers("np-bad", state)
    saver.register()
    bindings = saver._bindings  # noqa: SLF001 - the manifest the daemon answered
    snap = client_numpy_state.NumpySource(state).take()
    proto = snap.to_proto()
    proto.entries[0].checkpoint_key, proto.entries[1].checkpoint_key = (
        proto.entries[1].checkpoint_key, proto.entries[0].checkpoint_key,
    )  # fmt: skip
    variable_bytes = sum(int(np.prod(b.shape)) * b.variable.dtype.size for b in bindings.variables)
    header = pb.SaveHeader(
        run="np-bad", kind=pb.CHECKPOINT, export_dir="bad", step=0, variables=bindings.protos(),
        snapshot_bytes=variable_bytes + snap.nbytes, numpy_state=proto,
    )  # fmt: skip
    with grpc.insecure_channel(daemon.address) as channel, pytest.raises(grpc.RpcError) as raised:
        stub = checkpointd_pb2_grpc.CheckpointServiceStub(channel)
        next(stub.Save(iter([pb.SaveRequest(header=header)]), timeout=TIMEOUT))

    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "numpy_arrays/y/.ATTRIBUTES/py_state" in raised.value.details()
    assert not (daemon.root / "np-bad" / "bad").exists()
    with pytest.raises(RunNotFoundError):
        saver.restore("bad")
