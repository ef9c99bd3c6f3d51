"""The values that cross the seams: a save's metadata, its staged files, a committed save and its files."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from checkpointd.protocol.kinds import SaveKind

# A snapshot: every variable's bytes concatenated, or one buffer per variable.
SnapshotBytes = bytes | bytearray | memoryview | Sequence[memoryview]


@dataclass(frozen=True)
class SaveMeta:
    """What a save's manifest records besides its files."""

    run: str
    kind: SaveKind
    step: int
    export_dir: str  # as the trainer named it
    trainer_versions: Mapping[str, str] = field(default_factory=dict)  # the trainer's (SaveHeader), e.g. tensorflow's
    # time.monotonic() by which the store gives up retrying (the call's deadline, less a reserve);
    # None: no deadline. Not recorded in the manifest.
    deadline: float | None = None


@dataclass(frozen=True)
class Staged:
    """A save's files, written by a SaveFormat into a Store's staging dir.

    Attributes:
        path: the local staging dir holding the files.
        bytes_written: their total size.
        versions: the daemon's software versions for the save manifest (checkpointd's).
        known: (size, CRC32C) of files whose content the format already
            checksummed (template files written from memory), by
            '/'-separated path, so the store need not read them back.
        extra: format-specific fields for the save manifest.
        files_prefix: None for a save that is a dir of its own. Else the
            staged files are named `<files_prefix><suffix>` and are committed
            beside the target as `<target.name><suffix>`, sharing its parent
            dir with other saves (a TensorFlow checkpoint prefix).
    """

    path: Path
    bytes_written: int
    versions: Mapping[str, str]
    known: Mapping[str, tuple[int, int]] | None = None
    extra: Mapping[str, Any] | None = None
    files_prefix: str | None = None


@dataclass(frozen=True)
class CommittedSave:
    """One committed save, as its manifest describes it.

    Attributes:
        path: where it lives: a dir on the daemon's host for the local store
            (a `Path`), an object key for the object store (a
            `PurePosixPath` relative to the bucket).
        export_dir: the save relative to its folder, '/'-separated.
        run: the run that wrote it.
        kind: its kind.
        step: the train step in its snapshot.
        created: Unix time the daemon committed it.
        prefix: True for files `<path>.*` sharing their dir with other
            saves (a training checkpoint), False for a dir of its own.
        extra: the format's fields of its manifest (Staged.extra), if any.
    """

    path: PurePath
    export_dir: str
    run: str
    kind: SaveKind
    step: int
    created: float
    prefix: bool = False
    extra: Mapping[str, Any] | None = None

    @property
    def name(self) -> str:
        """The save's last path component (a training checkpoint's "ckpt-<step>")."""
        return self.path.name


@dataclass(frozen=True)
class SavedFile:
    """One file of a committed save, as its manifest lists it.

    Attributes:
        path: relative to the save's dir (its checkpoint dir for a prefix).
        size: bytes.
        crc32c: the whole file's CRC32C.
    """

    path: str
    size: int
    crc32c: int
