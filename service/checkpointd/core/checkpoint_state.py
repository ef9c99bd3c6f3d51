"""A training checkpoint dir's `checkpoint` state file and retention, as CheckpointManager keeps them.

`tf.train.CheckpointManager` keeps an *active set* of checkpoints (oldest
first, each with its timestamp) and `last_preserved_timestamp`, and writes
both to the dir's `checkpoint` file (a text CheckpointState proto) so the
next manager in the dir carries on. After each save it sweeps: while the
active set holds more than `max_to_keep`, the oldest leaves it, and is kept
for good if `keep_checkpoint_every_n_hours` have passed since the last one
so kept (which moves `last_preserved_timestamp` to it), else deleted.

The daemon keeps the same rules, but derives the active set from what is
committed instead of trusting a file a crash may have left behind: the
checkpoints whose manifest time is after `last_preserved_timestamp`, newest
last. Kept-for-good ones are exactly those at or before it (preserving one
sets the timestamp to its own). So the only state read back from the file is
that timestamp, and a `checkpoint` file written from this module names only
committed checkpoints, whatever happened before.

Pure: text in, text out; `checkpointd.saves.checkpoint_dirs` does the I/O.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from checkpointd.core.checkpoint_spec import CheckpointRetention
from checkpointd.core.retention import age

STATE_FILE = "checkpoint"  # CheckpointManager's (and tf.train.latest_checkpoint's) file name
_NAME = re.compile(r"[A-Za-z0-9._-]+\Z")
_LAST_PRESERVED = re.compile(r"^last_preserved_timestamp:\s*(\S+)\s*$", re.MULTILINE)


class Checkpoint(Protocol):
    """What the rules need of a committed checkpoint in the dir."""

    @property
    def name(self) -> str: ...  # the prefix's last component, e.g. "ckpt-7"

    @property
    def created(self) -> float: ...

    @property
    def step(self) -> int: ...


@dataclass(frozen=True)
class DirState:
    """What a `checkpoint` file says: the active set (oldest first) and the preservation mark."""

    active: tuple[tuple[str, float], ...]  # (name, timestamp)
    last_preserved: float

    @property
    def latest(self) -> str | None:
        return self.active[-1][0] if self.active else None


@dataclass(frozen=True)
class Sweep:
    """One sweep's outcome: what stays active, what goes, and the new preservation mark."""

    state: DirState
    victims: tuple[str, ...]
    preserved: tuple[str, ...]


def initial_mark(checkpoints: Sequence[Checkpoint]) -> float:
    """The mark of a dir without a state file: just before its oldest checkpoint.

    CheckpointManager starts from its own creation time minus a second, which
    precedes the first save it makes; this is that, for a manager the daemon
    never saw being created.
    """
    return min((c.created for c in checkpoints), default=0.0) - 1.0


def current(checkpoints: Sequence[Checkpoint], last_preserved: float) -> DirState:
    """The dir's state now: every committed checkpoint after the mark is active."""
    active = sorted((c for c in checkpoints if c.created > last_preserved), key=age)
    return DirState(tuple((c.name, c.created) for c in active), last_preserved)


def sweep(checkpoints: Sequence[Checkpoint], last_preserved: float, rules: CheckpointRetention) -> Sweep:
    """CheckpointManager._sweep over the dir's committed checkpoints.

    The newest checkpoint is never a victim: the active set keeps at least
    `max_to_keep` (>= 1) of the newest.
    """
    state = current(checkpoints, last_preserved)
    active = list(state.active)
    mark = last_preserved
    victims: list[str] = []
    preserved: list[str] = []
    hours = rules.keep_checkpoint_every_n_hours
    while rules.max_to_keep is not None and len(active) > rules.max_to_keep:
        name, timestamp = active.pop(0)
        if hours and timestamp - hours * 3600.0 >= mark:
            mark = timestamp
            preserved.append(name)
        else:
            victims.append(name)
    newest = max(checkpoints, key=age).name if checkpoints else None
    assert newest not in victims, "retention must never delete the newest checkpoint"
    return Sweep(DirState(tuple(active), mark), tuple(victims), tuple(preserved))


def render(state: DirState) -> str:
    """The `checkpoint` file CheckpointManager writes for `state` (paths relative to the dir).

    Raises:
        ValueError: the state is empty (CheckpointManager writes none then),
            or a name would need escaping.
    """
    if not state.active:
        raise ValueError("no checkpoint to name: a state file needs one")
    for name, _ in state.active:
        if not _NAME.match(name):
            raise ValueError(f"checkpoint name {name!r} is not a plain file name")
    lines = [f'model_checkpoint_path: "{state.active[-1][0]}"']
    lines += [f'all_model_checkpoint_paths: "{name}"' for name, _ in state.active]
    lines += [f"all_model_checkpoint_timestamps: {_double(t)}" for _, t in state.active]
    lines.append(f"last_preserved_timestamp: {_double(state.last_preserved)}")
    return "\n".join(lines) + "\n"


def read_mark(text: str) -> float | None:
    """`last_preserved_timestamp` from a state file's text; None if it has none (or garbage)."""
    found = _LAST_PRESERVED.search(text)
    if found is None:
        return None
    try:
        return float(found.group(1))
    except ValueError:
        return None


def _double(value: float) -> str:
    # repr is the shortest text that reads back as the same double, as
    # protobuf's text format prints it; read_mark then compares exactly.
    return repr(float(value))
