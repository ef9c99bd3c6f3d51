"""A tensor bundle read back: every key's dtype, shape and bytes, each tensor's CRC32C checked.

What `tf.train.load_checkpoint(prefix)` gives the daemon, without TensorFlow:
the index (`PREFIX.index`, the table `checkpointd.protocol.bundle_table`
reads, each block's CRC32C checked) maps "" to the BundleHeaderProto and each
key to its BundleEntryProto (`checkpointd.v1.tf_formats_pb2`, wire-identical
with TensorFlow's); a tensor's bytes are read from its shard
(`PREFIX.data-SSSSS-of-NNNNN`) at its offset and checked against the entry's
masked CRC32C, as TensorFlow's `BundleReader` does before it returns a
value. A fixed-size tensor's bytes are its little-endian C-order value; a
string tensor's are its elements' varint64 lengths, the masked CRC32C of the
lengths, then the elements (`checkpointd.bundle` writes both).

Errors: `CorruptBundleError` where a checksum fails (TensorFlow's DataLoss),
`UnreadableBundleError` where the files are missing, short or not a bundle,
`InvalidRequestError` where a link was put in the files' way (never followed:
every file is opened by `checkpointd.durable.dirs.open_file`).
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass

import crc32c
from google.protobuf import message

from checkpointd.bundle.writer import DATA_TYPES, INDEX_SUFFIX
from checkpointd.durable import dirs
from checkpointd.protocol import bundle_table, varint
from checkpointd.protocol.errors import InvalidRequestError
from checkpointd.protocol.tensors import ITEMSIZE, STRING
from checkpointd.v1 import tf_formats_pb2

_NAMES = {number: name for name, number in DATA_TYPES.items()}
_UINT32_MAX = 0xFFFFFFFF


class UnreadableBundleError(Exception):
    """The bundle's files are missing, short, or not a tensor bundle."""


class CorruptBundleError(UnreadableBundleError):
    """A checksum of the bundle fails: its bytes are not what was written."""


def dtype_name(number: int) -> str:
    """A DataType number's name as TensorFlow's `tf.DType.name` spells it ("float32", "string", "resource")."""
    if number in _NAMES:
        return _NAMES[number]
    try:
        return tf_formats_pb2.DataType.Name(number).removeprefix("DT_").lower()
    except ValueError:
        return f"DataType {number}"


@dataclass(frozen=True)
class Tensor:
    """One entry of a bundle's index."""

    dtype: str  # dtype_name of its DataType
    shape: tuple[int, ...]
    shard: int
    offset: int
    size: int
    masked_crc: int


class BundleReader:
    """A bundle's index, read and checked at open; its tensors read on demand.

    Args:
        prefix: the bundle's prefix (`<dir>/variables/variables`); with
            `below`, relative to it ('/'-separated).
        below: the dir (its path, or an open fd) below which no link is
            followed; default: the prefix's own dir.

    Raises:
        CorruptBundleError: an index block fails its CRC32C.
        UnreadableBundleError: the index is missing or is not a bundle's.
        InvalidRequestError: a component below `below` is a link.
    """

    def __init__(self, prefix: str | os.PathLike[str], *, below: str | int | None = None) -> None:
        self._prefix = os.fspath(prefix)  # as errors name it
        if below is None:
            below, self._name = os.path.split(self._prefix)
            below = below or "."
        else:
            self._name = self._prefix
        self._below = below
        try:
            with open(self._open(INDEX_SUFFIX), "rb") as f:
                index = f.read()
        except OSError as e:
            raise UnreadableBundleError(f"cannot read {self._prefix}{INDEX_SUFFIX} ({e.strerror or e})") from None
        self.tensors: dict[str, Tensor] = {}
        header = None
        try:
            for key, value in bundle_table.entries(index):
                if not key:
                    header = tf_formats_pb2.BundleHeaderProto.FromString(value)
                    continue
                entry = tf_formats_pb2.BundleEntryProto.FromString(value)
                if entry.slices:
                    raise UnreadableBundleError(f"{key.decode(errors='replace')!r} is a sliced tensor")
                self.tensors[key.decode()] = Tensor(
                    dtype_name(entry.dtype),
                    tuple(d.size for d in entry.shape.dim),
                    entry.shard_id,
                    entry.offset,
                    entry.size,
                    entry.crc32c,
                )
        except bundle_table.CorruptTableError as e:
            raise CorruptBundleError(f"{self._prefix}{INDEX_SUFFIX} is corrupt ({e})") from None
        except (ValueError, message.DecodeError, UnicodeDecodeError) as e:
            raise UnreadableBundleError(f"{self._prefix}{INDEX_SUFFIX} is not a readable bundle index ({e})") from None
        if header is None:
            raise UnreadableBundleError(f"{self._prefix}{INDEX_SUFFIX} has no header entry")
        if header.endianness != tf_formats_pb2.BundleHeaderProto.LITTLE:
            raise UnreadableBundleError(f"{self._prefix}{INDEX_SUFFIX} is a big-endian bundle")
        self.num_shards = header.num_shards
        for name, t in self.tensors.items():
            if not 0 <= t.shard < self.num_shards:
                raise UnreadableBundleError(f"{name!r} is in shard {t.shard} of {self.num_shards}")

    def shard_path(self, shard: int) -> str:
        """The data file of shard `shard`."""
        return f"{self._prefix}{self._shard_suffix(shard)}"

    def _shard_suffix(self, shard: int) -> str:
        return f".data-{shard:05d}-of-{self.num_shards:05d}"

    def _open(self, suffix: str) -> int:
        """The bundle's file `<prefix><suffix>`, opened following no link below `below`."""
        try:
            return dirs.open_file(self._below, self._name + suffix)
        except dirs.Moved as e:
            raise InvalidRequestError(
                f"{self._prefix}{suffix}: {e}, put in the save's way after it was committed; it is not followed "
                "and nothing was read through it: keep links out of the run's folder"
            ) from None

    def raw(self, key: str) -> bytes:
        """A tensor's bytes in its shard, checked against its entry's CRC32C (a string's as TensorFlow sums it).

        Raises:
            KeyError: no such key.
            CorruptBundleError: its bytes fail their CRC32C.
            UnreadableBundleError: its shard is missing or shorter than the index says.
        """
        t = self.tensors[key]
        path = self.shard_path(t.shard)
        try:
            fd = self._open(self._shard_suffix(t.shard))
            try:
                data = os.pread(fd, t.size, t.offset)
            finally:
                os.close(fd)
        except OSError as e:
            raise UnreadableBundleError(f"cannot read {path} ({e.strerror or e})") from None
        if len(data) != t.size:
            raise UnreadableBundleError(f"{path} ends before {key!r} ({len(data)} of its {t.size} bytes)")
        crc = _string_crc(key, t, data) if t.dtype == STRING else crc32c.crc32c(data)
        if bundle_table.mask(crc) != t.masked_crc:
            raise CorruptBundleError(f"{key!r} in {path} fails its CRC32C")
        if t.dtype != STRING and t.dtype in ITEMSIZE and len(data) != math.prod(t.shape) * ITEMSIZE[t.dtype]:
            raise UnreadableBundleError(f"{key!r} holds {len(data)} bytes for {t.dtype}{list(t.shape)}")
        return data

    def strings(self, key: str) -> list[bytes]:
        """A string tensor's elements, in C order.

        Raises:
            As `raw`; UnreadableBundleError too where `key` is not a string tensor.
        """
        t = self.tensors[key]
        if t.dtype != STRING:
            raise UnreadableBundleError(f"{key!r} is {t.dtype}, not a string tensor")
        return _split(key, math.prod(t.shape), self.raw(key))

    def string(self, key: str) -> bytes:
        """A scalar string tensor's value (an object graph, Python state)."""
        if self.tensors[key].shape != ():
            raise UnreadableBundleError(f"{key!r} is not a scalar")
        return self.strings(key)[0]


def _lengths(key: str, count: int, data: bytes) -> tuple[list[int], int]:
    lengths, at = [], 0
    try:
        for _ in range(count):
            n, at = varint.decode(data, at)
            lengths.append(n)
    except ValueError:
        raise UnreadableBundleError(f"{key!r}: its string lengths run past its bytes") from None
    if at + 4 + sum(lengths) != len(data):
        raise UnreadableBundleError(f"{key!r}: its string lengths do not add up to its {len(data)} bytes")
    return lengths, at


def _string_crc(key: str, t: Tensor, data: bytes) -> int:
    """What BundleWriter sums for a string tensor: each length as a fixed-width integer, the length checksum, the bytes."""
    lengths, at = _lengths(key, math.prod(t.shape), data)
    crc = 0
    for n in lengths:
        crc = crc32c.crc32c(struct.pack("<I", n) if n <= _UINT32_MAX else struct.pack("<Q", n), crc)
    (stored,) = struct.unpack_from("<I", data, at)
    if bundle_table.mask(crc) != stored:
        raise CorruptBundleError(f"{key!r}: its string lengths fail their CRC32C")
    return crc32c.crc32c(data[at:], crc)


def _split(key: str, count: int, data: bytes) -> list[bytes]:
    lengths, at = _lengths(key, count, data)
    at += 4
    out = []
    for n in lengths:
        out.append(data[at : at + n])
        at += n
    return out
