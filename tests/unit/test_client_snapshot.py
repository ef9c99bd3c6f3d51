"""Client-side pieces without a daemon: chunking, variable bindings, snapshots,
and that RemotePolicySaver validates its arguments exactly as PolicySaver does."""

from __future__ import annotations

import os

import crc32c
import numpy as np
import pytest
import tensorflow as tf
from tf_agents.networks import q_network
from tf_agents.policies import policy_saver, q_policy
from tf_agents.specs import tensor_spec
from tf_agents.trajectories import time_step as ts

from checkpointd.v1 import checkpointd_pb2
import checkpointd_client.saver as saver_module
from checkpointd_client import RemotePolicySaver, snapshot

BF16 = tf.bfloat16.as_numpy_dtype


def _tiny_saver(seed: int = 0, **kwargs: object) -> policy_saver.PolicySaver:
    obs = tensor_spec.BoundedTensorSpec((4,), tf.float32, -1, 1, name="obs")
    act = tensor_spec.BoundedTensorSpec((), tf.int32, 0, 2, name="act")
    tf.random.set_seed(seed)
    net = q_network.QNetwork(obs, act, fc_layer_params=(8,))
    policy = q_policy.QPolicy(ts.time_step_spec(obs), act, q_network=net)
    return policy_saver.PolicySaver(policy, **kwargs)


def _check_chunks(chunks, limit: int) -> bytes:
    """Asserts the chunk invariants; returns the reassembled bytes."""
    data = bytearray()
    for c in chunks:
        assert c.offset == len(data), "offsets must be contiguous"
        assert 0 < len(c.data) <= limit
        assert c.crc32c == crc32c.crc32c(c.data)
        data += c.data
    return bytes(data)


# Chunking.

ARRAYS = [
    np.arange(250, dtype=np.float32).reshape(10, 25),
    np.zeros((0, 3), np.float32),
    np.array([1.5, -2.25, 3.0], dtype=BF16),
    np.array([True, False, True, True, False]),
    np.array(2**40 + 7, dtype=np.int64),  # 0-d, like train_step
    np.arange(-5, 6, dtype=np.int64),
]


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1 << 20])
def test_array_chunks_reassemble_to_the_exact_bytes(chunk_bytes: int) -> None:
    chunks = list(snapshot.array_chunks(ARRAYS, chunk_bytes))
    assert _check_chunks(chunks, chunk_bytes) == b"".join(a.tobytes() for a in ARRAYS)


def test_array_chunks_never_span_two_arrays() -> None:
    boundaries = np.cumsum([a.nbytes for a in ARRAYS])
    for c in snapshot.array_chunks(ARRAYS, 64):
        assert not any(c.offset < b < c.offset + len(c.data) for b in boundaries)


def test_zero_size_arrays_yield_no_chunks() -> None:
    assert (
        list(snapshot.array_chunks([np.zeros((0,), np.float32), np.zeros((2, 0), BF16)], 8)) == []
    )


def test_wire_bytes_are_little_endian_and_c_order() -> None:
    big = np.array([1.0, -2.0], dtype=">f4")
    fortran = np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3))
    data = _check_chunks(snapshot.array_chunks([big, fortran], 5), 5)
    assert data == np.array([1.0, -2.0], "<f4").tobytes() + np.arange(6, dtype="<i8").tobytes()


@pytest.mark.parametrize("chunk_bytes", [0, -1, 1.5])
def test_chunk_bytes_must_be_a_positive_int(chunk_bytes: object) -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        list(snapshot.array_chunks(ARRAYS, chunk_bytes))  # type: ignore[arg-type]


def test_file_chunks_cover_every_file_with_relative_paths(tmp_path) -> None:
    files = {
        "saved_model.pb": os.urandom(1000),
        "exact.bin": os.urandom(64),
        "variables/variables.index": os.urandom(10),
        "assets/empty.txt": b"",
    }
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content)
    by_path: dict[str, list] = {}
    for c in snapshot.file_chunks(str(tmp_path), 64):
        by_path.setdefault(c.path, []).append(c)
    assert set(by_path) == set(files)
    for name, chunks in by_path.items():
        if files[name]:
            assert _check_chunks(chunks, 64) == files[name]
        else:
            assert [(c.offset, c.data, c.crc32c) for c in chunks] == [(0, b"", crc32c.crc32c(b""))]
    assert snapshot.template_size(str(tmp_path)) == sum(map(len, files.values()))


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
    readers = {
        d: tf.train.load_checkpoint(os.path.join(d, "variables", "variables"))
        for d in (model_dir, ckpt_dir)
    }
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
        np.testing.assert_array_equal(
            model_reader.get_tensor(b.key), ckpt_reader.get_tensor(b.checkpoint_key)
        )
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
        assert _check_chunks(snap.chunks(16), 16) == b"".join(a.tobytes() for a in before)
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
def test_constructor_raises_what_policy_saver_raises(
    monkeypatch, policy_arg, kwargs, error
) -> None:
    channels = []
    monkeypatch.setattr(saver_module.grpc, "insecure_channel", lambda *a, **k: channels.append(a))
    policy = _tiny_saver()._raw_policy if policy_arg is None else policy_arg
    with pytest.raises(error) as expected:
        policy_saver.PolicySaver(policy, **kwargs)
    with pytest.raises(error) as got:
        RemotePolicySaver(policy, "127.0.0.1:1", run="r", **kwargs)
    assert str(got.value) == str(expected.value)
    assert channels == []


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1 << 20])
def test_encoded_chunks_are_the_serialized_save_requests_byte_for_byte(chunk_bytes: int) -> None:
    arrays = [*ARRAYS, np.zeros(300, np.uint8), np.arange(200, dtype=np.float64)]  # zero CRCs, offset 0
    want = [
        checkpointd_pb2.SaveRequest(chunk=c).SerializeToString()
        for c in snapshot.array_chunks(arrays, chunk_bytes)
    ]
    assert list(snapshot.encoded_chunks(arrays, chunk_bytes)) == want


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
