"""Receiving uploads: a RegisterRun's template files and a Save's snapshot chunks.

The servicer's streaming handlers read their request iterators here. Every
chunk is checked (in order, within the announced size, CRC32C) before it is
kept: a template's written to its file, a snapshot's written into the save's
open files (`receive_snapshot`). `within` bounds a Save's upload by the daemon's --upload-timeout, since
gRPC's request iterator would otherwise wait for a stalled client forever.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeVar

import grpc

from checkpointd.core.ports import ImageSink
from checkpointd.protocol.errors import DeadlineError, InvalidRequestError
from checkpointd.protocol.names import check_export_dir
from checkpointd.protocol.wire import check_chunk
from checkpointd.rpc import same_chunks
from checkpointd.rpc.read_ahead import read_ahead
from checkpointd.saves.sinks import write_views
from checkpointd.v1 import checkpointd_pb2 as pb

_R = TypeVar("_R")
_T = TypeVar("_T")


def first(requests: Iterator, field: str, rpc: str):  # noqa: ANN202 - a pb message
    """The `field` of the stream's first message; InvalidRequestError if it has none."""
    try:
        message = next(requests)
    except StopIteration:
        raise InvalidRequestError(f"{rpc}: the stream ended before its {field}") from None
    if message.WhichOneof("item") != field:
        raise InvalidRequestError(f"{rpc}: the first message must be a {field}")
    return getattr(message, field)


class _Abandoned(Exception):
    """Ends a reader whose save was given up (past its deadline); nobody waits for it."""


_READER = "upload-reader"  # a reader thread's name while it runs a save's receive
_IDLE_READER = "upload-reader (idle)"
_IDLE_SECONDS = 60.0  # an idle reader thread ends after this long without a save


class _Readers:
    """Daemon threads that run the saves' receives, kept for the next save once one ends.

    A thread of its own per save cost a thread start per small save; these
    are reused while saves keep coming and end once idle for a minute.
    Daemon threads, as a reader blocked on a stalled client must not hold
    up the process's exit. Thread-safe.
    """

    def __init__(self, keep: int = 64) -> None:
        self._keep = keep  # idle threads kept at most
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting on _tasks, each to take one task
        self._tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

    def run(self, task: Callable[[], None]) -> None:
        """Runs `task` on an idle reader thread, or a new one."""
        with self._lock:
            if self._idle:
                self._idle -= 1
                self._tasks.put(task)
                return
        threading.Thread(target=self._work, args=(task,), name=_READER, daemon=True).start()

    def _work(self, task: Callable[[], None]) -> None:
        me = threading.current_thread()
        while True:
            me.name = _READER
            task()
            me.name = _IDLE_READER
            with self._lock:
                if self._idle >= self._keep:
                    return
                self._idle += 1
            try:
                task = self._tasks.get(timeout=_IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    try:  # handed one as the wait ended
                        task = self._tasks.get_nowait()
                    except queue.Empty:
                        self._idle -= 1
                        return


_READERS = _Readers()


class _Upload:
    """One save's upload as its reader and its handler share it: whether it was received, or given up."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # the receive's end and the deadline's, decided once
        self.finished = threading.Event()
        self.received = False  # the bytes are all in: the deadline no longer applies
        self.abandoned = False  # the deadline passed first: the reader stops
        self.outcome: list[Any] = []  # [result] or [None, the exception]


def within(
    receive: Callable[[Iterator[pb.SaveRequest]], _R],
    requests: Iterator[pb.SaveRequest],
    deadline: float,
    timeout: float,
    then: Callable[[_R], _T],
) -> _T:
    """`then(receive(requests))`, run on a reader thread; DeadlineError if the receive is not done by the monotonic `deadline`.

    gRPC's request iterator blocks with no timeout, so a thread reads it
    while the handler waits for the outcome for the time left: a client that
    stalls, or sends nothing at all, is cut off at the deadline without
    polling. The reader does all the per-chunk work too (checks, CRC32C, the
    write), so a small save's chunk passes from gRPC's thread to one of ours
    and no further: a queue between a reader and the handler cost a thread
    hand-off (and a wait for the GIL) per chunk. A large snapshot's chunks
    are taken from gRPC a few ahead by one more thread (`read_ahead`, from
    `_READERS` too), which pays that hand-off for a connection that never
    waits on a write. Once the snapshot is in, the reader goes on with
    `then` (the save's commit), which the deadline does not bound: the
    handler is woken once, with the outcome, not once for the upload and
    again for the commit. Once the deadline has passed first the reader
    stops at its next request, or ends with the call.
    """
    upload = _Upload()

    def guarded() -> Iterator[pb.SaveRequest]:
        for request in requests:
            if upload.abandoned:
                raise _Abandoned
            yield request

    def read() -> None:
        try:
            received = receive(guarded())
            with upload.lock:
                if upload.abandoned:  # the deadline passed as the last bytes came
                    raise _Abandoned
                upload.received = True
            upload.outcome.append(then(received))
        except BaseException as exc:  # noqa: BLE001 - handed to the handler thread
            upload.outcome.extend((None, exc))
        finally:
            upload.finished.set()

    _READERS.run(read)
    if not upload.finished.wait(max(deadline - time.monotonic(), 0.0)):
        with upload.lock:
            upload.abandoned = not upload.received
        if upload.abandoned:
            raise DeadlineError(
                f"upload did not finish within {timeout:g}s after the save was accepted "
                "(--upload-timeout); the save is discarded"
            )
        upload.finished.wait()  # received in time: its commit runs to the end
    if len(upload.outcome) == 2:
        raise upload.outcome[1]
    return upload.outcome[0]


def receive_template(requests: Iterator[pb.RegisterRunRequest], staged: Path, total: int) -> None:
    """Writes a RegisterRun's chunks (after its header) as files under `staged`, made here.

    Raises:
        InvalidRequestError: a message is not a chunk, a path is invalid or
            sent twice, or the bytes differ from the header's `total`.
        ChecksumError: a chunk's CRC32C does not match its data.
    """
    received = 0
    current: tuple[str, BinaryIO] | None = None  # (path, open file)
    offset = 0
    staged.mkdir(parents=True)
    try:
        for request in requests:
            if request.WhichOneof("item") != "chunk":
                raise InvalidRequestError("RegisterRun: only chunks may follow the header")
            chunk = request.chunk
            if current is None or chunk.path != current[0]:
                if current is not None:
                    current[1].close()
                relative = check_export_dir(chunk.path)
                target = staged / relative
                if target.exists():
                    raise InvalidRequestError(f"RegisterRun: file {chunk.path!r} sent twice")
                try:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    handle = open(target, "wb")
                except (FileExistsError, NotADirectoryError, IsADirectoryError):
                    raise InvalidRequestError(
                        f"RegisterRun: file {chunk.path!r} conflicts with another file of the "
                        "template (a file where a directory must be, or the reverse)"
                    ) from None
                current, offset = (chunk.path, handle), 0
            data = check_chunk(chunk, offset, offset + (total - received), f"template file {chunk.path!r}")
            current[1].write(data)
            offset += len(data)
            received += len(data)
    finally:
        if current is not None:
            current[1].close()
    if received != total:
        raise InvalidRequestError(f"RegisterRun: received {received} template bytes; the header announced {total}")


# A snapshot's chunks are taken from gRPC by a thread of their own, this many ahead of their
# checks and writes, once the snapshot is larger than READ_AHEAD_FROM bytes: there the connection
# no longer waits on the writes (bench/README.md, "Figures behind choices"). A smaller save gains
# nothing measurable and keeps its memory (the chunks queued) and its single thread hand-off.
READ_AHEAD = 4
READ_AHEAD_FROM = 64 << 20


class SharedSegment(Protocol):
    """A shared-memory segment holding a snapshot (`checkpointd.transport.shm.Segment`)."""

    @property
    def offsets(self) -> Sequence[int]: ...

    def views(self) -> list[memoryview]: ...

    def image(self) -> memoryview: ...


class Sink(Protocol):
    """Where a snapshot's parts are written as they arrive (`checkpointd.core.ports.SaveSink`)."""

    def write(self, part: int, offset: int, data: Any, crc: int | None = None) -> None: ...


def receive_snapshot(
    requests: Iterator[pb.SaveRequest],
    total: int,
    context: grpc.ServicerContext,
    parts: Sequence[int],
    segment: SharedSegment | None,
    sink: Sink,
) -> str:
    """Writes a Save's snapshot into `sink` as it arrives: the chunks after its header, checked, split in parts.

    Every chunk is checked (in order, within `total`, its CRC32C) and then
    written at once, so no more than a chunk of the snapshot is held here
    (and up to READ_AHEAD more, taken ahead, past READ_AHEAD_FROM bytes).
    When the accept offered `segment`, the client may instead send one
    `shared_memory_written` (the snapshot is in the segment) and half-close;
    the parts are then written into `sink` straight from the segment (the
    whole segment, to a sink that can write its data file from its image).

    Args:
        requests: the requests after the header.
        total: the snapshot's size in bytes, as the header announced it.
        context: the call, to tell a finished upload from a cancelled one.
        parts: the sizes of the snapshot's parts (each variable, then the
            numpy state), summing to `total`.
        segment: the shared-memory segment offered for these parts, if any.
        sink: takes each part's bytes, in order within the part.

    Returns:
        How the snapshot came: "grpc" or "shm".

    Raises:
        InvalidRequestError: a message is not a chunk, the chunks are out of
            order or not `total` bytes, shared memory is claimed where none
            was offered, or the client went away.
        ChecksumError: a chunk's CRC32C does not match its data.
    """
    requests = iter(requests)
    try:
        request = next(requests)
    except StopIteration:
        request = None
    if request is not None and request.WhichOneof("item") == "shared_memory_written":
        if segment is None:
            raise InvalidRequestError("Save: shared_memory_written, but this save's accept offered no shared memory")
        for _ in requests:
            raise InvalidRequestError("Save: nothing may follow shared_memory_written")
        if not context.is_active():
            raise InvalidRequestError("Save: the client went away during the upload")
        if isinstance(sink, ImageSink) and sink.image_layout() is not None:  # the data file from the whole segment
            sink.write_image(segment.image(), segment.offsets)
            return "shm"
        write_views(sink, segment.views())
        return "shm"
    if request is not None:
        requests = itertools.chain((request,), requests)
    if total > READ_AHEAD_FROM:
        requests = read_ahead(requests, READ_AHEAD, _READERS.run)
    sizes = list(parts)
    if sum(sizes) != total:
        raise InvalidRequestError(f"Save: the parts sum to {sum(sizes)}, not the {total} bytes announced")
    # (wire start, wire end, part) of each non-empty part, in order.
    spans, start = [], 0
    for j, size in enumerate(sizes):
        if size:
            spans.append((start, start + size, j))
        start += size
    span = 0
    received = 0
    for request in requests:
        if request.WhichOneof("item") == "same":  # an incremental save's unchanged range
            received = same_chunks.receive_same(request.same, received, total, sink)
            while span < len(spans) and received >= spans[span][1]:
                span += 1
            continue
        if request.WhichOneof("item") != "chunk":
            raise InvalidRequestError("Save: only chunks (or one shared_memory_written) may follow the header")
        data = memoryview(check_chunk(request.chunk, received, total, "snapshot"))
        done = 0
        while done < len(data):  # a chunk may span parts; the client's never do
            wire_start, wire_end, part = spans[span]
            n = min(len(data) - done, wire_end - received)
            # A chunk within one part (the client's always are) hands on its checked CRC32C.
            crc = request.chunk.crc32c if n == len(data) else None
            sink.write(part, received - wire_start, data[done : done + n], crc)
            done += n
            received += n
            if received == wire_end:
                span += 1
    if not context.is_active():
        raise InvalidRequestError("Save: the client went away during the upload")
    if received != total:
        raise InvalidRequestError(f"Save: the snapshot ended after {received} of its {total} bytes")
    return "grpc"
