"""A tf.train.Checkpoint's state as TensorFlow's saver would write it: described, copied, restored.

`describe` runs TensorFlow's own save path up to the write
(`save_util.serialize_graph_view`, what `Checkpoint.write` runs): it names
every tensor by its checkpoint key, in the saver's order (each trackable's
tensors in object-graph order, Python state after the rest), serializes
Python state (NumpyState arrays, py metrics) as TensorFlow does, and builds
the object graph proto. Nothing here knows an agent, a replay buffer or a
metric: whatever `tf.train.Checkpoint` can save is described the same way.

`TrainingState.copy` then takes the values at that instant, as host memory:
each variable read and copied (large ones in parallel pieces), into arrays
of a previous save or straight into the daemon's shared-memory segment;
Python state is already bytes. Values changed after the call are not in it.
Into a segment that holds the previous snapshot, only the rows of a replay
buffer's table written since are copied (`checkpointd_client.delta`).

`restore_into` assigns a checkpoint fetched from the daemon through
TensorFlow's own restore (`tf.train.Checkpoint.restore` over a local copy of
the checkpoint), so it does what an in-process `Checkpointer` does: every
variable, optimizer slots and NumPy state included; objects created later
(slots of an optimizer that has not built them yet) are restored when they
are created. A checkpoint of another structure is refused first, naming
the first key that differs.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.checkpoint import graph_view, save_util
from tensorflow.python.training.saving import saveable_object

from checkpointd.protocol import tensors as tensor_names
from checkpointd.protocol import wire
from checkpointd.protocol.errors import InvalidRequestError
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client.snapshot import copy_all, read_variable

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tensor:
    """One tensor of the checkpoint: its key, dtype name, shape and payload size.

    `source` is where its value comes from at copy time: a live variable, or
    (Python state, tensors an object computes) the value already taken.
    """

    checkpoint_key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    source: Any


@dataclass(frozen=True)
class TrainingState:
    """What one save of a tf.train.Checkpoint holds, described at one instant."""

    object_graph: bytes
    tensors: tuple[Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def layout(self) -> tuple[tuple[str, str, tuple[int, ...], int], ...]:
        """What a save's buffers depend on: equal layouts can reuse each other's arrays."""
        return tuple((t.checkpoint_key, t.dtype, t.shape, t.nbytes) for t in self.tensors)

    def to_proto(self, max_to_keep: int | None, keep_hours: float | None) -> pb.TrainingCheckpoint:
        return wire.training_checkpoint_to_pb(self.object_graph, self.tensors, max_to_keep, keep_hours)

    def copy(
        self,
        into: Sequence[memoryview] | None = None,
        *,
        strings: bool = False,
        rows: Mapping[int, Sequence[tuple[int, int]]] | None = None,
    ) -> list[memoryview]:
        """Every value's bytes now, in tensor order: numeric ones copied, Python state as taken.

        Args:
            into: one writable buffer per tensor to copy numeric values into
                (a previous save's buffers of the same layout, or views of a
                shared-memory segment); None allocates.
            strings: copy Python state into `into` too (a segment the
                daemon reads every part from); else its bytes are used as
                they are.
            rows: tensor index -> the [start, stop) ranges of its first
                dimension to copy into `into`, whose other rows already
                hold the value (`checkpointd_client.delta` says when);
                tensors not in it are copied whole.

        Raises:
            ValueError: `rows` without `into`.
        """
        if rows and into is None:
            raise ValueError("copying some rows needs the buffers that hold the others (into=)")
        rows = rows or {}
        pairs: list[tuple[np.ndarray, np.ndarray]] = []
        out: list[memoryview] = []
        for i, t in enumerate(self.tensors):
            if tensor_names.is_string(t.dtype):
                if strings and into is not None:
                    into[i][: t.nbytes] = t.source
                    out.append(into[i][: t.nbytes])
                else:
                    out.append(memoryview(t.source))
                continue
            dtype = np.dtype(tf.as_dtype(t.dtype).as_numpy_dtype)
            target = None
            if into is not None:
                target = np.frombuffer(into[i], dtype, math.prod(t.shape)).reshape(t.shape)
            else:
                target = np.empty(t.shape, dtype)
            out.append(wire.byte_view(target))
            ranges = rows.get(i)
            if ranges is not None and not ranges:
                continue  # nothing written since: not even read
            if ranges is None:
                value = np.asarray(read_variable(t.source)) if isinstance(t.source, tf.Variable) else t.source
                pairs.append((target, value))
            elif isinstance(t.source, tf.Variable):
                # Gathered, not read: a variable a sparse op wrote (a replay buffer's table) is in
                # TensorFlow's copy-on-read mode, where a dense read copies all of it first.
                gathered = np.asarray(t.source.sparse_read(np.concatenate([np.arange(*r) for r in ranges])))
                at = 0
                for start, stop in ranges:
                    pairs.append((target[start:stop], gathered[at : at + stop - start]))
                    at += stop - start
            else:
                pairs += [(target[start:stop], t.source[start:stop]) for start, stop in ranges]
        copy_all(pairs)
        return out


def describe(root: tf.train.Checkpoint) -> TrainingState:
    """What `root.write()` would write now: keys, dtypes, shapes, and Python state serialized.

    Raises:
        ValueError: something TensorFlow would save that the daemon cannot
            carry: a registered saver (DTensor), a sliced (partitioned)
            variable, an uninitialized variable, a non-scalar string or an
            unsupported dtype; the message names the key.
    """
    return describe_with_owners(root)[0]


def describe_with_owners(root: tf.train.Checkpoint) -> tuple[TrainingState, tuple[Any, ...]]:
    """`describe(root)`, with the trackable each tensor came from, in tensor order (`described_graph` needs it)."""
    serialized, _, registered, graph = save_util.serialize_graph_view(graph_view.ObjectGraphView(root))
    if registered:
        raise ValueError(f"objects with registered savers ({', '.join(registered)}) cannot be saved by checkpointd")
    described: list[Tensor] = []
    owners: list[Any] = []
    # The dict's order is the saver's: tensor trackables in object-graph
    # (breadth-first) order, then Python state. Its write keeps that order.
    for trackable, tensor_dict in serialized.items():
        for key, maybe in tensor_dict.items():
            if isinstance(maybe, dict):
                if list(maybe) != [""]:
                    raise ValueError(
                        f"{key!r} is saved in slices ({list(maybe)}); partitioned variables are not supported"
                    )
                maybe = maybe[""]
            described.append(tensor(key, trackable, maybe))
            owners.append(trackable)
    return TrainingState(graph.SerializeToString(), tuple(described)), tuple(owners)


def tensor(key: str, trackable: Any, maybe: Any) -> Tensor:
    """The described tensor of `key`, which `trackable`'s serialization gave as `maybe` (a SaveSpec or a value)."""
    variable = trackable if isinstance(trackable, tf.Variable) and key.endswith(tensor_names.VARIABLE_SUFFIX) else None
    if variable is not None and isinstance(maybe, saveable_object.SaveSpec):
        # Read at copy time, without the tensor TF's callable would make.
        if not variable.is_initialized():
            raise ValueError(f"variable {key!r} is not initialized; TensorFlow would not save it either")
        dtype, shape = variable.dtype, variable.shape
        source: Any = variable
    else:
        value = maybe.tensor if isinstance(maybe, saveable_object.SaveSpec) else maybe
        if value is None:
            raise ValueError(f"{key!r} has no value (an uninitialized variable?)")
        value = tf.convert_to_tensor(value)
        dtype, shape = value.dtype, value.shape
        if dtype == tf.string:
            if shape.rank != 0:
                raise ValueError(f"{key!r} is a string tensor of shape {shape}; only scalar strings are carried")
            data = value.numpy()  # a NumpyState array's .npy bytes, taken now
            return Tensor(key, tensor_names.STRING, (), len(data), data)
        source = np.array(value)  # a value the object computed now: copied now
    name = dtype.name
    if name not in tensor_names.ITEMSIZE:
        raise ValueError(f"{key!r} has dtype {name}; checkpointd carries {', '.join(sorted(tensor_names.ITEMSIZE))}")
    if not shape.is_fully_defined():
        raise ValueError(f"{key!r} has a partly unknown shape {shape}")
    dims = tuple(shape.as_list())
    return Tensor(key, name, dims, tensor_names.nbytes(name, dims), source)


def is_string(t: Tensor) -> bool:
    """Whether a tensor is Python state (a scalar string), bytes already taken at describe()."""
    return tensor_names.is_string(t.dtype)


# Restoring.


def check_structure(live: TrainingState, saved: pb.TrainingCheckpoint, where: str) -> None:
    """Refuses a saved checkpoint whose tensors do not fit the live objects'.

    Every live tensor must be in the save with its dtype and shape. Saved
    tensors the live objects lack are allowed: TensorFlow restores them
    into objects created later (optimizer slots built by the first train
    step, objects added afterwards), as an in-process restore does.

    Raises:
        InvalidRequestError: naming the first key that differs.
    """
    saved_by_key = {t.checkpoint_key: t for t in saved.tensors}
    for t in live.tensors:
        s = saved_by_key.get(t.checkpoint_key)
        if s is None:
            raise InvalidRequestError(
                f"{where} has no {t.checkpoint_key!r}, which the objects being restored have: "
                "was it saved from objects of another structure?"
            )
        if s.dtype != t.dtype or (not tensor_names.is_string(t.dtype) and tuple(s.shape) != t.shape):
            raise InvalidRequestError(
                f"{where} holds {t.checkpoint_key!r} as {s.dtype}{list(s.shape)}; the objects being restored "
                f"have {t.dtype}{list(t.shape)}"
            )


class LocalCopy:
    """A fetched checkpoint written to a private local dir, where TensorFlow's restore reads it.

    It must outlive the restore: TensorFlow reads objects created after
    `restore()` (deferred slots) from the files when they appear. `close()`
    deletes it.
    """

    def __init__(self, saved: pb.TrainingCheckpoint, payload: memoryview) -> None:
        self._dir = tempfile.mkdtemp(prefix="checkpointd-restore-")
        self.prefix = os.path.join(self._dir, "ckpt")
        names, values = [], []
        for t, data in zip(saved.tensors, _split(saved, payload), strict=True):
            names.append(t.checkpoint_key)
            if tensor_names.is_string(t.dtype):
                values.append(tf.constant(bytes(data)))
            else:
                dtype = np.dtype(tf.as_dtype(t.dtype).as_numpy_dtype)  # wire order is native on TF's platforms
                values.append(
                    np.frombuffer(data, dtype).reshape(tuple(t.shape)) if t.nbytes else np.zeros(tuple(t.shape), dtype)
                )
        tf.raw_ops.SaveV2(
            prefix=self.prefix,
            tensor_names=[*names, tensor_names.OBJECT_GRAPH_KEY],
            shape_and_slices=[""] * (len(names) + 1),
            tensors=[*values, tf.constant(saved.object_graph)],
        )

    def close(self) -> None:
        import shutil

        shutil.rmtree(self._dir, ignore_errors=True)


def _split(saved: pb.TrainingCheckpoint, payload: memoryview) -> Iterator[memoryview]:
    at = 0
    for t in saved.tensors:
        yield payload[at : at + t.nbytes]
        at += t.nbytes
    if at != len(payload):
        raise InvalidRequestError(f"Restore: the payload has {len(payload)} bytes; its tensors take {at}")
