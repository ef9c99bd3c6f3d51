"""Standby slots: a trainer's newest snapshot, where the daemon can write it once the trainer is gone.

A continuous `RemoteCheckpointer` on the daemon's host copies its newest
snapshot, between durable saves, into one of two slot files it made in the
daemon's shared-memory folder, without a call (`WatchStandby` told the
daemon about them once). The daemon reads them only when the trainer is
gone (`checkpointd.saves.standby`). A slot file:

    [0, HEAD)             the record's head: MAGIC (written last), the
                          generation (u64), the header's length (u32), a
                          CRC32C (u32) of the generation, length, data offset
                          and header, and the data offset (u64); little-endian
    [HEAD, HEAD + length) the header: a serialized `SaveHeader`, as the save
                          would have sent it
    [data offset, ...)    the snapshot's parts at `wire.aligned_offsets` of
                          their sizes, from the data offset (page-aligned)

The writer `invalidate`s a slot before it copies into it and `seal`s it
after: the header, the head's fields, then the magic. A slot is trusted
only if its magic and CRC32C check, so a trainer killed while copying
leaves that slot untrusted and the other one (the previous snapshot)
whole; of two trusted slots the higher generation is the newer.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import crc32c
from google.protobuf.message import DecodeError

from checkpointd.protocol.errors import InvalidRequestError
from checkpointd.protocol.wire import aligned_offsets
from checkpointd.v1 import checkpointd_pb2 as pb

MAGIC = b"CKPDSTB1"
_HEAD = struct.Struct("<8sQIIQ")  # magic, generation, header length, CRC32C, data offset
HEAD = _HEAD.size
_FIELDS = struct.Struct("<QIQ")  # what the CRC32C covers before the header: generation, length, data offset
PAGE = 4096
# A slot's file name in the daemon's folder: standby-<trainer pid>-<16 hex>-<0 or 1>.
SLOT_NAME = re.compile(r"standby-[0-9]{1,10}-[0-9a-f]{16}-[01]\Z")
# What became of a watched trainer's standby snapshot once it was gone (checkpointd_standby_saves_total{outcome}).
OUTCOMES = ("written", "not_newer", "no_whole_slot", "failed")
# Room for the header beyond its size when the slot is made: a header grows a little as steps do.
_HEADER_ROOM = 64 * 1024


@dataclass(frozen=True)
class Record:
    """A sealed slot's record: its generation, the SaveHeader's bytes, and where the parts start."""

    generation: int
    header: bytes
    data_offset: int


def data_offset_for(header_bytes: int) -> int:
    """Where a new slot's data starts: room for a header of `header_bytes` and more, page-aligned."""
    return -(-(HEAD + 2 * header_bytes + _HEADER_ROOM) // PAGE) * PAGE


def slot_size(data_offset: int, sizes: Sequence[int]) -> int:
    """The size of a slot whose data starts at `data_offset`, for parts of `sizes`."""
    return data_offset + aligned_offsets(sizes)[1]


def part_views(slot: memoryview, data_offset: int, sizes: Sequence[int]) -> list[memoryview]:
    """One view per part of `slot`'s data.

    Raises:
        ValueError: the parts do not fit in the slot.
    """
    offsets, end = aligned_offsets(sizes)
    if data_offset < HEAD or data_offset + end > slot.nbytes:
        raise ValueError(f"the slot has {slot.nbytes} bytes; its parts need {end} from offset {data_offset}")
    return [slot[data_offset + o : data_offset + o + n] for o, n in zip(offsets, sizes, strict=True)]


def invalidate(slot: memoryview) -> None:
    """Makes `slot` untrusted, before anything in it is overwritten."""
    slot[:8] = bytes(8)


def seal(slot: memoryview, generation: int, header: bytes, data_offset: int) -> None:
    """Writes the record of the snapshot just copied into `slot`: the header, the head, the magic last.

    Raises:
        ValueError: the header does not fit before the data offset (make a new slot).
    """
    if HEAD + len(header) > data_offset:
        raise ValueError(f"a header of {len(header)} bytes does not fit before the slot's data at {data_offset}")
    fields = _FIELDS.pack(generation, len(header), data_offset)
    crc = crc32c.crc32c(header, crc32c.crc32c(fields))
    slot[HEAD : HEAD + len(header)] = header
    slot[8:HEAD] = _HEAD.pack(bytes(8), generation, len(header), crc, data_offset)[8:]
    slot[:8] = MAGIC


def read(slot: memoryview) -> Record | None:
    """The record of a sealed, whole slot; None if it is not one (never sealed, or overwritten part way)."""
    if slot.nbytes < HEAD:
        return None
    magic, generation, length, crc, data_offset = _HEAD.unpack(slot[:HEAD])
    if magic != MAGIC or HEAD + length > min(data_offset, slot.nbytes):
        return None
    header = bytes(slot[HEAD : HEAD + length])
    if crc32c.crc32c(header, crc32c.crc32c(_FIELDS.pack(generation, length, data_offset))) != crc:
        return None
    return Record(generation, header, data_offset)


def header_message(header: bytes) -> pb.SaveHeader:
    """A record's header, parsed.

    Raises:
        InvalidRequestError: it does not parse.
    """
    try:
        return pb.SaveHeader.FromString(header)
    except DecodeError as e:
        raise InvalidRequestError(f"a standby record's SaveHeader does not parse: {e}") from None


def newest(records: Sequence[Record | None]) -> tuple[int, Record] | None:
    """The index and record of the newest trusted slot, or None."""
    found = [(r.generation, i, r) for i, r in enumerate(records) if r is not None]
    if not found:
        return None
    _, index, record = max(found)
    return index, record
