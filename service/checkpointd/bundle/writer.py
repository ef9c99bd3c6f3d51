"""TensorFlow's tensor bundle, written by the daemon: `PREFIX.data-00000-of-00001` and `PREFIX.index`.

Byte for byte what `tf.raw_ops.SaveV2` writes for the same tensors in the
same order (`tensor_bundle.cc`, BundleWriter::Add and Finish, read for this
module; the index is `checkpointd.bundle.table`):

- the data file is the tensors one after another in the order they were
  added, with no padding (SaveV2's data_alignment is 1). A fixed-size
  tensor is its little-endian C-order bytes. A string tensor is each
  element's length as a varint64, the masked CRC32C of those lengths (each
  folded in as the little-endian uint32 it fits in, else uint64), then the
  elements' bytes;
- the index maps "" to the BundleHeaderProto (one shard, little-endian,
  version {producer 1}) and each key, in bytewise order, to its
  BundleEntryProto: dtype, shape (present even when empty), offset, size and
  the masked CRC32C of what the tensor wrote (for a string tensor: the
  lengths as above, the length checksum, the bytes).

`BundleWriter` takes every tensor's key, dtype, shape and size up front, in
data order, so each tensor's place in the data file is known before its
first byte: the bytes may then arrive in any order across tensors (a
policy's wire order is not its data order), each tensor's in order, and
are written where they go (`os.pwrite`) while its CRC32C is folded in.
Strings are given whole. The index is written at `finish`.

Both protos are serialized here, field by field, as protobuf's own
serializer orders them (by field number, zero values left out), so the save
path never imports TensorFlow. Stdlib and crc32c only.
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import crc32c

from checkpointd import durable
from checkpointd.bundle import crc as crc_math
from checkpointd.bundle import table
from checkpointd.protocol.tensors import ITEMSIZE, STRING

DATA_SUFFIX = ".data-00000-of-00001"
INDEX_SUFFIX = ".index"

# types.proto's DataType numbers of the dtypes a bundle written here may hold.
DATA_TYPES: dict[str, int] = {
    "float32": 1,
    "float64": 2,
    "int32": 3,
    "uint8": 4,
    "int16": 5,
    "int8": 6,
    STRING: 7,
    "complex64": 8,
    "int64": 9,
    "bool": 10,
    "bfloat16": 14,
    "uint16": 17,
    "complex128": 18,
    "float16": 19,
    "uint32": 22,
    "uint64": 23,
}

# BundleHeaderProto{num_shards: 1, endianness: LITTLE (0, so absent), version: VersionDef{producer: 1}}.
HEADER = b"\x08\x01" + b"\x1a\x02" + b"\x08\x01"

_UINT32_MAX = 0xFFFFFFFF
# A tensor's bytes are written and summed this much at a time (see BundleWriter.write).
_SLICE_BYTES = 1 << 20


@dataclass(frozen=True)
class Entry:
    """One tensor of a bundle.

    Attributes:
        key: its checkpoint key (any string but "").
        dtype: a name in DATA_TYPES.
        shape: its dimensions; () for a scalar.
        size: the bytes it takes in the data file: for a fixed-size dtype its
            value's bytes, for a string tensor `string_size` of its elements.
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    size: int


def string_size(lengths: Sequence[int]) -> int:
    """The data-file bytes of a string tensor whose elements have these lengths."""
    return sum(len(table.varint(n)) for n in lengths) + 4 + sum(lengths)


def string_entry(key: str, value: bytes) -> Entry:
    """The Entry of a scalar string tensor holding `value` (an object graph, Python state)."""
    return Entry(key, STRING, (), string_size([len(value)]))


def _string_head(values: Sequence[bytes]) -> tuple[bytes, int]:
    """A string tensor's lengths and length checksum, and the running (unmasked) CRC after them."""
    lengths = bytearray()
    crc = 0
    for value in values:
        n = len(value)
        lengths += table.varint(n)
        crc = crc32c.crc32c(struct.pack("<I", n) if n <= _UINT32_MAX else struct.pack("<Q", n), crc)
    checksum = struct.pack("<I", table.mask(crc))
    return bytes(lengths) + checksum, crc32c.crc32c(checksum, crc)


def string_bytes(values: Sequence[bytes], entry: Entry) -> tuple[bytes, int]:
    """A string tensor's bytes in the data file, and its entry's (unmasked) CRC32C.

    Raises:
        ValueError: the elements do not take the size `entry` gave.
    """
    if string_size([len(v) for v in values]) != entry.size:
        raise ValueError(f"bundle key {entry.key!r}: its strings do not take the {entry.size} bytes announced")
    head, crc = _string_head(values)
    data = head + b"".join(values)
    return data, crc32c.crc32c(data[len(head) :], crc)


def entry_proto(dtype: str, shape: Sequence[int], offset: int, size: int, masked_crc: int) -> bytes:
    """A BundleEntryProto, serialized as protobuf does (fields in number order, zeros absent)."""
    return _entry_head(dtype, shape, offset, size) + _crc_field(masked_crc)


def _entry_head(dtype: str, shape: Sequence[int], offset: int, size: int) -> bytes:
    """A BundleEntryProto's fields before its crc32c (the last field): the same for every save of a layout."""
    dims = bytearray()
    for d in shape:
        dim = b"\x08" + table.varint(d) if d else b""  # TensorShapeProto.Dim{size}
        dims += b"\x12" + table.varint(len(dim)) + dim
    out = bytearray(b"\x08" + table.varint(DATA_TYPES[dtype]))
    out += b"\x12" + table.varint(len(dims)) + dims  # shape: always set, even for a scalar
    # shard_id (3) is 0: absent.
    if offset:
        out += b"\x20" + table.varint(offset)
    if size:
        out += b"\x28" + table.varint(size)
    return bytes(out)


def _crc_field(masked_crc: int) -> bytes:
    """BundleEntryProto.crc32c (5, fixed32), absent when zero."""
    return b"\x35" + struct.pack("<I", masked_crc) if masked_crc else b""


@dataclass(frozen=True)
class _Layout:
    """What every bundle of the same entries has alike: where each tensor goes, and its index row but the CRC."""

    offsets: tuple[int, ...]  # each entry's place in the data file, in data order
    size: int  # the data file's
    order: tuple[int, ...]  # the entries in the index's (bytewise key) order
    rows: tuple[tuple[bytes, bytes], ...]  # (key, entry proto without its crc32c) in that order
    index: table.FixedRows  # the index's table when no tensor's masked CRC32C is 0 (each then a 5-byte field)


@functools.lru_cache(maxsize=256)
def _layout(entries: tuple[Entry, ...]) -> _Layout:
    """The checked layout of a bundle of `entries` (data order), made once per distinct entries.

    A run's saves write bundles of the same entries (a template's); only the
    tensors' CRC32Cs differ from save to save.

    Raises:
        ValueError: see `check_entries` (not cached: raised at every call).
    """
    check_entries(entries)
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += e.size
    order = tuple(sorted(range(len(entries)), key=lambda i: entries[i].key.encode()))
    rows = tuple(
        (entries[i].key.encode(), _entry_head(entries[i].dtype, entries[i].shape, offsets[i], entries[i].size))
        for i in order
    )
    placeholder = _crc_field(1)
    fixed = table.FixedRows(
        [(b"", HEADER), *((key, head + placeholder) for key, head in rows)], [0] + [len(placeholder) - 1] * len(rows)
    )
    return _Layout(tuple(offsets), at, order, rows, fixed)


def data_offsets(entries: Sequence[Entry]) -> tuple[int, ...]:
    """Each entry's offset in the data file (data order).

    Raises:
        ValueError: see `check_entries`.
    """
    return _layout(tuple(entries)).offsets


def check_entries(entries: Sequence[Entry]) -> None:
    """Refuses entries a bundle cannot hold: "" or a repeated key, an unknown dtype, a size that does not add up.

    Raises:
        ValueError: naming the first such entry.
    """
    seen: set[str] = set()
    for e in entries:
        if not e.key or e.key in seen:
            raise ValueError(f"bundle key {e.key!r} is empty or repeated")
        seen.add(e.key)
        if e.dtype not in DATA_TYPES:
            raise ValueError(f"bundle key {e.key!r}: dtype {e.dtype!r} cannot be written")
        if any(d < 0 for d in e.shape):
            raise ValueError(f"bundle key {e.key!r}: shape {e.shape} has a negative dimension")
        if e.dtype != STRING:
            count = 1
            for d in e.shape:
                count *= d
            if e.size != count * ITEMSIZE[e.dtype]:
                raise ValueError(f"bundle key {e.key!r}: {e.size} bytes for a {e.dtype} tensor of shape {e.shape}")


class BundleWriter:
    """Writes one tensor bundle at `prefix` from each tensor's bytes, as they come.

    Use as a context manager or call `close`: a writer closed before
    `finish` leaves its data file partly written (the caller's staging dir
    is discarded). Not thread-safe: one thread writes.
    """

    def __init__(self, prefix: Path | str, entries: Sequence[Entry]) -> None:
        """Opens the data file (new) and places every tensor in it.

        Args:
            prefix: the bundle's path prefix; its dir must exist.
            entries: every tensor, in data order.

        Raises:
            ValueError: see `check_entries`.
            OSError: the data file could not be created.
        """
        self.entries = tuple(entries)
        self._layout = _layout(self.entries)  # checks them
        self.prefix = str(prefix)
        self.offsets = list(self._layout.offsets)
        self.size = self._layout.size  # the data file's
        self._written = [0] * len(self.entries)
        self._crcs = [0] * len(self.entries)
        self._string_file_crcs: dict[int, int] = {}  # a string tensor's bytes in the data file, by index
        self._fd: int | None = os.open(
            self.prefix + DATA_SUFFIX, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666
        )

    def __enter__(self) -> BundleWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def fileno(self) -> int:
        """The data file's descriptor (for early writeback); ValueError once closed."""
        if self._fd is None:
            raise ValueError("the bundle writer is closed")
        return self._fd

    def write(self, i: int, data: object, crc: int | None = None) -> None:
        """Writes the next bytes of fixed-size tensor #`i` (data order) and folds them into its CRC32C.

        `crc`, when given, is the CRC32C of `data` already checked by the
        caller (a received chunk's): it is combined into the tensor's
        instead of summing the bytes again.

        Raises:
            ValueError: tensor `i` is a string, or `data` runs past its size.
            OSError: the write failed.
        """
        entry = self.entries[i]
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
        done = self._written[i]
        if entry.dtype == STRING:
            raise ValueError(f"bundle key {entry.key!r} is a string tensor: give it whole (write_strings)")
        if done + view.nbytes > entry.size:
            raise ValueError(f"bundle key {entry.key!r}: {done + view.nbytes} bytes for a tensor of {entry.size}")
        if crc is not None:
            self._pwrite(view, self.offsets[i] + done)
            self._crcs[i] = crc_math.combine(self._crcs[i], crc, view.nbytes)
            self._written[i] = done + view.nbytes
            return
        at, running = self.offsets[i] + done, self._crcs[i]
        # In slices, each summed right after it is copied while it is still in
        # the CPU's cache: a large tensor (from shared memory, whole) is then
        # read from memory once, not once for the copy and again for the sum.
        for start in range(0, view.nbytes, _SLICE_BYTES):
            piece = view[start : start + _SLICE_BYTES]
            self._pwrite(piece, at + start)
            running = crc32c.crc32c(piece, running)
        self._crcs[i] = running
        self._written[i] = done + view.nbytes

    def copied(self, i: int, nbytes: int, crc: int) -> None:
        """Counts the next `nbytes` of fixed-size tensor #`i` as put in place by the caller (a range copied
        into `fileno` at its offset from another bundle), their CRC32C `crc` folded into the tensor's.

        Raises:
            ValueError: tensor `i` is a string, or `nbytes` runs past its size.
        """
        entry, done = self.entries[i], self._written[i]
        if entry.dtype == STRING or done + nbytes > entry.size:
            raise ValueError(f"bundle key {entry.key!r}: {nbytes} bytes copied past its {entry.size} at {done}")
        self._crcs[i] = crc_math.combine(self._crcs[i], crc, nbytes)
        self._written[i] = done + nbytes

    def written(self, i: int) -> int:
        """The bytes of tensor #`i` written so far."""
        return self._written[i]

    def write_strings(self, i: int, values: Sequence[bytes], image: memoryview | None = None) -> None:
        """Writes string tensor #`i` (data order) whole: its elements in C order.

        With `image` (the data file's image in memory, written to the file
        later by the caller), its bytes are put there instead of written.

        Raises:
            ValueError: tensor `i` is not a string tensor, is written already,
                or the elements do not take the size its entry gave.
            OSError: the write failed.
        """
        entry = self.entries[i]
        if entry.dtype != STRING or self._written[i]:
            raise ValueError(f"bundle key {entry.key!r}: not an unwritten string tensor")
        data, crc = string_bytes(values, entry)
        at = self.offsets[i]
        if image is not None:
            image[at : at + len(data)] = data
        else:
            self._pwrite(memoryview(data), at)
        self._crcs[i] = crc
        # The entry's checksum folds the lengths in as integers, not as the varints written.
        self._string_file_crcs[i] = crc32c.crc32c(data)
        self._written[i] = entry.size

    def write_raw(self, data: object, at: int) -> None:
        """Writes `data` at offset `at` of the data file as it is: bytes the caller accounts for (`copied`).

        Raises:
            OSError: the write failed.
        """
        self._pwrite(memoryview(data).cast("B"), at)  # type: ignore[arg-type]

    def _pwrite(self, view: memoryview, at: int) -> None:
        fd = self.fileno
        while view.nbytes:
            n = os.pwrite(fd, view, at)
            view, at = view[n:], at + n

    def data_crc(self) -> int:
        """The CRC32C of the whole data file, combined from its tensors' (each is what it wrote).

        Raises:
            ValueError: a tensor is not complete.
        """
        running = 0
        for i, e in enumerate(self.entries):
            if not self.complete(i):
                raise ValueError(f"bundle key {e.key!r}: {self._written[i]} of its {e.size} bytes were written")
            running = crc_math.combine(running, self._string_file_crcs.get(i, self._crcs[i]), e.size)
        return running

    def complete(self, i: int) -> bool:
        """Whether every byte of tensor #`i` has been written."""
        return self._written[i] == self.entries[i].size

    def index(self) -> bytes:
        """The `.index` file's bytes for what was written.

        Raises:
            ValueError: a tensor is not complete.
        """
        for i, e in enumerate(self.entries):
            if not self.complete(i):
                raise ValueError(f"bundle key {e.key!r}: {self._written[i]} of its {e.size} bytes were written")
        crcs, mask = self._crcs, table.mask
        masked = [mask(crcs[i]) for i in self._layout.order]
        if self._layout.index.fits and all(masked):  # the CRC fields' bytes are all that differ from save to save
            return self._layout.index.build([b"", *(struct.pack("<I", m) for m in masked)])
        rows = [(b"", HEADER)]
        rows += [
            (key, head + _crc_field(mask(crcs[i])))
            for i, (key, head) in zip(self._layout.order, self._layout.rows, strict=True)
        ]
        return table.build(rows)

    def finish(self) -> bytes:
        """Closes the data file and writes the index (a new file); returns the index's bytes.

        Neither file is fsynced: the Store does that as it commits.

        Raises:
            ValueError: a tensor is not complete.
            OSError: a file could not be written.
        """
        index = self.index()
        self.close()
        durable.write_new(self.prefix + INDEX_SUFFIX, index)
        return index

    def close(self) -> None:
        """Closes the data file (again: nothing)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def write(prefix: Path | str, entries: Sequence[Entry], values: Sequence[object]) -> bytes:
    """Writes a whole bundle: `values[i]` is entry i's bytes (a buffer) or, for a string tensor, its elements.

    Returns:
        The index's bytes.
    """
    with BundleWriter(prefix, entries) as writer:
        for i, (e, value) in enumerate(zip(entries, values, strict=True)):
            if e.dtype == STRING:
                writer.write_strings(i, value)  # type: ignore[arg-type]
            elif e.size:
                writer.write(i, value)
        return writer.finish()
