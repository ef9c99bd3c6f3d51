"""Training checkpoints the daemon must refuse, before the decision, writing and counting nothing.

Headers are built as RemoteCheckpointer builds them (from a real
tf.train.Checkpoint through `checkpointd_client.tf_checkpoint.describe`), then
broken one way each: an object graph or tensor list that does not match what
is announced, Python state declared numeric, sizes that do not add up, a
checkpoint over --max-snapshot-bytes, the wrong kind for the run, a negative
step. A restore into objects of another structure is refused by the client,
naming the first key that differs.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2
from tf_agents.utils import numpy_storage

from checkpointd.protocol import wire
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client import InvalidRequestError, RemoteCheckpointer
from checkpointd_client import tf_checkpoint as client_training
from tests.integration.support.daemon import Daemon
from tests.integration.support.raw import TIMEOUT, Stub, counts

RUN = "tc-bad"


def _root() -> tf.train.Checkpoint:
    state = numpy_storage.NumpyState()
    state.seen = np.arange(5, dtype=np.int32)
    return tf.train.Checkpoint(
        w=tf.Variable(np.ones((2, 3), np.float32)), step=tf.Variable(3, dtype=tf.int64), state=state
    )


def _header(state: client_training.TrainingState, run: str = RUN, step: int = 3) -> pb.SaveHeader:
    return pb.SaveHeader(
        run=run,
        kind=pb.TRAINING_CHECKPOINT,
        export_dir="train",
        step=step,
        snapshot_bytes=state.nbytes,
        training_checkpoint=state.to_proto(None, None),
    )


def _register(stub: Stub, run: str, kind: int = pb.TRAINING_CHECKPOINT, **extra: object) -> None:
    header = pb.RegisterRunHeader(run=run, kind=kind, **extra)  # type: ignore[arg-type]
    stub.RegisterRun(iter([pb.RegisterRunRequest(header=header)]), timeout=TIMEOUT)


def _decide(stub: Stub, header: pb.SaveHeader) -> grpc.StatusCode:
    """Sends only the header; the daemon must answer with a status, no decision."""
    try:
        responses = list(stub.Save(iter([pb.SaveRequest(header=header)]), timeout=TIMEOUT))
    except grpc.RpcError as e:
        return e.code()
    raise AssertionError(f"expected a refusal before the decision, got {responses}")


@pytest.fixture(scope="module")
def stub(daemon: Daemon) -> Stub:
    channel = grpc.insecure_channel(daemon.address)
    stub = Stub(channel)
    _register(stub, RUN)
    return stub


@pytest.fixture(scope="module")
def state() -> client_training.TrainingState:
    return client_training.describe(_root())


def _graph_with(
    state: client_training.TrainingState, edit: Callable[[trackable_object_graph_pb2.TrackableObjectGraph], None]
) -> bytes:
    graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(state.object_graph)
    edit(graph)
    return graph.SerializeToString()


def _rename_first_attribute(graph: trackable_object_graph_pb2.TrackableObjectGraph) -> None:
    attribute = next(a for n in graph.nodes for a in n.attributes)
    attribute.checkpoint_key = "renamed/.ATTRIBUTES/VARIABLE_VALUE"


def _add_attribute(graph: trackable_object_graph_pb2.TrackableObjectGraph) -> None:
    graph.nodes[0].attributes.add(name="VARIABLE_VALUE", checkpoint_key="extra/.ATTRIBUTES/VARIABLE_VALUE")


BROKEN: dict[str, tuple[Callable[[pb.SaveHeader, client_training.TrainingState], None], grpc.StatusCode]] = {
    "a tensor the object graph lacks": (
        lambda h, s: h.training_checkpoint.tensors.add(
            checkpoint_key="other/.ATTRIBUTES/VARIABLE_VALUE", dtype="float32", shape=[1], nbytes=4
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "an object graph key no tensor declares": (
        lambda h, s: h.training_checkpoint.__setattr__("object_graph", _graph_with(s, _add_attribute)),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "a renamed attribute": (
        lambda h, s: h.training_checkpoint.__setattr__("object_graph", _graph_with(s, _rename_first_attribute)),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "an object graph that does not parse": (
        lambda h, s: h.training_checkpoint.__setattr__("object_graph", b"\xff\xff not a proto"),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "python state declared as float32": (
        lambda h, s: _retype_python_state(h),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "a tensor whose nbytes is not its shape's": (
        lambda h, s: h.training_checkpoint.tensors[0].__setattr__(
            "nbytes", h.training_checkpoint.tensors[0].nbytes + 1
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "snapshot_bytes that is not the tensors' sum": (
        lambda h, s: h.__setattr__("snapshot_bytes", h.snapshot_bytes - 1),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "an unsupported dtype": (
        lambda h, s: h.training_checkpoint.tensors[0].__setattr__("dtype", "resource"),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "a negative step": (lambda h, s: h.__setattr__("step", -1), grpc.StatusCode.INVALID_ARGUMENT),
    "no training_checkpoint": (lambda h, s: h.ClearField("training_checkpoint"), grpc.StatusCode.INVALID_ARGUMENT),
    "policy variables besides": (
        lambda h, s: h.variables.add(key="k", checkpoint_key="k", dtype="float32", shape=[1]),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "negative keep hours": (
        lambda h, s: h.training_checkpoint.__setattr__("keep_checkpoint_every_n_hours", -1.0),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "a policy kind on a training run": (lambda h, s: _as_policy_save(h), grpc.StatusCode.INVALID_ARGUMENT),
}


def _retype_python_state(header: pb.SaveHeader) -> None:
    t = next(t for t in header.training_checkpoint.tensors if t.dtype == "string")
    header.snapshot_bytes += 4 - t.nbytes
    t.dtype, t.nbytes = "float32", 4
    t.shape[:] = [1]


def _as_policy_save(header: pb.SaveHeader) -> None:
    header.kind = pb.CHECKPOINT
    header.ClearField("training_checkpoint")


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_header_that_does_not_match_what_it_announces_is_refused_and_nothing_happens(
    daemon: Daemon, stub: Stub, state: client_training.TrainingState, case: str
) -> None:
    header = _header(state)
    edit, code = BROKEN[case]
    edit(header, state)
    before = counts(stub, RUN)
    assert _decide(stub, header) is code
    assert counts(stub, RUN) == before
    assert not (daemon.root / RUN).exists() or not any((daemon.root / RUN).rglob("ckpt-*"))


def test_the_good_header_of_the_same_run_is_accepted_and_written(daemon: Daemon, stub: Stub) -> None:
    root = _root()
    objects = {"w": root.w, "step": root.step, "state": root.state}
    with RemoteCheckpointer("good", daemon.address, run="tc-bad-good", timeout=TIMEOUT, **objects) as ckpt:
        assert ckpt.save(3, blocking=True).result() is not None
    assert (daemon.root / "tc-bad-good" / "good" / "ckpt-3.index").is_file()


def test_a_training_save_on_a_policy_run_is_refused(
    daemon: Daemon, stub: Stub, state: client_training.TrainingState
) -> None:
    from tests.integration.support import policies
    from tests.integration.support.raw import export_template, register

    template = export_template(policies.build(policies.q()), daemon.root.parent / "tc-template")
    register(stub, "tc-bad-policy", template)
    assert _decide(stub, _header(state, run="tc-bad-policy")) is grpc.StatusCode.INVALID_ARGUMENT
    assert counts(stub, "tc-bad-policy") == (0, 0, 0)


def test_a_training_registration_with_variables_or_template_files_is_refused(stub: Stub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _register(stub, "tc-bad-reg", variables=[pb.Variable(key="k", checkpoint_key="k", dtype="float32", shape=[1])])
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    header = pb.RegisterRunHeader(run="tc-bad-reg", kind=pb.TRAINING_CHECKPOINT, template_bytes=3)
    chunk = wire.chunk(b"abc", 0, "saved_model.pb")
    with pytest.raises(grpc.RpcError) as info:
        stub.RegisterRun(
            iter([pb.RegisterRunRequest(header=header), pb.RegisterRunRequest(chunk=chunk)]), timeout=TIMEOUT
        )
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_a_checkpoint_over_max_snapshot_bytes_is_refused_before_the_decision(
    fresh_daemon: Callable[..., Daemon], state: client_training.TrainingState
) -> None:
    daemon = fresh_daemon("--max-snapshot-bytes", str(state.nbytes - 1))
    with grpc.insecure_channel(daemon.address) as channel:
        stub = Stub(channel)
        _register(stub, RUN)
        assert _decide(stub, _header(state)) is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert counts(stub, RUN) == (0, 0, 0)
    assert not (daemon.root / RUN).exists()


def test_an_upload_cut_short_after_the_accept_fails_and_leaves_no_checkpoint(
    daemon: Daemon, stub: Stub, state: client_training.TrainingState
) -> None:
    run = "tc-bad-short"
    _register(stub, run)
    header = _header(state, run=run)
    parts = state.copy()
    chunks = list(wire.chunks(parts, 16))
    requests = [pb.SaveRequest(header=header)] + [pb.SaveRequest(chunk=c) for c in chunks[:-1]]
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Save(iter(requests), timeout=TIMEOUT))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert counts(stub, run) == (0, 0, 1)
    folder = daemon.root / run
    assert not folder.exists() or sorted(os.listdir(folder / "train")) == []


def test_restoring_into_objects_of_another_structure_names_the_first_key_that_differs(daemon: Daemon) -> None:
    root = _root()
    with RemoteCheckpointer(
        "shape", daemon.address, run="tc-bad-restore", timeout=TIMEOUT, w=root.w, step=root.step
    ) as ckpt:
        ckpt.save(3, blocking=True)
    wider = tf.Variable(np.zeros((2, 4), np.float32))
    with pytest.raises(
        InvalidRequestError, match=r"'w/\.ATTRIBUTES/VARIABLE_VALUE' as float32\[2, 3\].*float32\[2, 4\]"
    ):
        RemoteCheckpointer(
            "shape", daemon.address, run="tc-bad-restore", timeout=TIMEOUT, w=wider, step=tf.Variable(0, dtype=tf.int64)
        )
    with pytest.raises(InvalidRequestError, match=r"has no 'extra/\.ATTRIBUTES/VARIABLE_VALUE'"):
        RemoteCheckpointer(
            "shape", daemon.address, run="tc-bad-restore", timeout=TIMEOUT,
            w=tf.Variable(np.zeros((2, 3), np.float32)), step=tf.Variable(0, dtype=tf.int64), extra=tf.Variable(1.0),
        )  # fmt: skip
    assert wider.numpy().sum() == 0  # nothing was assigned
