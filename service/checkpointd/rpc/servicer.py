"""The gRPC servicer: CheckpointService, translated onto the save pipeline.

Each method decodes its request (`checkpointd.rpc.messages`), calls the
pipeline or the run registry, and encodes the answer. Domain errors become
statuses in one place (`checkpointd.rpc.errors.grpc_errors`); the request
streams are read by `checkpointd.rpc.upload`, which bounds a Save's upload by
--upload-timeout.
"""

from __future__ import annotations

import math
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import grpc

from checkpointd.core.ports import SavedFile
from checkpointd.protocol import wire
from checkpointd.protocol.errors import InvalidRequestError, RunClosedError, RunNotFoundError
from checkpointd.protocol.kinds import SaveKind, to_wire
from checkpointd.protocol.names import LEASE_WAIT_METADATA, TMP_PREFIX, check_export_dir, check_run_name
from checkpointd.restores import committed, files, staged_files
from checkpointd.rpc import messages, upload
from checkpointd.rpc.errors import grpc_errors
from checkpointd.saves import catalog
from checkpointd.saves.pipeline import SavePipeline
from checkpointd.saves.standby import Standbys
from checkpointd.transport.shm import Segment
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc as pb_grpc

_T = TypeVar("_T")

_SERVICE = pb.DESCRIPTOR.services_by_name["CheckpointService"].full_name


def _wait_seconds(value: float, rpc: str) -> float | None:
    """A request's timeout_seconds as a wait: None is no deadline.

    0 means no deadline, and so does anything past what a thread can wait
    (threading.TIMEOUT_MAX, about 292 years), rather than an OverflowError. A
    negative timeout has already passed: a busy run answers DEADLINE_EXCEEDED.
    """
    if math.isnan(value):
        raise InvalidRequestError(f"{rpc}: timeout_seconds is NaN; give seconds, or 0 for no deadline")
    if value == 0 or value >= threading.TIMEOUT_MAX:
        return None
    return max(value, 0.0) or 1e-9  # already passed: check once, do not wait


def _chunk_response(piece: files.Piece) -> bytes:
    """A piece as a serialized RestoreFilesResponse(chunk=...): its bytes copied once, after a few header bytes.

    Its CRC32C is the one the save recorded at commit where the piece has one.
    """
    crc = piece.crc if piece.crc is not None else wire.crc32c_of(piece.data)
    return wire.encoded_chunk(piece.offset, piece.data, crc, piece.path)


def _response_bytes(response: pb.RestoreFilesResponse | bytes) -> bytes:
    return response if isinstance(response, bytes) else response.SerializeToString()


def add_raw_handlers(servicer: CheckpointServicer, server: grpc.Server) -> None:
    """Serves RestoreFiles and Save with (de)serializers that skip a copy of each chunk's bytes.

    RestoreFiles' serializer passes chunks already serialized through; Save's
    deserializer reads a chunk's data as a view of the received message
    (`wire.parse_save_request`). Add them before
    `add_CheckpointServiceServicer_to_server`: gRPC asks the generic handlers
    in the order they were added, and the generated ones would (de)serialize
    every message with protobuf.
    """
    handlers: dict[str, grpc.RpcMethodHandler] = {
        "RestoreFiles": grpc.unary_stream_rpc_method_handler(
            servicer.RestoreFiles,
            request_deserializer=pb.RestoreFilesRequest.FromString,
            response_serializer=_response_bytes,
        ),
        "Save": grpc.stream_stream_rpc_method_handler(
            servicer.Save,
            request_deserializer=wire.parse_save_request,
            response_serializer=pb.SaveResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))


def _until_ended(context: grpc.ServicerContext, limit: float) -> None:
    """Waits until the call ends (the client cancels it or goes away), at most `limit` seconds."""
    ended = threading.Event()
    if context.add_callback(ended.set):
        ended.wait(limit)


def restore_file(f: SavedFile, stat: tuple[int, int, int] | None) -> pb.RestoreFile:
    """A RestoreFilesHeader's entry for one file, with its stat if the daemon vouches for it in place."""
    device, inode, mtime_ns = stat or (0, 0, 0)
    return pb.RestoreFile(path=f.path, size=f.size, crc32c=f.crc32c, device=device, inode=inode, mtime_ns=mtime_ns)


class CheckpointServicer(pb_grpc.CheckpointServiceServicer):
    """Implements checkpointd.v1.CheckpointService."""

    def __init__(self, pipeline: SavePipeline, staging: Path, standbys: Standbys | None = None) -> None:
        """Args:
        pipeline: the save pipeline (and through it the runs and the store).
        staging: where uploaded templates are received, in the daemon's state dir.
        standbys: the watched trainers' standby slots (None: no shared memory).
        """
        self._pipeline = pipeline
        self._lanes = pipeline.lanes
        self._staging = staging
        self._standbys = standbys

    @grpc_errors
    def RegisterRun(
        self, request_iterator: Iterator[pb.RegisterRunRequest], context: grpc.ServicerContext
    ) -> pb.RegisterRunResponse:
        header = upload.first(request_iterator, "header", "RegisterRun")
        # Named like a save temp dir, so startup recovery removes it after a crash.
        staged = self._staging / f"{TMP_PREFIX}template-{uuid.uuid4().hex}"

        def receive() -> Path:
            upload.receive_template(request_iterator, staged, header.template_bytes)
            return staged

        self._wait_standby(header.run, context)  # a trainer gone just now: its last snapshot first

        try:
            manifest = self._pipeline.register(
                header.run,
                header.folder,
                [messages.variable_from_pb(v) for v in header.variables],
                header.checkpoint_object_graph,
                header.template_bytes,
                receive,
                kind=messages.kind_from_pb(header.kind, "RegisterRun", optional=True),
                timeout=context.time_remaining(),  # how long it may wait for another daemon's lease
                on_lease_wait=lambda text: context.send_initial_metadata(((LEASE_WAIT_METADATA, text),)),
                checkpoint_dir=header.checkpoint_dir if header.HasField("checkpoint_dir") else None,
            )
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        run = check_run_name(header.run)
        return messages.register_response(run, self._lanes.folder(run), manifest)

    @grpc_errors
    def Save(
        self, request_iterator: Iterator[pb.SaveRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.SaveResponse]:
        request = messages.save_request(upload.first(request_iterator, "header", "Save"))

        def receive(
            parts: Sequence[int], segment: Segment | None, deadline: float, sink: upload.Sink, then: Callable[[str], _T]
        ) -> _T:
            def chunks(requests: Iterator[pb.SaveRequest]) -> str:
                return upload.receive_snapshot(requests, request.snapshot_bytes, context, parts, segment, sink)

            return upload.within(chunks, request_iterator, deadline, self._pipeline.upload_timeout, then)

        # A blocking save waiting for its turn wakes when the caller goes away.
        context.add_callback(self._lanes.wake)
        events = self._pipeline.save(request, receive, timeout=context.time_remaining(), is_active=context.is_active)
        for event in events:
            yield messages.save_response(event)

    @grpc_errors
    def Flush(self, request: pb.FlushRequest, context: grpc.ServicerContext) -> pb.FlushResponse:
        if request.local_skips:
            if not request.run:
                raise InvalidRequestError("Flush: local_skips need the run they were skipped on")
            self._pipeline.count_local_skips(
                check_run_name(request.run), messages.local_skips(request.local_skips, "Flush")
            )
        runs = self._lanes.flush(request.run or None, _wait_seconds(request.timeout_seconds, "Flush"))
        return pb.FlushResponse(runs=runs)

    @grpc_errors
    def CloseRun(self, request: pb.CloseRunRequest, context: grpc.ServicerContext) -> pb.CloseRunResponse:
        self._pipeline.close_run(request.run, _wait_seconds(request.timeout_seconds, "CloseRun"))
        if self._standbys is not None:  # closed by its trainer: nothing of it left to stand by
            self._standbys.watch(request.run, [])
        return pb.CloseRunResponse(run=request.run)

    @grpc_errors
    def WatchStandby(self, request: pb.WatchStandbyRequest, context: grpc.ServicerContext) -> pb.WatchStandbyResponse:
        run = check_run_name(request.run)
        if self._standbys is None:
            raise RunClosedError(
                "WatchStandby: this daemon has no shared memory (--shm-root), so it cannot watch standby slots; "
                "saves go to it as usual"
            )
        self._standbys.watch(run, list(request.slot_paths))
        return pb.WatchStandbyResponse(run=run)

    def _wait_standby(self, run: str | None, context: grpc.ServicerContext) -> None:
        """Until the standby snapshot of `run`'s trainer (any run's: None) that just went is written."""
        if self._standbys is not None:
            self._standbys.wait(run, context.time_remaining())

    @grpc_errors
    def GetStatus(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        if not request.stored:
            runs = [messages.run_status(view) for view in self._lanes.views(request.run or None)]
            return self._status(runs)
        run = check_run_name(request.run) if request.run else None
        try:
            views = self._lanes.views(run)
        except RunNotFoundError:
            views = []  # not registered here, but the store may hold its saves
        response = self._status([messages.run_status(v) for v in views])
        # One run: its folder only (as GetLatest searches); else every folder.
        folders = None if run is None else [self._pipeline.folder(run)]
        found = catalog.stored_runs(self._pipeline.store, self._pipeline.leases, folders=folders, run=run)
        messages.add_stored_runs(response, found, self._pipeline.store.location)
        return response

    def _status(self, runs: Sequence[pb.RunStatus]) -> pb.StatusResponse:
        return pb.StatusResponse(
            runs=runs, draining=self._lanes.draining, notice_seconds_left=self._lanes.notice_left()
        )

    @grpc_errors
    def GetLatest(self, request: pb.LatestRequest, context: grpc.ServicerContext) -> pb.LatestResponse:
        kind = messages.kind_from_pb(request.kind, "GetLatest", optional=True)
        self._wait_standby(request.run or None, context)
        if request.HasField("checkpoint_dir"):  # by where the checkpoints are, whichever run wrote them
            run = _reader_run(request.run, request.folder, "GetLatest")
            if kind is not None and kind is not SaveKind.TRAINING_CHECKPOINT:
                raise InvalidRequestError(
                    f"GetLatest: checkpoint_dir finds training checkpoints, not {kind.value} saves"
                )
            folder = self._pipeline.folder(run, request.folder)
            directory = check_export_dir(request.checkpoint_dir).as_posix()
            save = catalog.find_latest_in_dir(self._pipeline.store, folder, directory)
        else:
            run = check_run_name(request.run)
            folder = self._pipeline.folder(run, request.folder)
            save = catalog.find_latest(self._pipeline.store, folder, run, kind)
        checkpoints = self._pipeline.active_checkpoints(folder, save)
        return messages.latest_response(save, checkpoints, self._pipeline.store.location)

    @grpc_errors
    def Restore(self, request: pb.RestoreRequest, context: grpc.ServicerContext) -> Iterator[pb.RestoreResponse]:
        run = check_run_name(request.run)
        manifest, folder = self._lanes.manifest(run), self._lanes.folder(run)
        with self._pipeline.retention.holding(folder):  # retention must not delete it mid-stream
            with committed.opening(
                self._pipeline.store, self._pipeline.formats, folder, run, request.export_dir, manifest
            ) as opened:  # an object store's save: a local copy until the stream ends
                started = time.monotonic()
                yield from messages.restore_responses(opened, manifest, location=self._pipeline.store.location)
        committed.log_restored(run, opened, time.monotonic() - started)

    @grpc_errors
    def RestoreFiles(
        self, request: pb.RestoreFilesRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.RestoreFilesResponse | bytes]:
        """The header, then the chunks (serialized already: see add_raw_handlers), or the staged files."""
        run = _reader_run(request.run, request.folder if request.export_dir else "", "RestoreFiles")
        folder = self._pipeline.folder(run, request.folder)
        store = self._pipeline.store
        asked = [(r.path, r.offset, r.length) for r in request.ranges]
        staging = self._pipeline.shared_memory
        root = staging.folder if staging is not None else None
        if request.stage and root is None:
            raise InvalidRequestError(
                "RestoreFiles: this daemon has no staging dir (shared memory is off): ask without stage"
            )
        with self._pipeline.retention.holding(folder):  # retention must not delete it mid-stream
            plan = files.plan(store, folder, run, request.export_dir, asked, request.header_only)
            started = time.monotonic()
            save = plan.save
            root_stat = os.stat(root) if root is not None else None
            yield pb.RestoreFilesResponse(
                header=pb.RestoreFilesHeader(
                    export_dir=save.export_dir, step=save.step, kind=to_wire(save.kind), path=store.location(save.path),
                    unix_seconds=save.created, local_dir=str(plan.local_dir or ""), payload_bytes=plan.payload_bytes,
                    files=[restore_file(f, plan.verified.get(f.path)) for f in plan.files],
                    staging_dir=str(root or ""), staging_device=root_stat.st_dev if root_stat else 0,
                    staging_inode=root_stat.st_ino if root_stat else 0,
                )
            )  # fmt: skip
            if request.stage and root is not None:
                with staged_files.staged(store, plan, root) as staged:
                    yield pb.RestoreFilesResponse(staged=pb.StagedFiles(dir=str(staged.dir), paths=staged.paths))
                    _until_ended(context, staged_files.HOLD_SECONDS)
                staged_files.log_staged(run, plan, staged, time.monotonic() - started)
                return
            for piece in files.pieces(store, plan):
                yield _chunk_response(piece)
        files.log_sent(run, plan, time.monotonic() - started)


def _reader_run(run: str, folder: str, call: str) -> str:
    """The request's run name, checked; "" allowed for a reader that names the folder (it registers nothing).

    Raises:
        InvalidRequestError: a bad run name, or none without a folder.
    """
    if run or not folder:
        return check_run_name(run)
    return ""
