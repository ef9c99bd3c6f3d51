"""A `NumpyState` saved with the policy: snapshot at the call, restore from the daemon.

Each save serializes the state exactly as `tf.train.Checkpoint(numpy_arrays=
state).write(prefix)` would, through TensorFlow's own code path
(`save_util.serialize_graph_view`): the object graph, and one `.npy`
serialization per array (NumpyState's PythonState `serialize()`), keyed by its
checkpoint key. Serializing is the copy: arrays changed after the call do not
change the save. The daemon writes those bytes as a checkpoint at
`<export_dir>/numpy_state/numpy_state` without parsing them.

Restoring reads the object graph back to learn each key's attribute name, and
sets the attributes as TensorFlow's restore does (`NumpyState` re-creates
missing ones); attributes that are not in the save are left alone, as there.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2
from tensorflow.python.checkpoint import graph_view, save_util
from tensorflow.python.eager import context
from tf_agents.utils import numpy_storage

from checkpointd.protocol import wire
from checkpointd.v1 import checkpointd_pb2 as pb

# The attribute of the tf.train.Checkpoint that holds the state.
ROOT_NAME = "numpy_arrays"


@dataclass(frozen=True)
class NumpySnapshot:
    """A NumpyState's serialization at one instant, in TensorFlow's saver order."""

    object_graph: bytes
    keys: tuple[str, ...]
    values: tuple[bytes, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(v) for v in self.values)

    def to_proto(self) -> pb.NumpyState:
        return wire.numpy_state_to_pb(self.object_graph, zip(self.keys, map(len, self.values), strict=True))


class NumpySource:
    """Takes NumpySnapshots of one NumpyState.

    Args:
        state: the state; its arrays may change, and be added, between saves.

    Raises:
        TypeError: `state` is not a `tf_agents.utils.numpy_storage.NumpyState`.
    """

    def __init__(self, state: numpy_storage.NumpyState) -> None:
        if not isinstance(state, numpy_storage.NumpyState):
            raise TypeError(f"numpy_state must be a tf_agents.utils.numpy_storage.NumpyState, saw {type(state)!r}")
        self.state = state
        self._root = tf.train.Checkpoint(**{ROOT_NAME: state})

    def take(self) -> NumpySnapshot:
        """Serializes every array now, as Checkpoint.write would.

        Raises:
            ValueError: an array cannot be serialized without pickling (an
                object array), as TensorFlow's own save would raise.
        """
        # Eagerly even for a graph-mode policy: the arrays are host values,
        # and their serializations must be bytes now, not ops in its graph.
        with context.eager_mode():
            named, _, _, graph = save_util.serialize_graph_view(graph_view.ObjectGraphView(self._root))[:4]
            tensors: dict[str, tf.Tensor] = {}
            for serialized in named.values():
                tensors.update(serialized)
            keys = tuple(a.checkpoint_key for node in graph.nodes for a in node.attributes)
            values = tuple(bytes(tensors[k].numpy()) for k in keys)
        return NumpySnapshot(graph.SerializeToString(), keys, values)


def names(object_graph: bytes) -> dict[str, str]:
    """Checkpoint key -> attribute name of the state, read from a saved object graph.

    Raises:
        ValueError: the graph is not a `Checkpoint(numpy_arrays=NumpyState())`'s.
    """
    graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(object_graph)
    roots = [c.node_id for c in graph.nodes[0].children if c.local_name == ROOT_NAME] if graph.nodes else []
    if len(roots) != 1:
        raise ValueError(f"the saved numpy state has no {ROOT_NAME!r} object")
    found = {}
    for child in graph.nodes[roots[0]].children:
        for attribute in graph.nodes[child.node_id].attributes:
            found[attribute.checkpoint_key] = child.local_name
    return found


def arrays(state: pb.NumpyState, payload: memoryview) -> dict[str, np.ndarray]:
    """Attribute name -> array, from a restored header's numpy state and its bytes.

    Raises:
        ValueError: the bytes are not `.npy` serializations, or a key has no name.
    """
    by_key = names(state.object_graph)
    out: dict[str, np.ndarray] = {}
    start = 0
    for entry in state.entries:
        data = payload[start : start + entry.nbytes]
        start += entry.nbytes
        if entry.checkpoint_key not in by_key:
            raise ValueError(f"the saved numpy state has no attribute for {entry.checkpoint_key!r}")
        out[by_key[entry.checkpoint_key]] = np.load(io.BytesIO(data), allow_pickle=False)
    return out


def assign(state: numpy_storage.NumpyState, values: Mapping[str, np.ndarray]) -> None:
    """Sets each attribute, creating it if the state lacks it (as restore() does)."""
    for name, value in values.items():
        setattr(state, name, value)
