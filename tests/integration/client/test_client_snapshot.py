"""Client-side pieces without a daemon: variable bindings, snapshots, the copy,
and that RemotePolicySaver validates its arguments exactly as PolicySaver does.

Real TensorFlow objects, so this is the integration tier (it was in tests/unit).
The chunking tests that were here test the shared codecs now, without
TensorFlow: tests/unit/rpc/test_wire.py, under the same names.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf
from tf_agents.networks import q_network
from tf_agents.policies import policy_saver, q_policy
from tf_agents.specs import tensor_spec
from tf_agents.trajectories import time_step as ts

import checkpointd_client.saver as saver_module
from checkpointd.protocol import wire
from checkpointd_client import RemotePolicySaver, snapshot
from tests.unit.rpc.test_wire import check_chunks


def _tiny_saver(seed: int = 0, **kwargs: object) -> policy_saver.PolicySaver:
    obs = tensor_spec.BoundedTensorSpec((4,), tf.float32, -1, 1, name="obs")
    act = tensor_spec.BoundedTensorSpec((), tf.int32, 0, 2, name="act")
    tf.random.set_seed(seed)
    net = q_network.QNetwork(obs, act, fc_layer_params=(8,))
    policy = q_policy.QPolicy(ts.time_step_spec(obs), act, q_network=net)
    return policy_saver.PolicySaver(policy, **kwargs)


# Bindings against a real PolicySaver template.


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    train_step = tf.Variable(41, dtype=tf.int64)
    metadata = {
        "bf": tf.Variable(tf.constant([0.5, 1.5], tf.bfloat16)),
        "flag": tf.Variable([True, False]),
        "count": tf.Variable(3, dtype=tf.int64),
    }
    saver = _tiny_saver(train_step=train_step, metadata=metadata)
    # Distinct values, so a wrong key pairing shows up as a wrong value.
    for i, v in enumerate(saver.policy.model_variables):
        v.assign(tf.fill(v.shape, float(i + 1)))
    model_dir = str(tmp_path_factory.mktemp("template"))
    ckpt_dir = str(tmp_path_factory.mktemp("checkpoint"))
    saver.save(model_dir)
    saver.save_checkpoint(ckpt_dir)
    bindings = snapshot.bind(saver, model_dir)
    readers = {d: tf.train.load_checkpoint(os.path.join(d, "variables", "variables")) for d in (model_dir, ckpt_dir)}
    return saver, bindings, readers[model_dir], readers[ckpt_dir]


def _variable_keys(reader) -> set[str]:
    return set(reader.get_variable_to_shape_map()) - {"_CHECKPOINTABLE_OBJECT_GRAPH"}


def test_keys_equal_the_template_checkpoint_keys(template) -> None:
    _, bindings, model_reader, _ = template
    keys = [b.key for b in bindings.variables]
    assert keys == sorted(keys)
    assert set(keys) == _variable_keys(model_reader)
    dtypes = model_reader.get_variable_to_dtype_map()
    shapes = model_reader.get_variable_to_shape_map()
    for b in bindings.variables:
        assert (b.dtype, list(b.shape)) == (dtypes[b.key].name, shapes[b.key])


def test_checkpoint_keys_equal_what_save_checkpoint_writes(template) -> None:
    _, bindings, model_reader, ckpt_reader = template
    assert {b.checkpoint_key for b in bindings.variables} == _variable_keys(ckpt_reader)
    for b in bindings.variables:  # both keys name the same variable
        np.testing.assert_array_equal(model_reader.get_tensor(b.key), ckpt_reader.get_tensor(b.checkpoint_key))
    assert any(b.key != b.checkpoint_key for b in bindings.variables)


def test_object_graph_equals_the_one_save_checkpoint_writes(template) -> None:
    _, bindings, _, ckpt_reader = template
    assert bindings.object_graph == ckpt_reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH")


def test_bind_refuses_a_template_of_another_policy(template, tmp_path) -> None:
    saver = template[0]
    other = _tiny_saver(metadata={"other": tf.Variable(1.0)})
    other.save(str(tmp_path))
    with pytest.raises(ValueError, match="only in the template"):
        snapshot.bind(saver, str(tmp_path))


def test_snapshot_is_a_point_in_time_copy(template) -> None:
    saver, bindings, _, _ = template
    snap = snapshot.take_snapshot(bindings, saver._train_step)
    before = [b.variable.numpy().copy() for b in bindings.variables]
    assert snap.step == 41
    assert snap.keys == tuple(b.key for b in bindings.variables)
    saver._train_step.assign_add(10)
    saver.policy.model_variables[0].assign_add(tf.ones_like(saver.policy.model_variables[0]))
    try:
        for got, want in zip(snap.arrays, before, strict=True):
            np.testing.assert_array_equal(got, want)
            assert got.flags["C_CONTIGUOUS"]
        assert snap.nbytes == sum(a.nbytes for a in before)
        assert check_chunks(wire.chunks(snap.parts(), 16), 16) == b"".join(a.tobytes() for a in before)
    finally:
        saver._train_step.assign_add(-10)
        saver.policy.model_variables[0].assign_sub(tf.ones_like(saver.policy.model_variables[0]))


# RemotePolicySaver validates like PolicySaver, before any network I/O.


@pytest.mark.parametrize(
    "policy_arg, kwargs, error",
    [
        ("not a policy", {}, TypeError),
        (None, {"metadata": {"m": 1.0}}, TypeError),
        (None, {"batch_size": 0}, ValueError),
    ],
    ids=["non-TFPolicy", "non-Variable-metadata", "batch_size=0"],
)
def test_constructor_raises_what_policy_saver_raises(monkeypatch, policy_arg, kwargs, error) -> None:
    channels = []
    monkeypatch.setattr(saver_module.grpc, "insecure_channel", lambda *a, **k: channels.append(a))
    policy = _tiny_saver()._raw_policy if policy_arg is None else policy_arg
    with pytest.raises(error) as expected:
        policy_saver.PolicySaver(policy, **kwargs)
    with pytest.raises(error) as got:
        RemotePolicySaver(policy, "127.0.0.1:1", run="r", **kwargs)
    assert str(got.value) == str(expected.value)
    assert channels == []


def test_copy_all_copies_large_arrays_in_pieces_and_small_ones_whole() -> None:
    rng = np.random.default_rng(0)
    big = rng.standard_normal((1025, 1031)).astype(np.float32)  # > 4 MiB: split
    small = rng.integers(0, 1 << 40, size=17, dtype=np.int64)
    scalar = np.array(7, np.int64)
    strided = rng.standard_normal((2048, 1024)).astype(np.float32)[:, ::2]  # not contiguous
    pairs = [(np.zeros_like(a, order="C"), a) for a in (big, small, scalar, strided)]

    snapshot.copy_all(pairs)

    for dst, src in pairs:
        assert dst.tobytes() == np.ascontiguousarray(src).tobytes()
