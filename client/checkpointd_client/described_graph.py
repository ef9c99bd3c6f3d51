"""A tf.train.Checkpoint's description made once, and checked cheaply at each save that it still holds.

`tf_checkpoint.describe` runs TensorFlow's own save path up to the write
(`save_util.serialize_graph_view`): it walks the object graph twice, asks
every optimizer for its slots against every node, builds and serializes the
object-graph proto, and asks every object for its tensors. A training job's
graph is fixed after its first steps (optimizer slots aside), so most of
that work gives the same answer at every save. TensorFlow's own
`TrackableSaver` does not avoid it when executing eagerly: its cache (of
each object's tensors and proto attributes) is for graph building only, and
it still gathers the graph at every save.

`DescribedGraph.describe()` describes in full the first time, and after
that only checks, at each save, what the description depends on:

- the graph: each object's children (name and object, in order), walked
  from the root in the same breadth-first order TensorFlow walks (a new
  variable, an object replaced, a list grown are seen here);
- the slot variables: each optimizer's slot of each object, asked as
  TensorFlow asks (`get_slot_names`, `get_slot`; slots a first apply
  creates are seen here);
- every variable's dtype and shape;
- objects with no tensors of their own still have none (no SavedModel
  saveable factories attached since).

If all hold, the proto bytes and the keys are the ones described, the
variables' values are read at copy time as before, and Python state
(NumpyState, py metrics) is serialized again, as every save must. If any
differs, the graph is described in full again (and recorded first, so a
change while describing is seen at the next save).

Only a graph whose tensors all come from TensorFlow's stock variables and
stock Python state is described once: an object with tensors of its own
making (`_serialize_to_tensors` or legacy saveables: a lookup table, a
custom resource) may give other keys at each call, so such a graph is
described in full at every save, as before. The children of every object
must be trackables themselves (a plain list or dict child would be wrapped
afresh at each walk). Assumed, not checked: an object does not become an
optimizer later (gain `get_slot_names` as an instance attribute) or change
its class.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.saved_model import registration
from tensorflow.python.trackable import base, python_state

from checkpointd.protocol import tensors as tensor_names
from checkpointd_client import tf_checkpoint
from checkpointd_client.tf_checkpoint import Tensor, TrainingState

_VARIABLE_SAVE = resource_variable_ops.BaseResourceVariable._serialize_to_tensors  # noqa: SLF001
_STATE_SAVE = python_state.PythonState._serialize_to_tensors  # noqa: SLF001
_NO_SAVE = base.Trackable._serialize_to_tensors  # noqa: SLF001
_NO_SAVEABLES = base.Trackable._gather_saveables_for_checkpoint  # noqa: SLF001
_CHECKPOINT = base.SaveType.CHECKPOINT

Children = tuple[tuple[str, Any], ...]
Slots = tuple[tuple[str, int, Any], ...]  # (slot name, the original variable's node index, the slot variable)


@dataclass(frozen=True)
class _Graph:
    """The object graph as TensorFlow walks it: nodes breadth-first, each one's children, each optimizer's slots."""

    nodes: tuple[Any, ...]
    children: tuple[Children, ...]
    slots: tuple[tuple[int, Slots], ...]  # (an optimizer's node index, its slots)


@dataclass(frozen=True)
class _Description:
    """A graph, what was described of it, and what each save must look at again."""

    graph: _Graph
    state: TrainingState
    variables: tuple[tuple[int, Any], ...]  # (tensor index, the variable it reads)
    python_state: tuple[tuple[int, Any], ...]  # (tensor index, the PythonState it serializes)
    plain: tuple[Any, ...]  # objects with no tensors of their own


class DescribedGraph:
    """`tf_checkpoint.describe(root)` made once, then checked at each call (see the module docstring). Thread-safe."""

    def __init__(self, root: tf.train.Checkpoint) -> None:
        self._root = root
        self._lock = threading.Lock()
        self._described: _Description | None = None
        self.full_descriptions = 0  # how many calls described the graph in full

    def describe(self) -> TrainingState:
        """What `root.write()` would write now; the same as `tf_checkpoint.describe(root)`.

        Raises:
            ValueError: as `tf_checkpoint.describe`.
        """
        with self._lock, tf.init_scope():
            described = self._described
            if described is not None:
                state = _again(self._root, described)
                if state is not None:
                    return state
            self._described = None
            graph = _walk(self._root)  # before describing: a change during it is seen at the next call
            state, owners = tf_checkpoint.describe_with_owners(self._root)
            self.full_descriptions += 1
            if graph is not None:
                self._described = _record(graph, state, owners)
            return state


def _walk(root: Any) -> _Graph | None:
    """The graph now; None if it cannot be compared between calls (a child that is not a trackable)."""
    nodes: list[Any] = [root]
    index = {id(root): 0}
    children: list[Children] = []
    for node in nodes:  # grows as it goes: breadth-first
        node._maybe_initialize_trackable()  # noqa: SLF001 - as TensorFlow's walk does
        kids = tuple(node._trackable_children(_CHECKPOINT).items())  # noqa: SLF001
        for _, child in kids:
            if not isinstance(child, base.Trackable):
                return None
            if id(child) not in index:
                index[id(child)] = len(nodes)
                nodes.append(child)
        children.append(kids)
    optimizers = [i for i, node in enumerate(nodes) if "get_slot_names" in dir(node)]  # dir(): as TensorFlow asks
    return _Graph(tuple(nodes), tuple(children), tuple((i, _slots(nodes[i], nodes)) for i in optimizers))


def _slots(optimizer: Any, nodes: Sequence[Any]) -> Slots:
    """`optimizer`'s slot variables of `nodes`, as `checkpoint.util.serialize_slot_variables` finds them."""
    found = []
    for name in optimizer.get_slot_names():
        for i, original in enumerate(nodes):
            try:
                slot = optimizer.get_slot(original, name)
            except (AttributeError, KeyError):
                slot = None
            if slot is not None:
                found.append((name, i, slot))
    return tuple(found)


def _same_graph(root: Any, graph: _Graph) -> bool:
    """Whether the graph walked now is `graph`: the same children, by name and identity, and the same slots."""
    if graph.nodes[0] is not root:
        return False
    for node, kids in zip(graph.nodes, graph.children, strict=True):
        node._maybe_initialize_trackable()  # noqa: SLF001
        now = node._trackable_children(_CHECKPOINT)  # noqa: SLF001
        if len(now) != len(kids):
            return False
        for (name, child), (was_name, was) in zip(now.items(), kids, strict=True):
            if child is not was or name != was_name:
                return False
    return all(_same_slots(_slots(graph.nodes[i], graph.nodes), slots) for i, slots in graph.slots)


def _same_slots(now: Slots, was: Slots) -> bool:
    return len(now) == len(was) and all(
        a[0] == b[0] and a[1] == b[1] and a[2] is b[2] for a, b in zip(now, was, strict=True)
    )


def _kind(obj: Any) -> str | None:
    """'variable', 'python_state' or 'plain' (no tensors of its own), for TensorFlow's stock objects; else None."""
    if registration.get_registered_saver_name(obj):
        return None
    own = _own_attributes(obj)
    if own is None or {"_serialize_to_tensors", "_gather_saveables_for_checkpoint"} & own:
        return None
    save = getattr(type(obj), "_serialize_to_tensors", None)
    if isinstance(obj, resource_variable_ops.BaseResourceVariable) and save is _VARIABLE_SAVE:
        return "variable"
    if isinstance(obj, python_state.PythonState) and save is _STATE_SAVE:
        return "python_state"
    if save is _NO_SAVE and getattr(type(obj), "_gather_saveables_for_checkpoint", None) is _NO_SAVEABLES:
        return "plain" if not getattr(obj, "_self_saveable_object_factories", None) else None
    return None


def _own_attributes(obj: Any) -> set[str] | None:
    try:
        return set(object.__getattribute__(obj, "__dict__"))
    except (AttributeError, TypeError):
        return set()


def _record(graph: _Graph, state: TrainingState, owners: Sequence[Any]) -> _Description | None:
    """What each call checks of the graph described as `state`; None if it must be described at every call."""
    objects = [*graph.nodes, *(slot for _, slots in graph.slots for _, _, slot in slots)]
    kinds = {id(o): _kind(o) for o in objects}
    if None in kinds.values():
        return None
    variables, python_states = [], []
    owning: set[int] = set()
    for i, (t, owner) in enumerate(zip(state.tensors, owners, strict=True)):
        kind = kinds.get(id(owner))
        if kind == "variable" and t.source is owner and t.checkpoint_key.endswith(tensor_names.VARIABLE_SUFFIX):
            variables.append((i, owner))
        elif kind == "python_state":
            python_states.append((i, owner))
        else:
            return None  # a tensor of an object not walked, or of a kind described at every call
        owning.add(id(owner))
    # Each variable and Python state has exactly its one tensor; plain objects none.
    if len(owning) != len(state.tensors):
        return None
    plain = tuple(o for o in objects if kinds[id(o)] == "plain")
    if any(id(o) in owning for o in plain) or sum(1 for o in objects if kinds[id(o)] != "plain") != len(owning):
        return None
    return _Description(graph, state, tuple(variables), tuple(python_states), plain)


def _again(root: Any, d: _Description) -> TrainingState | None:
    """The state now if `d` still describes the graph, else None."""
    if not _same_graph(root, d.graph):
        return None
    if any(getattr(o, "_self_saveable_object_factories", None) for o in d.plain):
        return None
    tensors: list[Tensor] = list(d.state.tensors)
    for i, variable in d.variables:
        t = tensors[i]
        shape = variable.shape
        if variable.dtype.name != t.dtype or shape.rank is None or tuple(shape.as_list()) != t.shape:
            return None
    for i, state in d.python_state:
        values = state._serialize_to_tensors()  # noqa: SLF001 - what TensorFlow's save calls
        if list(values) != [python_state.PYTHON_STATE]:
            return None
        tensors[i] = tf_checkpoint.tensor(tensors[i].checkpoint_key, state, values[python_state.PYTHON_STATE])
    if not d.python_state:
        return d.state
    return TrainingState(d.state.object_graph, tuple(tensors))
