"""TrackableObjectGraphs, parsed once: what templates and numpy states carry.

A TF2 checkpoint names its tensors through an object graph: each node is one
trackable object, with named edges to its children and attributes (its saved
tensors, each under a checkpoint key). The daemon reads three: a template's
SavedModel graph, the graph `PolicySaver.save_checkpoint` writes for the same
policy, and a NumpyState's. `parse` turns the serialized proto into the plain
values below (with `checkpointd.v1.tf_formats_pb2`, wire-identical with TensorFlow's proto); the rest is
pure and runs on those values.

`checkpoint_keys` is why the daemon need not trust a trainer's pairing of a
variable's two keys: the checkpoint's root holds the policy as its child
`policy`, so the variable the SavedModel names by one path of child names is
the one the checkpoint reaches by `policy/` and the same path, and that node's
attribute is the variable's checkpoint key.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from google.protobuf import message

from checkpointd.protocol.errors import InvalidRequestError
from checkpointd.v1 import tf_formats_pb2

# The child of tf.train.Checkpoint(policy=..., ...) that holds the policy.
POLICY_CHILD = "policy"


@dataclass(frozen=True)
class Node:
    """One trackable object: (local name, node id) children and (kind, checkpoint key) attributes."""

    children: tuple[tuple[str, int], ...] = ()
    attributes: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ObjectGraph:
    """A TrackableObjectGraph's nodes; node 0 is the root."""

    nodes: tuple[Node, ...]

    def __post_init__(self) -> None:
        for node in self.nodes:
            for name, child in node.children:
                if not 0 <= child < len(self.nodes):
                    raise ValueError(f"child {name!r} points at node {child} of {len(self.nodes)}")

    def child(self, node: int, name: str) -> int | None:
        """The first child of `node` named `name`, or None."""
        return next((c for n, c in self.nodes[node].children if n == name), None)


def from_message(message: Any) -> ObjectGraph:
    """The graph of a parsed `TrackableObjectGraph` message (or anything shaped like one).

    Raises:
        ValueError: a child points at a node the graph does not have.
    """
    return ObjectGraph(
        tuple(
            Node(
                tuple((c.local_name, c.node_id) for c in node.children),
                tuple((a.name, a.checkpoint_key) for a in node.attributes),
            )
            for node in message.nodes
        )
    )


def parse(data: bytes, what: str) -> ObjectGraph:
    """Parses a serialized TrackableObjectGraph.

    Args:
        data: the serialized proto.
        what: how to name it in errors.

    Raises:
        InvalidRequestError: it does not parse, or a child points at no node.
    """
    try:
        return from_message(tf_formats_pb2.TrackableObjectGraph.FromString(data))
    except (message.DecodeError, ValueError) as e:
        raise InvalidRequestError(f"{what} is not a TrackableObjectGraph ({e})") from None


def attribute_keys(graph: ObjectGraph, kind: str, what: str, refusal: str) -> list[str]:
    """The checkpoint keys of every attribute, in TensorFlow's saver order (node order).

    Args:
        graph: the graph.
        kind: the only attribute name allowed (e.g. "VARIABLE_VALUE").
        what: how to name the graph in errors.
        refusal: why another kind is refused, ending the message.

    Raises:
        InvalidRequestError: an attribute is of another kind.
    """
    keys = []
    for node in graph.nodes:
        for name, key in node.attributes:
            if name != kind:
                raise InvalidRequestError(f"{what} has {key!r} of kind {name!r}: {refusal}")
            keys.append(key)
    return keys


def counterparts(graph: ObjectGraph, other: ObjectGraph, start: int) -> dict[int, int]:
    """Node of `graph` -> the node of `other` reached by the same child names.

    Paths start at `graph`'s root and at `other`'s node `start`, and are
    taken breadth first, as TensorFlow names objects: a node is paired by the
    first path both graphs have. Nodes no common path reaches are left out.
    """
    found = {0: start}
    queue = collections.deque([0])
    while queue:
        node = queue.popleft()
        theirs: dict[str, int] = {}
        for name, child in other.nodes[found[node]].children:
            theirs.setdefault(name, child)
        for name, child in graph.nodes[node].children:
            if child not in found and name in theirs:
                found[child] = theirs[name]
                queue.append(child)
    return found


def checkpoint_keys(saved_model: ObjectGraph, checkpoint: ObjectGraph, kind: str) -> dict[str, str | None]:
    """Each SavedModel key -> the checkpoint key of the same object in `checkpoint`.

    Args:
        saved_model: the template SavedModel's graph; its root is the policy.
        checkpoint: `PolicySaver.save_checkpoint`'s graph, whose root holds
            the policy as its child `policy`.
        kind: the attribute both name the value by ("VARIABLE_VALUE").

    Returns:
        For every `kind` attribute of `saved_model`, the key of the `kind`
        attribute of its counterpart in `checkpoint`; None where it has no
        counterpart, or one without exactly one such attribute.
    """
    policy = checkpoint.child(0, POLICY_CHILD) if checkpoint.nodes else None
    pairs = counterparts(saved_model, checkpoint, policy) if policy is not None and saved_model.nodes else {}
    derived: dict[str, str | None] = {}
    for node_id, node in enumerate(saved_model.nodes):
        for name, key in node.attributes:
            if name != kind:
                continue
            theirs = _keys(checkpoint.nodes[pairs[node_id]].attributes, kind) if node_id in pairs else []
            derived[key] = theirs[0] if len(theirs) == 1 else None
    return derived


def _keys(attributes: Iterable[tuple[str, str]], kind: str) -> list[str]:
    return [key for name, key in attributes if name == kind]
