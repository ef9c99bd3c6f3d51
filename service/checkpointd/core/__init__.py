"""The pure core of checkpointd: lanes, manifests, paths, errors. Stdlib only."""

from checkpointd.core.errors import (
    CheckpointdError,
    ChecksumError,
    DeadlineError,
    UnavailableError,
    InvalidRequestError,
    LimitExceededError,
    RunClosedError,
    RunNotFoundError,
    SaveFailedError,
    UnauthenticatedError,
)
from checkpointd.core.lane import (
    Failed,
    Lane,
    LaneState,
    SaveKind,
    SaveSpec,
    Skipped,
    Ticket,
    TicketState,
    Written,
)
from checkpointd.core.manifest import Manifest, VariableSpec

__all__ = [
    "CheckpointdError",
    "ChecksumError",
    "DeadlineError",
    "UnavailableError",
    "Failed",
    "InvalidRequestError",
    "Lane",
    "LaneState",
    "LimitExceededError",
    "Manifest",
    "RunClosedError",
    "RunNotFoundError",
    "SaveFailedError",
    "SaveKind",
    "SaveSpec",
    "Skipped",
    "Ticket",
    "TicketState",
    "UnauthenticatedError",
    "VariableSpec",
    "Written",
]
