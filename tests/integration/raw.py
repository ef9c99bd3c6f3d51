"""Raw gRPC saves for tests that need a save held in flight.

`HeldSave` sends a valid header built exactly as RemotePolicySaver builds it,
receives the daemon's accept, and then sends nothing until the test releases
it (the right chunks) or cancels it. While it is held, its run's lane is busy
for as long as the test wants, with no timing involved.
"""

from __future__ import annotations

import queue

import grpc
import tensorflow as tf

from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc
from checkpointd_client import RemotePolicySaver
from checkpointd_client import snapshot as client_snapshot
from tests.integration.daemon import Daemon

TIMEOUT = 60.0  # every wait is bounded by this; a hang fails the test instead


class HeldSave:
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
        saver.register()
        bindings = saver._bindings  # noqa: SLF001 - the manifest the daemon answered
        assert bindings is not None
        self._snap = client_snapshot.take_snapshot(bindings, train_step)
        self._chunk_bytes = chunk_bytes
        self.path = daemon.root / saver.run / export_dir
        header = pb.SaveHeader(
            run=saver.run,
            kind=kind,
            export_dir=export_dir,
            step=self._snap.step,
            variables=bindings.protos(),
            snapshot_bytes=self._snap.nbytes,
        )
        self._requests: queue.SimpleQueue[pb.SaveRequest | None] = queue.SimpleQueue()
        self._requests.put(pb.SaveRequest(header=header))
        self._channel = daemon.channel()
        stub = checkpointd_pb2_grpc.CheckpointServiceStub(self._channel)
        self._responses = stub.Save(iter(self._requests.get, None), timeout=TIMEOUT)
        if expect_accept:
            first = next(self._responses)
            assert first.decision.accepted, f"the lane was not idle: {first.decision.reason}"

    def decision(self) -> pb.SaveDecision:
        """The first answer (with expect_accept=False); raises the call's error."""
        return next(self._responses).decision

    def chunks(self) -> list[pb.Chunk]:
        return list(self._snap.chunks(self._chunk_bytes))

    def release(self) -> pb.SaveResult:
        """Sends the snapshot and half-closes; returns the daemon's result."""
        for chunk in self.chunks():
            self._requests.put(pb.SaveRequest(chunk=chunk))
        self._requests.put(None)
        return next(self._responses).result

    def send_half_then_cancel(self) -> None:
        chunks = self.chunks()
        assert len(chunks) >= 4, "too few chunks to stop mid-upload"
        for chunk in chunks[: len(chunks) // 2]:
            self._requests.put(pb.SaveRequest(chunk=chunk))
        self.cancel()

    def cancel(self) -> None:
        self._responses.cancel()
        self._requests.put(None)

    def close(self) -> None:
        self.cancel()
        self._channel.close()


def code_of(call: HeldSave) -> grpc.StatusCode:
    """The status code the held call ended with."""
    try:
        call.decision()
    except grpc.RpcError as error:
        return error.code()
    raise AssertionError("the call did not fail")
