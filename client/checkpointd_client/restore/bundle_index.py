"""A tensor bundle's `.index` read on the client: where each tensor lies in the data file.

The index is TensorFlow's sorted string table (LevelDB's format, as
`tsl/lib/io/table` writes it uncompressed): a 48-byte footer pointing at the
index block, whose entries point at the data blocks, whose entries map each
checkpoint key to its BundleEntryProto. Each block's entries are prefix
compressed (`varint32 shared, varint32 unshared, varint32 value length, key
suffix, value`) and end with their restart offsets and count. The table is
read by `checkpointd.protocol.bundle_table`, the daemon's reader too (each
block's CRC32C checked). Only what a partial restore needs is kept: each
key's dtype, shape, shard, offset and size.

`needed_keys` names the tensors TensorFlow's restore can read for objects
under the given children of the checkpoint's root: every attribute of a
node reachable from them (their children, and the optimizers' slot
variables), so deferred restorations find their bytes too.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from tensorflow.core.protobuf import tensor_bundle_pb2, trackable_object_graph_pb2

from checkpointd.protocol import bundle_table, varint


@dataclass(frozen=True)
class Location:
    """One tensor of a bundle: its DataType number and shape, where its bytes are (shard, offset, size)."""

    dtype: int
    shape: tuple[int, ...]
    shard: int
    offset: int
    size: int


def locations(index: bytes) -> dict[str, Location]:
    """Every tensor's location, by checkpoint key (the header entry left out).

    Raises:
        ValueError: the bytes are not a tensor bundle's index.
    """
    found: dict[str, Location] = {}
    for key, value in bundle_table.entries(index):
        if not key:
            continue  # the BundleHeaderProto
        entry = tensor_bundle_pb2.BundleEntryProto.FromString(value)
        found[key.decode()] = Location(
            entry.dtype, tuple(d.size for d in entry.shape.dim), entry.shard_id, entry.offset, entry.size
        )
    return found


def string_value(tensor: bytes) -> bytes:
    """A scalar string tensor's value from its bytes in the data file (length, length CRC, bytes)."""
    length, at = varint.decode(tensor, 0)
    return tensor[at + 4 : at + 4 + length]


def needed_keys(object_graph: bytes, children: Collection[str]) -> set[str]:
    """The checkpoint keys under the root's `children` (and the root's own attributes).

    Args:
        object_graph: the checkpoint's serialized TrackableObjectGraph.
        children: the names of the root's children being restored.
    """
    graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(object_graph)
    nodes = graph.nodes
    keys = {a.checkpoint_key for a in nodes[0].attributes}
    todo = [c.node_id for c in nodes[0].children if c.local_name in children]
    seen: set[int] = set()
    while todo:
        node_id = todo.pop()
        if node_id in seen:
            continue
        seen.add(node_id)
        node = nodes[node_id]
        keys.update(a.checkpoint_key for a in node.attributes)
        todo.extend(c.node_id for c in node.children)
        todo.extend(s.slot_variable_node_id for s in node.slot_variables)
    return keys


def counterpart_keys(live_graph: bytes, saved_graph: bytes) -> dict[str, str | None]:
    """Each live checkpoint key's key in a saved checkpoint, matched as TensorFlow's restore matches objects.

    Both graphs are walked from their roots by child name; a node's
    attribute matches the counterpart's attribute of the same name; an
    optimizer's slot matches the counterpart optimizer's slot of the same
    name for the counterpart variable. A key with no counterpart maps to None.
    """
    live = trackable_object_graph_pb2.TrackableObjectGraph.FromString(live_graph).nodes
    saved = trackable_object_graph_pb2.TrackableObjectGraph.FromString(saved_graph).nodes
    pairs: dict[int, int | None] = {}
    todo: list[tuple[int, int | None]] = [(0, 0)]
    while todo:
        node, other = todo.pop()
        if node in pairs and (pairs[node] is not None or other is None):
            continue  # met before (a counterpart found by another path counts)
        pairs[node] = other
        children = {c.local_name: c.node_id for c in saved[other].children} if other is not None else {}
        todo.extend((c.node_id, children.get(c.local_name)) for c in live[node].children)
    for node, other in list(pairs.items()):  # slots hang off their optimizer, named by their variable
        saved_slots = (
            {(s.original_variable_node_id, s.slot_name): s.slot_variable_node_id for s in saved[other].slot_variables}
            if other is not None
            else {}
        )
        for s in live[node].slot_variables:
            original = pairs.get(s.original_variable_node_id)
            pairs.setdefault(s.slot_variable_node_id, saved_slots.get((original, s.slot_name)))
    keys: dict[str, str | None] = {}
    for node, other in pairs.items():
        attributes = {a.name: a.checkpoint_key for a in saved[other].attributes} if other is not None else {}
        for a in live[node].attributes:
            keys[a.checkpoint_key] = attributes.get(a.name)
    return keys
