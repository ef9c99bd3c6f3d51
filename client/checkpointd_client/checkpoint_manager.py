"""What `Checkpointer.manager` offers, answered by the daemon (GetLatest), and the retention a checkpointer asks of it.

`tf_agents.utils.common.Checkpointer.manager` is a `tf.train.CheckpointManager`;
a RemoteCheckpointer's is a `RemoteCheckpointManager` over the daemon's
GetLatest answer (`Latest`). `checked_max_to_keep` turns CheckpointManager's
`max_to_keep` into what the wire carries.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from checkpointd.protocol.kinds import SaveKind, to_wire
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client.transport.session import DaemonSession


class RemoteCheckpointManager:
    """What `Checkpointer.manager` offers, answered by the daemon (`tf.train.CheckpointManager`'s view).

    Paths are the daemon's: `<root>/<folder>/<ckpt_dir>/ckpt-<step>`.
    """

    def __init__(self, directory: str, checkpoint: tf.train.Checkpoint, latest: Callable[[], Latest | None]) -> None:
        """A checkpointer's manager: its dir and checkpoint, and its GetLatest call (`latest`)."""
        self._directory = directory
        self._checkpoint = checkpoint
        self._latest = latest

    @property
    def directory(self) -> str:
        """The checkpoint dir, relative to the run's folder on the daemon."""
        return self._directory

    @property
    def checkpoint(self) -> tf.train.Checkpoint:
        return self._checkpoint

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest committed checkpoint's prefix on the daemon's host, or None."""
        latest = self._latest()
        return latest.path if latest is not None else None

    @property
    def checkpoints(self) -> list[str]:
        """The active set's prefixes on the daemon's host, oldest first (CheckpointManager.checkpoints)."""
        latest = self._latest()
        if latest is None:
            return []
        base = latest.path[: -len(latest.export_dir)] if latest.path.endswith(latest.export_dir) else ""
        return [base + c for c in latest.checkpoints]


class Latest:
    """A LatestResponse for this checkpointer's dir."""

    def __init__(self, response: pb.LatestResponse) -> None:
        self.path = response.path
        self.export_dir = response.export_dir
        self.step = response.step
        self.checkpoints = list(response.checkpoints)


def latest_checkpoint(daemon: DaemonSession, folder: str, ckpt_dir: str) -> Latest | None:
    """The newest checkpoint in `ckpt_dir` of `folder`, whichever run committed it (as latest_checkpoint(dir)).

    Raises:
        CheckpointdError: the status the daemon answered, named.
    """
    kind = to_wire(SaveKind.TRAINING_CHECKPOINT)
    request = pb.LatestRequest(run=daemon.run, kind=kind, folder=folder, checkpoint_dir=ckpt_dir)
    with daemon.calling(f"looking up the newest checkpoint in {ckpt_dir!r} of folder {folder!r}"):
        response = daemon.stub.GetLatest(request, timeout=daemon.timeout)
    return Latest(response) if response.found else None


def checked_max_to_keep(max_to_keep: Any) -> int | None:
    """`max_to_keep` as the wire carries it (uint32); more than that keeps all, as None does.

    Raises:
        ValueError: not a positive int or None.
    """
    if max_to_keep is None:
        return None
    if not isinstance(max_to_keep, int | np.integer) or isinstance(max_to_keep, bool) or max_to_keep < 1:
        raise ValueError(f"max_to_keep must be a positive int or None (keep all), got {max_to_keep!r}")
    return int(max_to_keep) if max_to_keep <= _MOST_KEPT else None


def checked_keep_hours(keep_checkpoint_every_n_hours: Any) -> float | None:
    """`keep_checkpoint_every_n_hours`, checked: a finite number of hours > 0, or None.

    Raises:
        ValueError: naming the argument.
    """
    hours = keep_checkpoint_every_n_hours
    if hours is not None and not (
        isinstance(hours, int | float) and not isinstance(hours, bool) and 0 < hours < math.inf
    ):
        raise ValueError(f"keep_checkpoint_every_n_hours must be a finite number of hours > 0, or None; got {hours!r}")
    return hours


_MOST_KEPT = 2**32 - 1  # TrainingCheckpoint.max_to_keep is a uint32
