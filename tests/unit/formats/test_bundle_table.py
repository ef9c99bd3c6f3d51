"""The tensor bundle's pure pieces against known vectors: varints, masked CRCs, separators, blocks, protos.

TensorFlow's own writer is the reference in tests/integration/formats/test_bundle_identity.py;
these pin the pieces without it, so a regression names the piece that broke.
"""

from __future__ import annotations

import struct
from pathlib import Path

import crc32c
import pytest

from checkpointd import bundle
from checkpointd.bundle import table


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        (0, "00"),
        (1, "01"),
        (127, "7f"),
        (128, "8001"),
        (300, "ac02"),
        (2**32, "8080808010"),
        (2**64 - 1, "ff" * 9 + "01"),
    ],
)
def test_varint_is_protobufs(value: int, encoded: str) -> None:
    assert table.varint(value).hex() == encoded


def test_varint_refuses_negatives() -> None:
    with pytest.raises(ValueError, match="unsigned"):
        table.varint(-1)


def test_mask_matches_crc32c_h() -> None:
    # crc32c.h: Mask(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8.
    assert table.mask(0) == 0xA282EAD8
    crc = crc32c.crc32c(b"123456789")
    assert crc == 0xE3069283  # the CRC-32C check value
    assert table.mask(crc) == ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF
    assert table.unmask(table.mask(crc)) == crc
    assert table.mask(crc) != crc


@pytest.mark.parametrize(
    ("start", "limit", "separator"),
    [
        (b"abc", b"abe", b"abd"),  # the differing byte raised, the rest dropped
        (b"abcxyz", b"abe", b"abd"),
        (b"abc", b"abd", b"abc"),  # raising it would reach the limit: unchanged
        (b"ab", b"abc", b"ab"),  # a prefix: unchanged
        (b"a\xffz", b"b", b"a\xffz"),  # 'a'+1 == 'b' is the limit itself
        (b"\xff\x01", b"\xff\x05", b"\xff\x02"),
        (b"", b"a", b""),
    ],
)
def test_shortest_separator(start: bytes, limit: bytes, separator: bytes) -> None:
    got = table.shortest_separator(start, limit)
    assert got == separator
    assert start <= got < limit


@pytest.mark.parametrize(
    ("key", "successor"), [(b"abc", b"b"), (b"\xff\xffa", b"\xff\xffb"), (b"\xff\xff", b"\xff\xff"), (b"", b"")]
)
def test_short_successor(key: bytes, successor: bytes) -> None:
    assert table.short_successor(key) == successor


def _trailer(block: bytes) -> bytes:
    return b"\x00" + struct.pack("<I", table.mask(crc32c.crc32c(block + b"\x00")))


def test_a_small_table_byte_by_byte() -> None:
    data = table.build([(b"", b"H"), (b"ab", b"1"), (b"abc", b"22")])
    # Data block: (shared, unshared, value length, key suffix, value) per entry,
    # prefix-compressed; one restart point (0) and the count.
    block = bytes.fromhex("000001") + b"H" + bytes.fromhex("000201") + b"ab1" + bytes.fromhex("020102") + b"c22"
    block += struct.pack("<II", 0, 1)
    metaindex = struct.pack("<II", 0, 1)  # empty: its restart array alone
    meta_at = len(block) + 5
    # Index block: the short successor of the last key ("b") -> the data block's handle.
    handle = table.varint(0) + table.varint(len(block))
    index = bytes.fromhex("000102") + b"b" + handle + struct.pack("<II", 0, 1)
    index_at = meta_at + len(metaindex) + 5
    footer = (
        table.varint(meta_at) + table.varint(len(metaindex)) + table.varint(index_at) + table.varint(len(index))
    ).ljust(40, b"\x00") + bytes.fromhex("57fb808b247547db")
    expected = block + _trailer(block) + metaindex + _trailer(metaindex) + index + _trailer(index) + footer
    assert data == expected
    assert len(footer) == table.FOOTER_BYTES


def test_restart_points_every_sixteen_keys() -> None:
    keys = [b"key%03d" % i for i in range(40)]
    data = table.build([(k, b"") for k in keys])
    # One data block at offset 0; its size is the first handle in the index block.
    index_offset, _ = _handles(data)[1]
    size = _first_handle_size(data, index_offset)
    block = data[:size]
    count = struct.unpack("<I", block[-4:])[0]
    restarts = struct.unpack(f"<{count}I", block[-4 - 4 * count : -4])
    assert count == 3  # keys 0, 16 and 32
    for offset, key in zip(restarts, (keys[0], keys[16], keys[32]), strict=True):
        shared, unshared = block[offset], block[offset + 1]
        assert shared == 0
        assert block[offset + 3 : offset + 3 + unshared] == key


def test_blocks_close_at_the_block_size_and_the_index_separates_them() -> None:
    value = b"v" * 1000
    keys = [b"tensor/%06d" % i for i in range(600)]  # ~600 KB: three data blocks
    data = table.build([(k, value) for k in keys])
    index_offset, index_size = _handles(data)[1]
    index = data[index_offset : index_offset + index_size]
    count = struct.unpack("<I", index[-4:])[0]
    assert count == 3  # restart interval 1 in the index block: one per entry
    first_size = _first_handle_size(data, index_offset)
    assert table.BLOCK_SIZE <= first_size < table.BLOCK_SIZE + 1100  # closed by the entry that reached it


def test_fixed_rows_make_the_table_build_makes_for_any_tails() -> None:
    keys = [b""] + [b"model/%02d/.ATTRIBUTES/VALUE" % i for i in range(40)]  # restarts at 0, 16 and 32
    tails = [0] + [4] * 40
    fixed = table.FixedRows([(k, b"head%d" % len(k) + b"\x00" * t) for k, t in zip(keys, tails, strict=True)], tails)
    assert fixed.fits
    for seed in (1, 2):
        given = [struct.pack("<I", (seed * 2654435761 * (i + 1)) & 0xFFFFFFFF)[:t] for i, t in enumerate(tails)]
        rows = [(k, b"head%d" % len(k) + tail) for k, tail in zip(keys, given, strict=True)]
        assert fixed.build(given) == table.build(rows)
    with pytest.raises(ValueError, match="length"):
        fixed.build([b""] * len(keys))


def test_fixed_rows_of_more_than_one_block_are_built_whole() -> None:
    rows = [(b"tensor/%06d" % i, b"v" * 1000) for i in range(600)]
    fixed = table.FixedRows(rows, [4] * len(rows))
    assert not fixed.fits
    with pytest.raises(ValueError, match="one data block"):
        fixed.build([b"abcd"] * len(rows))


def test_an_index_with_a_zero_crc_is_built_whole_as_the_reference(tmp_path: Path) -> None:
    # A tensor whose masked CRC32C is 0 leaves its field out: another row size than the layout's.
    entries = [bundle.Entry("a", "uint8", (1,), 1), bundle.Entry("b", "uint8", (2,), 2)]
    writer = bundle.BundleWriter(tmp_path / "v", entries)
    writer.write(0, b"\x01")
    writer.write(1, b"xy")
    writer._crcs[0] = table.unmask(0)  # noqa: SLF001 - a CRC32C whose mask is 0, which no small input gives
    expected = table.build(
        [
            (b"", bundle.HEADER),
            (b"a", bundle.entry_proto("uint8", (1,), 0, 1, 0)),
            (b"b", bundle.entry_proto("uint8", (2,), 1, 2, table.mask(crc32c.crc32c(b"xy")))),
        ]
    )
    assert writer.index() == expected
    writer.close()


def test_keys_must_increase() -> None:
    with pytest.raises(ValueError, match="increase"):
        table.build([(b"b", b""), (b"a", b"")])


def _handles(data: bytes) -> list[tuple[int, int]]:
    footer = data[-table.FOOTER_BYTES :]
    assert footer[-8:] == struct.pack("<Q", table.MAGIC)
    at = 0
    values = []
    for _ in range(4):
        value, shift = 0, 0
        while True:
            byte = footer[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        values.append(value)
    return [(values[0], values[1]), (values[2], values[3])]


def _first_handle_size(data: bytes, index_offset: int) -> int:
    at = index_offset
    shared, unshared, vlen = data[at], data[at + 1], data[at + 2]
    assert shared == 0
    value = data[at + 3 + unshared : at + 3 + unshared + vlen]
    assert value[0] == 0  # the first block's offset
    size, shift = 0, 0
    for byte in value[1:]:
        size |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            break
    return size


def test_header_and_entry_protos() -> None:
    assert bundle.HEADER.hex() == "08011a020801"
    # dtype float32, shape [2, 0], offset 5, size 0 (absent), crc 0xa282ead8 (of no bytes).
    proto = bundle.entry_proto("float32", (2, 0), 5, 0, table.mask(0))
    assert proto == bytes.fromhex("0801" + "1206" + "12020802" + "1200" + "2005" + "35") + struct.pack("<I", 0xA282EAD8)
    # A scalar at offset 0: the shape is present though empty, offset and size absent.
    assert bundle.entry_proto("string", (), 0, 0, 0) == bytes.fromhex("08071200")


def test_string_tensors_are_lengths_checksum_bytes(tmp_path: Path) -> None:
    values = [b"ab", b"", b"x" * 200]
    entry = bundle.Entry("s", "string", (3,), bundle.string_size([2, 0, 200]))
    assert entry.size == 1 + 1 + 2 + 4 + 202
    bundle.write(tmp_path / "b", [entry], [values])
    data = (tmp_path / ("b" + bundle.DATA_SUFFIX)).read_bytes()
    lengths_crc = crc32c.crc32c(struct.pack("<III", 2, 0, 200))  # as uint32s, not the varints
    assert data == bytes.fromhex("0200c801") + struct.pack("<I", table.mask(lengths_crc)) + b"ab" + b"x" * 200


def test_the_writer_places_tensors_arriving_out_of_order(tmp_path: Path) -> None:
    entries = [bundle.Entry("b", "uint8", (3,), 3), bundle.Entry("a", "int16", (2,), 4)]
    with bundle.BundleWriter(tmp_path / "o", entries) as writer:
        assert writer.offsets == [0, 3]
        writer.write(1, b"\x01\x00")
        writer.write(0, b"xyz")
        writer.write(1, b"\x02\x00")
        index = writer.finish()
    assert (tmp_path / ("o" + bundle.DATA_SUFFIX)).read_bytes() == b"xyz\x01\x00\x02\x00"
    assert (tmp_path / ("o" + bundle.INDEX_SUFFIX)).read_bytes() == index
    expected = table.build(
        [
            (b"", bundle.HEADER),
            (b"a", bundle.entry_proto("int16", (2,), 3, 4, table.mask(crc32c.crc32c(b"\x01\x00\x02\x00")))),
            (b"b", bundle.entry_proto("uint8", (3,), 0, 3, table.mask(crc32c.crc32c(b"xyz")))),
        ]
    )
    assert index == expected


def test_the_writer_refuses_what_does_not_add_up(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="repeated"):
        bundle.BundleWriter(tmp_path / "d", [bundle.Entry("a", "int8", (), 1)] * 2)
    with pytest.raises(ValueError, match="bytes for a"):
        bundle.BundleWriter(tmp_path / "d", [bundle.Entry("a", "int32", (2,), 4)])
    with bundle.BundleWriter(tmp_path / "e", [bundle.Entry("a", "int32", (2,), 8)]) as writer:
        with pytest.raises(ValueError, match="12 bytes"):
            writer.write(0, b"\x00" * 12)
        writer.write(0, b"\x00" * 4)
        with pytest.raises(ValueError, match="4 of its 8"):
            writer.finish()
