"""One Save call on the wire: header, decision, then (if accepted) chunks and result.

gRPC pulls requests from an iterator on its own thread. Here that iterator
reads a queue, so nothing but the header can leave before the daemon's
decision has been read: chunks are queued only by `upload()`. Every way out
of a stream puts the end marker on the queue, so gRPC's thread never waits
on it forever.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc

from checkpointd.protocol.codes import error_for
from checkpointd.protocol.errors import ChecksumError, DeadlineError, SaveFailedError
from checkpointd.protocol.kinds import from_wire
from checkpointd.v1 import checkpointd_pb2
from checkpointd_client import trainer_versions
from checkpointd_client.ticket import SaveResult, SaveTicket

_LOGGER = logging.getLogger(__name__)

_END = None
# How long past its deadline a call may go unanswered before it is cancelled here:
# gRPC's own deadline should end it first, but a call that found the daemon gone
# has been seen to wait on in the channel far past it, and a non-blocking save
# must not hold the training loop.
_DEADLINE_GRACE = 2.0
_POLL = 0.25  # seconds between looks at the call's end while no answer has come (failures only)
_ANSWER_AFTER_END = 0.5  # an answer still arriving this long after the call's status counts


class SaveStream:
    """A Save call whose requests are fed through a queue.

    Methods raise `grpc.RpcError` for a status the daemon (or the channel)
    sent; the caller maps it with `checkpointd.protocol.codes.error_for`.
    """

    def __init__(self, stub: SaveStub, header: checkpointd_pb2.SaveHeader, timeout: float | None) -> None:
        self._queue: queue.SimpleQueue[Iterable[checkpointd_pb2.SaveRequest | bytes] | None] = queue.SimpleQueue()
        request = checkpointd_pb2.SaveRequest(header=header)
        request.header.trainer_versions.update(trainer_versions.versions())  # for the save's manifest
        self._queue.put([request])
        self._timeout = timeout
        self._responses = stub.Save(self._requests(), timeout=timeout)

    def _requests(self) -> Iterator[checkpointd_pb2.SaveRequest | bytes]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            yield from item

    def decision(self) -> checkpointd_pb2.SaveDecision:
        """Waits for the daemon's first answer: accepted or skipped.

        Raises:
            grpc.RpcError: the status that ended the call instead.
            SaveFailedError: if the daemon broke the protocol.
        """
        return self._next("decision").decision

    def upload(self, requests: Iterable[bytes]) -> None:
        """Queues the snapshot's requests, already serialized, then the half-close.

        They are built lazily as gRPC sends them, so at most a few are in
        memory at once (see `wire.save_request_chunks`).
        """
        self._queue.put(requests)
        self._queue.put(_END)

    def result(self) -> checkpointd_pb2.SaveResult:
        """Waits for the daemon's SaveResult (the save is durable).

        Raises:
            grpc.RpcError: the status that ended the call instead.
            SaveFailedError: if the daemon broke the protocol.
        """
        return self._next("result").result

    def skip(self, ticket: SaveTicket, reason: str, run: str) -> None:
        """Completes `ticket` as skipped, logs it, and lets the daemon end the call."""
        _LOGGER.warning(
            "run %s: %s of step %s to %r skipped: %s",
            *(run, ticket.kind.value, ticket.step, ticket.export_dir, reason),
        )
        ticket._skip(reason)  # noqa: SLF001 - the saver's side completes tickets
        self._queue.put(_END)
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError:
            pass  # the skip is already known; how the call ends adds nothing

    def finish(
        self,
        ticket: SaveTicket,
        requests: Iterable[bytes],
        run: str,
        on_end: Callable[[], None] | None = None,
        resend: Callable[[], tuple[SaveStream, Iterable[bytes]]] | None = None,
    ) -> None:
        """Uploads an accepted snapshot and completes `ticket` with the daemon's answer.

        The save's own failure is not raised: it is stored on the ticket (so
        `ticket.result()` raises it) and logged at WARNING. `on_end` is called
        once the call has ended, before the ticket completes (a held save
        lets go of the run's busy lock there, so a save made once
        `ticket.result()` returns finds it free). `resend`, for an
        incremental save, opens the same save again, accepted, with every
        byte to send: it is called once if this one ends in DATA_LOSS (the
        base changed under it, or a chunk was damaged on the way).
        """
        start = time.monotonic()
        where = (run, ticket.kind.value, ticket.step, ticket.export_dir)
        try:
            self.upload(requests)
            result = self.result()
        except Exception as e:  # noqa: BLE001 - stored on the ticket, raised by result()
            error: Exception = e
            if isinstance(e, grpc.RpcError):
                error = error_for(*rpc_error(e))
                error.__cause__ = e
            self.close()
            if resend is not None and isinstance(error, ChecksumError):
                _LOGGER.info("run %s: %s of step %s to %r: %s; sending it again in full", *where, error)
                try:
                    again, full = resend()
                except Exception as e:  # noqa: BLE001 - stored on the ticket, as any failure
                    error = e
                else:
                    again.finish(ticket, full, run, on_end)
                    return
            _LOGGER.warning("run %s: %s of step %s to %r failed: %s: %s", *where, type(error).__name__, error)
            if on_end is not None:
                on_end()
            ticket._fail(error)  # noqa: SLF001 - the saver's side completes tickets
            return
        except BaseException as e:  # interrupted: end the ticket, then let it through
            self.close()
            if on_end is not None:
                on_end()
            ticket._fail(e)  # noqa: SLF001
            raise
        self.close()
        if on_end is not None:
            on_end()
        _LOGGER.info(
            "run %s: %s of step %s to %r durable at %s (%s bytes; daemon %.3f s, here %.3f s)",
            *where,
            result.path,
            result.bytes_written,
            result.duration_seconds,
            time.monotonic() - start,
        )
        ticket._succeed(  # noqa: SLF001
            SaveResult(
                path=result.path,
                bytes_written=result.bytes_written,
                duration_seconds=result.duration_seconds,
                step=result.step,
                kind=from_wire(result.kind) or ticket.kind,
                bytes_received=result.bytes_received,
                bytes_copied=result.bytes_copied,
                incremental_path=result.incremental_path,
            )
        )

    def close(self) -> None:
        """Half-closes and cancels the call if it is still running; idempotent."""
        self._queue.put(_END)
        self._responses.cancel()

    def _next(self, item: str) -> checkpointd_pb2.SaveResponse:
        """The call's next answer, or its status raised (a grpc.RpcError), or DeadlineError.

        gRPC's iterator is read on a thread of its own: a call whose status is
        already known can go on waiting inside gRPC for a message that never
        comes (seen for the first call after the daemon went away), and a
        non-blocking save must not hold the training loop. So the call's end
        (its done callback) or the deadline ends the wait here too.
        """
        box: list[object] = []
        answered = threading.Event()
        ended = threading.Event()

        def pull() -> None:
            try:
                box.append(next(self._responses, None))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                box.append(e)
            answered.set()

        threading.Thread(target=pull, name="checkpointd-save-answer", daemon=True).start()
        call: Any = self._responses  # a grpc.Future and grpc.RpcError too (the stubs type it as an iterator)
        call.add_done_callback(lambda _call: ended.set())
        deadline = None if self._timeout is None else time.monotonic() + self._timeout + _DEADLINE_GRACE
        ended_at = None
        while not answered.wait(_POLL):
            now = time.monotonic()
            if ended.is_set():
                ended_at = ended_at or now
                if now - ended_at >= _ANSWER_AFTER_END:  # the status is known and no message came with it
                    raise call  # the call itself: a grpc.RpcError with its code and details
            elif deadline is not None and now >= deadline:
                self._responses.cancel()
                raise DeadlineError(
                    f"no {item} from the daemon within the {self._timeout:g} s deadline (the call was cancelled); "
                    "check that the daemon is up at this address, or raise the saver's timeout"
                )
        [got] = box
        if isinstance(got, BaseException):
            raise got
        if got is None:
            raise SaveFailedError(f"the daemon ended the save without a {item}")
        assert isinstance(got, checkpointd_pb2.SaveResponse)
        if got.WhichOneof("item") != item:
            raise SaveFailedError(f"the daemon sent a {got.WhichOneof('item')} where a {item} was due")
        return got


class SaveStub:
    """CheckpointService.Save alone, taking requests as messages or serialized bytes."""

    def __init__(self, channel: grpc.Channel) -> None:
        service = checkpointd_pb2.DESCRIPTOR.services_by_name["CheckpointService"]
        self.Save = channel.stream_stream(  # noqa: N815 - the generated stub's name
            f"/{service.full_name}/Save",
            request_serializer=_serialize,
            response_deserializer=checkpointd_pb2.SaveResponse.FromString,
        )


class RestoreFilesStub:
    """CheckpointService.RestoreFiles alone, answering each response as its serialized bytes.

    Parsing a chunk's message copies its data out of the message; the caller
    reads the chunks from the bytes gRPC received instead (see
    `checkpointd_client.restore.files`).
    """

    def __init__(self, channel: grpc.Channel) -> None:
        service = checkpointd_pb2.DESCRIPTOR.services_by_name["CheckpointService"]
        self.RestoreFiles: grpc.UnaryStreamMultiCallable = channel.unary_stream(  # noqa: N815 - the generated name
            f"/{service.full_name}/RestoreFiles",
            request_serializer=checkpointd_pb2.RestoreFilesRequest.SerializeToString,
            response_deserializer=None,
        )


def _serialize(request: checkpointd_pb2.SaveRequest | bytes) -> bytes:
    return request if isinstance(request, bytes) else request.SerializeToString()


def rpc_error(error: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    """The status code and details of a gRPC error (both are on the call object)."""
    code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = error.details() if isinstance(error, grpc.Call) else str(error)
    return code, details or ""
