"""What Restore and RestoreFiles need of a Store and a SaveFormat: a save's values, files and local copies."""

from __future__ import annotations

from collections.abc import Generator, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from checkpointd.core.ports.records import CommittedSave, SavedFile

if TYPE_CHECKING:
    from checkpointd.core.checkpoint_spec import CheckpointSpec
    from checkpointd.core.numpy_state import NumpyStateSpec


class SaveValues(Protocol):
    """A committed save opened for Restore, checked against the run's manifest.

    A training checkpoint's values are also `CheckpointValues`; policy
    saves' need not be.
    """

    numpy_state: NumpyStateSpec | None
    nbytes: int

    def pieces(self) -> Iterator[memoryview]:
        """Each variable's raw bytes in manifest order, then each numpy entry's."""
        ...


@runtime_checkable
class CheckpointValues(Protocol):
    """SaveValues that describe what they hold (a training checkpoint's: its tensors, in payload order)."""

    checkpoint: CheckpointSpec | None


@runtime_checkable
class LocalCopies(Protocol):
    """A Store whose saves are not local files (an object store) gives readers local copies.

    SaveFormat.read needs a save's files on a filesystem; Restore opens a
    save of such a store through `local_copy`.
    """

    def local_copy(self, save: CommittedSave) -> AbstractContextManager[CommittedSave]:
        """Brings a committed save's files to a private local dir, checked against its manifest.

        Yields the save with `path` local; the copy is deleted on exit.

        Raises:
            ChecksumError, SaveFailedError: a file is missing, corrupt or unreadable.
        """
        ...


@runtime_checkable
class HeldSaves(Protocol):
    """A Store of local files lends a committed save's dir held open, so its readers follow no link put there since."""

    def held(self, save: CommittedSave) -> AbstractContextManager[CommittedSave]:
        """Opens the save's dir (a prefix's: its checkpoint dir) along the path its lookup checked, following no link.

        Yields the save with `path` naming it through the open descriptor
        (`/proc/self/fd/N`, and a prefix's name below it), closed on exit.
        Its readers open its files with `checkpointd.durable.dirs.open_file`.

        Raises:
            InvalidRequestError: a component of its path is a link now.
            RunNotFoundError: its dir is gone, or a file is in its place.
        """
        ...


@runtime_checkable
class SaveFiles(Protocol):
    """A Store that hands out a committed save's files as bytes, for RestoreFiles."""

    def files_of(self, save: CommittedSave) -> list[SavedFile]:
        """Every file of the save, from its manifest.

        Raises:
            RunNotFoundError: the save is no longer committed.
        """
        ...

    def local_dir(self, save: CommittedSave) -> Path | None:
        """The local dir the files' paths are relative to; None if they are not local files."""
        ...

    def verified(self, save: CommittedSave, files: Sequence[SavedFile]) -> dict[str, tuple[int, int, int]]:
        """The (st_dev, st_ino, st_mtime_ns) of each local file found to match its manifest (size and CRC32C).

        A file that does not match, or is no local file, is left out.
        """
        ...

    def read_ranges(self, save: CommittedSave, ranges: Sequence[tuple[str, int, int]]) -> Iterator[bytes]:
        """The bytes of each (path, offset, length) in order, in pieces of at most 3 MiB (wire.FILE_CHUNK_BYTES).

        Raises:
            SaveFailedError: a file is missing or unreadable.
            UnavailableError: the object store failed.
        """
        ...


@runtime_checkable
class StagesFiles(Protocol):
    """A SaveFiles Store that can land a save's byte ranges straight in local files (a staged RestoreFiles)."""

    def stage_ranges(
        self, save: CommittedSave, ranges: Sequence[tuple[str, int, int]], fds: Mapping[str, int]
    ) -> Generator[tuple[str, int, int, int], None, None]:
        """Writes each (path, offset, length) into `fds[path]` at its offset.

        Yields:
            (path, offset, length, crc32c) of each range, in order, once
            every byte of it is written.

        Raises:
            SaveFailedError: a file is missing or shorter than asked.
            UnavailableError: the object store failed.
            OSError: a write failed.
        """
        ...
