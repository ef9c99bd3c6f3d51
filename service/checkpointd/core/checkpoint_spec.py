"""Training checkpoints as a save declares them: its tensors, object graph and retention.

A TRAINING_CHECKPOINT save carries its own description instead of matching a
manifest registered once: the tensors a `tf.train.Checkpoint` holds change
between saves (optimizer slots appear after the first train step, Python
state changes size), and nothing of a policy template applies. The daemon
checks the description against itself here (sizes, dtypes, names) and
against its object graph in `checkpointd.formats.training_checkpoint`, before the
decision, so a save that does not add up is refused and writes nothing.

Pure: the object graph is carried, not parsed, here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from checkpointd.core.variable_manifest import check_limit
from checkpointd.protocol import tensors
from checkpointd.protocol.errors import InvalidRequestError


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a training checkpoint: its key, dtype, shape and payload size."""

    checkpoint_key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def __post_init__(self) -> None:
        key = self.checkpoint_key
        if not key:
            raise InvalidRequestError("a tensor has an empty checkpoint_key")
        if key == tensors.OBJECT_GRAPH_KEY:
            raise InvalidRequestError(f"{key!r} is the object graph's own key; it is not a tensor to send")
        if any(d < 0 for d in self.shape):
            raise InvalidRequestError(f"tensor {key!r} has a negative dimension {list(self.shape)}")
        if tensors.is_string(self.dtype):
            if self.shape:
                raise InvalidRequestError(
                    f"tensor {key!r} is a string of shape {list(self.shape)}; only scalar strings "
                    "(Python state) can be carried"
                )
        elif self.dtype not in tensors.ITEMSIZE:
            raise InvalidRequestError(
                f"tensor {key!r} has dtype {self.dtype!r}; supported: "
                + ", ".join(sorted([*tensors.ITEMSIZE, tensors.STRING]))
            )
        elif self.nbytes != tensors.nbytes(self.dtype, self.shape):
            raise InvalidRequestError(
                f"tensor {key!r} is {self.dtype}{list(self.shape)}, "
                f"{tensors.nbytes(self.dtype, self.shape)} bytes; its nbytes says {self.nbytes}"
            )
        if self.nbytes < 0:
            raise InvalidRequestError(f"tensor {key!r} has a negative size")


@dataclass(frozen=True)
class CheckpointRetention:
    """tf.train.CheckpointManager's two knobs, as the newest save of a dir sets them.

    Attributes:
        max_to_keep: checkpoints kept in the active set; None keeps all.
        keep_checkpoint_every_n_hours: a checkpoint leaving the active set is
            kept for good when it is this much newer than the last one kept;
            None: never.
    """

    max_to_keep: int | None = None
    keep_checkpoint_every_n_hours: float | None = None

    def __post_init__(self) -> None:
        if self.max_to_keep is not None and self.max_to_keep < 1:
            raise InvalidRequestError(f"max_to_keep must be >= 1 or unset (keep all), got {self.max_to_keep}")
        hours = self.keep_checkpoint_every_n_hours
        if hours is not None and not (math.isfinite(hours) and hours > 0):
            raise InvalidRequestError(
                f"keep_checkpoint_every_n_hours must be a positive number of hours or unset, got {hours}"
            )

    @classmethod
    def from_wire(cls, max_to_keep: int, keep_checkpoint_every_n_hours: float) -> CheckpointRetention:
        """From the proto's zeros-for-None (a negative or NaN hours value is refused)."""
        hours = keep_checkpoint_every_n_hours
        return cls(max_to_keep or None, None if hours == 0 else hours)


@dataclass(frozen=True)
class CheckpointSpec:
    """A training checkpoint's own description: tensors in payload (and write) order."""

    object_graph: bytes
    tensors: tuple[TensorSpec, ...]
    retention: CheckpointRetention = CheckpointRetention()

    def __post_init__(self) -> None:
        if not self.object_graph:
            raise InvalidRequestError("training_checkpoint: the object graph is empty")
        seen: set[str] = set()
        for t in self.tensors:
            if t.checkpoint_key in seen:
                raise InvalidRequestError(f"training_checkpoint: tensor {t.checkpoint_key!r} appears twice")
            seen.add(t.checkpoint_key)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(t.checkpoint_key for t in self.tensors)

    def check(self, declared_bytes: int, max_bytes: int | None) -> None:
        """Checks the header's snapshot size against the tensors' and the daemon's limit.

        Raises:
            InvalidRequestError: the sizes do not add up.
            LimitExceededError: the checkpoint is larger than `max_bytes`.
        """
        if declared_bytes != self.nbytes:
            raise InvalidRequestError(
                f"snapshot declares {declared_bytes} bytes; the training checkpoint's tensors take {self.nbytes}"
            )
        check_limit(declared_bytes, max_bytes)


def check_keys(declared: Sequence[str], graph: Sequence[tuple[str, str]]) -> None:
    """Checks declared tensors against an object graph's (checkpoint_key, attribute) pairs.

    Every attribute must be declared once and nothing else; a Python-state
    attribute's tensor must be a string (see `check_dtypes`).

    Raises:
        InvalidRequestError: naming the first key that differs.
    """
    in_graph = [key for key, _ in graph]
    graph_set, declared_set = set(in_graph), set(declared)
    for key in declared:
        if key not in graph_set:
            raise InvalidRequestError(f"training_checkpoint: tensor {key!r} is not in the object graph")
    for key in in_graph:
        if key not in declared_set:
            raise InvalidRequestError(f"training_checkpoint: the object graph has {key!r}, which no tensor declares")
    if len(in_graph) != len(graph_set):
        repeated = next(k for i, k in enumerate(in_graph) if k in in_graph[:i])
        raise InvalidRequestError(f"training_checkpoint: the object graph names {repeated!r} twice")


def check_dtypes(spec: CheckpointSpec, graph: Sequence[tuple[str, str]]) -> None:
    """Refuses a Python-state attribute declared as anything but a string tensor.

    Raises:
        InvalidRequestError: naming the key.
    """
    dtypes = {t.checkpoint_key: t.dtype for t in spec.tensors}
    for key, attribute in graph:
        if attribute == tensors.PY_STATE_ATTRIBUTE and not tensors.is_string(dtypes.get(key, tensors.STRING)):
            raise InvalidRequestError(
                f"training_checkpoint: {key!r} is Python state in the object graph; its tensor must be "
                f"a {tensors.STRING!r}, not {dtypes[key]!r}"
            )
