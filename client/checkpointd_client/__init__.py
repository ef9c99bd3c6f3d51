"""checkpointd_client: save TF-Agents policies through a checkpointd daemon."""

from checkpointd.auth import credentials
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
from checkpointd_client.saver import RemotePolicySaver
from checkpointd_client.ticket import SaveResult, SaveTicket

__all__ = [
    "CheckpointdError",
    "ChecksumError",
    "DeadlineError",
    "UnavailableError",
    "InvalidRequestError",
    "LimitExceededError",
    "RemotePolicySaver",
    "RunClosedError",
    "RunNotFoundError",
    "SaveFailedError",
    "SaveResult",
    "SaveTicket",
    "UnauthenticatedError",
    "credentials",
]
