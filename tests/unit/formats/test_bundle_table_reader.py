"""The index table's reader (checkpointd.protocol.bundle_table) and the bundle reader, on the daemon's own writer.

TensorFlow's writer is the reference in tests/integration/formats/test_bundle_reader.py;
here, without TensorFlow: what `checkpointd.bundle.table` and `bundle` write
reads back entry for entry, and a changed byte is refused.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from checkpointd import bundle
from checkpointd.bundle import table
from checkpointd.bundle.reader import BundleReader, CorruptBundleError, UnreadableBundleError, dtype_name
from checkpointd.protocol import bundle_table


def _rows(count: int) -> list[tuple[bytes, bytes]]:
    return [(f"layer_{i:05d}/kernel".encode(), bytes([i % 251]) * (i % 40)) for i in range(count)]


@pytest.mark.parametrize("count", [0, 1, 17, 20000])  # empty, one, past a restart, several blocks
def test_a_table_reads_back_what_was_built(count: int) -> None:
    rows = _rows(count)
    assert list(bundle_table.entries(table.build(rows))) == rows


def test_the_writer_and_the_client_share_one_definition() -> None:
    assert (table.MAGIC, table.FOOTER_BYTES, table.mask) == (
        bundle_table.MAGIC,
        bundle_table.FOOTER_BYTES,
        bundle_table.mask,
    )


def test_a_changed_byte_fails_its_blocks_crc() -> None:
    data = bytearray(table.build(_rows(3)))
    data[3] ^= 0x01  # the first key's first byte (after its three varints)
    with pytest.raises(bundle_table.CorruptTableError):
        list(bundle_table.entries(bytes(data)))
    assert list(bundle_table.entries(bytes(data), check=False))  # the structure still parses


def test_not_a_table_is_refused() -> None:
    data = table.build(_rows(3))
    with pytest.raises(ValueError, match="magic"):
        list(bundle_table.entries(data[:-8] + struct.pack("<Q", 1)))
    with pytest.raises(ValueError, match="too short"):
        list(bundle_table.entries(data[:20]))


def _bundle(tmp_path: Path) -> Path:
    prefix = tmp_path / "b"
    strings = [b"graph bytes", b""]
    entries = [
        bundle.Entry("a", "float32", (2,), 8),
        bundle.Entry("b", "int64", (), 8),
        bundle.Entry("c", "string", (2,), bundle.string_size([len(s) for s in strings])),
        bundle.Entry("d", "bool", (0, 3), 0),
    ]
    bundle.write(prefix, entries, [struct.pack("<2f", 1.5, -2.0), struct.pack("<q", 7), strings, b""])
    return prefix


def test_a_bundle_reads_back_what_the_daemon_wrote(tmp_path: Path) -> None:
    reader = BundleReader(_bundle(tmp_path))
    assert {k: (t.dtype, t.shape) for k, t in reader.tensors.items()} == {
        "a": ("float32", (2,)),
        "b": ("int64", ()),
        "c": ("string", (2,)),
        "d": ("bool", (0, 3)),
    }
    assert reader.raw("a") == struct.pack("<2f", 1.5, -2.0)
    assert reader.raw("b") == struct.pack("<q", 7)
    assert reader.strings("c") == [b"graph bytes", b""]
    assert reader.raw("d") == b""
    with pytest.raises(UnreadableBundleError, match="not a scalar"):
        reader.string("c")


def test_a_changed_value_byte_is_corrupt(tmp_path: Path) -> None:
    prefix = _bundle(tmp_path)
    data = Path(str(prefix) + bundle.DATA_SUFFIX)
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0x80
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptBundleError):
        BundleReader(prefix).raw("a")


def test_dtype_names_are_tensorflows() -> None:
    assert [dtype_name(n) for n in (1, 7, 19, 14, 20, 21, 11, 999)] == [
        "float32",
        "string",
        "float16",
        "bfloat16",
        "resource",
        "variant",
        "qint8",
        "DataType 999",
    ]
