"""The daemon's tensor bundle is byte for byte what TensorFlow's SaveV2 writes, and TensorFlow reads it back.

A property test draws random tensor sets (every dtype a TF-Agents policy,
agent, optimizer, replay buffer or metric holds, strings, scalars, empty
and zero-size shapes, keys with shared prefixes and non-ASCII characters),
writes them with `checkpointd.bundle` and with `tf.raw_ops.SaveV2`
in the same order, and compares both files byte for byte; then
`tf.train.load_checkpoint` reads every value back from the daemon's copy.
Fixed cases cover an index of several blocks and keys longer than a block.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpointd import bundle
from checkpointd.bundle import table

# Every dtype the wire carries (checkpointd.protocol.tensors.ITEMSIZE), and strings.
NUMERIC = (
    "float16 bfloat16 float32 float64 int8 int16 int32 int64 uint8 uint16 uint32 uint64 bool complex64 complex128"
).split()
DTYPES = (*NUMERIC, "string")
DRAWS = 300

_PREFIXES = ("", "agent/_optimizer/", "agent/_q_network/", "policy/_wrapped/ü/", "a", "ab")


def _np_dtype(name: str) -> np.dtype:
    return np.dtype(tf.as_dtype(name).as_numpy_dtype)


@st.composite
def tensors(draw: st.DrawFn) -> list[tuple[str, str, tuple[int, ...], Any]]:
    """A list of (key, dtype, shape, value) with distinct keys; value is an ndarray or, for strings, a list of bytes."""
    count = draw(st.integers(1, 12))
    keys = draw(
        st.lists(
            st.tuples(st.sampled_from(_PREFIXES), st.text(min_size=0, max_size=12)).map("".join).filter(bool),
            min_size=count,
            max_size=count,
            unique=True,
        )
    )
    out = []
    for key in keys:
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        n = int(np.prod(shape, dtype=np.int64))
        if dtype == "string":
            value: Any = draw(st.lists(st.binary(max_size=40), min_size=n, max_size=n))
        elif dtype == "bool":
            value = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), np.bool_).reshape(shape)
        else:
            raw = draw(st.binary(min_size=n * _np_dtype(dtype).itemsize, max_size=n * _np_dtype(dtype).itemsize))
            value = np.frombuffer(raw, _np_dtype(dtype)).reshape(shape)  # any bit pattern: NaNs, denormals
        out.append((key, dtype, shape, value))
    return out


def _both(tmp: Path, items: list[tuple[str, str, tuple[int, ...], Any]]) -> tuple[Path, Path]:
    """Writes `items` with SaveV2 (prefix `tf`) and with the bundle writer (prefix `ours`)."""
    tf_values = [
        tf.constant(np.array(v, dtype=object).reshape(s) if d == "string" else v, dtype=tf.as_dtype(d))
        for _, d, s, v in items
    ]
    tf.raw_ops.SaveV2(
        prefix=str(tmp / "tf"),
        tensor_names=[k for k, *_ in items],
        shape_and_slices=[""] * len(items),
        tensors=tf_values,
    )
    entries, values = [], []
    for key, dtype, shape, value in items:
        if dtype == "string":
            entries.append(bundle.Entry(key, dtype, shape, bundle.string_size([len(x) for x in value])))
            values.append(value)
        else:
            data = np.ascontiguousarray(value).tobytes()
            entries.append(bundle.Entry(key, dtype, shape, len(data)))
            values.append(data)
    bundle.write(tmp / "ours", entries, values)
    return tmp / "tf", tmp / "ours"


def _assert_identical(theirs: Path, ours: Path) -> None:
    for suffix in (bundle.DATA_SUFFIX, bundle.INDEX_SUFFIX):
        expected = Path(str(theirs) + suffix).read_bytes()
        got = Path(str(ours) + suffix).read_bytes()
        assert got == expected, f"{suffix}: {len(got)} bytes against SaveV2's {len(expected)}"


def _assert_reads_back(ours: Path, items: list[tuple[str, str, tuple[int, ...], Any]]) -> None:
    reader = tf.train.load_checkpoint(str(ours))
    dtypes = reader.get_variable_to_dtype_map()
    assert set(dtypes) == {k for k, *_ in items}
    for key, dtype, shape, value in items:
        got = reader.get_tensor(key)
        assert dtypes[key] == tf.as_dtype(dtype)
        assert tuple(np.shape(got)) == shape
        if dtype == "string":
            assert [bytes(x) for x in np.asarray(got, dtype=object).reshape(-1)] == value
        else:
            assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(value).tobytes()


@settings(max_examples=DRAWS, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=tensors())
def test_random_tensor_sets_are_what_savev2_writes(tmp_path_factory: pytest.TempPathFactory, items: list) -> None:
    tmp = tmp_path_factory.mktemp("draw")
    theirs, ours = _both(tmp, items)
    _assert_identical(theirs, ours)
    _assert_reads_back(ours, items)


def _index_blocks(index: bytes) -> int:
    """How many data blocks a table's index block points to (its restart count: one per entry)."""
    footer = index[-table.FOOTER_BYTES :]
    numbers, at = [], 0
    for _ in range(4):
        value = shift = 0
        while True:
            byte = footer[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        numbers.append(value)
    offset, size = numbers[2], numbers[3]
    return struct.unpack("<I", index[offset + size - 4 : offset + size])[0]


def test_thousands_of_keys_make_an_index_of_several_blocks(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    items = []
    for i in range(12000):
        dtype = NUMERIC[i % len(NUMERIC)]
        value = rng.integers(0, 2, size=(i % 3,), dtype=np.uint8).astype(_np_dtype(dtype))
        items.append((f"agent/_q_network/layer_{i:05d}/kernel/.ATTRIBUTES/VARIABLE_VALUE", dtype, (i % 3,), value))
    items.append(("_CHECKPOINTABLE_OBJECT_GRAPH", "string", (), [bytes(rng.integers(0, 256, 5000, np.uint8))]))
    theirs, ours = _both(tmp_path, items)
    _assert_identical(theirs, ours)
    assert _index_blocks(Path(str(ours) + bundle.INDEX_SUFFIX).read_bytes()) > 1
    _assert_reads_back(ours, items)


def test_keys_longer_than_a_block(tmp_path: Path) -> None:
    items = [
        ("a", "int32", (), np.array(1, np.int32)),
        ("k" * (2 * table.BLOCK_SIZE + 5), "float32", (2,), np.array([1, 2], np.float32)),
        ("l", "string", (), [b"after"]),
    ]
    theirs, ours = _both(tmp_path, items)
    _assert_identical(theirs, ours)
    _assert_reads_back(ours, items)


def test_large_tensors_written_in_pieces_out_of_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((300, 257)).astype(np.float32), rng.integers(0, 9, (70001,), np.int64)]
    items = [("w", "float32", (300, 257), arrays[0]), ("step", "int64", (70001,), arrays[1])]
    theirs, _ = _both(tmp_path, items)
    entries = [bundle.Entry(k, d, s, v.nbytes) for k, d, s, v in items]
    with bundle.BundleWriter(tmp_path / "pieces", entries) as writer:
        views = [memoryview(a.tobytes()) for a in arrays]
        for at in range(0, max(v.nbytes for v in views), 65536):  # interleaved, each tensor in order
            for i in (1, 0):
                if at < views[i].nbytes:
                    writer.write(i, views[i][at : at + 65536])
        writer.finish()
    _assert_identical(theirs, tmp_path / "pieces")
