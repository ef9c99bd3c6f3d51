"""The gRPC servicer: CheckpointService on top of Lanes and a Writer.

Requests are checked before any decision (bad input is refused, counted as
nothing and writes nothing); domain errors become statuses in one place,
`checkpointd.protocol.codes.grpc_errors`. The uploads themselves (template files,
snapshot chunks, the upload deadline) are read by `checkpointd.rpc.upload`.
"""

from __future__ import annotations

import logging
import math
import threading
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import grpc

from checkpointd.storage import local
from checkpointd.rpc import upload
from checkpointd.core.config import ServeConfig
from checkpointd.protocol.errors import InvalidRequestError, LimitExceededError, RunNotFoundError
from checkpointd.core.lane import Failed, SaveSpec, Skipped, Written
from checkpointd.protocol.kinds import SaveKind
from checkpointd.core.manifest import Manifest, VariableSpec
from checkpointd.core.numpy_state import NumpyEntry, NumpyPayload, NumpyStateSpec, check_payload
from checkpointd.protocol.names import check_run_name
from checkpointd.storage.local import resolve_export_dir
from checkpointd.core.ports import Writer
from checkpointd.core.retention import RetentionPolicy
from checkpointd.saves.budget import UploadBudget, default_staging_bytes
from checkpointd.saves.runs import Lanes
from checkpointd.saves.retention import Retention
from checkpointd.saves.shm import Segment, SharedMemory
from checkpointd.saves.restore import latest_response, restore_responses
from checkpointd.rpc.errors import grpc_errors
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc as pb_grpc

_LOGGER = logging.getLogger(__name__)

KIND_FROM_PB = {pb.SAVED_MODEL: SaveKind.SAVED_MODEL, pb.CHECKPOINT: SaveKind.CHECKPOINT}
KIND_TO_PB = {v: k for k, v in KIND_FROM_PB.items()}


class PhaseSink(Protocol):
    """Times the phases of accepted saves and counts their transports (`checkpointd.metrics.Metrics`)."""

    def observe_phase(self, kind: str, phase: str, seconds: float) -> None: ...

    def snapshot_received(self, kind: str, transport: str) -> None: ...


class _NoPhases:
    def observe_phase(self, kind: str, phase: str, seconds: float) -> None:
        pass

    def snapshot_received(self, kind: str, transport: str) -> None:
        pass


def variable_from_pb(v: pb.Variable) -> VariableSpec:
    return VariableSpec(v.key, v.checkpoint_key, v.dtype, tuple(v.shape))


def variable_to_pb(v: VariableSpec) -> pb.Variable:
    return pb.Variable(key=v.key, checkpoint_key=v.checkpoint_key, dtype=v.dtype, shape=v.shape)


def numpy_state_from_pb(header: pb.SaveHeader) -> NumpyStateSpec | None:
    if not header.HasField("numpy_state"):
        return None
    state = header.numpy_state
    entries = tuple(NumpyEntry(e.checkpoint_key, e.nbytes) for e in state.entries)
    return NumpyStateSpec(state.object_graph, entries)


def _check_folder(folder: str) -> str:
    try:
        return check_run_name(folder)
    except InvalidRequestError:
        raise InvalidRequestError(
            f"folder {folder!r} is invalid: like a run name, use 1-128 characters of "
            "A-Z a-z 0-9 . _ -, starting with a letter or digit"
        ) from None


def _segment_to_pb(segment: Segment | None) -> pb.SharedMemory | None:
    if segment is None:
        return None
    return pb.SharedMemory(path=str(segment.path), size=segment.size, offsets=segment.offsets)


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


class CheckpointServicer(pb_grpc.CheckpointServiceServicer):
    """Implements checkpointd.v1.CheckpointService."""

    def __init__(
        self,
        config: ServeConfig,
        lanes: Lanes,
        writer: Writer,
        phases: PhaseSink | None = None,
        retention: Retention | None = None,
        shared_memory: SharedMemory | None = None,
    ) -> None:
        self._config = config
        self._retention = retention or Retention(config.root, RetentionPolicy())
        self._lanes = lanes
        self._writer = writer
        self._phases = phases if phases is not None else _NoPhases()
        self._shm = shared_memory
        self._staging = config.state_dir / "staging"
        self._budget = UploadBudget(
            config.max_concurrent_uploads, config.max_staging_bytes or default_staging_bytes()
        )

    @grpc_errors
    def RegisterRun(self, request_iterator: Iterator[pb.RegisterRunRequest], context: grpc.ServicerContext) -> pb.RegisterRunResponse:
        header = upload.first(request_iterator, "header", "RegisterRun")
        run = check_run_name(header.run)
        folder = _check_folder(header.folder) if header.folder else run
        variables = [variable_from_pb(v) for v in header.variables]
        if header.template_bytes > self._config.max_template_bytes:
            raise LimitExceededError(
                f"template of {header.template_bytes} bytes exceeds the daemon's limit of "
                f"{self._config.max_template_bytes} (--max-template-bytes)"
            )
        started = time.monotonic()
        # Named like a save temp dir, so startup recovery removes it after a crash.
        staged = self._staging / f"{local.TMP_PREFIX}template-{uuid.uuid4().hex}"
        try:
            upload.receive_template(request_iterator, staged, header.template_bytes)
            manifest = self._writer.register(run, staged, variables, header.checkpoint_object_graph)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        self._lanes.register(run, manifest, folder)
        _LOGGER.info(
            "registered run=%s folder=%s variables=%d snapshot_bytes=%d template_bytes=%d in %.3fs",
            run, folder, len(manifest.variables), manifest.nbytes, header.template_bytes,
            time.monotonic() - started,
        )
        return pb.RegisterRunResponse(
            run=run,
            variables=[variable_to_pb(v) for v in manifest.variables],
            snapshot_bytes=manifest.nbytes,
            folder=folder,
        )

    @grpc_errors
    def Save(self, request_iterator: Iterator[pb.SaveRequest], context: grpc.ServicerContext) -> Iterator[pb.SaveResponse]:
        header = upload.first(request_iterator, "header", "Save")
        if header.kind not in KIND_FROM_PB:
            raise InvalidRequestError("Save: kind must be SAVED_MODEL or CHECKPOINT")
        kind = KIND_FROM_PB[header.kind]
        run = check_run_name(header.run)
        manifest = self._lanes.manifest(run)
        folder = self._lanes.folder(run)
        target = resolve_export_dir(self._config.root, folder, header.export_dir)
        numpy_state = numpy_state_from_pb(header)
        check_payload(
            manifest,
            [variable_from_pb(v) for v in header.variables],
            header.snapshot_bytes,
            numpy_state,
            self._config.max_snapshot_bytes,
        )
        if numpy_state is not None:
            from checkpointd.formats import numpy_files  # TensorFlow's protos parse the object graph

            numpy_files.check(numpy_state)
        # Reserved before the lane decides: past a limit the request is refused
        # like bad input, before anything is allocated or counted.
        with self._budget.reserve(header.snapshot_bytes, run) as release:
            yield from self._decide_and_save(
                header, run, kind, manifest, folder, target, numpy_state, request_iterator, context,
                release,
            )

    def _decide_and_save(
        self,
        header: pb.SaveHeader,
        run: str,
        kind: SaveKind,
        manifest: Manifest,
        folder: str,
        target: Path,
        numpy_state: NumpyStateSpec | None,
        request_iterator: Iterator[pb.SaveRequest],
        context: grpc.ServicerContext,
        release: Callable[[], None],
    ) -> Iterator[pb.SaveResponse]:
        spec = SaveSpec(kind, header.export_dir, header.blocking, header.step)
        asked = time.monotonic()
        decision = self._lanes.begin(
            run, spec, timeout=context.time_remaining(), is_active=context.is_active
        )
        if isinstance(decision, Skipped):
            _LOGGER.warning(
                "skipped run=%s kind=%s export_dir=%s step=%d: %s",
                run, kind.value, header.export_dir, header.step, decision.reason,
            )
            yield pb.SaveResponse(decision=pb.SaveDecision(accepted=False, reason=decision.reason))
            return
        accepted = time.monotonic()
        self._phases.observe_phase(kind.value, "queue", accepted - asked)
        outcome: Written | Failed = Failed("the client went away during the save")
        transport = "none"  # until the snapshot has arrived
        segment = None
        try:
            parts = [v.nbytes for v in manifest.variables]
            parts.append(header.snapshot_bytes - manifest.nbytes)  # the numpy state
            if header.shared_memory and self._shm is not None:
                segment = self._shm.segment(run, parts)  # safe: this save holds the lane
            yield pb.SaveResponse(
                decision=pb.SaveDecision(accepted=True, shared_memory=_segment_to_pb(segment))
            )
            # A phase is timed when it ends, failed or not, as save_duration is.
            timeout = self._config.upload_timeout_seconds
            chunks = upload.until(request_iterator, accepted + timeout, timeout)
            try:
                received, transport = upload.receive_snapshot(
                    chunks, header.snapshot_bytes, context, parts, segment
                )
                self._phases.snapshot_received(kind.value, transport)
            finally:
                chunks.close()  # stops its reader now, not when the generator is collected
                self._phases.observe_phase(kind.value, "transfer", time.monotonic() - accepted)
            # Again at write time: a symlink planted during the upload must not
            # redirect the save out of the run's folder.
            target = resolve_export_dir(self._config.root, folder, header.export_dir)
            writing = time.monotonic()
            variables, tail = received[:-1], received[-1]
            payload = NumpyPayload(numpy_state, tail) if numpy_state is not None else None
            try:
                with self._retention.holding(folder):  # no deletions in the folder meanwhile
                    bytes_written = self._writer.write(
                        run, kind, target, variables, step=header.step,
                        export_dir=header.export_dir, numpy_state=payload,
                    )
            finally:
                self._phases.observe_phase(kind.value, "write", time.monotonic() - writing)
            outcome = Written(str(target), bytes_written)
            self._retention.after_save(run, folder)
        except Exception as exc:
            outcome = Failed(str(exc) or type(exc).__name__)
            raise
        finally:
            if segment is not None:
                self._shm.release(run)  # idle again: may give way to another run's
            release()  # before the caller hears the result, so its next save fits
            self._lanes.finish(run, decision, outcome)
            seconds = time.time() - (decision.accepted_at or time.time())
            if isinstance(outcome, Written):
                _LOGGER.info(
                    "saved run=%s kind=%s export_dir=%s step=%d bytes=%d duration=%.3fs transport=%s",
                    run, kind.value, header.export_dir, header.step, outcome.bytes_written, seconds,
                    transport,
                )
            else:
                _LOGGER.warning(
                    "failed run=%s kind=%s export_dir=%s step=%d duration=%.3fs: %s",
                    run, kind.value, header.export_dir, header.step, seconds, outcome.error,
                )
        yield pb.SaveResponse(
            result=pb.SaveResult(
                path=outcome.path,
                bytes_written=outcome.bytes_written,
                duration_seconds=seconds,
                step=header.step,
                kind=header.kind,
            )
        )

    @grpc_errors
    def Flush(self, request: pb.FlushRequest, context: grpc.ServicerContext) -> pb.FlushResponse:
        runs = self._lanes.flush(request.run or None, _wait_seconds(request.timeout_seconds, "Flush"))
        return pb.FlushResponse(runs=runs)

    @grpc_errors
    def CloseRun(self, request: pb.CloseRunRequest, context: grpc.ServicerContext) -> pb.CloseRunResponse:
        self._lanes.close(check_run_name(request.run), _wait_seconds(request.timeout_seconds, "CloseRun"))
        if self._shm is not None:
            self._shm.drop(request.run)
        _LOGGER.info("closed run=%s", request.run)
        return pb.CloseRunResponse(run=request.run)

    @grpc_errors
    def GetStatus(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        runs = []
        for view in self._lanes.views(request.run or None):
            status = pb.RunStatus(
                run=view.run,
                state=view.state.value,
                saves_ok=view.stats.ok,
                saves_skipped=view.stats.skipped,
                saves_failed=view.stats.failed,
                last_error=view.stats.last_error,
            )
            if view.in_flight is not None:
                spec = view.in_flight.spec
                status.in_flight.CopyFrom(
                    pb.InFlightSave(
                        kind=KIND_TO_PB[spec.kind],
                        export_dir=spec.export_dir,
                        step=spec.step,
                        started_unix_seconds=view.in_flight.accepted_at or 0.0,
                        waiting=view.waiting,
                    )
                )
            if view.stats.last_success is not None:
                last = view.stats.last_success
                status.last_success.CopyFrom(
                    pb.LastSuccess(kind=KIND_TO_PB[last.kind], path=last.path, step=last.step, unix_seconds=last.at)
                )
            runs.append(status)
        return pb.StatusResponse(runs=runs, draining=self._lanes.draining)

    @grpc_errors
    def GetLatest(self, request: pb.LatestRequest, context: grpc.ServicerContext) -> pb.LatestResponse:
        run = check_run_name(request.run)
        if request.kind != pb.SAVE_KIND_UNSPECIFIED and request.kind not in KIND_FROM_PB:
            raise InvalidRequestError("GetLatest: kind must be unspecified, SAVED_MODEL or CHECKPOINT")
        kind = KIND_FROM_PB.get(request.kind)
        return latest_response(self._config.root, self._folder(run, request.folder), run, kind)

    def _folder(self, run: str, asked: str) -> str:
        """The folder to search: the one asked for, else the registered one, else the run's name."""
        if asked:
            return _check_folder(asked)
        try:
            return self._lanes.folder(run)
        except RunNotFoundError:
            return run  # not registered (yet, or since a restart): its default folder

    @grpc_errors
    def Restore(self, request: pb.RestoreRequest, context: grpc.ServicerContext) -> Iterator[pb.RestoreResponse]:
        run = check_run_name(request.run)
        manifest, folder = self._lanes.manifest(run), self._lanes.folder(run)
        with self._retention.holding(folder):  # retention must not delete it mid-stream
            yield from restore_responses(self._config.root, folder, run, request.export_dir, manifest)
