"""A save being written as its snapshot arrives: the wire's parts routed into a tensor bundle.

A save format opens a `BundleSink` before the snapshot is received
(`checkpointd.core.ports.SaveSink`); the receiver hands it each part's bytes
as they land, and the pipeline calls `finish` once all have come. Each
wire part (a variable, a training checkpoint's tensor, the numpy state's
bytes) goes one of three ways:

- a fixed-size tensor: written into the bundle's data file where it goes
  (`checkpointd.bundle.BundleWriter`), its CRC32C folded in, never
  held here;
- a string tensor (a training checkpoint's Python state): kept until
  complete, then written whole (strings are small, and their bytes follow
  their length and its checksum);
- the tail (a policy save's numpy state): kept, and handed to `finish`'s
  callback, which writes it as a bundle of its own.

Strings known at open (the object graph) are written at once. Large data
files are handed to the disk while they grow (`durable.writeback.writing`);
a snapshot in shared memory comes whole (`write_parts`) and is written in
the data file's order, so the file grows from its start and the writeback
sees each page as it is written. A large segment laid out as an image of
the data file (`image_layout`, `checkpointd.bundle.image`) is written whole
with O_DIRECT instead (`write_image`): no copy into the page cache, and
nothing left for the commit's fsync but the file's metadata. The staged
save carries both files' size and CRC32C (`Staged.known`, combined from the tensors' as they were
written), so the store's manifest does not read them back.

Every fixed-size tensor's chunk digests are logged on the way
(`checkpointd.bundle.chunks`): from the CRC32C a caller checked, when its
piece lies within one chunk, else summed here chunk by chunk. `copy_from_base` puts
whole chunks in place from another bundle's data file (an incremental
save's unchanged ranges), their CRC32Cs taken from that bundle's record:
the range is accounted for at once, in order, and copied by the kernel on a
copier thread while the next chunks arrive; `settle` waits for the copies
(`finish` and `close` do too, so no copy outlives the descriptor).

Thread-safety: one thread writes at a time, but `close` may come from
another (the pipeline gives up on a stalled upload while its reader still
writes): a lock makes close wait for a write in progress, and writes after
it fail, so no write ever lands on a reused descriptor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

import crc32c

from checkpointd.bundle import chunks, image
from checkpointd.bundle.writer import DATA_SUFFIX, INDEX_SUFFIX, BundleWriter, Entry, string_bytes
from checkpointd.core.ports import Staged
from checkpointd.durable import copies, direct, writeback
from checkpointd.protocol.errors import ChecksumError, InvalidRequestError, SaveFailedError
from checkpointd.protocol.tensors import STRING

_LOGGER = logging.getLogger(__name__)

# The devices whose file system refused an O_DIRECT write: not tried again there.
_refused: set[int] = set()
# Images at least this large are written with O_DIRECT; below it the disk's
# round trip for the data, then another for the fsync, costs more than one.
_DIRECT_MIN_BYTES = writeback.WRITEBACK_BYTES
# The data file's CRC32C is combined from its tensors' for up to one tensor per 2**this bytes.
_COMBINE_SHIFT = 20

# finish's callback: (the index's bytes, the tail's bytes) -> the staged save.
Finisher = Callable[[bytes, bytes], Staged]
# The kernel copies ranges from a base while the receiver goes on (copy_file_range releases the GIL).
_copiers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="checkpointd-range-copy")


class BundleSink:
    """Routes a snapshot's parts into one tensor bundle; see the module docstring."""

    def __init__(
        self,
        prefix: Path | str,
        entries: Sequence[Entry],
        routes: Sequence[int | None],
        parts: Sequence[int],
        finisher: Finisher,
        *,
        strings: Mapping[int, bytes] | None = None,
    ) -> None:
        """Opens the bundle and writes the strings known now.

        Args:
            prefix: the bundle's path prefix (its dir exists).
            entries: the bundle's tensors, in data order.
            routes: for each wire part, the data-order index of its tensor,
                or None for the tail.
            parts: each wire part's size in bytes.
            finisher: called by `finish` with the index and the tail.
            strings: scalar string tensors written now, by data-order index.

        Raises:
            ValueError: the routes and parts disagree with the entries.
            OSError: the bundle could not be created.
        """
        if len(routes) != len(parts):
            raise ValueError(f"{len(routes)} routes for {len(parts)} parts")
        for route, size in zip(routes, parts, strict=True):
            if route is None:
                continue
            entry = entries[route]
            want = entry.size if entry.dtype != STRING else None
            if want is not None and want != size:
                raise ValueError(f"part for {entry.key!r} has {size} bytes; the tensor takes {want}")
        self._parts = tuple(parts)
        self._routes = tuple(routes)
        self._finisher = finisher
        self._received = [0] * len(parts)
        self._kept: dict[int, bytearray] = {
            j: bytearray() for j, r in enumerate(routes) if r is None or entries[r].dtype == STRING
        }
        self._logs: dict[int, chunks.ChunkLog] = {
            j: chunks.ChunkLog(entries[r].size) for j, r in enumerate(routes) if r is not None and j not in self._kept
        }
        self._lock = threading.Lock()
        self._copies: list[Future[None]] = []  # ranges being copied from a base
        self._closed = False
        self._on_range: Callable[[int, int], None] | None = None
        self._on_refer: Callable[[int, int, object, int], None] | None = None
        self._referred = False  # some ranges were left to the store to copy (their bytes not in staging)
        self._strings = dict(strings or {})
        self._direct = False  # written from an image with O_DIRECT: none of the data file is in the page cache
        self._stack = contextlib.ExitStack()
        try:
            self._writer = self._stack.enter_context(BundleWriter(prefix, entries))
            self._stack.enter_context(writeback.writing(os.path.dirname(prefix), self._writer.size))
            for i, value in self._strings.items():
                self._writer.write_strings(i, [value])
        except BaseException:
            self._stack.close()
            raise

    def __enter__(self) -> BundleSink:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def write(self, part: int, offset: int, data: object, crc: int | None = None) -> None:
        """Takes the bytes of wire part `part` at `offset` in it: each part's bytes in order.

        `crc`, if given, is `data`'s CRC32C as the caller checked it; a
        fixed-size tensor's checksum is then combined from it, not summed again.

        Raises:
            InvalidRequestError: out of order, or past the part's size.
            ValueError: the sink is closed.
            OSError: the write failed.
        """
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
        with self._lock:
            if self._closed:
                raise ValueError("the save's files were closed (the save was given up)")
            done = self._received[part]
            if offset != done or done + view.nbytes > self._parts[part]:
                raise InvalidRequestError(
                    f"Save: {view.nbytes} bytes at offset {offset} of part #{part}, which has "
                    f"{done} of its {self._parts[part]} bytes (parts in order, within their size)"
                )
            self._received[part] = done + view.nbytes
            kept = self._kept.get(part)
            if kept is None:
                route, log = self._route(part), self._logs[part]
                if crc is not None and chunks.count(offset % chunks.CHUNK_BYTES + view.nbytes) <= 1:
                    self._writer.write(route, view, crc)
                    log.add(view.nbytes, crc)
                else:  # summed a chunk at a time, each piece's CRC32C logged and handed on
                    for start, end in chunks.spans(offset, view.nbytes):
                        piece = view[start - offset : end - offset]
                        piece_crc = crc32c.crc32c(piece)
                        self._writer.write(route, piece, piece_crc)
                        log.add(piece.nbytes, piece_crc)
                self._written(self._writer.offsets[route] + offset, view.nbytes)
                return
            kept += view
            if self._received[part] == self._parts[part] and self._routes[part] is not None:
                route = self._route(part)
                self._writer.write_strings(route, [bytes(kept)])
                self._written(self._writer.offsets[route], self._writer.entries[route].size)

    def copy_from_base(
        self, part: int, offset: int, nbytes: int, source: int, source_offset: int, crcs: Sequence[int]
    ) -> None:
        """Copies `nbytes` of part `part` at `offset` from descriptor `source` at `source_offset`: whole chunks.

        `crcs` are the chunks' CRC32Cs as the source's record has them; the
        caller has checked that the source is that file.

        Raises:
            InvalidRequestError: out of order, not whole chunks of a fixed-size tensor, or past its size.
            ValueError: the sink is closed.
            OSError: the copy failed.
        """
        with self._lock:
            at = self._account(part, offset, nbytes, crcs)
            self._copies.append(_copiers.submit(self._copy, source, source_offset, self._writer.fileno, at, nbytes))

    def refer(
        self, part: int, offset: int, nbytes: int, source: object, source_offset: int, crcs: Sequence[int]
    ) -> None:
        """Counts whole chunks of part `part` at `offset` as equal to `source`'s bytes at `source_offset`, unwritten.

        For a store that copies them itself (S3's UploadPartCopy): the range
        is accounted for as `copy_from_base` does and reported to the callback given to
        `watch_references`, and staging never holds its bytes.

        Raises:
            ChecksumError: no store takes the range (nothing watches): the
                save is sent again in full.
            InvalidRequestError, ValueError: as `copy_from_base`.
        """
        with self._lock:
            if self._on_refer is None:
                raise ChecksumError(
                    "this save's data file goes up whole, so unchanged chunks cannot be copied from its base: "
                    "send the save again in full (without incremental)"
                )
            at = self._account(part, offset, nbytes, crcs)
            self._referred = True
            self._on_refer(at, at + nbytes, source, source_offset)

    def watch_references(self, on_refer: Callable[[int, int, object, int], None]) -> None:
        """Calls `on_refer(start, end, source, source_offset)` for each range `refer` leaves unwritten."""
        with self._lock:
            self._on_refer = on_refer

    def _account(self, part: int, offset: int, nbytes: int, crcs: Sequence[int]) -> int:
        """Checks and counts a range put in place from elsewhere (whole chunks, in order); its data file offset.

        The caller holds the lock.
        """
        if self._closed:
            raise ValueError("the save's files were closed (the save was given up)")
        log = self._logs.get(part)
        done = self._received[part]
        size = self._parts[part]
        whole = log is not None and offset % chunks.CHUNK_BYTES == 0
        end = offset + nbytes
        if (
            not whole
            or offset != done
            or end > size
            or (end % chunks.CHUNK_BYTES and end != size)
            or len(crcs) != chunks.count(nbytes)
        ):
            raise InvalidRequestError(
                f"Save: {nbytes} bytes of part #{part} at offset {offset} referred to the base, which has "
                f"{done} of its {size} bytes (whole chunks of a tensor, in order)"
            )
        assert log is not None
        route = self._route(part)
        at = self._writer.offsets[route] + offset
        self._writer.copied(route, nbytes, chunks.range_crc(crcs, offset, size))
        log.add_chunks(crcs, nbytes)
        self._received[part] = end
        return at

    def _copy(self, source: int, source_offset: int, fd: int, at: int, nbytes: int) -> None:
        copies.copy_range(source, source_offset, fd, at, nbytes)
        with self._lock:
            self._written(at, nbytes)

    def settle(self) -> None:
        """Waits for every range being copied; raises the first copy's error (OSError)."""
        with self._lock:
            pending, self._copies = self._copies, []
        errors = [e for e in (f.exception() for f in pending) if e is not None]
        if errors:
            raise errors[0]

    def digests(self) -> list[chunks.BaseTensor]:
        """Every fixed-size tensor written whole, with its place in the data file and its chunks' CRC32Cs."""
        out = []
        for part, log in self._logs.items():
            if log.complete:
                route = self._route(part)
                e = self._writer.entries[route]
                out.append(
                    chunks.BaseTensor(e.key, e.dtype, e.shape, self._writer.offsets[route], e.size, tuple(log.crcs))
                )
        return out

    def write_parts(self, views: Sequence[memoryview]) -> None:
        """Takes every part whole (a snapshot in shared memory), written in the data file's order.

        The file then grows from its start, as SaveV2's does, so the writeback
        that hands a growing file's new pages to the disk sees every page as it
        is written, not one jump to the end (the wire's order is not the data's).

        Raises:
            as `write`.
        """
        if len(views) != len(self._parts):
            raise InvalidRequestError(f"Save: {len(views)} parts given whole; the snapshot has {len(self._parts)}")
        for j in self.order():
            if views[j].nbytes:
                self.write(j, 0, views[j])

    def image_layout(self) -> tuple[list[int], int] | None:
        """Each part's offset in an image of the data file, and the image's size (`checkpointd.bundle.image`)."""
        return image.layout(self._writer.entries, self._routes, self._parts)

    def write_image(self, whole: memoryview, offsets: Sequence[int]) -> None:
        """Takes every part from `whole`, a page-aligned segment holding part j at `offsets[j]`.

        When `offsets` are `image_layout()`'s (the segment is an image of the
        data file) and the image is large, the strings are put into the
        image's gaps and the image is written with O_DIRECT
        (`checkpointd.durable.direct`), each tensor's chunks summed
        meanwhile; where the file system refuses O_DIRECT, the image is
        written through the page cache. Otherwise (a small image, bytes
        that came another way, a store watching the ranges) the parts are
        taken as `write_parts` takes them.

        Raises:
            as `write`.
        """
        if len(offsets) != len(self._parts):
            raise InvalidRequestError(f"Save: {len(offsets)} parts given whole; the snapshot has {len(self._parts)}")
        views = [whole[o : o + n] for o, n in zip(offsets, self._parts, strict=True)]
        fits = self.image_layout()
        if (
            fits is None
            or list(offsets) != fits[0]
            or whole.nbytes < fits[1]
            or fits[1] < _DIRECT_MIN_BYTES
            or self._on_range is not None
            or any(self._received)
        ):
            self.write_parts(views)
            return
        with self._lock:
            if self._closed:
                raise ValueError("the save's files were closed (the save was given up)")
            self._write_image(whole[: fits[1]], views)

    def _write_image(self, whole: memoryview, views: list[memoryview]) -> None:
        """`write_image`'s write, under the lock: the strings placed, the image written, the tensors summed."""
        writer, size = self._writer, self._writer.size
        for i, value in self._strings.items():  # written to the file at open; the image's block holds them too
            data, _ = string_bytes([value], writer.entries[i])
            whole[writer.offsets[i] : writer.offsets[i] + len(data)] = data
        for j in self._kept:
            route = self._routes[j]
            if route is not None:  # a string tensor's value, in place after its length and checksum
                writer.write_strings(route, [bytes(views[j])], image=whole)
        path = writer.prefix + DATA_SUFFIX
        device = os.fstat(writer.fileno).st_dev
        writing = direct.DirectWrite(path, whole) if direct.supported() and device not in _refused else None
        try:
            pieces = [
                (j, route, start, end)
                for j in self.order()
                if j not in self._kept and (route := self._routes[j]) is not None
                for start, end in chunks.spans(0, views[j].nbytes)
            ]
            crcs = _sum_pieces([views[j][start:end] for j, _, start, end in pieces])
            for (j, route, start, end), crc in zip(pieces, crcs, strict=True):
                writer.copied(route, end - start, crc)
                self._logs[j].add(end - start, crc)
        finally:
            written = writing.wait() if writing is not None else False
        if written:
            os.ftruncate(writer.fileno, size)  # the image's last block, cut to the file
            self._direct = True
        else:
            if writing is not None:
                _refused.add(device)
                _LOGGER.info("%s refuses O_DIRECT writes; shared-memory saves there go through the page cache", path)
            writer.write_raw(whole[:size], 0)
        self._received = list(self._parts)

    def order(self) -> list[int]:
        """The parts in the data file's order (the tail last)."""
        last = self._writer.size  # the tail (not in the data file) after the tensors

        def at(j: int) -> int:
            route = self._routes[j]
            return last if route is None else self._writer.offsets[route]

        return sorted(range(len(self._parts)), key=at)

    def watch(self, on_range: Callable[[int, int], None]) -> tuple[Path, int]:
        """Calls `on_range(start, end)` once each byte range of the data file is written; returns its path and size.

        Ranges come in any order (the wire's, not the data's), each byte in
        one range once; the tensors complete already are reported now. The
        callback runs under the sink's lock, so it must be quick.
        """
        with self._lock:
            self._on_range = on_range
            for i, entry in enumerate(self._writer.entries):
                if entry.size and self._writer.complete(i):
                    on_range(self._writer.offsets[i], self._writer.offsets[i] + entry.size)
            return Path(self._writer.prefix + DATA_SUFFIX), self._writer.size

    def _written(self, start: int, nbytes: int) -> None:
        if self._on_range is not None and nbytes:
            self._on_range(start, start + nbytes)

    def _route(self, part: int) -> int:
        route = self._routes[part]
        assert route is not None
        return route

    def missing(self) -> list[int]:
        """The parts not yet complete."""
        return [j for j, size in enumerate(self._parts) if self._received[j] != size]

    def finish(self) -> Staged:
        """Writes the index, then what the format's callback writes; returns the staged save.

        Raises:
            InvalidRequestError: a part is incomplete.
            OSError: the files could not be written.
        """
        self.settle()
        with self._lock:
            missing = self.missing()
            if missing:
                j = missing[0]
                raise InvalidRequestError(
                    f"Save: part #{j} ended after {self._received[j]} of its {self._parts[j]} bytes"
                )
            if self._referred:  # a referred range at the end: the file is still its size (its manifest's)
                os.ftruncate(self._writer.fileno, self._writer.size)
            index = self._writer.finish()
            tail = b"".join(bytes(b) for j, b in self._kept.items() if self._routes[j] is None)
            try:
                return self._known(self._finisher(index, tail), index)
            finally:
                self._closed = True
                self._stack.close()

    def _known(self, staged: Staged, index: bytes) -> Staged:
        """`staged` with the bundle's files in its `known` (size, CRC32C): the manifest need not read them back.

        The data file's CRC32C is combined from its tensors' where that is
        cheaper than reading it (about a tensor per MiB or fewer: each
        combine is pure Python).
        """
        base = os.fspath(staged.path) + os.sep
        if self._writer.prefix.startswith(base):  # as the formats join them: no pathlib parsing
            rel = self._writer.prefix[len(base) :].replace(os.sep, "/")
        else:
            try:
                rel = Path(self._writer.prefix).relative_to(staged.path).as_posix()
            except ValueError:
                return staged  # staged elsewhere: the store reads the files back
        known = dict(staged.known or {})
        known[rel + INDEX_SUFFIX] = (len(index), crc32c.crc32c(index))
        # Combined always when staging lacks referred ranges: reading the file back would sum holes.
        # And when written with O_DIRECT: none of the file is in the page cache to read back.
        if self._referred or self._direct or len(self._writer.entries) <= max(self._writer.size >> _COMBINE_SHIFT, 1):
            known[rel + DATA_SUFFIX] = (self._writer.size, self._writer.data_crc())
        return dataclasses.replace(staged, known=known)

    def close(self) -> None:
        """Closes the files (after a write or copy in progress); the caller discards the staging dir."""
        with self._lock:
            self._closed = True
            pending, self._copies = self._copies, []
        for f in pending:
            f.exception()  # waited for; the save is given up, so its error is not raised
        with self._lock:
            self._stack.close()


def _sum_pieces(pieces: Sequence[memoryview]) -> list[int]:
    """Each piece's CRC32C, the second half summed on a thread of its own (crc32c releases the GIL).

    Two cores sum an image at twice the speed; and under load, where the
    caller's thread runs at the writers' low priority, each thread gets its
    share of a core. The helper is made by the caller, so it has its priority.
    """
    crcs = [0] * len(pieces)
    failed: list[BaseException] = []

    def sum_range(lo: int, hi: int) -> None:
        try:
            for k in range(lo, hi):
                crcs[k] = crc32c.crc32c(pieces[k])
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
            failed.append(e)

    half = len(pieces) // 2
    helper = threading.Thread(target=sum_range, args=(half, len(pieces)), name="crc32c", daemon=True)
    helper.start()
    sum_range(0, half)
    helper.join()
    if failed:
        raise failed[0]
    return crcs


def split(snapshot: object, sizes: Sequence[int], who: str, what: str) -> list[memoryview]:
    """A snapshot in memory (the parts' concatenation, or one buffer per part) as one view per part.

    Raises:
        SaveFailedError: the snapshot does not have the parts' sizes.
    """
    if isinstance(snapshot, (bytes, bytearray, memoryview)):
        whole = memoryview(snapshot).cast("B")
        if whole.nbytes != sum(sizes):
            raise SaveFailedError(f"{who}: snapshot has {whole.nbytes} bytes; {what} needs {sum(sizes)}")
        views, at = [], 0
        for size in sizes:
            views.append(whole[at : at + size])
            at += size
        return views
    views = [memoryview(p).cast("B") for p in snapshot]  # type: ignore[attr-defined]
    if [v.nbytes for v in views] != list(sizes):
        raise SaveFailedError(f"{who}: snapshot parts do not match {what}")
    return views


def feed(sink: BundleSink, parts: Sequence[object]) -> Staged:
    """Writes a snapshot held in memory (one buffer per part) through `sink`; returns it finished."""
    for j, part in enumerate(parts):
        view = memoryview(part)  # type: ignore[arg-type]
        if view.nbytes:
            sink.write(j, 0, view)
    return sink.finish()
