"""What the daemon and its clients share: errors, save kinds, names, wire codecs.

The only daemon code `checkpointd_client` imports (with `checkpointd.v1`).
Nothing here imports tensorflow, tf_agents or prometheus_client.
"""

from checkpointd.protocol.errors import (
    CheckpointdError,
    ChecksumError,
    DeadlineError,
    InvalidRequestError,
    LimitExceededError,
    RunClosedError,
    RunNotFoundError,
    SaveFailedError,
    UnauthenticatedError,
    UnavailableError,
)
from checkpointd.protocol.kinds import SaveKind

__all__ = [
    "CheckpointdError",
    "ChecksumError",
    "DeadlineError",
    "InvalidRequestError",
    "LimitExceededError",
    "RunClosedError",
    "RunNotFoundError",
    "SaveFailedError",
    "SaveKind",
    "UnauthenticatedError",
    "UnavailableError",
]
