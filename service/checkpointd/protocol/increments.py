"""An incremental save's requests: changed chunks as Chunks, unchanged runs of them as SameChunks.

The client's side of `checkpointd.bundle.chunks`: with the base's digests
from the accept (SaveDecision.base), each payload part is cut into the
base's chunks, each chunk's CRC32C computed (lazily, on whichever thread
pulls the requests: gRPC's sending thread, not the trainer's) and compared
with the base's. A chunk whose CRC32C differs is sent, with that CRC32C;
a run of equal ones becomes one SameChunks naming them. Without a base (or
for a part the base does not hold) every byte is sent, as
`wire.save_request_chunks` sends it.

A client that knows which bytes of a part it wrote since the snapshot the
base was saved from (`written`: the base is that snapshot's committed save,
and the part's buffer held that snapshot's bytes; `checkpointd_client.delta`
says when) need not sum the others: a chunk that overlaps no written range
is the base's chunk, and goes as a SameChunks with the base's own digest.
Only chunks a written range touches are summed and compared.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import crc32c

from checkpointd.protocol.wire import Buffer, check_chunk_bytes, encoded_chunk
from checkpointd.v1 import checkpointd_pb2 as pb


@dataclass
class Sent:
    """What an incremental upload has sent so far: payload bytes as chunks, and as references.

    `unsummed_bytes`: of `same_bytes`, those taken as the base's unsummed (nothing wrote them).
    """

    chunk_bytes: int = 0
    same_bytes: int = 0
    unsummed_bytes: int = 0


def save_requests(
    parts: Iterable[Buffer],
    base: pb.IncrementalBase | None,
    chunk_bytes: int,
    sent: Sent | None = None,
    written: Sequence[Sequence[tuple[int, int]] | None] | None = None,
) -> Iterator[bytes]:
    """The payload's requests, serialized, in payload order; `sent` counts them as they go.

    Args:
        parts: the payload's parts, in payload order.
        base: the accept's base (None: every byte is sent).
        chunk_bytes: the chunk size without a base.
        sent: counts what was sent, as it goes.
        written: per part, the sorted byte ranges [start, stop) written since
            the snapshot `base` is the committed save of (None, or a part
            past its end: not known, every chunk is summed). Chunks outside
            them are taken as the base's without being summed.

    Raises:
        ValueError: `chunk_bytes` (or the base's) is not a positive int.
    """
    check_chunk_bytes(chunk_bytes)
    sent = sent if sent is not None else Sent()
    digests = [list(p.chunk_crc32c) for p in base.parts] if base is not None else []
    size = int(base.chunk_bytes) if base is not None else chunk_bytes
    if digests:
        check_chunk_bytes(size)
    offset = 0
    for j, part in enumerate(parts):
        view = memoryview(part).cast("B")
        known = digests[j] if j < len(digests) else []
        step = size if known else chunk_bytes
        touched = _touched(written[j], step, len(known)) if written is not None and j < len(written) else None
        run_start, run_crcs = 0, list[int]()  # a run of unchanged chunks, not yet sent
        for n, start in enumerate(range(0, view.nbytes, step)):
            data = view[start : start + step]
            unwritten = touched is not None and n < len(known) and not touched[n]
            crc = known[n] if unwritten else crc32c.crc32c(data)
            sent.unsummed_bytes += data.nbytes if unwritten else 0
            if n < len(known) and known[n] == crc:
                if not run_crcs:
                    run_start = offset + start
                run_crcs.append(crc)
                continue
            if run_crcs:
                yield _same(run_start, offset + start - run_start, run_crcs, sent)
                run_crcs = []
            sent.chunk_bytes += data.nbytes
            yield encoded_chunk(offset + start, data, crc)
        if run_crcs:
            yield _same(run_start, offset + view.nbytes - run_start, run_crcs, sent)
        offset += view.nbytes


def _touched(ranges: Sequence[tuple[int, int]] | None, chunk: int, chunks: int) -> list[bool] | None:
    """Per chunk of a part, whether a written range overlaps it; None if what was written is not known."""
    if ranges is None:
        return None
    touched = [False] * chunks
    for start, stop in ranges:
        for n in range(start // chunk, min(chunks, -(-stop // chunk))):
            touched[n] = True
    return touched


def _same(offset: int, length: int, crcs: list[int], sent: Sent) -> bytes:
    sent.same_bytes += length
    return pb.SaveRequest(same=pb.SameChunks(offset=offset, length=length, chunk_crc32c=crcs)).SerializeToString()
