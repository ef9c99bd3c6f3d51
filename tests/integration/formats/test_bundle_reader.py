"""The daemon's bundle reader reads what TensorFlow's SaveV2 writes: every dtype, shape and string.

`test_bundle_identity`'s property test run the other way: TensorFlow writes
random tensor sets (its strategy: every dtype the wire carries, strings,
scalars, empty and zero-size shapes, keys sharing prefixes), and
`checkpointd.bundle.reader` reads every key's dtype, shape and bytes
back, each entry's CRC32C checked; the client's index reader
(`checkpointd_client.restore.bundle_index`, on the same table reader) agrees. A byte
changed anywhere a checksum covers is refused as corrupt, as TensorFlow's
reader refuses it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings

from checkpointd import bundle
from checkpointd.bundle.reader import BundleReader, CorruptBundleError, UnreadableBundleError
from checkpointd_client.restore import bundle_index
from tests.integration.formats.test_bundle_identity import DRAWS, NUMERIC, tensors

Items = list[tuple[str, str, tuple[int, ...], Any]]


def _save_with_tensorflow(prefix: Path, items: Items) -> None:
    tf.raw_ops.SaveV2(
        prefix=str(prefix),
        tensor_names=[k for k, *_ in items],
        shape_and_slices=[""] * len(items),
        tensors=[
            tf.constant(np.array(v, dtype=object).reshape(s) if d == "string" else v, dtype=tf.as_dtype(d))
            for _, d, s, v in items
        ],
    )


def _assert_reads(prefix: Path, items: Items) -> None:
    reader = BundleReader(prefix)
    assert set(reader.tensors) == {k for k, *_ in items}
    locations = bundle_index.locations(Path(str(prefix) + bundle.INDEX_SUFFIX).read_bytes())
    for key, dtype, shape, value in items:
        t = reader.tensors[key]
        assert (t.dtype, t.shape) == (dtype, shape)
        assert (locations[key].offset, locations[key].size, locations[key].shape) == (t.offset, t.size, t.shape)
        if dtype == "string":
            assert reader.strings(key) == value
        else:
            assert reader.raw(key) == np.ascontiguousarray(value).tobytes()


@settings(max_examples=DRAWS, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=tensors())
def test_every_tensor_tensorflow_writes_reads_back(tmp_path_factory: pytest.TempPathFactory, items: Items) -> None:
    prefix = tmp_path_factory.mktemp("draw") / "tf"
    _save_with_tensorflow(prefix, items)
    _assert_reads(prefix, items)


def test_an_index_of_several_blocks_reads_back(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    items: Items = []
    for i in range(12000):
        dtype = NUMERIC[i % len(NUMERIC)]
        value = rng.integers(0, 2, size=(i % 3,), dtype=np.uint8).astype(tf.as_dtype(dtype).as_numpy_dtype)
        items.append((f"agent/_q_network/layer_{i:05d}/kernel/.ATTRIBUTES/VARIABLE_VALUE", dtype, (i % 3,), value))
    items.append(("_CHECKPOINTABLE_OBJECT_GRAPH", "string", (), [bytes(rng.integers(0, 256, 5000, np.uint8))]))
    _save_with_tensorflow(tmp_path / "tf", items)
    _assert_reads(tmp_path / "tf", items)


def _written(tmp_path: Path) -> Path:
    items: Items = [
        ("a/kernel", "float32", (3, 2), np.arange(6, dtype=np.float32).reshape(3, 2)),
        ("b/state", "string", (), [b"python state"]),
        ("c/strings", "string", (2,), [b"x" * 300, b""]),
    ]
    _save_with_tensorflow(tmp_path / "tf", items)
    return tmp_path / "tf"


@pytest.mark.parametrize("key", ["a/kernel", "b/state", "c/strings"])
def test_a_changed_byte_in_a_tensor_is_corrupt(tmp_path: Path, key: str) -> None:
    prefix = _written(tmp_path)
    reader = BundleReader(prefix)
    t = reader.tensors[key]
    data = Path(str(prefix) + bundle.DATA_SUFFIX)
    raw = bytearray(data.read_bytes())
    raw[t.offset + t.size - 1] ^= 0x01  # the last byte: a value's, never its lengths'
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptBundleError, match="CRC32C"):
        reader.raw(key)
    with pytest.raises(tf.errors.OpError, match="Checksum does not match"):  # as TensorFlow's reader refuses it
        tf.train.load_checkpoint(str(prefix)).get_tensor(key)


def test_a_changed_string_length_is_corrupt(tmp_path: Path) -> None:
    prefix = _written(tmp_path)
    reader = BundleReader(prefix)
    t = reader.tensors["c/strings"]
    data = Path(str(prefix) + bundle.DATA_SUFFIX)
    raw = bytearray(data.read_bytes())
    raw[t.offset + 2] = 1  # the second element's length: 0 -> 1, the sizes no longer add up
    data.write_bytes(bytes(raw))
    with pytest.raises(UnreadableBundleError):
        reader.strings("c/strings")


def test_a_changed_byte_in_the_index_is_corrupt(tmp_path: Path) -> None:
    prefix = _written(tmp_path)
    index = Path(str(prefix) + bundle.INDEX_SUFFIX)
    raw = bytearray(index.read_bytes())
    raw[3] ^= 0x20  # inside the first data block (a key's bytes)
    index.write_bytes(bytes(raw))
    with pytest.raises(CorruptBundleError, match="CRC32C"):
        BundleReader(prefix)


def test_a_short_data_file_is_unreadable_not_corrupt(tmp_path: Path) -> None:
    prefix = _written(tmp_path)
    data = Path(str(prefix) + bundle.DATA_SUFFIX)
    data.write_bytes(data.read_bytes()[:10])
    reader = BundleReader(prefix)
    with pytest.raises(UnreadableBundleError, match="ends before") as caught:
        reader.raw("c/strings")
    assert not isinstance(caught.value, CorruptBundleError)


def test_a_missing_index_is_unreadable(tmp_path: Path) -> None:
    with pytest.raises(UnreadableBundleError, match="cannot read"):
        BundleReader(tmp_path / "nothing")
