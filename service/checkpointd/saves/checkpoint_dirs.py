"""Training checkpoint dirs: their `checkpoint` state file and CheckpointManager's retention.

A TRAINING_CHECKPOINT save lands beside the dir's other checkpoints as
`<dir>/ckpt-<step>.*`. This module keeps what `tf.train.CheckpointManager`
keeps there, so `tf.train.latest_checkpoint(dir)`, an in-process
`common.Checkpointer` over the dir and the daemon all agree:

- the `checkpoint` state file is rewritten after every commit, naming the
  dir's committed checkpoints only (newest last, as `model_checkpoint_path`);
  before a checkpoint stops being committed (a replacement of the same step,
  a deletion) it is rewritten without it first;
- retention (`tidy`, on the retention worker, never on the save path)
  applies `max_to_keep` and `keep_checkpoint_every_n_hours` as the newest
  save set them (`checkpointd.core.checkpoint_state`): the oldest of the
  active set go, the newest never does;
- `recover`, at daemon start, rewrites every dir's state file from its
  committed checkpoints and tidies it, so a daemon killed between a commit
  and its state file, or in the middle of a sweep, leaves no disagreement.

The active set is derived from the committed checkpoints each time (see
`checkpoint_state`); the state file only carries `last_preserved_timestamp`
from one sweep to the next. One run per dir, as one CheckpointManager per
dir: the state file speaks of every checkpoint committed in the dir.

Lock discipline: `_guard` guards `_locks`; each dir's lock serializes its
state-file writes and sweeps. Callers hold the folder as the Retention
guard says (shared while committing, exclusive while tidying).
"""

from __future__ import annotations

import logging
import posixpath
import threading
from collections import defaultdict
from collections.abc import Iterable
from pathlib import PurePath

from checkpointd.core import checkpoint_state
from checkpointd.core.checkpoint_spec import CheckpointRetention
from checkpointd.core.ports import CommittedSave, Store
from checkpointd.core.retention import age
from checkpointd.protocol.errors import InvalidRequestError, RunNotFoundError
from checkpointd.protocol.kinds import SaveKind

_LOGGER = logging.getLogger(__name__)

# The manifest field where the training format records a save's rules
# (checkpointd.formats.training_checkpoint.EXTRA_FIELD; named here to keep saves/ off formats/).
RULES_FIELD = "training_checkpoint"


def directory_of(export_dir: str) -> str:
    """A checkpoint prefix's dir, relative to its folder ("" for the folder itself)."""
    return posixpath.dirname(export_dir)


def rules_of(save: CommittedSave) -> CheckpointRetention:
    """The CheckpointManager rules a committed checkpoint's save set (none recorded: keep all)."""
    record = (save.extra or {}).get(RULES_FIELD) or {}
    try:
        return CheckpointRetention(record.get("max_to_keep"), record.get("keep_checkpoint_every_n_hours"))
    except (InvalidRequestError, TypeError, AttributeError):
        _LOGGER.warning("checkpoint %s records unusable retention rules %r; keeping all", save.path, record)
        return CheckpointRetention()


class CheckpointDirs:
    """The state files and retention of every training checkpoint dir in a Store. Thread-safe."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._guard = threading.Lock()
        self._locks: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
        self.deleted = 0  # checkpoints deleted so far, for logs and tests

    def replacing(self, folder: str, export_dir: str) -> None:
        """Before a checkpoint at `export_dir` is committed: one already there leaves the state file."""
        try:
            old = self._store.committed_at(folder, export_dir)
        except (RunNotFoundError, InvalidRequestError):
            return
        if old.kind is SaveKind.TRAINING_CHECKPOINT and old.prefix:
            directory = directory_of(export_dir)
            with self._lock(folder, directory):
                checkpoints = [c for c in self._checkpoints(folder, directory) if c.name != old.name]
                self._write(folder, directory, checkpoints, self._mark(folder, directory, checkpoints))

    def committed(self, folder: str, export_dir: str) -> None:
        """After a checkpoint at `export_dir` was committed: the state file names it (newest)."""
        directory = directory_of(export_dir)
        with self._lock(folder, directory):
            checkpoints = self._checkpoints(folder, directory)
            self._write(folder, directory, checkpoints, self._mark(folder, directory, checkpoints))

    def tidy(self, folder: str, directory: str, rules: CheckpointRetention | None = None) -> int:
        """Applies CheckpointManager's retention to one dir; returns how many checkpoints it deleted.

        In three steps, each leaving a state a restarted daemon derives the
        same sweep from: the state file without the victims (old mark), the
        victims deleted (manifest first), the state file with the new mark
        (only if the mark moved, or a victim's delete failed and it stays).

        Args:
            folder: the run folder.
            directory: the dir relative to the folder ("" for the folder).
            rules: the rules to apply; None: those its newest checkpoint recorded.
        """
        if rules is not None and rules.max_to_keep is None:
            return 0  # keep every one: CheckpointManager._sweep returns at once too, reading nothing
        with self._lock(folder, directory):
            checkpoints = self._checkpoints(folder, directory)
            if not checkpoints:
                return 0
            if rules is None:
                rules = rules_of(max(checkpoints, key=age))
            mark = self._mark(folder, directory, checkpoints)
            swept = checkpoint_state.sweep(checkpoints, mark, rules)
            victims = [c for c in checkpoints if c.name in swept.victims]
            kept = [c for c in checkpoints if c.name not in swept.victims]
            if victims:
                self._write(folder, directory, kept, mark)
            deleted = 0
            for save in victims:
                if self._store.delete(save):
                    deleted += 1
                    _LOGGER.info(
                        "retention: deleted run=%s kind=%s export_dir=%s step=%d (max_to_keep=%s)",
                        save.run, save.kind.value, save.export_dir, save.step, rules.max_to_keep,
                    )  # fmt: skip
            for name in swept.preserved:
                _LOGGER.info(
                    "retention: keeping %r for good (keep_checkpoint_every_n_hours=%s)",
                    posixpath.join(directory, name),
                    rules.keep_checkpoint_every_n_hours,
                )
            # The state file already names what is left unless a victim stayed (its delete failed) or
            # the mark moved: a continuous trainer's every save has a victim, and each write is two fsyncs.
            if deleted < len(victims) or swept.state.last_preserved != mark:
                self._write(folder, directory, self._checkpoints(folder, directory), swept.state.last_preserved)
        self.deleted += deleted
        return deleted

    def active(self, folder: str, directory: str) -> list[CommittedSave]:
        """The dir's active set, oldest first: what its state file names (CheckpointManager.checkpoints)."""
        with self._lock(folder, directory):
            checkpoints = self._checkpoints(folder, directory)
            names = [
                name
                for name, _ in checkpoint_state.current(checkpoints, self._mark(folder, directory, checkpoints)).active
            ]
        by_name = {c.name: c for c in checkpoints}
        return [by_name[n] for n in names]

    def recover(self) -> int:
        """Rewrites every training dir's state file and tidies it (daemon start); returns deletions."""
        return sum(self.recover_folder(folder) for folder in self._store.folders())

    def recover_folder(self, folder: str, run: str | None = None) -> int:
        """Rewrites the state file of each training dir in `folder` and tidies it; returns deletions.

        Args:
            folder: the run folder.
            run: only the dirs holding checkpoints of this run (a run this
                daemon just took over); None: every training dir there.
        """
        deleted = 0
        for directory in sorted(self._directories(folder, run)):
            with self._lock(folder, directory):
                checkpoints = self._checkpoints(folder, directory)
                self._write(folder, directory, checkpoints, self._mark(folder, directory, checkpoints))
            deleted += self.tidy(folder, directory)
        return deleted

    # Internals.

    def _lock(self, folder: str, directory: str) -> threading.Lock:
        with self._guard:
            return self._locks[(folder, directory)]

    def _checkpoints(self, folder: str, directory: str) -> list[CommittedSave]:
        return [
            s
            for s in self._store.committed(folder, None)
            if s.kind is SaveKind.TRAINING_CHECKPOINT and s.prefix and directory_of(s.export_dir) == directory
        ]

    def _directories(self, folder: str, run: str | None = None) -> Iterable[str]:
        return {
            directory_of(s.export_dir)
            for s in self._store.committed(folder, run)
            if s.kind is SaveKind.TRAINING_CHECKPOINT and s.prefix
        }

    def _state_file(self, folder: str, directory: str) -> PurePath:
        return self._store.target(folder, posixpath.join(directory, checkpoint_state.STATE_FILE))

    def _mark(self, folder: str, directory: str, checkpoints: list[CommittedSave]) -> float:
        """`last_preserved_timestamp` from the dir's state file, else just before its oldest checkpoint."""
        data = self._store.read_file(self._state_file(folder, directory))
        mark = checkpoint_state.read_mark(data.decode("utf-8", "replace")) if data is not None else None
        return mark if mark is not None else checkpoint_state.initial_mark(checkpoints)

    def _write(self, folder: str, directory: str, checkpoints: list[CommittedSave], mark: float) -> None:
        state = checkpoint_state.current(checkpoints, mark)
        if not state.active:
            # CheckpointManager never writes an empty state; its last one named
            # what is still there or nothing at all, and stays.
            return
        self._store.write_file(self._state_file(folder, directory), checkpoint_state.render(state).encode("utf-8"))
