"""Raw gRPC calls, for tests that drive the daemon message by message.

- `RawSave`: one Save call whose requests the test sends one at a time.
- `HeldSave`: a RawSave whose header is built exactly as RemotePolicySaver
  builds it; it receives the daemon's accept and then sends nothing until the
  test releases it (the right chunks) or cancels it. While it is held, its
  run's lane is busy for as long as the test wants, with no timing involved.
- `Template`, `Run` and `register`: a template exported once by the real
  PolicySaver, registered raw under any run name, and what a good save of
  such a run sends.
- `run_status` and `counts`: a run's GetStatus.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tf_agents.policies import policy_saver

from checkpointd.protocol import wire
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc
from checkpointd_client import RemotePolicySaver
from checkpointd_client import snapshot as client_snapshot
from tests.integration.support.daemon import Daemon

TIMEOUT = 60.0  # every wait is bounded by this; a hang fails the test instead
CHUNK_BYTES = 128  # a Run's chunks: several per snapshot, so order and truncation can be broken
Stub = checkpointd_pb2_grpc.CheckpointServiceStub
_END = object()


# A Save call driven message by message.


class RawSave:
    """One Save call whose requests the test sends one at a time.

    Requests go through a queue that gRPC's sending thread reads, so nothing
    after the first message leaves before the test says so. Leaving the
    `with` block (or `close()`) half-closes and cancels the call, so a failed
    assert never leaves gRPC's thread waiting on the queue.
    """

    def __init__(self, stub: Stub, *first: pb.SaveRequest) -> None:
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.send(*first)
        self._responses = stub.Save(self._requests(), timeout=TIMEOUT)

    def _requests(self) -> Iterator[pb.SaveRequest]:
        while (item := self._outbox.get()) is not _END:
            yield item

    def send(self, *requests: pb.SaveRequest) -> None:
        for r in requests:
            self._outbox.put(r)

    def send_chunks(self, chunks: Sequence[pb.Chunk]) -> None:
        self.send(*(pb.SaveRequest(chunk=c) for c in chunks))

    def half_close(self) -> None:
        self._outbox.put(_END)

    def next(self) -> pb.SaveResponse:
        return next(self._responses)

    def decision(self) -> pb.SaveDecision:
        """The next answer, a decision; raises the call's error if it ended in one."""
        response = self.next()
        assert response.WhichOneof("item") == "decision"
        return response.decision

    def result(self) -> pb.SaveResult:
        """Waits for the daemon's next answer, a result, without half-closing."""
        response = self.next()
        assert response.WhichOneof("item") == "result", response
        return response.result

    def finish(self, chunks: Sequence[pb.Chunk]) -> pb.SaveResult:
        """Sends `chunks`, half-closes (the snapshot is complete) and waits for the result."""
        self.send_chunks(chunks)
        self.half_close()
        return self.result()

    def refused(self) -> grpc.StatusCode:
        """Reads on until the daemon ends the call with an error; returns its code."""
        with pytest.raises(grpc.RpcError) as caught:
            while True:
                self.next()
        return caught.value.code()

    def cancel(self) -> None:
        """Cancels the call, as a client that goes away, then ends the request stream."""
        self._responses.cancel()
        self.half_close()

    def close(self) -> None:
        """Half-closes and cancels the call (a no-op once it ended)."""
        self.half_close()
        self._responses.cancel()

    def __enter__(self) -> RawSave:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def code_of(call: RawSave) -> grpc.StatusCode:
    """The status code the call ended with before its decision."""
    try:
        call.decision()
    except grpc.RpcError as error:
        return error.code()
    raise AssertionError("the call did not fail")


# A save of a RemotePolicySaver's run, sent raw.


def saver_header(
    saver: RemotePolicySaver,
    train_step: tf.Variable,
    export_dir: str,
    *,
    kind: int = pb.SAVED_MODEL,
) -> tuple[pb.SaveHeader, client_snapshot.Snapshot]:
    """The header RemotePolicySaver sends for a save of the policy now, and the snapshot.

    Registers the saver first unless it is registered. A graph-mode saver's
    variables are read through its session, as its own saves read them.
    """
    saver.register()
    bindings = saver._bindings  # noqa: SLF001 - the manifest the daemon answered
    assert bindings is not None
    reads = saver._graph_reads  # noqa: SLF001
    values = reads.values(bindings) if reads is not None else None
    snap = client_snapshot.take_snapshot(bindings, train_step, values=values)
    header = pb.SaveHeader(
        run=saver.run, kind=kind, export_dir=export_dir, step=snap.step,
        variables=bindings.protos(), snapshot_bytes=snap.nbytes,
    )  # fmt: skip
    return header, snap


class HeldSave(RawSave):
    """A raw Save call that holds its run's lane: accepted, then silent until released."""

    def __init__(
        self,
        daemon: Daemon,
        saver: RemotePolicySaver,
        train_step: tf.Variable,
        export_dir: str,
        *,
        kind: int = pb.SAVED_MODEL,
        chunk_bytes: int = 64,
        expect_accept: bool = True,
    ) -> None:
        header, self.snapshot = saver_header(saver, train_step, export_dir, kind=kind)
        self._chunk_bytes = chunk_bytes
        self.path = daemon.root / saver.run / export_dir
        self._channel = daemon.channel()
        super().__init__(Stub(self._channel), pb.SaveRequest(header=header))
        if expect_accept:
            first = self.next()
            assert first.decision.accepted, f"the lane was not idle: {first.decision.reason}"

    def chunks(self) -> list[pb.Chunk]:
        return list(wire.chunks(self.snapshot.parts(), self._chunk_bytes))

    def release(self) -> pb.SaveResult:
        """Sends the snapshot and half-closes; returns the daemon's result once durable."""
        return self.finish(self.chunks())

    def send_half_then_cancel(self) -> None:
        chunks = self.chunks()
        assert len(chunks) >= 4, "too few chunks to stop mid-upload"
        self.send_chunks(chunks[: len(chunks) // 2])
        self.cancel()

    def close(self) -> None:
        self.cancel()
        self._channel.close()


# A template exported once by the real PolicySaver, registered raw under many run names.


@dataclass(frozen=True)
class Template:
    dir: Path
    bindings: client_snapshot.Bindings
    train_step: tf.Variable
    policy: object

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(b.shape)) * b.variable.dtype.size for b in self.bindings.variables)

    @property
    def size(self) -> int:
        return wire.template_size(self.dir)


def export_template(policy: object, directory: Path, step: int = 7) -> Template:
    train_step = tf.Variable(step, dtype=tf.int64)
    saver = policy_saver.PolicySaver(policy, train_step=train_step)
    saver.save(str(directory))
    return Template(directory, client_snapshot.bind(saver, str(directory)), train_step, policy)


def register_requests(
    run: str,
    files_dir: Path,
    variables: Sequence[pb.Variable],
    graph: bytes,
    template_bytes: int | None = None,
) -> Iterator[pb.RegisterRunRequest]:
    size = wire.template_size(files_dir) if template_bytes is None else template_bytes
    yield pb.RegisterRunRequest(
        header=pb.RegisterRunHeader(run=run, variables=variables, checkpoint_object_graph=graph, template_bytes=size)
    )
    for chunk in wire.template_chunks(files_dir, 1 << 20):
        yield pb.RegisterRunRequest(chunk=chunk)


@dataclass(frozen=True)
class Run:
    """A registered run: its name and what a good save of it sends."""

    name: str
    template: Template

    def variables(self) -> list[pb.Variable]:
        return self.template.bindings.protos()

    def header(self, export_dir: str = "good", **fields: object) -> pb.SaveHeader:
        values: dict[str, object] = dict(
            run=self.name,
            kind=pb.SAVED_MODEL,
            export_dir=export_dir,
            step=int(self.template.train_step.numpy()),
            variables=self.variables(),
            snapshot_bytes=self.template.nbytes,
        )
        values.update(fields)
        return pb.SaveHeader(**values)

    def chunks(self) -> list[pb.Chunk]:
        snap = client_snapshot.take_snapshot(self.template.bindings, self.template.train_step)
        return list(wire.chunks(snap.parts(), CHUNK_BYTES))


def register(stub: Stub, run: str, template: Template) -> Run:
    reply = stub.RegisterRun(
        register_requests(run, template.dir, template.bindings.protos(), template.bindings.object_graph),
        timeout=TIMEOUT,
    )
    assert list(reply.variables) == template.bindings.protos()
    assert reply.snapshot_bytes == template.nbytes
    return Run(run, template)


# A run's status.


def run_status(target: Stub | Daemon, run: str) -> pb.RunStatus:
    """The run's GetStatus row (exactly one), through a stub or a new channel to a daemon."""
    if isinstance(target, Daemon):
        with target.channel() as channel:
            return run_status(Stub(channel), run)
    (status,) = target.GetStatus(pb.StatusRequest(run=run), timeout=TIMEOUT).runs
    return status


def counts(target: Stub | Daemon, run: str) -> tuple[int, int, int]:
    """The run's (ok, skipped, failed) counts from GetStatus."""
    status = run_status(target, run)
    return status.saves_ok, status.saves_skipped, status.saves_failed
