"""Wire codecs both sides share: chunk checks and the snapshot buffer layout."""

from __future__ import annotations

from collections.abc import Sequence

import crc32c

from checkpointd.protocol.errors import ChecksumError, InvalidRequestError
from checkpointd.v1 import checkpointd_pb2 as pb


def check_chunk(chunk: pb.Chunk, expected_offset: int, limit: int, what: str) -> None:
    """Refuses a chunk out of order, past `limit` bytes, or with a wrong CRC32C."""
    if chunk.offset != expected_offset:
        raise InvalidRequestError(
            f"{what}: chunk at offset {chunk.offset}, expected {expected_offset} (chunks in order)"
        )
    if chunk.offset + len(chunk.data) > limit:
        raise InvalidRequestError(
            f"{what}: data runs past the announced {limit} bytes "
            f"(chunk at {chunk.offset} of {len(chunk.data)} bytes)"
        )
    if crc32c.crc32c(chunk.data) != chunk.crc32c:
        raise ChecksumError(f"{what}: CRC32C mismatch in the chunk at offset {chunk.offset}")


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
