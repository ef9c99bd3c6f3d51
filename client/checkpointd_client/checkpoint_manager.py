"""What `Checkpointer.manager` offers, answered by the daemon, and the retention a checkpointer asks of it.

`tf_agents.utils.common.Checkpointer.manager` is a `tf.train.CheckpointManager`;
a RemoteCheckpointer's is a `RemoteCheckpointManager` over the daemon's
GetLatest answer (`Latest`). `checked_max_to_keep` turns CheckpointManager's
`max_to_keep` into what the wire carries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from checkpointd.v1 import checkpointd_pb2 as pb

if TYPE_CHECKING:
    from checkpointd_client.checkpointer import RemoteCheckpointer


class RemoteCheckpointManager:
    """What `Checkpointer.manager` offers, answered by the daemon (`tf.train.CheckpointManager`'s view).

    Paths are the daemon's: `<root>/<folder>/<ckpt_dir>/ckpt-<step>`.
    """

    def __init__(self, owner: RemoteCheckpointer) -> None:
        self._owner = owner

    @property
    def directory(self) -> str:
        """The checkpoint dir, relative to the run's folder on the daemon."""
        return self._owner.ckpt_dir

    @property
    def checkpoint(self) -> tf.train.Checkpoint:
        return self._owner.checkpoint

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest committed checkpoint's prefix on the daemon's host, or None."""
        latest = self._owner._latest()  # noqa: SLF001 - the owner's RPC
        return latest.path if latest is not None else None

    @property
    def checkpoints(self) -> list[str]:
        """The active set's prefixes on the daemon's host, oldest first (CheckpointManager.checkpoints)."""
        latest = self._owner._latest()  # noqa: SLF001
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


_MOST_KEPT = 2**32 - 1  # TrainingCheckpoint.max_to_keep is a uint32
