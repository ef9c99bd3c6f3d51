"""Object graphs as plain values: saver order, and each variable's checkpoint key derived.

The graphs here are built by hand in the shapes PolicySaver's have (the
integration tier checks the derivation on real ones): a SavedModel graph whose
root is the policy, and a save_checkpoint graph whose root holds the policy as
`policy` beside `model_variables` and `train_step`.
"""

from __future__ import annotations

import pytest

from checkpointd.formats import object_graph
from checkpointd.formats.object_graph import Node, ObjectGraph
from checkpointd.protocol.errors import InvalidRequestError

V = "VARIABLE_VALUE"


def key(path: str) -> str:
    return f"{path}/.ATTRIBUTES/{V}"


# SavedModel: policy -> train_step, metadata/m, model_variables/{0,1}.
SAVED_MODEL = ObjectGraph(
    (
        Node((("train_step", 1), ("metadata", 2), ("model_variables", 3))),  # 0: the policy
        Node(attributes=((V, key("train_step")),)),  # 1
        Node((("m", 4),)),  # 2: metadata
        Node((("0", 5), ("1", 6))),  # 3: model_variables
        Node(attributes=((V, key("metadata/m")),)),  # 4
        Node(attributes=((V, key("model_variables/0")),)),  # 5
        Node(attributes=((V, key("model_variables/1")),)),  # 6
    )
)
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


def test_each_variable_gets_the_key_of_the_same_object_in_the_checkpoint() -> None:
    assert object_graph.checkpoint_keys(SAVED_MODEL, CHECKPOINT, V) == {
        key("train_step"): key("train_step"),
        key("metadata/m"): key("policy/metadata/m"),
        key("model_variables/0"): key("model_variables/0"),
        key("model_variables/1"): key("model_variables/1"),
    }


def test_the_derivation_follows_objects_not_key_text() -> None:
    # The checkpoint's model_variables list in the other order: the same
    # text keys now name the other object, and the derivation follows.
    nodes = list(CHECKPOINT.nodes)
    nodes[1] = Node((("0", 5), ("1", 4)))
    swapped = ObjectGraph(tuple(nodes))
    derived = object_graph.checkpoint_keys(SAVED_MODEL, swapped, V)
    assert derived[key("model_variables/0")] == key("model_variables/1")
    assert derived[key("model_variables/1")] == key("model_variables/0")


def test_a_variable_with_no_counterpart_derives_none() -> None:
    nodes = list(CHECKPOINT.nodes)
    nodes[6] = Node()  # the policy's metadata lost its child
    derived = object_graph.checkpoint_keys(SAVED_MODEL, ObjectGraph(tuple(nodes)), V)
    assert derived[key("metadata/m")] is None
    assert derived[key("train_step")] == key("train_step")


def test_a_checkpoint_without_a_policy_child_derives_nothing() -> None:
    nodes = list(CHECKPOINT.nodes)
    nodes[0] = Node((("model_variables", 1), ("train_step", 3)))
    derived = object_graph.checkpoint_keys(SAVED_MODEL, ObjectGraph(tuple(nodes)), V)
    assert set(derived) == {key("train_step"), key("metadata/m"), key("model_variables/0"), key("model_variables/1")}
    assert set(derived.values()) == {None}
    assert object_graph.checkpoint_keys(SAVED_MODEL, ObjectGraph(()), V) == dict.fromkeys(derived)


def test_counterparts_pair_by_the_first_common_path_breadth_first() -> None:
    pairs = object_graph.counterparts(SAVED_MODEL, CHECKPOINT, 2)
    assert pairs == {0: 2, 1: 3, 2: 6, 3: 1, 4: 7, 5: 4, 6: 5}


def test_graph_cycles_end_the_walk() -> None:
    loop = ObjectGraph((Node((("self", 0), ("v", 1))), Node(attributes=((V, "v"),))))
    checkpoint = ObjectGraph((Node((("policy", 1),)), Node((("self", 1), ("v", 2))), Node(attributes=((V, "cv"),))))
    assert object_graph.checkpoint_keys(loop, checkpoint, V) == {"v": "cv"}


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
