"""The daemon's copies of TensorFlow's messages are wire-identical with TensorFlow's own.

`checkpointd.v1.tf_formats_pb2` holds the messages the daemon reads or
writes without TensorFlow. For each, bytes TensorFlow wrote (a real
PolicySaver export, a training checkpoint with optimizer slots, a SaveV2
bundle, messages built field by field) are parsed by both, and each side's
serialization is parsed by the other: the same bytes and the same values
both ways. Where the copy names every field (all but MetaGraphDef's parts
the daemon does not read), the text formats agree too, so no field went
unknown and every name is TensorFlow's (policy_specs.pbtxt is text).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import message, text_format
from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, tensor_slice_pb2, versions_pb2
from tensorflow.core.protobuf import (
    fingerprint_pb2,
    saved_model_pb2,
    struct_pb2,
    tensor_bundle_pb2,
    trackable_object_graph_pb2,
)
from tf_agents.policies import policy_saver

from checkpointd import bundle
from checkpointd.protocol import bundle_table
from checkpointd.protocol.tensors import OBJECT_GRAPH_KEY
from checkpointd.v1 import tf_formats_pb2 as ours
from tests.integration.support import policies


def assert_wire_identical(theirs_type: type[message.Message], ours_type: type[message.Message], data: bytes) -> None:
    """Both parse `data` to the same bytes, and each one's serialization parses on the other side unchanged.

    Deterministic serializations: a map's entries otherwise come in any order, and
    where the copy keeps a message as bytes, its nested maps are bytes it cannot reorder.
    """
    theirs, mine = theirs_type.FromString(data), ours_type.FromString(data)
    assert mine.SerializeToString(deterministic=True) == theirs.SerializeToString(deterministic=True)
    assert theirs_type.FromString(mine.SerializeToString(deterministic=True)) == theirs
    assert ours_type.FromString(theirs.SerializeToString(deterministic=True)) == mine


def assert_same_fields(theirs_type: type[message.Message], ours_type: type[message.Message], data: bytes) -> None:
    """Every field is known to the copy, under TensorFlow's name: the text formats are equal."""
    assert_wire_identical(theirs_type, ours_type, data)
    theirs_text = text_format.MessageToString(theirs_type.FromString(data))
    assert text_format.MessageToString(ours_type.FromString(data)) == theirs_text


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real PolicySaver export of an actor policy (bounded specs: TensorProtos in policy_specs.pbtxt)."""
    out = tmp_path_factory.mktemp("export")
    policy = policies.build(policies.actor())
    policy_saver.PolicySaver(policy, train_step=tf.Variable(3, dtype=tf.int64)).save(str(out))
    return out


def test_saved_model(export: Path) -> None:
    data = (export / "saved_model.pb").read_bytes()
    assert_wire_identical(saved_model_pb2.SavedModel, ours.SavedModel, data)
    # Byte for byte the file: what the daemon reads is what TensorFlow wrote.
    assert ours.SavedModel.FromString(data).SerializeToString(deterministic=True) == data
    theirs = saved_model_pb2.SavedModel.FromString(data).meta_graphs[0]
    mine = ours.SavedModel.FromString(data).meta_graphs[0]
    assert set(mine.signature_def) == set(theirs.signature_def) >= set(policies.SIGNATURES)
    for name, signature in theirs.signature_def.items():
        assert mine.signature_def[name] == signature.SerializeToString(deterministic=True)
    assert mine.HasField("saver_def") == theirs.HasField("saver_def")


def test_fingerprint(export: Path) -> None:
    assert_same_fields(fingerprint_pb2.FingerprintDef, ours.FingerprintDef, (export / "fingerprint.pb").read_bytes())
    built = fingerprint_pb2.FingerprintDef(
        saved_model_checksum=(1 << 64) - 1,
        graph_def_program_hash=1,
        signature_def_hash=1 << 63,
        saved_object_graph_hash=12345,
        checkpoint_hash=0,
        version=versions_pb2.VersionDef(producer=1, min_consumer=2, bad_consumers=[3, 4]),
    )
    assert_same_fields(fingerprint_pb2.FingerprintDef, ours.FingerprintDef, built.SerializeToString())


def test_policy_specs_text(export: Path) -> None:
    text = (export / "policy_specs.pbtxt").read_text()
    theirs = text_format.Parse(text, struct_pb2.StructuredValue())
    mine = text_format.Parse(text, ours.StructuredValue())
    assert mine.SerializeToString(deterministic=True) == theirs.SerializeToString(deterministic=True)
    assert "bounded_tensor_spec_value" in text and "minimum" in text  # the TensorProto fields are exercised
    assert_same_fields(struct_pb2.StructuredValue, ours.StructuredValue, theirs.SerializeToString())


def test_policy_object_graphs(export: Path) -> None:
    graph = tf.train.load_checkpoint(str(export / "variables" / "variables")).get_tensor(OBJECT_GRAPH_KEY)
    assert_same_fields(trackable_object_graph_pb2.TrackableObjectGraph, ours.TrackableObjectGraph, graph)


def test_a_training_object_graph_with_slots(tmp_path: Path) -> None:
    model = tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(2,))])
    optimizer = tf.keras.optimizers.Adam()
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.ones((1, 2))))
    optimizer.apply_gradients(
        zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables, strict=True)
    )
    prefix = tf.train.Checkpoint(model=model, optimizer=optimizer, step=tf.Variable(1)).write(str(tmp_path / "ckpt"))
    graph = tf.train.load_checkpoint(prefix).get_tensor(OBJECT_GRAPH_KEY)
    parsed = trackable_object_graph_pb2.TrackableObjectGraph.FromString(graph)
    assert any(node.slot_variables for node in parsed.nodes) or any(
        "optimizer" in c.local_name for node in parsed.nodes for c in node.children
    )
    assert_same_fields(trackable_object_graph_pb2.TrackableObjectGraph, ours.TrackableObjectGraph, graph)
    built = trackable_object_graph_pb2.TrackableObjectGraph()
    node = built.nodes.add()
    node.slot_variables.add(original_variable_node_id=1, slot_name="m", slot_variable_node_id=2)
    node.registered_saver.name = "saver"
    node.registered_saver.object_name = "obj"
    node.has_checkpoint_values.value = True
    built.nodes.add().attributes.add(
        name="VARIABLE_VALUE", full_name="v", checkpoint_key="v/.ATTRIBUTES/VARIABLE_VALUE"
    )
    assert_same_fields(
        trackable_object_graph_pb2.TrackableObjectGraph, ours.TrackableObjectGraph, built.SerializeToString()
    )


def test_bundle_header_and_entries(tmp_path: Path) -> None:
    values: list[Any] = [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.array(7, np.int64),
        np.array([b"a", b"bc"], dtype=object),
        np.zeros((0, 4), np.float16),
    ]
    tf.raw_ops.SaveV2(
        prefix=str(tmp_path / "b"),
        tensor_names=["w", "step", "s", "empty"],
        shape_and_slices=[""] * 4,
        tensors=[tf.constant(v) for v in values],
    )
    rows = list(bundle_table.entries((tmp_path / ("b" + bundle.INDEX_SUFFIX)).read_bytes()))
    assert [k for k, _ in rows] == [b"", b"empty", b"s", b"step", b"w"]
    assert_same_fields(tensor_bundle_pb2.BundleHeaderProto, ours.BundleHeaderProto, rows[0][1])
    for _, value in rows[1:]:
        assert_same_fields(tensor_bundle_pb2.BundleEntryProto, ours.BundleEntryProto, value)
        # And the daemon's own writer's bytes (bundle.entry_proto) are what protobuf makes of them.
        assert ours.BundleEntryProto.FromString(value).SerializeToString() == value
    sliced = tensor_bundle_pb2.BundleEntryProto(
        dtype=1,
        shard_id=2,
        offset=3,
        size=4,
        crc32c=0xFFFFFFFF,
        slices=[tensor_slice_pb2.TensorSliceProto(extent=[{"start": 1, "length": 0}, {"start": 2}])],
    )
    assert_same_fields(tensor_bundle_pb2.BundleEntryProto, ours.BundleEntryProto, sliced.SerializeToString())
    big_endian = tensor_bundle_pb2.BundleHeaderProto(num_shards=3, endianness=1)
    assert_same_fields(tensor_bundle_pb2.BundleHeaderProto, ours.BundleHeaderProto, big_endian.SerializeToString())


@pytest.mark.parametrize(
    "value",
    [
        np.float32(1.5),
        np.arange(4, dtype=np.float16),
        np.array([[1, -2]], np.int8),
        np.array([True, False]),
        np.array([1 + 2j], np.complex128),
        np.array([b"x", b""], dtype=object),
        np.array([2**64 - 1], np.uint64),
    ],
)
def test_tensor_protos(value: Any) -> None:
    for proto in (tf.make_tensor_proto(value), tf.make_tensor_proto(value, shape=None)):
        assert_same_fields(tensor_pb2.TensorProto, ours.TensorProto, proto.SerializeToString())
    shape = tensor_shape_pb2.TensorShapeProto(dim=[{"size": 3, "name": "batch"}, {"size": -1}], unknown_rank=False)
    assert_same_fields(tensor_shape_pb2.TensorShapeProto, ours.TensorShapeProto, shape.SerializeToString())
