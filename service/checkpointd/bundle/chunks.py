"""Chunk digests of a bundle's tensors: what an incremental save compares, and the record a save keeps of them.

Each fixed-size tensor of a bundle is cut into chunks of `CHUNK_BYTES` from
its own first byte (the last one shorter), and each chunk's digest is its
CRC32C. The receiver already has every chunk's CRC32C when a trainer sends
chunks of that size (the wire's own, checked as they land), so a full save
records its digests for nothing; bytes that come another way (shared memory,
a snapshot in memory) are summed here in chunk-sized slices, as the bundle
writer would sum them anyway.

A committed save keeps its layout and digests in its manifest
(`checkpointd.core.chunk_record`).

A digest is 32 bits, as the bundle's own per-tensor checksum is: a changed
chunk whose CRC32C equals the old one's (odds of 2^-32 for a random change)
would be taken as unchanged.

Stdlib and crc32c only.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import crc32c

from checkpointd.bundle import crc as crc_math
from checkpointd.core.chunk_record import CHUNK_BYTES, FIELD, BaseTensor, count, record

__all__ = ["CHUNK_BYTES", "FIELD", "BaseTensor", "ChunkLog", "count", "digests", "range_crc", "record", "spans"]


def spans(offset: int, nbytes: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, int]]:
    """[start, end) pieces of bytes [offset, offset + nbytes) of a tensor, split at its chunk boundaries."""
    end = offset + nbytes
    while offset < end:
        stop = min(end, (offset // chunk_bytes + 1) * chunk_bytes)
        yield offset, stop
        offset = stop


def digests(data: object, chunk_bytes: int = CHUNK_BYTES) -> list[int]:
    """The CRC32C of each chunk of one tensor's bytes."""
    view = memoryview(data).cast("B")  # type: ignore[arg-type]
    return [crc32c.crc32c(view[at : at + chunk_bytes]) for at in range(0, view.nbytes, chunk_bytes)]


def range_crc(crcs: Sequence[int], offset: int, size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """The CRC32C of tensor bytes [offset, offset + len(crcs) chunks), from those chunks' CRC32Cs.

    `offset` is a chunk boundary; the last chunk is cut at the tensor's `size`.
    """
    crc = 0
    for n, c in enumerate(crcs):
        start = offset + n * chunk_bytes
        length = min(chunk_bytes, size - start)
        crc = c if n == 0 else crc_math.combine(crc, c, length)
    return crc


class ChunkLog:
    """One tensor's chunk CRC32Cs, folded from the pieces written into it in order."""

    def __init__(self, size: int, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.size = size
        self.chunk_bytes = chunk_bytes
        self.crcs: list[int] = []
        self._done = 0  # bytes logged
        self._running = 0  # the current chunk's CRC32C so far

    def add(self, nbytes: int, crc: int) -> None:
        """Logs the next `nbytes` (within one chunk, see `spans`), whose CRC32C is `crc`."""
        if not nbytes:
            return
        into = self._done % self.chunk_bytes
        self._running = crc if into == 0 else crc_math.combine(self._running, crc, nbytes)
        self._done += nbytes
        if self._done % self.chunk_bytes == 0 or self._done == self.size:
            self.crcs.append(self._running)
            self._running = 0

    def add_chunks(self, crcs: Sequence[int], nbytes: int) -> None:
        """Logs whole chunks (from a chunk boundary), `nbytes` in all."""
        if self._done % self.chunk_bytes:
            raise ValueError("whole chunks start at a chunk boundary")
        self.crcs.extend(crcs)
        self._done += nbytes

    @property
    def complete(self) -> bool:
        return self._done == self.size
