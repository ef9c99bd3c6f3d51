"""Raw gRPC requests for the servicer tests, built by hand from the proto's rules.

Adapted from tests/integration/support/raw.py, without TensorFlow: a template is a
few files the fake format accepts, a snapshot is bytes. Chunks are cut here
rather than by the client's codecs, so these tests check the daemon against
the proto's comments, not against the client.

- `RawSave`: one Save call whose requests the test sends one at a time, so a
  save can be held accepted and silent for as long as the test wants.
- `register`: a RegisterRun of a tiny template, several chunks per file.
- `save_header`, `snapshot_chunks`: what a good save sends.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import crc32c
import grpc
import pytest

from checkpointd.core.variable_manifest import VariableSpec
from checkpointd.rpc.messages import variable_to_pb
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc
from tests.component.conftest import SNAPSHOT_BYTES, VARIABLES
from tests.component.fakes import LIMIT, TEMPLATE_MARKER

Stub = checkpointd_pb2_grpc.CheckpointServiceStub
CHUNK_BYTES = 16  # several chunks per snapshot and per template file
TEMPLATE = {
    TEMPLATE_MARKER: b"a saved model graph, thirty-six byte",
    "variables/variables.index": b"an index of eighteen",
    "assets/empty": b"",
}
_END = object()


def variables_pb(variables: Sequence[VariableSpec] = VARIABLES) -> list[pb.Variable]:
    return [variable_to_pb(v) for v in variables]


def chunk(data: bytes, offset: int, path: str = "") -> pb.Chunk:
    return pb.Chunk(path=path, offset=offset, data=data, crc32c=crc32c.crc32c(data))


def template_chunks(files: Mapping[str, bytes]) -> Iterator[pb.Chunk]:
    """Each file whole before the next, offsets from 0 per file; an empty file is one empty chunk."""
    for path, content in sorted(files.items()):
        yield chunk(content[:CHUNK_BYTES], 0, path)
        for start in range(CHUNK_BYTES, len(content), CHUNK_BYTES):
            yield chunk(content[start : start + CHUNK_BYTES], start, path)


def register_requests(
    run: str,
    files: Mapping[str, bytes] = TEMPLATE,
    variables: Sequence[VariableSpec] = VARIABLES,
    folder: str = "",
) -> Iterator[pb.RegisterRunRequest]:
    yield pb.RegisterRunRequest(
        header=pb.RegisterRunHeader(
            run=run, folder=folder, variables=variables_pb(variables),
            checkpoint_object_graph=b"object graph",
            template_bytes=sum(len(c) for c in files.values()),
        )
    )  # fmt: skip
    for c in template_chunks(files):
        yield pb.RegisterRunRequest(chunk=c)


def register(stub: Stub, run: str, files: Mapping[str, bytes] = TEMPLATE, **fields: object) -> pb.RegisterRunResponse:
    return stub.RegisterRun(register_requests(run, files, **fields), timeout=LIMIT)  # type: ignore[arg-type]


def save_header(run: str, export_dir: str, step: int = 1, **fields: Any) -> pb.SaveHeader:
    values: dict[str, Any] = dict(
        run=run, kind=pb.SAVED_MODEL, export_dir=export_dir, step=step,
        variables=variables_pb(), snapshot_bytes=SNAPSHOT_BYTES,
    )  # fmt: skip
    values.update(fields)
    return pb.SaveHeader(**values)


def snapshot_chunks(*parts: bytes) -> list[pb.Chunk]:
    """The parts back to back, cut into chunks at offsets over the whole payload."""
    payload = b"".join(parts)
    return [chunk(payload[i : i + CHUNK_BYTES], i) for i in range(0, len(payload), CHUNK_BYTES)]


def save_requests(header: pb.SaveHeader, *parts: bytes) -> Iterator[pb.SaveRequest]:
    """A whole Save sent at once (the client does wait for the decision; a test may not)."""
    yield pb.SaveRequest(header=header)
    for chunk in snapshot_chunks(*parts):
        yield pb.SaveRequest(chunk=chunk)


class RawSave:
    """One Save call whose requests the test sends one at a time.

    Requests go through a queue that gRPC's sending thread reads, so nothing
    after the header leaves before the test says so. `close()` half-closes
    and cancels, so a failed assert never leaves gRPC's thread waiting.
    """

    def __init__(self, stub: Stub, header: pb.SaveHeader, timeout: float = LIMIT) -> None:
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.send(pb.SaveRequest(header=header))
        self._responses = stub.Save(self._requests(), timeout=timeout)

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

    def decision(self) -> pb.SaveDecision:
        response = next(self._responses)
        assert response.WhichOneof("item") == "decision", response
        return response.decision

    def result(self) -> pb.SaveResult:
        response = next(self._responses)
        assert response.WhichOneof("item") == "result", response
        return response.result

    def finish(self, chunks: Sequence[pb.Chunk]) -> pb.SaveResult:
        """Sends `chunks`, half-closes and waits for the result."""
        self.send_chunks(chunks)
        self.half_close()
        return self.result()

    def ended(self) -> bool:
        """True if the call ends OK with no further answer."""
        return next(self._responses, None) is None

    def refused(self) -> grpc.RpcError:
        """Reads on until the daemon ends the call with an error; returns it."""
        with pytest.raises(grpc.RpcError) as caught:
            while True:
                next(self._responses)
        return caught.value

    def close(self) -> None:
        self.half_close()
        self._responses.cancel()
