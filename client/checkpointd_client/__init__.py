"""checkpointd_client: save TF-Agents policies and training state through a checkpointd daemon."""

from checkpointd.protocol.credentials import credentials
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
from checkpointd_client.checkpointer import RemoteCheckpointer
from checkpointd_client.learner import RemoteLearner, train_modules
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
    "RemoteCheckpointer",
    "RemoteLearner",
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
    "train_modules",
]
