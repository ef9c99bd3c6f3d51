"""The SaveFormat of each kind of save, and the keywords a kind's format is given."""

from __future__ import annotations

from checkpointd.core.checkpoint_spec import CheckpointSpec
from checkpointd.core.ports import SaveFormat
from checkpointd.protocol.errors import InvalidRequestError
from checkpointd.protocol.kinds import SaveKind


class Formats:
    """The SaveFormat of each kind; `checkpointd.server` registers them."""

    def __init__(self, *formats: SaveFormat) -> None:
        self._by_kind: dict[SaveKind, SaveFormat] = {}
        for fmt in formats:
            for kind in fmt.kinds:
                if kind in self._by_kind:
                    raise ValueError(f"two formats for {kind.value}")
                self._by_kind[kind] = fmt

    def __call__(self, kind: SaveKind) -> SaveFormat:
        try:
            return self._by_kind[kind]
        except KeyError:
            raise InvalidRequestError(f"this daemon has no format for {kind.value} saves") from None


def own_spec(checkpoint: CheckpointSpec | None) -> dict[str, CheckpointSpec]:
    """The keyword a training checkpoint's format takes (`SaveFormat.check`, `open`); nothing for the policy formats.

    Formats of the policy kinds (and fakes of them) predate the argument: it
    is passed only when there is one to pass.
    """
    return {} if checkpoint is None else {"checkpoint": checkpoint}
