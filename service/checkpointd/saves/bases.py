"""The base of an incremental save: the run's newest committed save, opened, and what it offers.

A training checkpoint's base is the newest committed checkpoint of the run in
the same dir whose manifest records its chunk digests
(`checkpointd.bundle.chunks`); a policy save's (`save`, `save_checkpoint`)
is the run's newest committed save of the same kind in the same parent dir
(its `variables/` bundle: the same keys in the same layout). It is opened at the accept, before its
digests are offered: the descriptor keeps its bytes readable should
retention delete it (or a save replace it) while the new save copies from
it, and the file is used only if its identity (device, inode, size,
modification time) is the one its manifest recorded. After the last copy the
identity is checked again (`check`): a file written to meanwhile fails the
save with ChecksumError (DATA_LOSS: the client sends it again in full), so a
copied range is never other than the bytes its digests describe.

On an object store (`RemoteBases`: S3) the base is the newest committed
checkpoint's data object, named with the ETag its manifest recorded; its
ranges are not copied here but referred to (`BundleSink.refer`), and the
store copies them server-side at commit on condition of that ETag
(`checkpointd.storage.s3.part_copy`). A base that replaces itself (the same
export dir) is not offered there: its object is the one being replaced.

`Incremental` is the save's sink with the base beside it: the receiver hands
it each SameChunks range, checked against the base's digests and copied.
A snapshot in shared memory comes whole (`write_parts`): the daemon sums its
chunks' CRC32Cs itself, after the trainer has let go of the call (as the
bundle writer would sum them anyway), and copies the runs equal to the
base's instead of writing them.
`Newest` remembers each dir's newest checkpoint as this daemon committed it,
so an accept lists the dir only once after a start.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from checkpointd.core import chunk_record as chunks
from checkpointd.core.ports import CommittedSave, CopyingSink, OrderedSink, RemoteBases, Staged, Store
from checkpointd.core.retention import age
from checkpointd.core.variable_manifest import VariableSpec
from checkpointd.protocol import tensors
from checkpointd.protocol.errors import ChecksumError, InvalidRequestError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.wire import crc32c_of
from checkpointd.saves.checkpoint_dirs import directory_of
from checkpointd.saves.requests import SaveRequest

_LOGGER = logging.getLogger(__name__)


@dataclass
class OpenBase:
    """A base save's data file, open, and its tensors matched to the new save's parts."""

    export_dir: str
    path: Path
    fd: int
    identity: tuple[int, int, int, int]
    chunk_bytes: int
    parts: list[chunks.BaseTensor | None]  # per payload part: the base's same tensor, or None
    copied: int = field(default=0)  # payload bytes copied from it so far
    source: object | None = None  # on an object store: the object the store copies from (fd is -1)

    def offer(self) -> list[tuple[int, ...]]:
        """Each part's chunk digests, () where the base has no such tensor."""
        return [t.crcs if t is not None else () for t in self.parts]

    def check(self) -> None:
        """Raises ChecksumError unless the base's file is still the one its digests describe."""
        if self.fd < 0:
            return  # an object's copies are conditional on its ETag instead
        if chunks.identity(os.fstat(self.fd)) != self.identity:
            raise ChecksumError(
                f"the base save {self.export_dir!r} was written to while this save copied from it; "
                "nothing was committed: send the save again in full (without incremental)"
            )

    def close(self) -> None:
        """Closes the base's data file (again: nothing)."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


# A save of less than one chunk has nothing worth copying: opening its base and
# reading its manifest back after the commit cost more than sending its bytes.
MIN_BYTES = chunks.CHUNK_BYTES


def worth_a_base(parts: Sequence[int]) -> bool:
    """Whether a save whose payload parts are `parts` bytes may copy from a base."""
    return sum(parts) >= MIN_BYTES


class Newest:
    """The newest committed checkpoint of each (folder, dir), as found once and then as committed here. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._saves: dict[tuple[str, str, str], CommittedSave] = {}

    def find(self, store: Store, folder: str, request: SaveRequest) -> CommittedSave | None:
        """The newest committed save of the request's run and kind in its dir, or None."""
        key = (folder, directory_of(request.export_dir), request.kind.value)
        with self._lock:
            known = self._saves.get(key)
        if known is not None and known.run == request.run:
            return known
        prefix = request.checkpoint is not None  # a training checkpoint's files are a prefix in its dir
        saves = [
            s
            for s in store.committed(folder, request.run)
            if s.kind is request.kind and s.prefix == prefix and directory_of(s.export_dir) == key[1]
        ]
        newest = max(saves, key=age) if saves else None
        if newest is not None:
            with self._lock:
                self._saves[key] = newest
        return newest

    def forget(self, folder: str, request: SaveRequest) -> None:
        """Drops what is known of the request's dir (a save committed there without being remembered)."""
        with self._lock:
            self._saves.pop((folder, directory_of(request.export_dir), request.kind.value), None)

    def committed(self, store: Store, folder: str, request: SaveRequest) -> None:
        """Reads back the manifest of the request's save, just committed: the dir's next base."""
        try:
            save = store.committed_at(folder, request.export_dir)
        except Exception as e:  # noqa: BLE001 - the save is committed; the next one lists the dir instead
            _LOGGER.info("run %s: %s not remembered as a base: %s", request.run, request.export_dir, e)
            save = None
        with self._lock:
            key = (folder, directory_of(request.export_dir), request.kind.value)
            if save is None:
                self._saves.pop(key, None)
            else:
                self._saves[key] = save


def open_base(
    store: Store,
    folder: str,
    request: SaveRequest,
    local: bool,
    newest: Newest | None = None,
    variables: Sequence[VariableSpec] = (),
    remote: RemoteBases | None = None,
) -> OpenBase | None:
    """The base the request's save may copy from, opened; None if there is none to use.

    Args:
        store: where the run's saves are.
        folder: the run's folder.
        request: an accepted, incremental save.
        local: whether the store's saves are files on this host (else
            `remote` must be given for a base to be offered).
        newest: what is known of each dir's newest checkpoint; None lists the dir.
        variables: a policy save's variables (its manifest's), its payload
            parts but the numpy state; a training checkpoint's come with it.
        remote: the store as `RemoteBases`, if it is one (the pipeline decides once).
    """
    checkpoint = request.checkpoint
    remote = None if local else remote
    if checkpoint is not None:
        keyed = [(t.checkpoint_key, t.dtype, t.shape, t.nbytes) for t in checkpoint.tensors]
    else:  # as the policy's bundle names them: a SavedModel's keys or a checkpoint's
        saved_model = request.kind is SaveKind.SAVED_MODEL
        keyed = [(v.key if saved_model else v.checkpoint_key, v.dtype, v.shape, v.nbytes) for v in variables]
    if not keyed or (not local and remote is None):
        return None
    found = (newest or Newest()).find(store, folder, request)
    if found is None:
        return None
    newest_save = found
    record = chunks.parse(newest_save.extra)
    if record is None or record.chunk_bytes != chunks.CHUNK_BYTES:
        return None
    path = Path(str(newest_save.path) + record.data_file)
    source: object | None = None
    if remote is not None:
        if newest_save.export_dir == request.export_dir:
            return None
        source = remote.base_source(newest_save, record.data_file, record.identity[2])
        if source is None:
            return None
        fd = -1
    else:
        if not isinstance(newest_save.path, Path):
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            _LOGGER.info("run %s: no base for an incremental save: %s: %s", request.run, path, e)
            return None
        if chunks.identity(os.fstat(fd)) != record.identity:
            os.close(fd)
            _LOGGER.info("run %s: base %s is not the file its manifest describes; sending in full", request.run, path)
            return None
    parts: list[chunks.BaseTensor | None] = []
    for key, dtype, shape, nbytes in keyed:
        b = record.tensors.get(key)
        same = b is not None and not tensors.is_string(dtype) and (b.dtype, b.shape, b.size) == (dtype, shape, nbytes)
        parts.append(b if same else None)
    parts.append(None)  # the tail (a policy save's numpy state)
    if not any(p is not None and p.size for p in parts):
        if fd >= 0:
            os.close(fd)
        return None
    return OpenBase(newest_save.export_dir, path, fd, record.identity, record.chunk_bytes, parts, source=source)


class Incremental:
    """A save's sink that also takes SameChunks ranges, copied from its base."""

    def __init__(self, sink: CopyingSink, base: OpenBase, parts: Sequence[int]) -> None:
        self._sink = sink
        self._base = base
        self._starts: list[int] = []
        at = 0
        for size in parts:
            self._starts.append(at)
            at += size
        self._total = at

    def write(self, part: int, offset: int, data: object, crc: int | None = None) -> None:
        """A received chunk's bytes, as `SaveSink.write`."""
        self._sink.write(part, offset, data, crc)

    def same(self, offset: int, length: int, crcs: Sequence[int]) -> None:
        """Copies payload bytes [offset, offset + length) from the base, whose digests must be `crcs`.

        Raises:
            InvalidRequestError: the range is not whole chunks of one part the
                base holds, or `crcs` are not the base's.
        """
        part = _part_at(self._starts, offset)
        base = self._base.parts[part] if 0 <= part < len(self._base.parts) else None
        within = offset - self._starts[part] if part >= 0 else -1
        first = within // chunks.CHUNK_BYTES
        if base is None or within < 0 or within + length > base.size or length <= 0:
            raise InvalidRequestError(
                f"Save: SameChunks at payload offset {offset} ({length} bytes) is not in a tensor the base holds"
            )
        if tuple(crcs) != base.crcs[first : first + len(crcs)]:
            raise InvalidRequestError(
                f"Save: SameChunks at payload offset {offset}: the chunks' CRC32Cs are not the base's; send them as chunks"
            )
        self._reuse(part, base, within, length, crcs)

    def _reuse(self, part: int, base: chunks.BaseTensor, within: int, length: int, crcs: Sequence[int]) -> None:
        """Puts bytes [within, within + length) of part `part` in place from the base: copied, or referred to."""
        if self._base.source is not None:  # an object: the store copies it server-side at commit
            self._sink.refer(part, within, length, self._base.source, base.offset + within, crcs)
        else:
            self._sink.copy_from_base(part, within, length, self._base.fd, base.offset + within, crcs)
        self._base.copied += length

    def write_parts(self, views: Sequence[memoryview]) -> None:
        """Takes every part whole (a snapshot in shared memory): chunks equal to the base's are copied, not written.

        Parts go in the sink's order (the data file's, `BundleSink.order`).

        Raises:
            as `SaveSink.write`.
        """
        ordered = self._sink.order() if isinstance(self._sink, OrderedSink) else None
        size = chunks.CHUNK_BYTES
        for j in ordered if ordered is not None else range(len(views)):
            view = memoryview(views[j]).cast("B")
            base = self._base.parts[j] if j < len(self._base.parts) else None
            if base is None:
                if view.nbytes:
                    self._sink.write(j, 0, view)
                continue
            run_at, run = 0, list[int]()  # unchanged chunks not yet put in place
            for n, at in enumerate(range(0, view.nbytes, size)):
                piece = view[at : at + size]
                crc = crc32c_of(piece)
                if crc == base.crcs[n]:
                    if not run:
                        run_at = at
                    run.append(crc)
                    continue
                if run:
                    self._reuse(j, base, run_at, at - run_at, run)
                    run = []
                self._sink.write(j, at, piece, crc)
            if run:
                self._reuse(j, base, run_at, view.nbytes - run_at, run)

    def settle(self) -> None:
        """Waits for the copies from the base still running (their OSError, if one failed)."""
        self._sink.settle()

    def finish(self) -> Staged:
        """As `SaveSink.finish` (after the copies end)."""
        return self._sink.finish()

    def close(self) -> None:
        """As `SaveSink.close` (after the copies end)."""
        self._sink.close()


def _part_at(starts: Sequence[int], offset: int) -> int:
    """The part holding payload byte `offset` (the last non-empty one starting at or before it)."""
    # Empty parts share their start with the next: the last one starting here is the one with bytes.
    return bisect.bisect_right(starts, offset) - 1
