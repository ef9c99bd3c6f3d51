"""A Save's SameChunks message: payload bytes unchanged since the base, copied instead of received."""

from __future__ import annotations

from checkpointd.core.ports import SameChunksSink
from checkpointd.protocol.errors import InvalidRequestError
from checkpointd.v1 import checkpointd_pb2 as pb


def receive_same(same: pb.SameChunks, received: int, total: int, sink: object) -> int:
    """Has `sink` (a `SameChunksSink` if the accept offered a base) copy the range from the save's base; returns the payload offset after it.

    Raises:
        InvalidRequestError: out of order, past `total`, or no base was offered.
    """
    if same.offset != received:
        raise InvalidRequestError(f"Save: SameChunks at offset {same.offset}, expected {received} (in order)")
    if same.offset + same.length > total:
        raise InvalidRequestError(f"Save: SameChunks at {same.offset} of {same.length} bytes runs past {total}")
    if not isinstance(sink, SameChunksSink):
        raise InvalidRequestError("Save: SameChunks, but this save's accept offered no base")
    sink.same(same.offset, same.length, list(same.chunk_crc32c))
    return received + same.length
