"""checkpointd_client: save TF-Agents policies and training state through a checkpointd daemon.

The savers are imported on first use, so importing a module of the package
that needs no TensorFlow (`checkpointd_client.transport.session`) loads none.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from checkpointd.protocol.credentials import credentials
from checkpointd.protocol.errors import (
    AlreadyExistsError,
    CheckpointdError,
    ChecksumError,
    DeadlineError,
    InvalidRequestError,
    LimitExceededError,
    RunClosedError,
    RunHeldError,
    RunNotFoundError,
    SaveFailedError,
    UnauthenticatedError,
    UnavailableError,
)
from checkpointd.protocol.kinds import SaveKind

if TYPE_CHECKING:
    from checkpointd_client.checkpointer import RemoteCheckpointer
    from checkpointd_client.learner import (
        RemoteLearner,
        common_module,
        policy_saver_module,
        ppo_learner_module,
        train_modules,
    )
    from checkpointd_client.notice import NoticeOutcome, preempted
    from checkpointd_client.restore.policies import LatestSave
    from checkpointd_client.saver import RemotePolicySaver
    from checkpointd_client.ticket import SaveCounts, SaveResult, SaveTicket
    from checkpointd_client.trigger import RemotePolicySavedModelTrigger

# Name -> the module that defines it, imported when the name is first used.
_LAZY = {
    "RemoteCheckpointer": "checkpointd_client.checkpointer",
    "RemoteLearner": "checkpointd_client.learner",
    "common_module": "checkpointd_client.learner",
    "policy_saver_module": "checkpointd_client.learner",
    "ppo_learner_module": "checkpointd_client.learner",
    "train_modules": "checkpointd_client.learner",
    "LatestSave": "checkpointd_client.restore.policies",
    "NoticeOutcome": "checkpointd_client.notice",
    "preempted": "checkpointd_client.notice",
    "RemotePolicySaver": "checkpointd_client.saver",
    "SaveCounts": "checkpointd_client.ticket",
    "SaveResult": "checkpointd_client.ticket",
    "SaveTicket": "checkpointd_client.ticket",
    "RemotePolicySavedModelTrigger": "checkpointd_client.trigger",
}

__all__ = [
    "AlreadyExistsError",
    "CheckpointdError",
    "ChecksumError",
    "DeadlineError",
    "InvalidRequestError",
    "LatestSave",
    "LimitExceededError",
    "NoticeOutcome",
    "RemoteCheckpointer",
    "RemoteLearner",
    "RemotePolicySaver",
    "RemotePolicySavedModelTrigger",
    "RunClosedError",
    "RunHeldError",
    "RunNotFoundError",
    "SaveCounts",
    "SaveFailedError",
    "SaveKind",
    "SaveResult",
    "SaveTicket",
    "UnauthenticatedError",
    "UnavailableError",
    "common_module",
    "credentials",
    "policy_saver_module",
    "ppo_learner_module",
    "preempted",
    "train_modules",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'checkpointd_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
