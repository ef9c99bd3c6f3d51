"""RemotePolicySaver against a fake in-process daemon that records what it receives.

The fake follows the contract's order: it reads the SaveHeader, answers with a
SaveDecision, and only then reads chunks. Tests hold uploads at a gate so they
can change the policy's variables between save() and the upload.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
from concurrent import futures

import crc32c
import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2
from tf_agents.networks import q_network
from tf_agents.policies import q_policy
from tf_agents.specs import tensor_spec
from tf_agents.trajectories import time_step as ts

from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.tensors import TEMPLATE_OBJECT_GRAPH
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc
from checkpointd_client import (
    ChecksumError,
    DeadlineError,
    InvalidRequestError,
    LimitExceededError,
    RemotePolicySaver,
    RunClosedError,
    RunHeldError,
    RunNotFoundError,
    SaveFailedError,
    UnauthenticatedError,
    UnavailableError,
)
from checkpointd_client import snapshot as snapshot_lib
from checkpointd_client.save_call import SaveCall

CHUNK = 256
WAIT = 10.0  # seconds; every wait in these tests is bounded by it


class FakeDaemon(checkpointd_pb2_grpc.CheckpointServiceServicer):
    """Records every request; `plan` scripts the answer to the next saves."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[str] = []
        self.registrations: list[tuple[pb.RegisterRunHeader, dict[str, bytes]]] = []
        self.saves: list[dict] = []
        # "accept" (default), "skip", ("abort_before", code), ("abort_after", code)
        self.plan: collections.deque = collections.deque()
        self.gate = threading.Event()  # uploads are read only once it is set
        self.gate.set()

    def _record(self, name: str) -> None:
        with self.lock:
            self.calls.append(name)

    def RegisterRun(self, request_iterator, context):
        self._record("RegisterRun")
        header = next(request_iterator).header
        files: dict[str, bytearray] = {}
        for request in request_iterator:
            chunk = request.chunk
            data = files.setdefault(chunk.path, bytearray())
            assert chunk.offset == len(data) and chunk.crc32c == crc32c.crc32c(chunk.data)
            data += chunk.data
        self.registrations.append((header, {k: bytes(v) for k, v in files.items()}))
        nbytes = sum(
            int(np.prod(v.shape, dtype=np.int64)) * np.dtype(_np_dtype(v.dtype)).itemsize for v in header.variables
        )
        return pb.RegisterRunResponse(run=header.run, variables=header.variables, snapshot_bytes=nbytes)

    def Save(self, request_iterator, context):
        self._record("Save")
        record = {"header": next(request_iterator).header, "chunks": []}
        self.saves.append(record)
        action = self.plan.popleft() if self.plan else "accept"
        if action[0] == "abort_before":
            context.abort(action[1], "scripted failure")
        if action == "skip":
            yield pb.SaveResponse(decision=pb.SaveDecision(accepted=False, reason="busy"))
            record["chunks"] = [r.chunk for r in request_iterator]  # until the half-close
            return
        yield pb.SaveResponse(decision=pb.SaveDecision(accepted=True))
        assert self.gate.wait(WAIT)
        record["chunks"] = [r.chunk for r in request_iterator]
        if action[0] == "abort_after":
            context.abort(action[1], "scripted failure")
        header = record["header"]
        yield pb.SaveResponse(
            result=pb.SaveResult(
                path=f"/root/{header.run}/{header.export_dir}",
                bytes_written=sum(len(c.data) for c in record["chunks"]),
                duration_seconds=0.25,
                step=header.step,
                kind=header.kind,
            )
        )

    def Flush(self, request, context):
        self._record(f"Flush {request.run}")
        return pb.FlushResponse(runs=[request.run])

    def CloseRun(self, request, context):
        self._record(f"CloseRun {request.run}")
        return pb.CloseRunResponse(run=request.run)


def _np_dtype(name: str) -> np.dtype:
    return np.dtype(tf.bfloat16.as_numpy_dtype) if name == "bfloat16" else np.dtype(name)


@pytest.fixture
def daemon():
    fake = FakeDaemon()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    checkpointd_pb2_grpc.add_CheckpointServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    fake.address = f"127.0.0.1:{port}"
    yield fake
    fake.gate.set()
    server.stop(None)


@pytest.fixture(scope="module")
def policy():
    obs = tensor_spec.BoundedTensorSpec((4,), tf.float32, -1, 1, name="obs")
    act = tensor_spec.BoundedTensorSpec((), tf.int32, 0, 2, name="act")
    net = q_network.QNetwork(obs, act, fc_layer_params=(40,))
    return q_policy.QPolicy(ts.time_step_spec(obs), act, q_network=net)


@pytest.fixture
def saver(daemon, policy):
    train_step = tf.Variable(7, dtype=tf.int64)
    metadata = {"flag": tf.Variable([True, False]), "bf": tf.Variable(tf.ones([3], tf.bfloat16))}
    remote = RemotePolicySaver(
        policy,
        daemon.address,
        run="run-1",
        train_step=train_step,
        metadata=metadata,
        chunk_bytes=CHUNK,
        timeout=WAIT,
    )
    yield remote
    daemon.gate.set()
    remote.close(timeout=WAIT)


def _values(saver: RemotePolicySaver, header: pb.SaveHeader) -> bytes:
    """The current bytes of the saver's variables, in the header's order."""
    by_key = {b.key: b.variable for b in saver._bindings.variables}
    return b"".join(np.ascontiguousarray(by_key[v.key].numpy()).tobytes() for v in header.variables)


def _reassemble(chunks) -> bytes:
    data = bytearray()
    for c in chunks:
        assert c.path == "" and c.offset == len(data) and 0 < len(c.data) <= CHUNK
        assert c.crc32c == crc32c.crc32c(c.data)
        data += c.data
    return bytes(data)


def test_accepted_save_uploads_the_snapshot_taken_at_the_call(daemon, saver, monkeypatch) -> None:
    # Hold the client's background work (everything after save() returns) until
    # training has moved on, so a snapshot read late would send the new values.
    upload, go = SaveCall._upload, threading.Event()
    monkeypatch.setattr(SaveCall, "_upload", lambda self, *a: go.wait(WAIT) and upload(self, *a))
    ticket = saver.save("policies/p1")
    header = daemon.saves[0]["header"]
    at_call = _values(saver, header)
    assert not ticket.skipped and not ticket.done()
    # Training goes on before the upload: the daemon must still get the values of the call.
    for v in saver.policy.model_variables:
        v.assign_add(tf.ones_like(v))
    saver._saver._train_step.assign_add(5)
    go.set()
    result = ticket.result(timeout=WAIT)

    assert _reassemble(daemon.saves[0]["chunks"]) == at_call
    assert len(daemon.saves[0]["chunks"]) > len(header.variables)  # variables were split
    assert (header.run, header.kind, header.export_dir, header.blocking) == (
        "run-1",
        pb.SAVED_MODEL,
        "policies/p1",
        False,
    )
    assert header.step == ticket.step == 7
    assert header.snapshot_bytes == len(at_call)
    assert [v.key for v in header.variables] == sorted(v.key for v in header.variables)
    assert result.path == "/root/run-1/policies/p1" and result.step == 7
    assert result.kind is SaveKind.SAVED_MODEL and result.bytes_written == len(at_call)


def test_registration_uploads_the_template_and_the_manifest(daemon, saver) -> None:
    saver.save_checkpoint("c1").result(timeout=WAIT)
    ((header, files),) = daemon.registrations
    assert header.run == "run-1"
    assert {
        "saved_model.pb",
        "fingerprint.pb",
        "policy_specs.pbtxt",
        "variables/variables.index",
        TEMPLATE_OBJECT_GRAPH,
    } <= set(files)
    # No variable values: every save writes its own. The object graph stands in for the data shard.
    assert not [p for p in files if p.startswith("variables/variables.data-")]
    graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(files[TEMPLATE_OBJECT_GRAPH])
    keys = {a.checkpoint_key for n in graph.nodes for a in n.attributes}
    assert keys == {v.key for v in header.variables}
    assert header.template_bytes == sum(len(b) for b in files.values())
    assert list(header.variables) == list(daemon.saves[0]["header"].variables)
    assert {v.dtype for v in header.variables} >= {"float32", "int64", "bool", "bfloat16"}
    assert header.checkpoint_object_graph  # its exact bytes: test_client_snapshot
    assert daemon.saves[0]["header"].kind == pb.CHECKPOINT


def test_skip_is_reported_on_the_ticket_and_sends_no_chunk(daemon, saver, caplog) -> None:
    daemon.plan.append("skip")
    with caplog.at_level(logging.WARNING, logger="checkpointd_client"):
        ticket = saver.save_checkpoint("c2")
    assert ticket.skipped and ticket.done() and ticket.reason == "busy"
    assert ticket.result(timeout=0) is None and ticket.exception(timeout=0) is None
    # The fake read the stream to its half-close: a client that streamed before
    # reading the decision would have left chunks here.
    assert daemon.saves[0]["chunks"] == []
    assert any("run-1" in r.getMessage() and "step 7" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "code, error",
    [
        (grpc.StatusCode.FAILED_PRECONDITION, RunClosedError),
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequestError),
        (grpc.StatusCode.UNAUTHENTICATED, UnauthenticatedError),
    ],
)
def test_an_error_about_the_request_instead_of_a_decision_raises_its_mapped_error(daemon, saver, code, error) -> None:
    daemon.plan.append(("abort_before", code))
    with pytest.raises(error, match="scripted failure"):
        saver.save("p")
    assert daemon.saves[0]["chunks"] == []
    assert saver.counts.failed == 0


@pytest.mark.parametrize(
    "code, error",
    [
        (grpc.StatusCode.UNAVAILABLE, UnavailableError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, LimitExceededError),
        (grpc.StatusCode.INTERNAL, SaveFailedError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineError),
        (grpc.StatusCode.ABORTED, RunHeldError),
    ],
)
def test_a_daemon_side_error_fails_a_non_blocking_saves_ticket_and_raises_from_a_blocking_one(
    daemon, saver, code, error
) -> None:
    daemon.plan.append(("abort_before", code))
    ticket = saver.save("p")  # training goes on: no raise
    assert isinstance(ticket.exception(timeout=0), error) and "scripted failure" in str(ticket.exception(0))
    assert saver.counts.failed == 1 and daemon.saves[0]["chunks"] == []
    daemon.plan.append(("abort_before", code))
    with pytest.raises(error, match="scripted failure"):
        saver.save("b", blocking=True)  # a blocking save always tries, and raises
    assert saver.save("b", blocking=True).result(timeout=0) is not None  # and ends the outage
    assert saver.save("n").result(timeout=WAIT) is not None
    assert (saver.counts.durable, saver.counts.failed) == (2, 1)


def test_not_found_registers_again_once_then_retries(daemon, saver) -> None:
    daemon.plan.append(("abort_before", grpc.StatusCode.NOT_FOUND))
    assert saver.save("p", blocking=True).result(timeout=0).step == 7
    assert daemon.calls == ["RegisterRun", "Save", "RegisterRun", "Save"]

    daemon.plan.extend([("abort_before", grpc.StatusCode.NOT_FOUND)] * 2)
    assert isinstance(saver.save("p").exception(timeout=0), RunNotFoundError)
    assert daemon.calls[4:] == ["Save", "RegisterRun", "Save"]


def test_upload_failure_is_stored_on_the_ticket_and_logged(daemon, saver, caplog) -> None:
    daemon.plan.append(("abort_after", grpc.StatusCode.DATA_LOSS))
    with caplog.at_level(logging.WARNING, logger="checkpointd_client"):
        ticket = saver.save("bad")
        with pytest.raises(ChecksumError):
            ticket.result(timeout=WAIT)
    assert isinstance(ticket.exception(timeout=0), ChecksumError)
    message = caplog.records[-1].getMessage()
    assert all(s in message for s in ("run-1", "saved_model", "step 7", "'bad'"))
    # The saver lives on.
    assert saver.save("good").result(timeout=WAIT).path.endswith("/good")


def test_blocking_save_returns_durable_or_raises(daemon, saver) -> None:
    ticket = saver.save("b1", blocking=True)
    assert ticket.done() and ticket.result(timeout=0).path.endswith("/b1")
    assert daemon.saves[0]["header"].blocking

    daemon.plan.append(("abort_after", grpc.StatusCode.INTERNAL))
    with pytest.raises(SaveFailedError):
        saver.save("b2", blocking=True)


def test_result_times_out_while_the_upload_is_held(daemon, saver) -> None:
    daemon.gate.clear()
    ticket = saver.save("p")
    with pytest.raises(TimeoutError):
        ticket.result(timeout=0)
    with pytest.raises(DeadlineError):
        saver.flush(timeout=0)
    daemon.gate.set()
    saver.flush(timeout=WAIT)
    assert ticket.done() and daemon.calls[-1] == "Flush run-1"


def test_close_flushes_closes_the_run_and_refuses_later_saves(daemon, saver) -> None:
    daemon.gate.clear()
    ticket = saver.save("p")
    daemon.gate.set()
    saver.close(timeout=WAIT)
    assert ticket.done()
    assert daemon.calls[-2:] == ["Flush run-1", "CloseRun run-1"]
    calls = list(daemon.calls)
    with pytest.raises(RunClosedError):
        saver.save("p2")
    with pytest.raises(RunClosedError):
        saver.save_checkpoint("c2")
    saver.close()
    assert daemon.calls == calls  # no network call after close


def test_context_manager_closes(daemon, policy) -> None:
    with RemotePolicySaver(policy, daemon.address, run="ctx", timeout=WAIT) as remote:
        remote.save("p").result(timeout=WAIT)
    assert daemon.calls[-1] == "CloseRun ctx"


def test_register_function_exports_the_template_again(daemon, saver) -> None:
    saver.save("p1", blocking=True)
    spec = tf.TensorSpec((4,), tf.float32)
    saver.register_function("obs_sum", lambda x: tf.reduce_sum(x, axis=-1), spec)
    saver.save("p2", blocking=True)
    saver.save("p3", blocking=True)
    assert daemon.calls == ["RegisterRun", "Save", "RegisterRun", "Save", "Save"]
    assert daemon.registrations[0][1]["saved_model.pb"] != daemon.registrations[1][1]["saved_model.pb"]


def test_invalid_export_dir_is_refused_without_a_call(daemon, saver) -> None:
    with pytest.raises(InvalidRequestError):
        saver.save("/abs/path")
    with pytest.raises(InvalidRequestError):
        saver.save("../escape")
    assert daemon.calls == []


def test_an_unreachable_daemon_fails_a_non_blocking_save_and_raises_from_a_blocking_one(policy) -> None:
    remote = RemotePolicySaver(policy, "127.0.0.1:1", run="nowhere", timeout=WAIT)
    assert isinstance(remote.save("p").exception(timeout=0), UnavailableError)
    with pytest.raises(UnavailableError):
        remote.save("p", blocking=True)
    assert remote.counts.failed == 1
    remote.close(timeout=WAIT)  # never registered: nothing to flush or close remotely


def test_unreachable_and_silent_daemons_are_named_with_what_was_being_done(policy) -> None:
    remote = RemotePolicySaver(policy, "127.0.0.1:1", run="nowhere", timeout=WAIT)
    with pytest.raises(UnavailableError, match=r"^registering run 'nowhere' at 127\.0\.0\.1:1: "):
        remote.save("p").result(timeout=0)
    with pytest.raises(UnavailableError, match=r"^looking up run 'nowhere'.s newest save at 127\.0\.0\.1:1: "):
        remote.latest()
    remote.close(timeout=WAIT)
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        quiet = RemotePolicySaver(policy, address, run="quiet", timeout=1.0)
        with pytest.raises(DeadlineError, match=rf"^registering run 'quiet' at {address}: "):
            quiet.register()
        quiet.close(timeout=WAIT)


def test_an_address_without_a_port_is_the_daemons_default_port(policy) -> None:
    remote = RemotePolicySaver(policy, "localhost", run="default-port", timeout=WAIT)
    assert remote.address == "localhost:7431"  # gRPC alone would have dialled 443
    remote.close(timeout=WAIT)


def test_attributes_forward_to_policy_saver(saver) -> None:
    assert set(saver.signatures) >= {
        "action",
        "get_initial_state",
        "get_train_step",
        "get_metadata",
    }
    assert saver.get_train_step() == 7
    assert set(saver.get_metadata()) == {"flag", "bf"}
    assert saver.policy_state_spec == () and saver.action_input_spec is not None
    assert saver.policy_step_spec is not None and saver.policy is saver._saver.policy
    assert saver._batch_size is None  # any other PolicySaver attribute, via __getattr__


def test_a_skipped_save_copies_no_variable(daemon, saver, monkeypatch) -> None:
    saver.register()
    copies = []
    take = snapshot_lib.take_snapshot
    monkeypatch.setattr(snapshot_lib, "take_snapshot", lambda *a, **k: copies.append(1) or take(*a, **k))
    daemon.plan.append("skip")
    assert saver.save_checkpoint("c1").skipped
    assert copies == []
    saver.save_checkpoint("c2").result(timeout=WAIT)
    assert copies == [1]


def test_saves_reusing_the_last_snapshots_arrays_send_their_own_values(daemon, saver) -> None:
    saver.save("p1").result(timeout=WAIT)
    first = saver._saves._spare  # noqa: SLF001 - what the next snapshot copies into
    assert first is not None
    for v in saver.policy.model_variables:
        v.assign_add(tf.ones_like(v))
    saver._saver._train_step.assign(8)  # noqa: SLF001
    ticket = saver.save("p2")
    header = daemon.saves[1]["header"]
    at_call = _values(saver, header)
    for v in saver.policy.model_variables:  # training goes on before the upload
        v.assign_add(tf.ones_like(v))
    ticket.result(timeout=WAIT)
    assert _reassemble(daemon.saves[1]["chunks"]) == at_call
    assert _reassemble(daemon.saves[0]["chunks"]) != at_call
    assert header.step == ticket.step == 8
    assert saver._saves._spare[1][0] is first[1][0]  # noqa: SLF001 - the arrays were reused
