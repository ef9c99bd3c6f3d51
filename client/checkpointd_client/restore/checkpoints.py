"""RemoteCheckpointer's restore: TensorFlow's own restore over the save's files.

The files come from `checkpointd_client.restore.files` (read in place on the
daemon's host, else fetched into memory, only the tensors under the
checkpoint's own children when it holds more). `tf.train.Checkpoint.restore`
reads them, so its semantics are TensorFlow's: deferred restoration of
objects created later, NumPy state, the status object and its assertions.
A checkpoint whose tensors do not fit the live objects' is refused first,
naming the first key that differs. A fetched copy is deleted at once when
every value found its object, else kept for the deferred ones until the
checkpointer closes.

A daemon without RestoreFiles is restored from as before: its tensors
re-encoded into a private local checkpoint (`tf_checkpoint.LocalCopy`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import grpc
import tensorflow as tf

from checkpointd.protocol.errors import ChecksumError, InvalidRequestError, describe
from checkpointd.protocol.kinds import SaveKind, to_wire
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client import tf_checkpoint
from checkpointd_client.restore import bundle_index, files
from checkpointd_client.restore.policies import fetch_tensors
from checkpointd_client.transport.session import DaemonSession
from checkpointd_client.transport.stream import rpc_error

_LOGGER = logging.getLogger(__name__)

KeptFiles = tf_checkpoint.LocalCopy | files.Fetched


@dataclass(frozen=True)
class Restored:
    """A restore's outcome.

    Attributes:
        status: TensorFlow's restore status.
        copy: the files TensorFlow may still read for deferred objects (close
            them when done), or None.
        received: file bytes received over the connection.
        in_place: True if the files were read where the daemon keeps them.
    """

    status: Any
    copy: KeptFiles | None
    received: int
    in_place: bool


def restore(
    daemon: DaemonSession,
    checkpoint: tf.train.Checkpoint,
    children: Collection[str],
    export_dir: str,
    folder: str,
    *,
    in_place: bool = True,
) -> Restored:
    """Restores `checkpoint` from the run's save at `export_dir`.

    Args:
        daemon: the run's session.
        checkpoint: the live objects.
        children: the names of the checkpoint's children (what to fetch).
        export_dir: the save.
        folder: the run's folder ("" for the registered one).
        in_place: whether files the daemon keeps on this host may be read there.

    Raises:
        InvalidRequestError: the save is no training checkpoint, or its
            tensors do not fit the live objects'.
        ChecksumError: a file is corrupt, or was replaced.
        CheckpointdError: another status the daemon answered.
    """
    started = time.monotonic()
    with daemon.calling(f"restoring run {daemon.run!r}"):
        try:
            fetched = files.fetch(
                daemon.files_stub,
                daemon.run,
                export_dir,
                daemon.timeout,
                folder=folder,
                children=children,
                in_place=in_place,
            )
        except grpc.RpcError as e:
            if rpc_error(e)[0] != grpc.StatusCode.UNIMPLEMENTED:
                raise
            return _restore_tensors(daemon, checkpoint, export_dir)  # a daemon without RestoreFiles
    try:
        if fetched.header.kind != to_wire(SaveKind.TRAINING_CHECKPOINT):
            raise InvalidRequestError(f"{export_dir!r} is a {fetched.header.kind} save, not a training checkpoint")
        _check_structure(checkpoint, fetched, repr(export_dir))
        try:
            status = checkpoint.restore(fetched.prefix)
        except tf.errors.DataLossError as e:
            raise ChecksumError(f"{export_dir!r} is corrupt or was replaced: {describe(e)}") from None
    except BaseException:
        fetched.close()
        raise
    kept: KeptFiles | None = fetched
    try:
        status.assert_consumed()  # every value found its object: none is left to defer
        fetched.close()
        kept = None
    except AssertionError:
        pass  # TensorFlow reads the rest when the objects it is for are created
    _LOGGER.info(
        "run %s: restored %r (step %d, %s, %d bytes received, %.2f s)",
        daemon.run, export_dir, fetched.header.step, "in place" if fetched.in_place else "fetched",
        fetched.received, time.monotonic() - started,
    )  # fmt: skip
    return Restored(status, kept, fetched.received, fetched.in_place)


def _check_structure(checkpoint: tf.train.Checkpoint, fetched: files.Fetched, where: str) -> None:
    """Refuses a save whose tensors do not fit the live objects' (tf_checkpoint.check_structure), matched by graph.

    The live objects are matched to the saved ones as TensorFlow will match
    them, so a subset of what was saved (a policy out of a whole training
    state, under other keys there) fits.
    """
    live = tf_checkpoint.describe(checkpoint)
    locations = bundle_index.locations(fetched.index)
    graph_at = locations.get(files.OBJECT_GRAPH_KEY)
    if graph_at is None:
        raise InvalidRequestError(f"{where} has no {files.OBJECT_GRAPH_KEY}: not a TF2 checkpoint")
    graph = bundle_index.string_value(fetched.read(graph_at))
    tensors = []
    for key, saved_key in bundle_index.counterpart_keys(live.object_graph, graph).items():
        at = locations.get(saved_key) if saved_key is not None else None
        if at is not None:
            tensors.append(pb.Tensor(checkpoint_key=key, dtype=tf.as_dtype(at.dtype).name, shape=at.shape))
    tf_checkpoint.check_structure(live, pb.TrainingCheckpoint(tensors=tensors), where)


def _restore_tensors(daemon: DaemonSession, checkpoint: tf.train.Checkpoint, export_dir: str) -> Restored:
    started = time.monotonic()
    request = pb.RestoreRequest(run=daemon.run, export_dir=export_dir)
    with daemon.calling(f"restoring run {daemon.run!r}"):
        header, payload = fetch_tensors(daemon.stub, request, daemon.timeout)
    if not header.HasField("training_checkpoint"):
        raise InvalidRequestError(f"{export_dir!r} is a {header.kind} save, not a training checkpoint")
    saved = header.training_checkpoint
    tf_checkpoint.check_structure(tf_checkpoint.describe(checkpoint), saved, repr(export_dir))
    copy = tf_checkpoint.LocalCopy(saved, payload)
    try:
        status = checkpoint.restore(copy.prefix)
    except BaseException:
        copy.close()
        raise
    _LOGGER.info(
        "run %s: restored %r (step %d, %d tensors, %d bytes, %.2f s)",
        daemon.run, export_dir, header.step, len(saved.tensors), len(payload), time.monotonic() - started,
    )  # fmt: skip
    return Restored(status, copy, len(payload), False)
