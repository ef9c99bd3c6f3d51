"""What the core needs from the outside world, as Protocols."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from checkpointd.protocol.kinds import SaveKind
    from checkpointd.core.manifest import Manifest, VariableSpec
    from checkpointd.core.numpy_state import NumpyPayload


class Clock(Protocol):
    def __call__(self) -> float:
        """Seconds since the epoch."""


class MetricsSink(Protocol):
    """Receives every save outcome; `checkpointd.metrics` implements it."""

    def save_skipped(self, run: str, kind: str) -> None: ...

    def save_written(
        self, run: str, kind: str, bytes_written: int, seconds: float, at: float
    ) -> None: ...

    def save_failed(self, run: str, kind: str, seconds: float) -> None: ...

    def in_flight_changed(self, delta: int) -> None: ...

    def run_closed(self, run: str) -> None:
        """The run's lane closed: its per-run series can go."""


class NullSink:
    """A MetricsSink that records nothing."""

    def save_skipped(self, run: str, kind: str) -> None:
        pass

    def save_written(
        self, run: str, kind: str, bytes_written: int, seconds: float, at: float
    ) -> None:
        pass

    def save_failed(self, run: str, kind: str, seconds: float) -> None:
        pass

    def in_flight_changed(self, delta: int) -> None:
        pass

    def run_closed(self, run: str) -> None:
        pass


class Writer(Protocol):
    """Turns templates and snapshots into files; `checkpointd.formats.policy` implements it.

    Both methods leave nothing behind on failure.
    """

    def register(
        self,
        run: str,
        staged_dir: Path,
        variables: Sequence[VariableSpec],
        checkpoint_object_graph: bytes,
    ) -> Manifest:
        """Validates an uploaded template and makes it the run's template.

        Raises:
            InvalidRequestError: the template is not a TF-Agents policy
                SavedModel, or `variables` disagree with it.
        """
        ...

    def write(
        self,
        run: str,
        kind: SaveKind,
        target: Path,
        snapshot: bytes | bytearray | memoryview | Sequence[memoryview],
        *,
        step: int = -1,
        export_dir: str | None = None,
        numpy_state: NumpyPayload | None = None,
    ) -> int:
        """Writes one save atomically to `target`; returns the bytes written.

        `step` and `export_dir` (as the trainer named it) are recorded in the
        save's manifest; `numpy_state`, if given, is written beside the
        variables and listed in it.

        Raises:
            SaveFailedError: the save could not be written.
        """
        ...
