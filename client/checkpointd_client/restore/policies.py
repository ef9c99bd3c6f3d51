"""A restarted trainer's side of GetLatest and Restore.

`latest` asks the daemon for a run's newest committed save; it needs no
registration, so it works right after a trainer or daemon restart. `restore_policy`
registers the run, takes the save's files (`checkpointd_client.restore.files`: read in
place on the daemon's host, else fetched into memory, each checked against its
manifest's CRC32C), reads the values with TensorFlow's own reader, checks them
against the policy's variables, and only then assigns them into the live
variables (policy, train_step, metadata) and the NumpyState: a broken stream
changes nothing. A daemon without RestoreFiles streams the values instead
(Restore), checked chunk by chunk, assigned once all have arrived.
"""

from __future__ import annotations

import io
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc
import numpy as np
import tensorflow as tf

from checkpointd.protocol import wire
from checkpointd.protocol.errors import ChecksumError, InvalidRequestError, RunNotFoundError, SaveFailedError, describe
from checkpointd.protocol.kinds import SaveKind, from_wire, to_wire
from checkpointd.protocol.names import check_export_dir
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc
from checkpointd_client import numpy_state as numpy_state_lib
from checkpointd_client import snapshot
from checkpointd_client.restore import files
from checkpointd_client.transport.session import DaemonSession
from checkpointd_client.transport.stream import rpc_error

_LOGGER = logging.getLogger(__name__)

OBJECT_GRAPH_KEY = files.OBJECT_GRAPH_KEY
# A policy save's checkpoints, relative to its dir.
VARIABLES_PREFIX = os.path.join("variables", "variables")
NUMPY_PREFIX = os.path.join("numpy_state", "numpy_state")

RegisterTemplate = Callable[..., snapshot.Bindings]  # RemotePolicySaver._register_template(stale=None)
Assign = Callable[[snapshot.Bindings, list[np.ndarray]], None]


@dataclass(frozen=True)
class LatestSave:
    """A committed save on the daemon.

    Attributes:
        path: the save dir on the daemon's host.
        export_dir: relative to the run's folder, as `save()` and `restore()` take it.
        step: the train step in the save.
        kind: SAVED_MODEL (`save()`) or CHECKPOINT (`save_checkpoint()`).
        unix_seconds: when the daemon committed it.
        numpy_arrays: after `restore()`, the NumpyState arrays the save held
            (attribute name -> array); empty from `latest()`.
    """

    path: str
    export_dir: str
    step: int
    kind: SaveKind
    unix_seconds: float
    numpy_arrays: Mapping[str, np.ndarray] = field(default_factory=dict)


def latest(daemon: DaemonSession, kind: SaveKind | None, folder: str | None) -> LatestSave | None:
    """The run's newest committed save, or None (see RemotePolicySaver.latest)."""
    request = pb.LatestRequest(
        run=daemon.run, kind=to_wire(kind) if kind is not None else pb.SAVE_KIND_UNSPECIFIED, folder=folder or ""
    )
    with daemon.calling(f"looking up run {daemon.run!r}'s newest save"):
        response = daemon.stub.GetLatest(request, timeout=daemon.timeout)
    if not response.found:
        return None
    return LatestSave(response.path, response.export_dir, response.step, _kind(response.kind), response.unix_seconds)


def restore_policy(
    daemon: DaemonSession,
    export_dir: str | None,
    register_template: RegisterTemplate,
    numpy_source: numpy_state_lib.NumpySource | None,
    folder: str | None,
    assign: Assign | None = None,
) -> LatestSave:
    """Fetches a save and assigns it (see RemotePolicySaver.restore).

    `assign` sets the variables (a graph-mode policy's `GraphReads.assign`);
    None assigns each one eagerly.
    """
    started = time.monotonic()
    run, timeout = daemon.run, daemon.timeout
    doing = f"restoring run {run!r}"
    with daemon.calling(doing):
        bindings = register_template()
    if export_dir is None:
        found = latest(daemon, None, folder)
        if found is None:
            raise RunNotFoundError(f"run {run!r} has no committed save on the daemon to restore")
        export_dir = found.export_dir
    check_export_dir(export_dir)
    with daemon.calling(doing):
        try:
            fetched: files.Fetched | None = files.fetch_whole(
                daemon.files_stub, run, export_dir, timeout, folder=folder or ""
            )
        except grpc.RpcError as e:
            if rpc_error(e)[0] != grpc.StatusCode.UNIMPLEMENTED:
                raise
            fetched = None  # a daemon without RestoreFiles: its tensor stream, below
    if fetched is not None:
        sent = fetched.header
        try:
            read, saved_arrays = _read_files(fetched.prefix, bindings, _kind(sent.kind), repr(sent.export_dir))
        finally:
            fetched.close()
        _assign(bindings, read, saved_arrays, numpy_source, assign)
        _LOGGER.info(
            "run %s: restored %s %r of step %s (%s, %d bytes received, %.2f s)",
            run, _kind(sent.kind).value, sent.export_dir, sent.step,
            "in place" if fetched.in_place else "fetched", fetched.received, time.monotonic() - started,
        )  # fmt: skip
        return LatestSave(sent.path, sent.export_dir, sent.step, _kind(sent.kind), sent.unix_seconds, saved_arrays)
    request = pb.RestoreRequest(run=run, export_dir=export_dir)
    current = [bindings]

    def register_again() -> None:
        current[0] = register_template(stale=current[0])

    # NOT_FOUND is a missing save or a daemon that forgot the run
    # (restarted): only the second is fixed by registering again.
    header, payload = daemon.retrying_lost_run(
        lambda: fetch_tensors(daemon.stub, request, timeout), register_again, doing, lost=lambda: not _known(daemon)
    )
    bindings = current[0]
    bindings = bindings.ordered(header.variables)
    values = _split(bindings, payload)
    arrays: dict[str, np.ndarray] = {}
    if header.HasField("numpy_state"):
        arrays = numpy_state_lib.arrays(header.numpy_state, payload[sum(a.nbytes for a in values) :])
    _assign(bindings, values, arrays, numpy_source, assign)
    _LOGGER.info(
        "run %s: restored %s %r of step %s (%s bytes, %.2f s)",
        run,
        _kind(header.kind).value,
        header.export_dir,
        header.step,
        len(payload),
        time.monotonic() - started,
    )
    return LatestSave(header.path, header.export_dir, header.step, _kind(header.kind), header.unix_seconds, arrays)


def _assign(
    bindings: snapshot.Bindings,
    values: list[np.ndarray],
    arrays: dict[str, np.ndarray],
    numpy_source: numpy_state_lib.NumpySource | None,
    assign: Assign | None,
) -> None:
    if assign is not None:
        assign(bindings, values)
    else:
        for binding, value in zip(bindings.variables, values, strict=True):
            binding.variable.assign(value)
    if numpy_source is not None:
        numpy_state_lib.assign(numpy_source.state, arrays)


def _read_files(
    base: str, bindings: snapshot.Bindings, kind: SaveKind, where: str
) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    """Each bound variable's value and the numpy state's arrays, read by TensorFlow from a save's files.

    Raises:
        InvalidRequestError: the save's variables are not the policy's (naming the first key).
        ChecksumError: a tensor is corrupt.
    """
    try:
        reader = tf.train.load_checkpoint(os.path.join(base, VARIABLES_PREFIX))
        shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
        keys = [b.key if kind is SaveKind.SAVED_MODEL else b.checkpoint_key for b in bindings.variables]
        for key, b in zip(keys, bindings.variables, strict=True):
            if key not in shapes:
                raise InvalidRequestError(f"{where}: the save has no {key!r}; was it written by another policy?")
            if dtypes[key].name != b.dtype or tuple(shapes[key]) != tuple(b.shape):
                raise InvalidRequestError(
                    f"{where}: {key!r} is {dtypes[key].name}{list(shapes[key])} in the save; the policy has "
                    f"{b.dtype}{list(b.shape)}"
                )
        extra = set(shapes) - set(keys) - {OBJECT_GRAPH_KEY}
        if extra:
            raise InvalidRequestError(f"{where}: the save has {min(extra)!r}, which the policy lacks")
        values = [np.asarray(reader.get_tensor(key)) for key in keys]
        arrays: dict[str, np.ndarray] = {}
        numpy_prefix = os.path.join(base, NUMPY_PREFIX)
        if os.path.exists(numpy_prefix + files.INDEX_SUFFIX):
            numpy_reader = tf.train.load_checkpoint(numpy_prefix)
            for key, name in numpy_state_lib.names(numpy_reader.get_tensor(OBJECT_GRAPH_KEY)).items():
                arrays[name] = np.load(io.BytesIO(numpy_reader.get_tensor(key)), allow_pickle=False)
    except tf.errors.DataLossError as e:
        raise ChecksumError(f"{where} is corrupt: {describe(e)}") from None
    return values, arrays


def _kind(value: int) -> SaveKind:
    kind = from_wire(value)
    if kind is None:
        raise SaveFailedError(f"the daemon answered a save of unknown kind {value}")
    return kind


def _known(daemon: DaemonSession) -> bool:
    """Whether the daemon has the run registered (GetStatus answers NOT_FOUND if not)."""
    try:
        daemon.stub.GetStatus(pb.StatusRequest(run=daemon.run), timeout=daemon.timeout)
    except grpc.RpcError as e:
        if rpc_error(e)[0] == grpc.StatusCode.NOT_FOUND:
            return False
        raise daemon.domain_error(e, f"looking up run {daemon.run!r}") from e
    return True


def fetch_tensors(
    stub: checkpointd_pb2_grpc.CheckpointServiceStub, request: pb.RestoreRequest, timeout: float | None
) -> tuple[pb.RestoreHeader, memoryview]:
    """The header and the whole checked payload of one Restore call.

    Raises:
        grpc.RpcError: the status that ended the call.
        ChecksumError: a chunk's CRC32C does not match.
        SaveFailedError: the daemon broke the protocol.
    """
    responses = stub.Restore(request, timeout=timeout)
    try:
        first = next(responses, None)
        if first is None or first.WhichOneof("item") != "header":
            raise SaveFailedError("the daemon's Restore answer did not start with a header")
        header = first.header
        buffer = bytearray(header.snapshot_bytes)
        received = 0
        for response in responses:
            if response.WhichOneof("item") != "chunk":
                raise SaveFailedError(f"Restore: expected a chunk at offset {received}")
            chunk = response.chunk
            try:
                wire.check_chunk(chunk, received, len(buffer), "Restore")
            except InvalidRequestError as e:  # the daemon's answer is bad, not our request
                raise SaveFailedError(str(e)) from None
            buffer[received : received + len(chunk.data)] = chunk.data
            received += len(chunk.data)
        if received != len(buffer):
            raise SaveFailedError(f"Restore: the stream ended after {received} of {len(buffer)} bytes")
    finally:
        responses.cancel()  # a no-op once the call has ended
    return header, memoryview(buffer)


def _split(bindings: snapshot.Bindings, payload: memoryview) -> list[np.ndarray]:
    """Each bound variable's value, read from its bytes at the front of the payload."""
    values, offset = [], 0
    for b in bindings.variables:
        dtype = np.dtype(tf.as_dtype(b.dtype).as_numpy_dtype)
        count = int(np.prod(b.shape, dtype=np.int64))
        if count == 0:
            values.append(np.zeros(b.shape, dtype))
            continue
        # Wire order is little-endian, native on every platform TF ships for.
        values.append(np.frombuffer(payload, dtype, count, offset).reshape(b.shape))
        offset += count * dtype.itemsize
    return values
