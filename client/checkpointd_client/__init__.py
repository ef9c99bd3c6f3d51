"""checkpointd_client: save TF-Agents policies through a checkpointd daemon."""

from checkpointd.auth import credentials
from checkpointd.core import SaveKind
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
from checkpointd_client.restore import LatestSave
from checkpointd_client.saver import RemotePolicySaver
from checkpointd_client.ticket import SaveResult, SaveTicket
from checkpointd_client.trigger import RemotePolicySavedModelTrigger

__all__ = [
    "CheckpointdError",
    "ChecksumError",
    "DeadlineError",
    "UnavailableError",
    "InvalidRequestError",
    "LatestSave",
    "LimitExceededError",
    "RemotePolicySaver",
    "RemotePolicySavedModelTrigger",
    "RunClosedError",
    "RunNotFoundError",
    "SaveFailedError",
    "SaveKind",
    "SaveResult",
    "SaveTicket",
    "UnauthenticatedError",
    "credentials",
]
