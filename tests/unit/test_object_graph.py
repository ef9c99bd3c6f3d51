"""Object graphs as plain values: TensorFlow's saver order, and graphs that cannot be."""

from __future__ import annotations

import pytest

from checkpointd.formats import object_graph
from checkpointd.formats.object_graph import Node, ObjectGraph
from checkpointd.protocol.errors import InvalidRequestError

V = "VARIABLE_VALUE"


def key(path: str) -> str:
    return f"{path}/.ATTRIBUTES/{V}"


# save_checkpoint: root -> model_variables, policy, train_step; the same objects below.
CHECKPOINT = ObjectGraph(
    (
        Node((("model_variables", 1), ("policy", 2), ("train_step", 3))),  # 0: the Checkpoint
        Node((("0", 4), ("1", 5))),  # 1: model_variables
        Node((("train_step", 3), ("metadata", 6), ("model_variables", 1))),  # 2: the policy
        Node(attributes=((V, key("train_step")),)),  # 3
        Node(attributes=((V, key("model_variables/0")),)),  # 4
        Node(attributes=((V, key("model_variables/1")),)),  # 5
        Node((("m", 7),)),  # 6: metadata
        Node(attributes=((V, key("policy/metadata/m")),)),  # 7
    )
)


def test_attribute_keys_come_in_node_order_and_of_one_kind() -> None:
    assert object_graph.attribute_keys(CHECKPOINT, V, "graph", "why") == [
        key("train_step"),
        key("model_variables/0"),
        key("model_variables/1"),
        key("policy/metadata/m"),
    ]
    table = ObjectGraph((Node(attributes=((V, "a"), ("TABLE", "t"))),))
    with pytest.raises(InvalidRequestError, match="graph has 't' of kind 'TABLE': not a variable"):
        object_graph.attribute_keys(table, V, "graph", "not a variable")


def test_a_child_pointing_at_no_node_is_refused() -> None:
    with pytest.raises(ValueError, match="node 5 of 1"):
        ObjectGraph((Node((("x", 5),)),))
