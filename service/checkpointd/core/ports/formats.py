"""The SaveFormat seam: how one kind of save is checked, written into staging and read back.

`checkpointd.formats.policy` writes policy SavedModels and checkpoints,
`checkpointd.formats.training_checkpoint` training checkpoints. A save's
files are opened before its snapshot arrives (`SaveFormat.open`) and
written as it does (`SaveSink`), so no snapshot is held whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from checkpointd.core.ports.records import CommittedSave, SnapshotBytes, Staged
from checkpointd.core.ports.restore import SaveValues
from checkpointd.core.ports.sinks import SaveSink

if TYPE_CHECKING:
    from checkpointd.core.checkpoint_spec import CheckpointSpec
    from checkpointd.core.numpy_state import NumpyPayload, NumpyStateSpec
    from checkpointd.core.variable_manifest import Manifest, VariableSpec
    from checkpointd.protocol.kinds import SaveKind


class SaveFormat(Protocol):
    """One family of save kinds: how a run registers, and how its saves are written and read."""

    @property
    def kinds(self) -> tuple[SaveKind, ...]:
        """The kinds this format writes."""
        ...

    def register(
        self,
        run: str,
        staged_dir: Path,
        variables: Sequence[VariableSpec],
        checkpoint_object_graph: bytes,
    ) -> Manifest:
        """Validates an uploaded template and makes it the run's template.

        `staged_dir` is consumed (kept or deleted).

        Raises:
            InvalidRequestError: the template or `variables` are not valid for this format.
        """
        ...

    def check(
        self,
        manifest: Manifest,
        variables: Sequence[VariableSpec],
        snapshot_bytes: int,
        numpy_state: NumpyStateSpec | None,
        max_snapshot_bytes: int,
        *,
        checkpoint: CheckpointSpec | None = None,
    ) -> None:
        """Refuses a save header that does not fit the run's manifest, before the decision.

        `checkpoint` is a training checkpoint's own description, given (only)
        to the format of TRAINING_CHECKPOINT saves; the pipeline passes it to
        no other, so policy formats need not take it.

        Raises:
            InvalidRequestError, LimitExceededError: naming what is wrong.
        """
        ...

    def write(
        self,
        run: str,
        kind: SaveKind,
        manifest: Manifest,
        staging: Path,
        snapshot: SnapshotBytes,
        numpy_state: NumpyPayload | None,
        *,
        checkpoint: CheckpointSpec | None = None,
    ) -> Staged:
        """Writes one save's files into the empty dir `staging`.

        `manifest` is the one the snapshot was checked against: a run
        registered anew meanwhile fails the save rather than mislabel it.
        `checkpoint`: as for `check`, the training checkpoint the snapshot
        holds (one part per tensor).

        Raises:
            RunNotFoundError: the run has no template here.
            SaveFailedError: the snapshot does not fit the run's template.
            Exception: the files could not be written (the pipeline reports
                it as SaveFailedError with the reason).
        """
        ...

    def open(
        self,
        run: str,
        kind: SaveKind,
        manifest: Manifest,
        staging: Path,
        parts: Sequence[int],
        numpy_state: NumpyStateSpec | None,
        *,
        checkpoint: CheckpointSpec | None = None,
    ) -> SaveSink:
        """Opens one save's files in the empty dir `staging`, before its snapshot arrives.

        `parts` are the snapshot's part sizes as the pipeline receives them:
        each variable (or a training checkpoint's tensor), then the numpy
        state's bytes (0 without). Otherwise as `write`, whose snapshot the
        returned sink takes piece by piece.

        Raises:
            RunNotFoundError: the run has no template here.
            SaveFailedError: the parts do not fit the run's template.
            Exception: the files could not be created.
        """
        ...

    def read(self, save: CommittedSave, manifest: Manifest) -> SaveValues:
        """Opens a committed save of this format for Restore.

        Raises:
            InvalidRequestError: the save does not fit the run's manifest.
            ChecksumError, SaveFailedError: its files are corrupt or unreadable.
        """
        ...


@runtime_checkable
class SegmentLayouts(Protocol):
    """A SaveFormat that lays a save's shared-memory segment out as its data file's image (O_DIRECT writes)."""

    def segment_layout(
        self, parts: Sequence[int], *, checkpoint: CheckpointSpec | None = None
    ) -> tuple[list[int], int] | None:
        """Each part's offset in the segment and its size, as `open`'s sink would write the image; None: no image.

        Raises:
            SaveFailedError: the parts do not fit the save.
        """
        ...
