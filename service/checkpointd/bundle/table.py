"""TensorFlow's sorted string table, the format of a tensor bundle's `.index` file.

The table is LevelDB's, as TensorFlow keeps it in `tsl/lib/io` (read for this
module: `table_builder.cc`, `block_builder.cc`, `format.cc`, `format.h`, the
defaults of `table_options.h`), written the way `BundleWriter::Finish` asks:
no compression, the default block size and restart interval, the bytewise
comparator. `build` returns the whole file for entries given in key order:

- data blocks of entries `varint32 shared, varint32 unshared, varint32
  value length, key suffix, value`, the key prefix-compressed against the
  previous one except at a restart point (every `RESTART_INTERVAL` keys),
  then each restart point's offset and their count (fixed32 each); a block is
  closed once its estimated size reaches `BLOCK_SIZE`, or before an entry of
  at least twice that;
- after each block its trailer: the type byte (0, no compression) and the
  masked CRC32C of the block and that byte;
- an empty metaindex block, then the index block (restart interval 1) that
  maps, for each data block, a key between it and the next (the shortest
  separator; after the last, the short successor) to its handle
  `varint64 offset, varint64 size`;
- the 48-byte footer: the metaindex and index handles, zero padding to 40
  bytes, the table's magic number (fixed64 as two fixed32, low word first).

`FixedRows` makes the same file for rows whose keys and value sizes stay
the same and whose values' last bytes change (a run's bundle index from save
to save: only the CRCs), from the parts made once.

The format's constants and its reader are `checkpointd.protocol.bundle_table`, shared
with the client. Stdlib and crc32c only; TensorFlow's own writer is the reference in tests.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

import crc32c

from checkpointd.protocol.bundle_table import FOOTER_BYTES, MAGIC, NO_COMPRESSION, mask, unmask
from checkpointd.protocol.varint import encode as varint

__all__ = [
    "BLOCK_SIZE",
    "FOOTER_BYTES",
    "MAGIC",
    "RESTART_INTERVAL",
    "FixedRows",
    "build",
    "mask",
    "short_successor",
    "shortest_separator",
    "unmask",
]

# table_options.h's defaults, which BundleWriter keeps (it changes only the compression).
BLOCK_SIZE = 262144
RESTART_INTERVAL = 16
_NO_COMPRESSION = bytes((NO_COMPRESSION,))
_HANDLE_MAX_BYTES = 20  # two varint64s at most


def shortest_separator(start: bytes, limit: bytes) -> bytes:
    """The bytewise comparator's FindShortestSeparator: a short key in [start, limit).

    Where the two first differ, the byte of `start` is raised by one and the
    rest dropped, if that stays below `limit`; otherwise, or if one is a
    prefix of the other, `start` itself.
    """
    common = 0
    for a, b in zip(start, limit, strict=False):
        if a != b:
            break
        common += 1
    if common >= min(len(start), len(limit)):
        return start
    byte = start[common]
    if byte < 0xFF and byte + 1 < limit[common]:
        return start[:common] + bytes((byte + 1,))
    return start


def short_successor(key: bytes) -> bytes:
    """The bytewise comparator's FindShortSuccessor: the first byte below 0xff raised, the rest dropped."""
    for i, byte in enumerate(key):
        if byte != 0xFF:
            return key[:i] + bytes((byte + 1,))
    return key


class _Block:
    """A block being built (BlockBuilder)."""

    def __init__(self, restart_interval: int) -> None:
        self._interval = restart_interval
        self._buffer = bytearray()
        self._restarts = [0]
        self._counter = 0
        self._last = b""

    @property
    def empty(self) -> bool:
        return not self._buffer

    def estimate(self) -> int:
        """CurrentSizeEstimate: the entries, the restart array and its length."""
        return len(self._buffer) + 4 * len(self._restarts) + 4

    def add(self, key: bytes, value: bytes) -> None:
        shared = 0
        if self._counter < self._interval:
            last = self._last
            limit = min(len(last), len(key))
            while shared < limit and last[shared] == key[shared]:
                shared += 1
        else:
            self._restarts.append(len(self._buffer))
            self._counter = 0
        buffer = self._buffer
        buffer += varint(shared)
        buffer += varint(len(key) - shared)
        buffer += varint(len(value))
        buffer += key[shared:]
        buffer += value
        self._last = key
        self._counter += 1

    def finish(self) -> bytes:
        restarts = self._restarts
        return bytes(self._buffer) + struct.pack(f"<{len(restarts) + 1}I", *restarts, len(restarts))


def _handle(offset: int, size: int) -> bytes:
    return varint(offset) + varint(size)


def build(entries: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The table file holding `entries` (key, value), which must come in strictly increasing key order.

    Raises:
        ValueError: a key is not greater than the one before it.
    """
    out = bytearray()

    def write_block(block: _Block) -> bytes:
        contents = block.finish()
        handle = _handle(len(out), len(contents))
        crc = crc32c.crc32c(_NO_COMPRESSION, crc32c.crc32c(contents))
        out.extend(contents)
        out.extend(_NO_COMPRESSION + struct.pack("<I", mask(crc)))
        return handle

    data = _Block(RESTART_INTERVAL)
    index = _Block(1)
    last: bytes | None = None
    pending: bytes | None = None  # the handle of the last block written, waiting for the next key
    for key, value in entries:
        if last is not None:
            if key <= last:
                raise ValueError(f"table keys must increase: {key!r} after {last!r}")
            if len(key) + len(value) >= 2 * BLOCK_SIZE and not data.empty:
                pending = write_block(data)
                data = _Block(RESTART_INTERVAL)
        if pending is not None:
            assert last is not None
            index.add(shortest_separator(last, key), pending)
            pending = None
        last = key
        data.add(key, value)
        if data.estimate() >= BLOCK_SIZE:
            pending = write_block(data)
            data = _Block(RESTART_INTERVAL)
    if not data.empty:
        pending = write_block(data)
    metaindex = write_block(_Block(RESTART_INTERVAL))
    if pending is not None:
        assert last is not None
        index.add(short_successor(last), pending)
    index_handle = write_block(index)
    footer = (metaindex + index_handle).ljust(2 * _HANDLE_MAX_BYTES, b"\x00")
    out.extend(footer + struct.pack("<II", MAGIC & 0xFFFFFFFF, MAGIC >> 32))
    return bytes(out)


class FixedRows:
    """The table of rows whose keys and value sizes never change, only each value's last bytes (a bundle's CRCs).

    Made once from the rows with any tails; `build(tails)` is then what
    `build` returns for the same rows with those tails, from the parts that
    do not change: the entries' headers and fixed bytes, the restarts, the
    metaindex, index and footer. Only a table of one data block is made so
    (a bundle index under `BLOCK_SIZE`, any policy's); `fits` is False for
    others, which `build` makes whole.
    """

    def __init__(self, rows: Sequence[tuple[bytes, bytes]], tails: Sequence[int]) -> None:
        """Args:
        rows: (key, value) in strictly increasing key order, each value ending in its tail.
        tails: each row's tail length in bytes (0: the whole value is fixed).
        """
        self._tails = tuple(tails)
        fixed: list[bytes] = []
        restarts = [0]
        size, counter, last = 0, 0, b""
        for key, value in rows:
            shared = 0
            if counter < RESTART_INTERVAL:
                limit = min(len(last), len(key))
                while shared < limit and last[shared] == key[shared]:
                    shared += 1
            else:
                restarts.append(size)
                counter = 0
            head = varint(shared) + varint(len(key) - shared) + varint(len(value)) + key[shared:]
            fixed.append(head + value[: len(value) - self._tails[len(fixed)]])
            size += len(head) + len(value)
            last, counter = key, counter + 1
        self._fixed = fixed
        self._restarts = struct.pack(f"<{len(restarts) + 1}I", *restarts, len(restarts))
        whole = build(rows)
        contents = self._contents([value[len(value) - t :] for (_, value), t in zip(rows, self._tails, strict=True)])
        self._suffix = whole[len(contents) + 5 :]  # after the data block's trailer
        # One data block, and the same bytes as `build`: else `build` it is, every time.
        self.fits = bool(rows) and self._table(contents) == whole

    def _contents(self, tails: Sequence[bytes]) -> bytes:
        parts = []
        for fixed, tail in zip(self._fixed, tails, strict=True):
            parts.append(fixed)
            parts.append(tail)
        parts.append(self._restarts)
        return b"".join(parts)

    def _table(self, contents: bytes) -> bytes:
        crc = crc32c.crc32c(_NO_COMPRESSION, crc32c.crc32c(contents))
        return contents + _NO_COMPRESSION + struct.pack("<I", mask(crc)) + self._suffix

    def build(self, tails: Sequence[bytes]) -> bytes:
        """The table with these tails (each of its row's tail length), as `build` makes it; only if `fits`."""
        if not self.fits:
            raise ValueError("these rows do not fit one data block: build them whole")
        if [len(t) for t in tails] != list(self._tails):
            raise ValueError("a tail of another length than its row's")
        return self._table(self._contents(tails))
