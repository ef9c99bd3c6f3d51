"""A save's sink: its files open in staging, taking the snapshot as it arrives, and what only some sinks do.

`SaveSink` is what every format's sink does. The rest are capabilities a
sink may have (`checkpointd.bundle.sink.BundleSink` has them all), each a
Protocol of its own, checked with isinstance where it is used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from checkpointd.core.ports.records import Staged


class SaveSink(Protocol):
    """A save's files, open in staging, taking the snapshot's parts as they arrive.

    The parts are the wire's (each variable or tensor, then the numpy
    state's bytes), each one's bytes in order; the parts themselves may come
    in any order. `close` may be called from another thread than the writer's
    (a save given up mid-upload): it waits for a write in progress, and
    later writes fail.
    """

    def write(self, part: int, offset: int, data: Any, crc: int | None = None) -> None:
        """Takes `data`, the bytes of part #`part` from `offset` on (the bytes it has so far).

        `crc`, if given, is `data`'s CRC32C as the receiver checked it (a
        sink may fold it in instead of summing the bytes again).

        Raises:
            InvalidRequestError: out of order or past the part's size.
            Exception: the files could not be written.
        """
        ...

    def finish(self) -> Staged:
        """Completes the files once every part has come; returns them staged for the Store.

        Raises:
            InvalidRequestError: a part is incomplete.
            Exception: the files could not be written.
        """
        ...

    def close(self) -> None:
        """Closes the files (again: nothing); the staging dir is the caller's to discard."""
        ...


@runtime_checkable
class WatchedSink(Protocol):
    """A SaveSink that reports its data file's byte ranges as they are written (`BundleSink`)."""

    def watch(self, on_range: Callable[[int, int], None]) -> tuple[Path, int]:
        """Calls `on_range(start, end)` per written range, any order; returns the data file's path and size."""
        ...


@runtime_checkable
class WholePartsSink(Protocol):
    """A SaveSink that takes a snapshot's parts all at once (one in shared memory) and picks their order."""

    def write_parts(self, views: Sequence[memoryview]) -> None:
        """Takes every part whole (`views[j]` is part j's bytes), as `write(j, 0, views[j])` for each would.

        Raises:
            as `SaveSink.write`.
        """
        ...


@runtime_checkable
class ImageSink(Protocol):
    """A SaveSink that can write its data file straight from a shared-memory segment laid out as the file's image."""

    def image_layout(self) -> tuple[list[int], int] | None:
        """Each part's offset in an image of the data file and the image's size; None: the parts have no image."""
        ...

    def write_image(self, whole: memoryview, offsets: Sequence[int]) -> None:
        """Takes every part from `whole` (part j at `offsets[j]`), as `write_parts` would from its views.

        Raises:
            as `SaveSink.write`.
        """
        ...


@runtime_checkable
class OrderedSink(Protocol):
    """A SaveSink whose data file lays its parts out in an order of its own: writing in it writes the file in order."""

    def order(self) -> list[int] | None:
        """The parts' indices in the data file's order; None: any order."""
        ...


@runtime_checkable
class CopyingSink(SaveSink, Protocol):
    """A SaveSink that can put whole chunks in place from a base save instead of receiving them (incremental saves)."""

    def copy_from_base(
        self, part: int, offset: int, nbytes: int, source: int, source_offset: int, crcs: Sequence[int]
    ) -> None:
        """Copies part `part`'s bytes [offset, offset + nbytes) from the file open as `source`, at `source_offset`.

        `crcs` are the CRC32Cs of its chunks, as the base's manifest records them.
        """
        ...

    def refer(
        self, part: int, offset: int, nbytes: int, source: object, source_offset: int, crcs: Sequence[int]
    ) -> None:
        """As `copy_from_base`, from an object the store copies server-side at commit (`RemoteBases.base_source`)."""
        ...

    def settle(self) -> None:
        """Waits for the copies still running (raises the OSError of one that failed)."""
        ...


@runtime_checkable
class ReferencingSink(Protocol):
    """A WatchedSink that also names the ranges it leaves unwritten, each as a range of a base object."""

    def watch_references(self, on_refer: Callable[[int, int, object, int], None]) -> None:
        """Calls `on_refer(start, end, source, offset)` per referred range of the data file, any order."""
        ...


@runtime_checkable
class SameChunksSink(Protocol):
    """A save's sink that takes SameChunks: payload ranges unchanged since the base, copied from it."""

    def same(self, offset: int, length: int, crcs: Sequence[int]) -> None:
        """Copies payload bytes [offset, offset + length) from the base, whose digests must be `crcs`.

        Raises:
            InvalidRequestError: the range is not whole chunks the base holds, or `crcs` are not the base's.
        """
        ...
