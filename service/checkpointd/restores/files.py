"""RestoreFiles: a committed save's files sent as they are, for TensorFlow's reader on the client.

No tensor is decoded here and TensorFlow is not imported: the daemon lists
the files a restore reads (a training checkpoint's index and data file, a
policy save's `variables/` checkpoint and numpy state) with their size and
CRC32C from the save's manifest, and sends the asked byte ranges as the
Store reads them (pread on a local root, parallel ranged GETs on an object
store). Each chunk carries its CRC32C: on a local root, where the chunk is
whole chunks of a training checkpoint's chunk record (`chunk_record`), the
CRC32C the daemon logged from the bytes it was sent at commit (so the
client's check covers the bytes from commit to its memory), else one
computed from the bytes read. The client checks a file received
whole against the manifest's CRC32C before TensorFlow reads it, and a
partial range by TensorFlow's own per-tensor CRC32C in the checked index.
On a local root the header also vouches for files a client on this host may
read in place: checked against their manifest, named by their stat.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from checkpointd.core import chunk_record
from checkpointd.core.crc_combine import combine
from checkpointd.core.numpy_state import DIRECTORY as NUMPY_STATE_DIRECTORY
from checkpointd.core.ports import CommittedSave, SavedFile, SaveFiles, Store
from checkpointd.protocol.errors import InvalidRequestError
from checkpointd.protocol.wire import FILE_CHUNK_BYTES
from checkpointd.restores import committed

_LOGGER = logging.getLogger(__name__)

# A policy save's files a restore reads: its variables/ checkpoint and numpy state.
_POLICY_DIRS = ("variables/", f"{NUMPY_STATE_DIRECTORY}/")


@dataclass(frozen=True)
class FilePlan:
    """What one RestoreFiles call sends.

    Attributes:
        save: the committed save.
        files: the files a restore reads, index files first.
        ranges: (path, offset, length) to send, in order.
        local_dir: the dir the files' paths are relative to on this host, or
            None on an object store.
        verified: the files under local_dir found to match their manifest,
            by path: their (st_dev, st_ino, st_mtime_ns).
    """

    save: CommittedSave
    files: tuple[SavedFile, ...]
    ranges: tuple[tuple[str, int, int], ...]
    local_dir: Path | None
    verified: dict[str, tuple[int, int, int]]

    @property
    def payload_bytes(self) -> int:
        """The bytes the ranges carry."""
        return sum(length for _, _, length in self.ranges)

    def ranges_with_crcs(self) -> list[tuple[str, int, int, int | None]]:
        """The ranges as `cut` gives them, with no CRC32C known."""
        return [(path, offset, length, None) for path, offset, length in self.ranges]


@dataclass(frozen=True)
class Piece:
    """One chunk's worth of a file: where it goes, its bytes, and their CRC32C if the save recorded it."""

    path: str
    offset: int
    data: bytes
    crc: int | None = None


def plan(
    store: Store, folder: str, run: str, export_dir: str, asked: Sequence[tuple[str, int, int]], header_only: bool
) -> FilePlan:
    """Finds the save and checks the asked ranges against its files.

    Args:
        store: where the saves live.
        folder: the run's folder.
        run: the run whose newest save serves when `export_dir` is empty.
        export_dir: the save, whichever run committed it (restores go by
            where the saves are); empty for the run's newest.
        asked: (path, offset, length) ranges, length 0 to the file's end;
            none: every file whole.
        header_only: send no ranges at all.

    Raises:
        RunNotFoundError: no such committed save (see `checkpointd.restores.committed.find`).
        InvalidRequestError: a bad export_dir, a range of no listed file or
            past its end, or a store that cannot send files.
    """
    if not isinstance(store, SaveFiles):
        raise InvalidRequestError(f"{store.describe()} cannot send a save's files; use Restore")
    save = committed.find(store, folder, run, export_dir)
    files = sorted(
        (f for f in store.files_of(save) if save.prefix or f.path.startswith(_POLICY_DIRS)),
        key=lambda f: (not f.path.endswith(".index"), f.path),
    )
    by_path = {f.path: f for f in files}
    ranges: list[tuple[str, int, int]] = []
    if header_only:
        pass
    elif not asked:
        ranges = [(f.path, 0, f.size) for f in files]
    for path, offset, length in asked if not header_only else ():
        file = by_path.get(path)
        if file is None:
            raise InvalidRequestError(
                f"RestoreFiles: {save.export_dir!r} has no file {path!r} to send; it has {sorted(by_path)}"
            )
        # Length 0 is "to the end": from past the end that would be a negative length.
        length = length or max(file.size - offset, 0)
        if offset + length > file.size:
            raise InvalidRequestError(
                f"RestoreFiles: the range at {offset} of {length} bytes runs past the end of {path!r} "
                f"({file.size} bytes)"
            )
        ranges.append((path, offset, length))
    local_dir = store.local_dir(save)
    verified = store.verified(save, files) if local_dir is not None else {}
    return FilePlan(save, tuple(files), tuple(ranges), local_dir, verified)


def pieces(store: Store, plan: FilePlan) -> Iterator[Piece]:
    """The plan's ranges, in order, as the store's pieces, each with its recorded CRC32C where there is one.

    Raises:
        SaveFailedError, UnavailableError: the store could not read them.
    """
    assert isinstance(store, SaveFiles)
    # An object store's GETs are larger than a chunk: its ranges stay whole.
    ranges = cut(plan.save, plan.files, plan.ranges) if plan.local_dir is not None else plan.ranges_with_crcs()
    data_pieces = store.read_ranges(plan.save, [(path, offset, length) for path, offset, length, _ in ranges])
    for path, offset, length, crc in ranges:
        at, end = offset, offset + length
        while at < end:
            data = next(data_pieces)
            yield Piece(path, at, data, crc if at == offset and len(data) == length else None)
            at += len(data)


def recorded_chunks(save: CommittedSave, files: Sequence[SavedFile]) -> tuple[str, list[tuple[int, int, int]]] | None:
    """The data file a save's chunk record describes, and its chunks (start, end, CRC32C) in file order.

    None if the save has no usable record: none at all, one for a file the
    save does not list at the size it recorded, or chunks that overlap.
    """
    record = chunk_record.parse(save.extra)
    if record is None or not save.prefix:
        return None
    path = save.path.name + record.data_file
    if not any(f.path == path and f.size == record.identity[2] for f in files):
        return None
    step = record.chunk_bytes
    spans = sorted(
        (t.offset + n * step, min(t.offset + (n + 1) * step, t.offset + t.size), crc)
        for t in record.tensors.values()
        for n, crc in enumerate(t.crcs)
    )
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:], strict=False)):
        return None
    return path, spans


def cut(
    save: CommittedSave,
    files: Sequence[SavedFile],
    ranges: Sequence[tuple[str, int, int]],
    limit: int = FILE_CHUNK_BYTES,
) -> list[tuple[str, int, int, int | None]]:
    """The ranges cut into (path, offset, length, crc) pieces of at most `limit` bytes.

    In the save's recorded data file a piece is whole recorded chunks where
    it can be, with their CRC32Cs combined; every other piece's crc is None.
    """
    found = recorded_chunks(save, files)
    out: list[tuple[str, int, int, int | None]] = []
    for path, offset, length in ranges:
        spans = found[1] if found is not None and found[0] == path else []
        starts = [s[0] for s in spans]
        at, end = offset, offset + length
        i = bisect.bisect_left(starts, at)
        while at < end:
            if i < len(spans) and spans[i][0] == at and spans[i][1] <= min(end, at + limit):
                stop, crc = spans[i][1], spans[i][2]
                i += 1
                while i < len(spans) and spans[i][0] == stop and spans[i][1] <= min(end, at + limit):
                    crc = combine(crc, spans[i][2], spans[i][1] - spans[i][0])
                    stop = spans[i][1]
                    i += 1
                out.append((path, at, stop - at, crc))
            else:
                stop = min(end, at + limit, spans[i][0] if i < len(spans) and spans[i][0] > at else end)
                out.append((path, at, stop - at, None))
                i = bisect.bisect_left(starts, stop, i)
            at = stop
    return out


def log_sent(run: str, plan: FilePlan, seconds: float) -> None:
    """Logs a RestoreFiles call sent in full."""
    save = plan.save
    _LOGGER.info(
        "restored files run=%s kind=%s export_dir=%s step=%d bytes=%d of %d in %.3fs",
        run, save.kind.value, save.export_dir, save.step, plan.payload_bytes, sum(f.size for f in plan.files), seconds,
    )  # fmt: skip
