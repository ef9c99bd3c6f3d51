"""TensorFlow's sorted string table, as a tensor bundle's `.index` holds it: its constants and its reader.

The table is LevelDB's, as TensorFlow keeps it in `tsl/lib/io` (`format.h`,
`format.cc`, `block.cc`): blocks of prefix-compressed entries (`varint32
shared, varint32 unshared, varint32 value length, key suffix, value`) ending
in their restart offsets and count (fixed32 each); after each block a
trailer of its compression type (0: none, all TensorFlow writes for a bundle)
and the masked CRC32C of the block and that byte; at the end a 48-byte footer
with the handles (`varint64 offset, varint64 size`) of the metaindex and the
index block, whose entries point at the data blocks.

The one definition of these constants for the daemon's writer
(`checkpointd.bundle.table`), its bundle reader and the client's
(`checkpointd_client.restore.bundle_index`). `entries` reads every key and value,
checking each block's CRC32C as TensorFlow's reader does. Stdlib and crc32c only.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import crc32c

from checkpointd.protocol import varint

# format.h: the leading 64 bits of sha1("http://code.google.com/p/leveldb/").
MAGIC = 0xDB4775248B80FB57
FOOTER_BYTES = 48
TRAILER_BYTES = 5  # after each block: its compression type byte and masked CRC32C
NO_COMPRESSION = 0
# crc32c.h: CRCs stored beside the data they cover are rotated and offset,
# so that the CRC of a string holding CRCs is not trivially related to them.
_MASK_DELTA = 0xA282EAD8


class CorruptTableError(ValueError):
    """A block of the table fails its CRC32C: its bytes are not what was written."""


def mask(crc: int) -> int:
    """`crc32c::Mask`: the CRC rotated right by 15 bits, plus a constant (mod 2**32)."""
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def unmask(masked: int) -> int:
    """`crc32c::Unmask`, the inverse of `mask`."""
    rot = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


def block(table: bytes, handle: bytes, at: int = 0, *, check: bool = True) -> tuple[bytes, int]:
    """The block that the handle at `at` of `handle` points at, and where that handle ends.

    Raises:
        CorruptTableError: (with `check`) its CRC32C does not match its trailer.
        ValueError: the block runs past the table or is compressed.
    """
    offset, at = varint.decode(handle, at)
    size, at = varint.decode(handle, at)
    end = offset + size
    if end + TRAILER_BYTES > len(table):
        raise ValueError(f"a block at {offset} of {size} bytes runs past the index's {len(table)}")
    if table[end] != NO_COMPRESSION:
        raise ValueError("a compressed block (TensorFlow writes bundles uncompressed)")
    contents = table[offset:end]
    if check:
        (stored,) = struct.unpack_from("<I", table, end + 1)
        if crc32c.crc32c(table[end : end + 1], crc32c.crc32c(contents)) != unmask(stored):
            raise CorruptTableError(f"the block at {offset} of {size} bytes fails its CRC32C")
    return contents, at


def block_entries(contents: bytes) -> Iterator[tuple[bytes, bytes]]:
    """The (key, value) entries of one block, in order.

    Raises:
        ValueError: the block's entries run past it.
    """
    if len(contents) < 4:
        raise ValueError(f"a block of {len(contents)} bytes has no restart count")
    (restarts,) = struct.unpack_from("<I", contents, len(contents) - 4)
    end = len(contents) - 4 - 4 * restarts
    if end < 0:
        raise ValueError(f"a block of {len(contents)} bytes cannot hold {restarts} restarts")
    at, key = 0, b""
    while at < end:
        shared, at = varint.decode(contents, at)
        unshared, at = varint.decode(contents, at)
        length, at = varint.decode(contents, at)
        if shared > len(key) or at + unshared + length > end:
            raise ValueError(f"a block's entry at {at} runs past its entries")
        key = key[:shared] + contents[at : at + unshared]
        at += unshared
        yield key, contents[at : at + length]
        at += length


def entries(table: bytes, *, check: bool = True) -> Iterator[tuple[bytes, bytes]]:
    """Every (key, value) of a table file, in key order, each block's CRC32C checked (with `check`).

    Raises:
        CorruptTableError: a block fails its CRC32C.
        ValueError: the bytes are not a table (too short, wrong magic
            number, a block out of bounds or compressed).
    """
    if len(table) < FOOTER_BYTES:
        raise ValueError(f"{len(table)} bytes is too short for an index")
    low, high = struct.unpack_from("<II", table, len(table) - 8)
    if (high << 32 | low) != MAGIC:
        raise ValueError("not a TensorFlow table (wrong magic number)")
    _, at = block(table, table, len(table) - FOOTER_BYTES, check=check)  # the metaindex (empty)
    index_block, _ = block(table, table, at, check=check)
    for _, handle in block_entries(index_block):
        contents, _ = block(table, handle, check=check)
        yield from block_entries(contents)
