"""The catalog of committed saves: a run's newest one, for GetLatest, Restore and resume.

What counts as committed is the Store's to say (a save with a valid manifest);
"newest" is `checkpointd.core.retention.age`'s order: the latest creation
time, then the highest step.
"""

from __future__ import annotations

from checkpointd.core.ports import CommittedSave, Store
from checkpointd.core.retention import age
from checkpointd.protocol.kinds import SaveKind


def find_latest(store: Store, folder: str, run: str, kind: SaveKind | None = None) -> CommittedSave | None:
    """The run's newest committed save in `folder`.

    Args:
        store: where the saves live.
        folder: the run's folder (a valid run name; usually the run's name).
        run: only saves whose manifest names this run count.
        kind: only saves of this kind count; None for either.

    Returns:
        The save, or None if the run has none (or its folder does not exist).
    """
    saves = [s for s in store.committed(folder, run) if kind is None or s.kind is kind]
    # Not max(..., default=None): mypy infers the key's argument from the
    # Optional return type and rejects age.
    return max(saves, key=age) if saves else None
