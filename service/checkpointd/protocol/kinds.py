"""The kinds of save, and their one label and wire map.

A kind's `value` is its label everywhere text names it: metrics labels, save
manifests, logs and `checkpointd status`. `to_wire`/`from_wire` map it to the
proto's `SaveKind` enum. Stdlib only until a wire function is called.
"""

from __future__ import annotations

import enum
import functools
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from checkpointd.v1 import checkpointd_pb2 as pb


class SaveKind(enum.Enum):
    SAVED_MODEL = "saved_model"  # PolicySaver.save: a SavedModel
    CHECKPOINT = "checkpoint"  # PolicySaver.save_checkpoint: variables/ only
    # tf.train.CheckpointManager.save (common.Checkpointer): a whole training state
    TRAINING_CHECKPOINT = "training_checkpoint"


LABELS: tuple[str, ...] = tuple(k.value for k in SaveKind)


def to_wire(kind: SaveKind) -> pb.SaveKind:
    """The proto `SaveKind` value of a kind (same member names)."""
    # An int at run time; protobuf's stubs type Value() as int, the messages'
    # kind fields as the enum.
    return cast("pb.SaveKind", _wire_values()[kind])


@functools.cache
def _wire_values() -> dict[SaveKind, int]:
    """Every kind's proto value, looked up once (every save's response names its kind)."""
    from checkpointd.v1 import checkpointd_pb2 as pb

    return {kind: pb.SaveKind.Value(kind.name) for kind in SaveKind}


def from_wire(value: int) -> SaveKind | None:
    """The kind a proto `SaveKind` value names; None for UNSPECIFIED or an unknown value."""
    from checkpointd.v1 import checkpointd_pb2 as pb

    try:
        return SaveKind[pb.SaveKind.Name(value)]
    except (KeyError, ValueError):
        return None
