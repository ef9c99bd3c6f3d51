"""TrackableObjectGraphs, parsed once: what templates and numpy states carry.

A TF2 checkpoint names its tensors through an object graph: each node is one
trackable object, with named edges to its children and attributes (its saved
tensors, each under a checkpoint key). The daemon reads three: a template's
SavedModel graph, the graph `PolicySaver.save_checkpoint` writes for the same
policy, and a NumpyState's. `parse` turns the serialized proto into the plain
values below (TensorFlow's protos are imported inside it only); the rest is
pure and runs on those values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from checkpointd.protocol.errors import InvalidRequestError


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
    from google.protobuf import message
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    try:
        return from_message(trackable_object_graph_pb2.TrackableObjectGraph.FromString(data))
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
