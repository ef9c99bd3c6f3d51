"""Wire codecs both sides share: chunks, byte order, the buffer layout, messages.

One definition of each, used by the client and the daemon alike:
- chunks: `chunk` encodes one (data, offset, path) with its CRC32C and
  `check_chunk` checks one as it arrives; `chunks` cuts buffers into them
  (snapshots, and Restore's answer), `save_request_chunks` the same already
  serialized as SaveRequests, and `template_chunks` a template's files;
- byte order: `little_endian` (the wire's, whatever the host's);
- layout: `ALIGNMENT` and `aligned_offsets`, where each part of a received
  snapshot starts in the daemon's buffer;
- messages: `variable_to_pb`, `numpy_state_to_pb` and `training_checkpoint_to_pb`.

No NumPy import: arrays are handled through their own methods, so this
module stays as light as the protocol it serves.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import crc32c
from google.protobuf.message import DecodeError

from checkpointd.protocol import varint
from checkpointd.protocol.errors import ChecksumError, InvalidRequestError
from checkpointd.v1 import checkpointd_pb2 as pb

# Anything memoryview() takes: bytes, bytearray, memoryview, a uint8 array.
Buffer = Any

# The largest payload of one chunk either side sends unless told otherwise
# (a snapshot, a template, Restore's answer): well under gRPC's 4 MiB message limit.
CHUNK_BYTES = 1 << 20
# RestoreFiles' chunks: fewer, larger messages move a file's bytes faster; still under 4 MiB.
FILE_CHUNK_BYTES = 3 << 20


# Chunks.


def chunk(data: Buffer, offset: int, path: str = "") -> pb.Chunk:
    """One chunk of `data` at `offset` (in `path`, for a template file), with its CRC32C."""
    data = bytes(data)
    return pb.Chunk(path=path, offset=offset, data=data, crc32c=crc32c.crc32c(data))


def crc32c_of(data: Buffer, value: int = 0) -> int:
    """The CRC32C (Castagnoli) of `data`, as chunks and save manifests carry it; `value`: of what came before."""
    return crc32c.crc32c(data, value)


def check_chunk(chunk: pb.Chunk | ChunkView, expected_offset: int, limit: int, what: str) -> Buffer:
    """Refuses a chunk out of order, past `limit` bytes, or with a wrong CRC32C.

    Returns:
        The chunk's data, read once: every read of a message's bytes field
        copies it, so the caller keeps this instead of reading it again.

    Raises:
        InvalidRequestError: out of order, or past `limit`.
        ChecksumError: the CRC32C does not match the data.
    """
    data = chunk.data
    if chunk.offset != expected_offset:
        raise InvalidRequestError(
            f"{what}: chunk at offset {chunk.offset}, expected {expected_offset} (chunks in order)"
        )
    if chunk.offset + len(data) > limit:
        raise InvalidRequestError(
            f"{what}: data runs past the announced {limit} bytes (chunk at {chunk.offset} of {len(data)} bytes)"
        )
    if crc32c.crc32c(data) != chunk.crc32c:  # the GIL is released while it sums
        raise ChecksumError(f"{what}: CRC32C mismatch in the chunk at offset {chunk.offset}")
    return data


class ChunkView:
    """A Chunk parsed by `parse_save_request`: its data a view of the received message, not a copy."""

    __slots__ = ("path", "offset", "data", "crc32c")

    def __init__(self, path: str, offset: int, data: memoryview, crc32c: int) -> None:
        self.path, self.offset, self.data, self.crc32c = path, offset, data, crc32c


class ChunkRequest:
    """A SaveRequest that holds a chunk and nothing else, as `parse_save_request` reads one."""

    __slots__ = ("chunk",)

    def __init__(self, chunk: ChunkView) -> None:
        self.chunk = chunk

    def WhichOneof(self, group: str) -> str | None:  # noqa: N802 - the message's own method, duck-typed
        return "chunk" if group == "item" else None


class MalformedRequest:
    """A Save call's message that is not a SaveRequest: reading it raises InvalidRequestError, saying why."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def WhichOneof(self, group: str) -> str | None:  # noqa: N802 - the message's own method, duck-typed
        raise InvalidRequestError(
            f"Save: a message is not a SaveRequest that protobuf can decode ({self.reason}); build the "
            "messages from protos/checkpointd/v1/checkpointd.proto"
        )


def parse_save_request(data: bytes) -> pb.SaveRequest | ChunkRequest | MalformedRequest:
    """A Save call's message: a chunk as a `ChunkRequest` whose data is a view of `data`; else a SaveRequest.

    The daemon's deserializer of Save. A message's bytes field is copied by
    the parse and again by each read of it: for a snapshot's chunks, the
    daemon's largest CPU cost after their CRC32Cs. A
    message laid out as `encoded_chunk` writes one (its fields once each,
    nothing else) is read here without a copy; any other is left to
    `SaveRequest.FromString`, so it means exactly what protobuf says. Bytes
    protobuf cannot decode become a `MalformedRequest`, which the handler
    refuses as INVALID_ARGUMENT when it reads it (a deserializer that raises
    makes gRPC answer INTERNAL, "Exception deserializing request!").
    """
    fast = _chunk_view(data)
    if fast is not None:
        return ChunkRequest(fast)
    try:
        return pb.SaveRequest.FromString(data)
    except DecodeError as e:
        return MalformedRequest(str(e) or type(e).__name__)


# Chunk's fields with their wire types: path (1, bytes), offset (2, varint), data (3, bytes), crc32c (4, fixed32).
_CHUNK_TAGS = frozenset((0x0A, 0x10, 0x1A, 0x25))


def _chunk_view(data: bytes) -> ChunkView | None:
    """The chunk of a SaveRequest holding only one, fields once each; None for anything else."""
    if data[:1] != b"\x12":
        return None
    try:
        length, at = varint.decode(data, 1)
        if at + length != len(data):
            return None
        path, offset, view, crc = "", 0, None, 0
        seen = 0
        while at < len(data):
            tag, at = varint.decode(data, at)
            if tag not in _CHUNK_TAGS or seen & (1 << (tag >> 3)):
                return None  # another field, or one twice (the last wins): FromString's to read
            seen |= 1 << (tag >> 3)
            if tag == 0x10:  # offset
                offset, at = varint.decode(data, at)
                if offset >> 64:
                    return None
            elif tag == 0x25:  # crc32c
                if at + 4 > len(data):
                    return None
                crc = int.from_bytes(data[at : at + 4], "little")
                at += 4
            else:  # path, data: length-delimited
                size, at = varint.decode(data, at)
                if at + size > len(data):
                    return None
                if tag == 0x0A:
                    path = data[at : at + size].decode("utf-8")
                else:
                    view = memoryview(data)[at : at + size]
                at += size
    except (ValueError, UnicodeDecodeError):
        return None
    return ChunkView(path, offset, view if view is not None else memoryview(b""), crc)


def check_chunk_bytes(chunk_bytes: int) -> None:
    """Raises ValueError unless `chunk_bytes` is a positive int."""
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive int, saw {chunk_bytes!r}")


def slices(parts: Iterable[Buffer], chunk_bytes: int) -> Iterator[tuple[int, memoryview]]:
    """(offset, slice) over the concatenation of `parts`, never concatenating them.

    Each slice lies within one part and holds at most `chunk_bytes`; offsets
    are contiguous over the concatenation; empty parts yield nothing. Slices
    are views: nothing is copied here.

    Raises:
        ValueError: `chunk_bytes` is not a positive int.
    """
    check_chunk_bytes(chunk_bytes)
    offset = 0
    for part in parts:
        view = memoryview(part).cast("B")
        for start in range(0, len(view), chunk_bytes):
            data = view[start : start + chunk_bytes]
            yield offset, data
            offset += len(data)


def chunks(parts: Iterable[Buffer], chunk_bytes: int) -> Iterator[pb.Chunk]:
    """`slices` as Chunk messages, each slice copied once, lazily, as it is taken."""
    for offset, data in slices(parts, chunk_bytes):
        yield chunk(data, offset)


def save_request_chunks(parts: Iterable[Buffer], chunk_bytes: int) -> Iterator[bytes]:
    """`chunks`, each already serialized as `SaveRequest(chunk=...)`, byte for byte.

    Building Chunk messages copies each slice three times (to bytes, into the
    Chunk, into the SaveRequest) before gRPC serializes it, a fourth; here
    the slice is copied once, joined straight after its few header bytes.
    """
    for offset, data in slices(parts, chunk_bytes):
        yield encoded_chunk(offset, data, crc32c.crc32c(data))


def encoded_chunk(offset: int, data: Buffer, crc: int, path: str = "") -> bytes:
    """`SaveRequest(chunk=Chunk(path=path, offset=offset, data=data, crc32c=crc))`, serialized, `data` copied once.

    The same bytes are a `RestoreFilesResponse(chunk=...)`: both hold the chunk as field 2.
    """
    # Chunk fields in number order, proto3 defaults omitted, as upb writes them.
    name = path.encode()
    head = (b"\x0a" + varint.encode(len(name)) + name if name else b"") + (
        b"\x10" + varint.encode(offset) if offset else b""
    )
    head += b"\x1a" + varint.encode(len(data))
    tail = b"\x25" + crc.to_bytes(4, "little") if crc else b""
    body = len(head) + len(data) + len(tail)
    return b"".join((b"\x12", varint.encode(body), head, data, tail))  # SaveRequest.chunk = 2


def template_files(root: str | os.PathLike[str]) -> list[str]:
    """Every regular file under `root`, sorted (the order a template is sent in)."""
    found: list[str] = []
    for dirpath, _, filenames in os.walk(root):
        found.extend(os.path.join(dirpath, name) for name in filenames)
    return sorted(found)


def template_size(root: str | os.PathLike[str]) -> int:
    """The bytes of every file under `root`: a RegisterRunHeader's `template_bytes`."""
    return sum(os.path.getsize(p) for p in template_files(root))


def template_chunks(root: str | os.PathLike[str], chunk_bytes: int) -> Iterator[pb.Chunk]:
    """Chunks of every file under `root`, the template rules of RegisterRun.

    Files come in sorted path order, each whole before the next, paths
    relative and '/'-separated, offsets per file; an empty file is one chunk
    with no data. Files are read as the chunks are taken.

    Raises:
        ValueError: `chunk_bytes` is not a positive int.
    """
    check_chunk_bytes(chunk_bytes)
    for path in template_files(root):
        relative = os.path.relpath(path, root).replace(os.sep, "/")
        with open(path, "rb") as f:
            empty = True
            for offset, data in slices(iter(functools.partial(f.read, chunk_bytes), b""), chunk_bytes):
                empty = False
                yield chunk(data, offset, relative)
            if empty:
                yield chunk(b"", 0, relative)


# Byte order.


def little_endian(array: Any) -> Any:
    """`array` (a NumPy array) as C-contiguous memory of little-endian bytes, the wire order.

    The array itself when it already is (every platform TF ships for); else a
    copy. A big-endian array is byte-swapped in memory and keeps its dtype
    label, so read the result as bytes only.
    """
    if not array.flags.c_contiguous:
        array = array.copy(order="C")
    order = array.dtype.byteorder
    if array.dtype.itemsize > 1 and (order == ">" or (order == "=" and sys.byteorder == "big")):
        array = array.byteswap()
    return array


def byte_view(array: Any) -> memoryview:
    """The wire bytes of a NumPy array, as a flat memoryview (a view unless a copy is needed)."""
    return memoryview(little_endian(array).reshape(-1).view("uint8"))


# Where each part of a received snapshot starts in the daemon's buffer. The
# wire carries the parts back to back; here each starts on a 64-byte
# boundary, Eigen's alignment, so TensorFlow can wrap a variable's bytes as a
# tensor without copying them (checkpointd.formats.policy).
ALIGNMENT = 64


def aligned_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Each part's offset in the buffer, and the buffer's size."""
    offsets, end = [], 0
    for size in sizes:
        end = -(-end // ALIGNMENT) * ALIGNMENT
        offsets.append(end)
        end += size
    return offsets, end


# Messages.


class VariableLike(Protocol):
    """A variable as both sides describe it (the client's binding, the daemon's VariableSpec)."""

    @property
    def key(self) -> str: ...

    @property
    def checkpoint_key(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> Sequence[int]: ...


def variable_to_pb(v: VariableLike) -> pb.Variable:
    return pb.Variable(key=v.key, checkpoint_key=v.checkpoint_key, dtype=v.dtype, shape=v.shape)


def numpy_state_to_pb(object_graph: bytes, entries: Iterable[tuple[str, int]]) -> pb.NumpyState:
    """A NumpyState message from its object graph and (checkpoint_key, nbytes) entries, in payload order."""
    return pb.NumpyState(
        object_graph=object_graph,
        entries=[pb.NumpyStateEntry(checkpoint_key=key, nbytes=size) for key, size in entries],
    )


class TensorLike(Protocol):
    """A training checkpoint's tensor as both sides describe it."""

    @property
    def checkpoint_key(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> Sequence[int]: ...

    @property
    def nbytes(self) -> int: ...


def training_checkpoint_to_pb(
    object_graph: bytes,
    tensors: Iterable[TensorLike],
    max_to_keep: int | None = None,
    keep_checkpoint_every_n_hours: float | None = None,
) -> pb.TrainingCheckpoint:
    """A TrainingCheckpoint message; None (keep all, off) travels as 0."""
    return pb.TrainingCheckpoint(
        object_graph=object_graph,
        tensors=[
            pb.Tensor(checkpoint_key=t.checkpoint_key, dtype=t.dtype, shape=t.shape, nbytes=t.nbytes) for t in tensors
        ],
        max_to_keep=max_to_keep or 0,
        keep_checkpoint_every_n_hours=keep_checkpoint_every_n_hours or 0.0,
    )
