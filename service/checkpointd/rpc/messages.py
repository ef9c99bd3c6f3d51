"""Proto messages to domain values and back: the servicer's translations.

The one place the daemon builds or reads `checkpointd.v1` messages besides
the request-stream readers in `checkpointd.rpc.upload`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import PurePath

from checkpointd.core.checkpoint_spec import CheckpointRetention, CheckpointSpec, TensorSpec
from checkpointd.core.lane import LaneStats
from checkpointd.core.numpy_state import NumpyEntry, NumpyStateSpec
from checkpointd.core.ports import CheckpointValues, CommittedSave
from checkpointd.core.variable_manifest import Manifest, VariableSpec
from checkpointd.protocol import standby, wire
from checkpointd.protocol.errors import InvalidRequestError
from checkpointd.protocol.kinds import SaveKind, from_wire, to_wire
from checkpointd.protocol.names import checkpoint_prefix
from checkpointd.protocol.wire import variable_to_pb
from checkpointd.restores.committed import Opened
from checkpointd.saves.catalog import StoredRuns
from checkpointd.saves.pipeline import Decision, LocalSkip, Result, SaveRequest, TrainerDecided
from checkpointd.saves.requests import BaseOffer
from checkpointd.saves.runs import RunView
from checkpointd.transport.shm import Segment
from checkpointd.v1 import checkpointd_pb2 as pb

Location = Callable[[PurePath], str]  # Store.location: where clients are told a save is


def variable_from_pb(v: pb.Variable) -> VariableSpec:
    return VariableSpec(v.key, v.checkpoint_key, v.dtype, tuple(v.shape))


def numpy_state_from_pb(state: pb.NumpyState) -> NumpyStateSpec:
    entries = tuple(NumpyEntry(e.checkpoint_key, e.nbytes) for e in state.entries)
    return NumpyStateSpec(state.object_graph, entries)


def numpy_state_to_pb(spec: NumpyStateSpec) -> pb.NumpyState:
    return wire.numpy_state_to_pb(spec.object_graph, ((e.checkpoint_key, e.nbytes) for e in spec.entries))


def kind_from_pb(value: int, rpc: str, *, optional: bool = False) -> SaveKind | None:
    """A request's kind; InvalidRequestError for an unknown one (or UNSPECIFIED unless optional)."""
    if optional and value == pb.SAVE_KIND_UNSPECIFIED:
        return None
    kind = from_wire(value)
    if kind is None:
        names = ", ".join(k.name for k in SaveKind)
        raise InvalidRequestError(f"{rpc}: kind must be {'unspecified, ' if optional else ''}one of {names}")
    return kind


def training_checkpoint_from_pb(message: pb.TrainingCheckpoint) -> CheckpointSpec:
    return CheckpointSpec(
        message.object_graph,
        tuple(TensorSpec(t.checkpoint_key, t.dtype, tuple(t.shape), t.nbytes) for t in message.tensors),
        CheckpointRetention.from_wire(message.max_to_keep, message.keep_checkpoint_every_n_hours),
    )


def save_header_request(header: bytes) -> SaveRequest:
    """A serialized SaveHeader (a standby slot's record), decoded as `save_request` does.

    Raises:
        InvalidRequestError: it does not parse, or is no valid header.
    """
    return save_request(standby.header_message(header))


def save_request(header: pb.SaveHeader) -> SaveRequest:
    kind = kind_from_pb(header.kind, "Save")
    assert kind is not None
    checkpoint, export_dir = None, header.export_dir
    training = kind is SaveKind.TRAINING_CHECKPOINT
    if header.HasField("training_checkpoint") != training:
        raise InvalidRequestError("Save: training_checkpoint is set with, and only with, kind TRAINING_CHECKPOINT")
    if training:
        checkpoint = training_checkpoint_from_pb(header.training_checkpoint)
        # The header names the checkpoint's dir; the save is its prefix ckpt-<step> there.
        export_dir = checkpoint_prefix(header.export_dir, header.step)
    held = None
    blocking = header.blocking or header.on_notice  # a save on notice is never skipped
    if header.HasField("held"):
        if blocking:
            raise InvalidRequestError("Save: held is for non-blocking saves only; send a blocking save without it")
        if not header.held.segment_path or not header.held.lock_path:
            raise InvalidRequestError("Save: held needs the segment_path and lock_path the daemon offered")
        held = TrainerDecided(header.held.segment_path, header.held.lock_path)
    return SaveRequest(
        run=header.run,
        kind=kind,
        export_dir=export_dir,
        blocking=blocking,
        step=header.step,
        variables=tuple(variable_from_pb(v) for v in header.variables),
        snapshot_bytes=header.snapshot_bytes,
        numpy_state=numpy_state_from_pb(header.numpy_state) if header.HasField("numpy_state") else None,
        shared_memory=header.shared_memory,
        checkpoint=checkpoint,
        trainer_decided=held,
        local_skips=local_skips(header.local_skips, "Save"),
        incremental=header.incremental,
        on_notice=header.on_notice,
        notice_unix_seconds=header.notice_unix_seconds if header.on_notice else 0.0,
        trainer_versions=trainer_versions(header.trainer_versions),
    )


# SaveHeader.trainer_versions: a few names and versions, recorded in every manifest.
MAX_TRAINER_VERSIONS = 16
MAX_VERSION_CHARS = 128


def trainer_versions(versions: Mapping[str, str]) -> dict[str, str]:
    """A Save header's trainer_versions; InvalidRequestError past the limits the proto states."""
    if len(versions) > MAX_TRAINER_VERSIONS or any(
        not k or len(k) > MAX_VERSION_CHARS or len(v) > MAX_VERSION_CHARS for k, v in versions.items()
    ):
        raise InvalidRequestError(
            f"Save: trainer_versions takes at most {MAX_TRAINER_VERSIONS} entries, each a non-empty name and a "
            f"version of at most {MAX_VERSION_CHARS} characters"
        )
    return dict(versions)


def local_skips(skips: Sequence[pb.LocalSkip], rpc: str) -> tuple[LocalSkip, ...]:
    """A request's local_skips; InvalidRequestError for one of an unknown kind."""
    out = []
    for skip in skips:
        kind = kind_from_pb(skip.kind, f"{rpc}: local_skips")
        assert kind is not None
        out.append(LocalSkip(kind, skip.export_dir, skip.step))
    return tuple(out)


def _segment_to_pb(segment: Segment | None, lock_path: str) -> pb.SharedMemory | None:
    if segment is None:
        return None
    return pb.SharedMemory(path=str(segment.path), size=segment.size, offsets=segment.offsets, lock_path=lock_path)


def save_response(event: Decision | Result) -> pb.SaveResponse:
    if isinstance(event, Decision):
        return pb.SaveResponse(
            decision=pb.SaveDecision(
                accepted=event.accepted,
                reason=event.reason,
                shared_memory=_segment_to_pb(event.segment, event.lock_path),
                base=_base_to_pb(event.base),
            )
        )
    return pb.SaveResponse(
        result=pb.SaveResult(
            path=event.path,
            bytes_written=event.bytes_written,
            duration_seconds=event.duration_seconds,
            step=event.step,
            kind=to_wire(event.kind),
            bytes_received=event.bytes_received,
            bytes_copied=event.bytes_copied,
            incremental_path=event.incremental_path,
        )
    )


def _base_to_pb(base: BaseOffer | None) -> pb.IncrementalBase | None:
    if base is None:
        return None
    return pb.IncrementalBase(
        export_dir=base.export_dir,
        chunk_bytes=base.chunk_bytes,
        parts=[pb.PartDigests(chunk_crc32c=crcs) for crcs in base.parts],
    )


def register_response(run: str, folder: str, manifest: Manifest) -> pb.RegisterRunResponse:
    return pb.RegisterRunResponse(
        run=run,
        variables=[variable_to_pb(v) for v in manifest.variables],
        snapshot_bytes=manifest.nbytes,
        folder=folder,
    )


def run_status(view: RunView) -> pb.RunStatus:
    stats: LaneStats = view.stats
    status = pb.RunStatus(
        run=view.run,
        state=view.state.value,
        saves_ok=stats.ok,
        saves_skipped=stats.skipped,
        saves_failed=stats.failed,
        saves_cancelled=stats.cancelled,
        last_error=stats.last_error,
    )
    if view.in_flight is not None:
        spec = view.in_flight.spec
        status.in_flight.CopyFrom(
            pb.InFlightSave(
                kind=to_wire(spec.kind),
                export_dir=spec.export_dir,
                step=spec.step,
                started_unix_seconds=view.in_flight.accepted_at or 0.0,
                waiting=view.waiting,
            )
        )
    if stats.last_success is not None:
        last = stats.last_success
        status.last_success.CopyFrom(
            pb.LastSuccess(
                kind=to_wire(last.kind),
                path=last.path,
                step=last.step,
                unix_seconds=last.at,
                bytes_received=last.bytes_received,
                bytes_copied=last.bytes_copied,
            )  # fmt: skip
        )
    return status


def add_stored_runs(response: pb.StatusResponse, found: StoredRuns, location: Location = str) -> None:
    """Fills a status response's stored runs (StatusRequest.stored); `location` says where a save is (Store.location)."""
    for stored in found.runs:
        save = stored.newest
        entry = response.stored_runs.add(
            folder=stored.folder,
            run=stored.run,
            saves=stored.saves,
            kind=to_wire(save.kind),
            export_dir=save.export_dir,
            step=save.step,
            unix_seconds=save.created,
            path=location(save.path),
        )
        if stored.holder is not None:
            entry.lease_holder = stored.holder
    response.stored_truncated = found.truncated
    response.stored_folders = found.folders


def latest_response(
    save: CommittedSave | None, checkpoints: Sequence[CommittedSave] = (), location: Location = str
) -> pb.LatestResponse:
    if save is None:
        return pb.LatestResponse(found=False)
    return pb.LatestResponse(
        found=True,
        path=location(save.path),
        export_dir=save.export_dir,
        step=save.step,
        kind=to_wire(save.kind),
        unix_seconds=save.created,
        checkpoints=[c.export_dir for c in checkpoints],
    )


def restore_responses(
    opened: Opened, manifest: Manifest, chunk_bytes: int = wire.CHUNK_BYTES, *, location: Location = str
) -> Iterator[pb.RestoreResponse]:
    """Restore's answer, streamed the way a Save's snapshot arrives.

    A header naming the variables (the run's manifest order) and the numpy
    state, then the payload as Chunks of at most `chunk_bytes`, each with its
    CRC32C, at offsets over the whole payload.
    """
    save, values = opened.save, opened.values
    header = pb.RestoreHeader(
        export_dir=save.export_dir,
        step=save.step,
        kind=to_wire(save.kind),
        variables=[variable_to_pb(v) for v in manifest.variables],
        snapshot_bytes=values.nbytes,
        path=location(save.path),
        unix_seconds=save.created,
    )
    if values.numpy_state is not None:
        header.numpy_state.CopyFrom(numpy_state_to_pb(values.numpy_state))
    # Only a training checkpoint's values describe themselves (CheckpointValues).
    checkpoint = values.checkpoint if isinstance(values, CheckpointValues) else None
    if checkpoint is not None:
        header.training_checkpoint.CopyFrom(wire.training_checkpoint_to_pb(checkpoint.object_graph, checkpoint.tensors))
    yield pb.RestoreResponse(header=header)
    for chunk in wire.chunks(values.pieces(), chunk_bytes):
        yield pb.RestoreResponse(chunk=chunk)
