"""Retention off the save path: a background worker deletes old committed saves.

After each successful save the pipeline asks for the run's folder to be
tidied; one worker thread does it later, so no save waits for deletions.
Only committed saves of the run (the Store lists those whose manifest names
it) are candidates, the newest one is never deleted, and a folder is never
tidied while a save is being committed into it or restored from it: those
hold the folder shared (`holding(folder)`, many at once); the worker's
deletions hold it exclusively. The Store deletes a save so that a reader
sees it whole or not at all.

Training checkpoints follow their own dir's CheckpointManager rules instead
of the daemon's policy (`checkpointd.saves.checkpoint_dirs`): the same
worker tidies their dirs, queued by `after_checkpoint`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from checkpointd.core.checkpoint_spec import CheckpointRetention
from checkpointd.core.ports import Store
from checkpointd.core.retention import RetentionPolicy
from checkpointd.protocol.kinds import SaveKind
from checkpointd.saves.checkpoint_dirs import CheckpointDirs

_LOGGER = logging.getLogger(__name__)


class Retainer(Protocol):
    """Retention as the pipeline uses it (`Retention` below)."""

    checkpoints: CheckpointDirs | None  # training checkpoint dirs' state files, if the daemon takes them

    def holding(self, folder: str) -> contextlib.AbstractContextManager[None]: ...

    def after_save(self, run: str, folder: str) -> None: ...

    def after_checkpoint(self, folder: str, directory: str, rules: CheckpointRetention) -> None: ...

    def wait_idle(self) -> None:
        """Blocks until every queued tidying has run."""


class Retention:
    """Deletes a run's saves past its RetentionPolicy, in a thread of its own."""

    def __init__(self, store: Store, policy: RetentionPolicy, checkpoints: CheckpointDirs | None = None) -> None:
        """Args:
        store: where the saves live.
        policy: the daemon's policy for policy saves (--keep-last, --keep-every-steps).
        checkpoints: the training checkpoint dirs to tidy by their own rules;
            None: the daemon takes no training checkpoints.
        """
        self._store = store
        self.policy = policy
        self.checkpoints = checkpoints
        self._guards: defaultdict[str, _FolderGuard] = defaultdict(_FolderGuard)
        self._locks_guard = threading.Lock()
        # (run, folder) for the policy; (folder, dir, rules) for a checkpoint dir.
        self._tasks: queue.Queue[tuple[str, str] | tuple[str, str, CheckpointRetention] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.deleted = 0  # saves deleted so far, for logs and tests

    def start(self) -> None:
        if (self.policy.enabled or self.checkpoints is not None) and self._thread is None:
            self._thread = threading.Thread(target=self._work, name="retention", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Finishes the queued tidying, then ends the worker."""
        if self._thread is not None:
            self._tasks.put(None)
            self._thread.join(timeout)
            self._thread = None

    def wait_idle(self) -> None:
        """Blocks until every queued tidying has run (tests, shutdown)."""
        self._tasks.join()

    def holding(self, folder: str) -> contextlib.AbstractContextManager[None]:
        """Held around a publication into, or a restore from, the folder:
        no deletion runs in it meanwhile (other holders may)."""
        return self._guard(folder).shared()

    def after_save(self, run: str, folder: str) -> None:
        """Queues the run's folder for tidying (returns at once)."""
        if self._thread is not None and self.policy.enabled:
            self._tasks.put((run, folder))

    def after_checkpoint(self, folder: str, directory: str, rules: CheckpointRetention) -> None:
        """Queues a training checkpoint dir for CheckpointManager's retention (returns at once)."""
        if self._thread is not None and self.checkpoints is not None:
            self._tasks.put((folder, directory, rules))

    def tidy_checkpoints(self, folder: str, directory: str, rules: CheckpointRetention | None = None) -> int:
        """Applies a training checkpoint dir's rules now; returns how many it deleted."""
        if self.checkpoints is None:
            return 0
        with self._guard(folder).exclusive():
            deleted = self.checkpoints.tidy(folder, directory, rules)
        self.deleted += deleted
        return deleted

    def tidy(self, run: str, folder: str) -> int:
        """Deletes the run's saves past the policy now; returns how many."""
        deleted = 0
        with self._guard(folder).exclusive():
            saves = self._store.committed(folder, run)
            for kind in SaveKind:
                if kind is SaveKind.TRAINING_CHECKPOINT:
                    continue  # its dir's own rules apply (tidy_checkpoints)
                for save in self.policy.victims([s for s in saves if s.kind is kind]):
                    if self._store.delete(save):
                        deleted += 1
                        _LOGGER.info(
                            "retention: deleted run=%s kind=%s export_dir=%s step=%d",
                            run,
                            kind.value,
                            save.export_dir,
                            save.step,
                        )
        self.deleted += deleted
        return deleted

    def take_over(self, run: str, folder: str) -> int:
        """Applies the run's retention now, before its first save here; returns how many saves it deleted.

        For a run this daemon just took over from another (a fleet's lease):
        the last holder may have died between a commit and its tidying, or
        run with other rules, so the bucket can hold more of the run's saves
        than its rules keep. Its policy saves get the daemon's policy; its
        training checkpoint dirs get their state files rewritten and the
        rules their newest checkpoint recorded (what `recover` does at a
        lone daemon's start).
        """
        deleted = self.tidy(run, folder) if self.policy.enabled else 0
        if self.checkpoints is not None:
            with self._guard(folder).exclusive():
                swept = self.checkpoints.recover_folder(folder, run)
            self.deleted += swept
            deleted += swept
        return deleted

    def _guard(self, folder: str) -> _FolderGuard:
        with self._locks_guard:
            return self._guards[folder]

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            try:
                if task is None:
                    return
                if len(task) == 3:
                    self.tidy_checkpoints(*task)
                else:
                    self.tidy(*task)
            except Exception:  # noqa: BLE001 - a failed tidy must not end the worker
                _LOGGER.exception("retention of run %s failed", task[0] if task else "?")
            finally:
                self._tasks.task_done()


class _FolderGuard:
    """A readers-writer lock: many holders, or one tidier, never both."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holders = 0
        self._tidying = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._tidying)
            self._holders += 1
        try:
            yield
        finally:
            with self._cond:
                self._holders -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._tidying and self._holders == 0)
            self._tidying = True
        try:
            yield
        finally:
            with self._cond:
                self._tidying = False
                self._cond.notify_all()
