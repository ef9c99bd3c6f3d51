"""An incremental save's data file on S3: unchanged ranges copied from the base object, the rest uploaded.

An incremental save's unchanged chunks are never received: the bundle sink
names each such range of the new data file with the base object and offset
it equals (`Reference`), and leaves it unwritten in staging. At commit the
parts the stream has not sent (`checkpointd.storage.s3.parts`) are made
here: a referred run of at least S3's minimum part size (5 MiB) goes up as
one `UploadPartCopy` (`CopySourceRange`) of the base object, server-side;
the written bytes go up from staging, and where a changed run is shorter
than the minimum it is padded with its unchanged neighbours' bytes, read
from the base object with a ranged GET (the daemon's own bytes: the
trainer is never asked again). `plan` is that arithmetic, pure.

Every copy and GET is conditional on the base object's ETag as its
manifest committed it (`CopySourceIfMatch`, `IfMatch`): a base deleted or
replaced meanwhile fails the save with ChecksumError (DATA_LOSS), nothing
is committed, and the client sends the save again in full.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from checkpointd.protocol.errors import ChecksumError
from checkpointd.storage.s3.client import error_code

_LOGGER = logging.getLogger(__name__)

MIN_PART_BYTES = 5 << 20  # S3's minimum size of every part but the last
MAX_PARTS = 10_000  # S3's most parts in one upload
# Codes of a source that is gone or no longer the committed bytes.
_SOURCE_GONE = frozenset({"404", "NoSuchKey", "NotFound", "412", "PreconditionFailed"})


@dataclass(frozen=True)
class Source:
    """A committed object the new data file may copy ranges of: its key and the ETag its manifest recorded."""

    key: str
    etag: str


@dataclass(frozen=True)
class Reference:
    """Bytes [start, end) of the new data file equal bytes [offset, offset + end - start) of `source`."""

    start: int
    end: int
    source: Source
    offset: int


@dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of the new data file: from staging (`source` None) or from `source` at `offset`."""

    start: int
    end: int
    source: Source | None = None
    offset: int = 0


@dataclass(frozen=True)
class Part:
    """One part of the upload: a server-side copy of one referred piece (`copy`), or pieces uploaded."""

    start: int
    end: int
    pieces: tuple[Piece, ...]
    copy: bool

    @property
    def uploaded(self) -> int:
        """The bytes this part sends (none for a copy)."""
        return 0 if self.copy else self.end - self.start


def plan(
    start: int,
    end: int,
    refs: Iterable[Reference],
    *,
    object_end: int,
    max_bytes: int,
    min_bytes: int = MIN_PART_BYTES,
) -> list[Part]:
    """The parts covering bytes [start, end) of a data file of `object_end` bytes, in order.

    Every part has at least `min_bytes` but one ending at `object_end`; no
    part has more than `max_bytes` (at least twice `min_bytes`). A copy part
    copies only from one reference; an upload part's pieces are staging's
    bytes except those inside references (read from their source).
    References reaching past the range count for their bytes within it.

    Raises:
        ValueError: references overlap; the range is
            shorter than `min_bytes` and does not end the object; or
            `max_bytes` is below twice `min_bytes`.
    """
    if max_bytes < 2 * min_bytes:
        raise ValueError(f"max_bytes {max_bytes} is below twice the minimum part size {min_bytes}")
    if end - start < min_bytes and end != object_end and end > start:
        raise ValueError(f"bytes [{start}, {end}) are fewer than one part's minimum and do not end the object")
    runs = _runs(_pieces(start, end, refs), min_bytes, object_end)
    _pad(runs, min_bytes, end == object_end)
    parts: list[Part] = []
    for copy, pieces in runs:
        parts.extend(_split(pieces, copy, max_bytes))
    return parts


def _pieces(start: int, end: int, refs: Iterable[Reference]) -> list[Piece]:
    """[start, end) tiled by the references (adjacent ones of one source merged) and staging between them."""
    out: list[Piece] = []
    at = start
    for whole in sorted((r for r in refs if r.end > start and r.start < end), key=lambda r: r.start):
        cut = max(start, whole.start)  # clipped to the range
        r = Reference(cut, min(end, whole.end), whole.source, whole.offset + cut - whole.start)
        if r.start < at:
            raise ValueError(f"reference [{whole.start}, {whole.end}) overlaps another")
        if r.start > at:
            out.append(Piece(at, r.start))
        last = out[-1] if out else None
        if (
            last is not None
            and last.source == r.source
            and last.end == r.start
            and (last.offset + last.end - last.start == r.offset)
        ):
            out[-1] = Piece(last.start, r.end, r.source, last.offset)
        else:
            out.append(Piece(r.start, r.end, r.source, r.offset))
        at = r.end
    if at < end:
        out.append(Piece(at, end))
    return out


def _runs(pieces: list[Piece], min_bytes: int, object_end: int) -> list[tuple[bool, list[Piece]]]:
    """Consecutive pieces grouped: (True, [one referred piece]) copies, the rest uploads.

    A referred piece is copied if it has `min_bytes` or more, or ends the object (the last part may be short).
    """
    runs: list[tuple[bool, list[Piece]]] = []
    for p in pieces:
        copy = p.source is not None and (p.end - p.start >= min_bytes or p.end == object_end)
        if copy or not runs or runs[-1][0]:
            runs.append((copy, [p]))
        else:
            runs[-1][1].append(p)
    return runs


def _length(pieces: Sequence[Piece]) -> int:
    return pieces[-1].end - pieces[0].start


def _pad(runs: list[tuple[bool, list[Piece]]], min_bytes: int, ends_object: bool) -> None:
    """Grows each upload run shorter than `min_bytes` (but a last one ending the object) from its copy neighbours."""
    i = 0
    while i < len(runs):
        copy, pieces = runs[i]
        need = min_bytes - _length(pieces)
        if copy or need <= 0 or (i == len(runs) - 1 and ends_object):
            i += 1
            continue
        after = runs[i + 1][1][0] if i + 1 < len(runs) else None
        before = runs[i - 1][1][0] if i > 0 else None
        if after is not None and after.end - after.start - need >= min_bytes:  # take the next copy's head
            cut = after.start + need
            pieces.append(Piece(after.start, cut, after.source, after.offset))
            runs[i + 1] = (True, [Piece(cut, after.end, after.source, after.offset + need)])
        elif before is not None and before.end - before.start - need >= min_bytes:  # the previous one's tail
            cut = before.end - need
            pieces.insert(0, Piece(cut, before.end, before.source, before.offset + cut - before.start))
            runs[i - 1] = (True, [Piece(before.start, cut, before.source, before.offset)])
        else:  # a neighbour too short to share: uploaded whole, the smaller one (or the one there is)
            if after is None and before is None:
                raise ValueError("an upload run shorter than a part, with nothing to pad it from")
            take_after = before is None or (after is not None and after.end - after.start <= before.end - before.start)
            j = i + 1 if take_after else i - 1
            merged = [*pieces, *runs[j][1]] if take_after else [*runs[j][1], *pieces]
            lo, hi = min(i, j), max(i, j)
            runs[lo : hi + 1] = [(False, merged)]
            i = lo
            # The merged run may now touch another upload run: join them.
            while i + 1 < len(runs) and not runs[i + 1][0]:
                runs[i] = (False, [*runs[i][1], *runs.pop(i + 1)[1]])
            if i > 0 and not runs[i - 1][0]:
                runs[i - 1] = (False, [*runs[i - 1][1], *runs.pop(i)[1]])
                i -= 1
            continue
        i += 1


def _split(pieces: list[Piece], copy: bool, max_bytes: int) -> list[Part]:
    """One run as parts of at most `max_bytes`, near-equal (so none falls under the minimum)."""
    lo, hi = pieces[0].start, pieces[-1].end
    count = max(1, -(-(hi - lo) // max_bytes))
    bounds = [lo + (hi - lo) * k // count for k in range(count + 1)]
    parts = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        cut = tuple(
            Piece(max(a, p.start), min(b, p.end), p.source, p.offset + max(a, p.start) - p.start)
            for p in pieces
            if p.end > a and p.start < b
        )
        parts.append(Part(a, b, cut, copy))
    return parts


def send(client: Any, bucket: str, key: str, upload_id: str, number: int, part: Part, fd: int) -> dict[str, Any]:
    """Sends one planned part (copied server-side, or its bytes from staging `fd` and the base); its entry.

    Raises:
        ChecksumError: the base object is gone or no longer the committed one.
        OSError: staging lacks bytes it should hold.
    """
    try:
        if part.copy:
            (piece,) = part.pieces
            assert piece.source is not None
            answer = client.upload_part_copy(
                Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                CopySource={"Bucket": bucket, "Key": piece.source.key},
                CopySourceRange=f"bytes={piece.offset}-{piece.offset + piece.end - piece.start - 1}",
                CopySourceIfMatch=f'"{piece.source.etag}"',
            )  # fmt: skip
            return {"ETag": answer["CopyPartResult"]["ETag"], "PartNumber": number}
        body = bytearray()
        for piece in part.pieces:
            n = piece.end - piece.start
            if piece.source is None:
                data = os.pread(fd, n, piece.start)
            else:
                got = client.get_object(
                    Bucket=bucket, Key=piece.source.key, IfMatch=f'"{piece.source.etag}"',
                    Range=f"bytes={piece.offset}-{piece.offset + n - 1}",
                )  # fmt: skip
                data = got["Body"].read()
            if len(data) != n:
                raise OSError(f"{key}: bytes [{piece.start}, {piece.end}) gave {len(data)} bytes, {n} expected")
            body += data
        answer = client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=bytes(body))
        return {"ETag": answer["ETag"], "PartNumber": number}
    except Exception as e:
        if error_code(e) in _SOURCE_GONE:
            raise ChecksumError(
                f"the base save's object {part.pieces[0].source.key if part.pieces[0].source else key!r} is gone "
                "or was replaced while this save copied from it; nothing was committed: send the save again in full"
            ) from e
        raise
