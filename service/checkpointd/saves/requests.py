"""A Save call as the pipeline sees it: the decoded request, the answers it yields, how it is received.

The RPC layer (`checkpointd.rpc.messages`) translates these to and from the
protocol's messages; `checkpointd.saves.pipeline` takes and yields them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from checkpointd.core.checkpoint_spec import CheckpointSpec
from checkpointd.core.numpy_state import NumpyStateSpec
from checkpointd.core.ports import SaveSink
from checkpointd.core.variable_manifest import VariableSpec
from checkpointd.protocol.kinds import SaveKind
from checkpointd.transport.shm import Segment

_T = TypeVar("_T")


@dataclass(frozen=True)
class SaveRequest:
    """A Save call's header, decoded."""

    run: str
    kind: SaveKind
    export_dir: str
    blocking: bool
    step: int
    variables: tuple[VariableSpec, ...]
    snapshot_bytes: int
    numpy_state: NumpyStateSpec | None = None
    shared_memory: bool = False  # the trainer can map a segment on this host
    # A training checkpoint's own description (its export_dir is then the
    # checkpoint prefix <dir>/ckpt-<step>); None for policy saves.
    checkpoint: CheckpointSpec | None = None
    # The trainer holds the run's busy lock and wrote this segment: no skip decision.
    trainer_decided: TrainerDecided | None = None
    # Saves the trainer skipped on its own since its last report.
    local_skips: tuple[LocalSkip, ...] = ()
    # The trainer can send unchanged chunks as references to a base save.
    incremental: bool = False
    # The trainer's last snapshot before it is stopped (blocking: never skipped; a
    # daemon on notice needs no more of its window for the run), and when its
    # notice came by its clock (0: unknown).
    on_notice: bool = False
    notice_unix_seconds: float = 0.0
    # The trainer's software versions (SaveHeader.trainer_versions), for the save's manifest.
    trainer_versions: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainerDecided:
    """A request's claim to hold the run's busy lock (SaveHeader.held)."""

    segment_path: str
    lock_path: str


@dataclass(frozen=True)
class LocalSkip:
    """A save its trainer skipped itself (the run's busy lock was taken)."""

    kind: SaveKind
    export_dir: str
    step: int


@dataclass(frozen=True)
class Decision:
    """The lane's answer: accepted (with a shared-memory segment, if offered) or skipped."""

    accepted: bool
    reason: str = ""
    segment: Segment | None = None
    lock_path: str = ""  # the run's busy lock, offered with the segment
    # An incremental save's base: its export_dir and each part's chunk digests.
    base: BaseOffer | None = None


@dataclass(frozen=True)
class BaseOffer:
    """The base an accept offers an incremental save (SaveDecision.base)."""

    export_dir: str
    chunk_bytes: int
    parts: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Result:
    """An accepted save, committed."""

    path: str
    bytes_written: int
    duration_seconds: float
    step: int
    kind: SaveKind
    bytes_received: int = 0  # of the payload: sent, or from shared memory
    bytes_copied: int = 0  # of the payload: copied from the base
    # An incremental save's path (`checkpointd.core.incremental_path.PATHS`); "" for a save sent in full.
    incremental_path: str = ""


class Receiver(Protocol):
    """Reads an accepted save's snapshot (the RPC layer's request stream) into the save's open files.

    Writes each part's bytes (the variables, then the numpy state's) into
    `sink` as they arrive, then returns `then(transport)` for the transport
    they came by ("grpc" or "shm"), called on the thread that wrote them
    (the save's commit: no hand-off to another thread), unbounded by the
    deadline. Raises a domain error for a bad upload: out of order, bad CRC,
    late past `deadline` (monotonic).
    """

    def __call__(
        self, parts: Sequence[int], segment: Segment | None, deadline: float, sink: SaveSink, then: Callable[[str], _T]
    ) -> _T: ...
