"""The sink the pipeline hands the receiver: the format's, at the writer pool's priority.

An incremental save's is `checkpointd.saves.bases.Incremental` around it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

from checkpointd.core.ports import CopyingSink, ImageSink, OrderedSink, SaveSink, Staged, WholePartsSink
from checkpointd.saves.pool import WriterPool


class AtWriterPriority:
    """A save's sink that lowers whichever thread writes into it to the writer pool's priority.

    The receiver writes the files as the bytes arrive, on its own thread, not
    the pool's: lowered like the pool's threads (`--write-nice`, per thread and
    never raised back), a save still takes only the CPU training leaves.
    """

    def __init__(self, sink: SaveSink, pool: WriterPool) -> None:
        self._sink = sink
        self._pool = pool
        self._lowered: set[int] = set()

    def write(self, part: int, offset: int, data: object, crc: int | None = None) -> None:
        self._lower()
        self._sink.write(part, offset, data, crc)

    def write_parts(self, views: Sequence[memoryview]) -> None:
        self._lower()
        if isinstance(self._sink, WholePartsSink):
            self._sink.write_parts(views)
            return
        for part, view in enumerate(views):
            if view.nbytes:
                self._sink.write(part, 0, view)

    def image_layout(self) -> tuple[list[int], int] | None:
        return self._sink.image_layout() if isinstance(self._sink, ImageSink) else None

    def write_image(self, whole: memoryview, offsets: Sequence[int]) -> None:
        """The format's sink's `write_image`; call it only where `image_layout()` is not None."""
        if not isinstance(self._sink, ImageSink):
            raise TypeError(f"{type(self._sink).__name__} writes no image: give it the parts (write_parts)")
        self._lower()
        self._sink.write_image(whole, offsets)

    def _lower(self) -> None:
        if threading.get_ident() not in self._lowered:
            self._pool.initializer()
            self._lowered.add(threading.get_ident())

    def copy_from_base(
        self, part: int, offset: int, nbytes: int, source: int, source_offset: int, crcs: Sequence[int]
    ) -> None:
        self._copying().copy_from_base(part, offset, nbytes, source, source_offset, crcs)

    def order(self) -> list[int] | None:
        if not isinstance(self._sink, OrderedSink):
            return None
        order = self._sink.order()
        return list(order) if order is not None else None

    def refer(
        self, part: int, offset: int, nbytes: int, source: object, source_offset: int, crcs: Sequence[int]
    ) -> None:
        self._copying().refer(part, offset, nbytes, source, source_offset, crcs)

    def settle(self) -> None:
        self._copying().settle()

    def _copying(self) -> CopyingSink:
        """The format's sink as a CopyingSink: a save is offered a base only where its format's sink copies."""
        if not isinstance(self._sink, CopyingSink):
            raise TypeError(f"{type(self._sink).__name__} cannot copy from a base (not a CopyingSink)")
        return self._sink

    def finish(self) -> Staged:
        return self._sink.finish()

    def close(self) -> None:
        self._sink.close()


class PartWriter(Protocol):
    """Anything a snapshot's parts are written into (a `SaveSink`, the receiver's sink)."""

    def write(self, part: int, offset: int, data: Any, crc: int | None = None) -> None: ...


def write_views(sink: PartWriter, views: Sequence[memoryview]) -> None:
    """Writes a snapshot's parts, each whole in memory (`views[j]` is part j's bytes), into `sink`."""
    if isinstance(sink, WholePartsSink):
        sink.write_parts(views)  # whole parts: the sink picks their order
        return
    for part, view in enumerate(views):
        if view.nbytes:
            sink.write(part, 0, view)
