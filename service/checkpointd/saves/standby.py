"""Standby snapshots: a trainer's newest snapshot, written as a checkpoint once the trainer is gone.

A continuous `RemoteCheckpointer` on this host keeps its newest snapshot
in two slot files in this daemon's shared-memory folder
(`checkpointd.protocol.standby` says what is in one), and asks once
(`WatchStandby`) to be watched. While the trainer lives it holds a shared
flock(2) of its first slot; a watcher thread here tries, every
`POLL_SECONDS`, to take it exclusively. Once it can, the trainer is gone
(SIGKILL, the OOM killer, an uncaught exception: the kernel lets go of a
dead process's locks), and the newest whole slot is written as an ordinary
blocking save of the run, through the pipeline (lease, budget, retention,
the save's metrics), after the saves in flight, unless the run's dir holds
a checkpoint of that step or newer by then (the trainer's own save on
notice, or its last flush). A torn slot (the trainer died copying into it)
is not trusted: the other one, a snapshot older by one hand-over, is used.

A RegisterRun or GetLatest of the run waits for that write (`wait`), so a
trainer restarted at once restores it. The time between the death and its
notice here (up to `POLL_SECONDS`) is not covered: a trainer process starts
and imports TensorFlow in far longer.

What it costs the trainer: its stall only (a copy of what changed into a
slot, and the record), no call and no work here until it dies. What it
does not cover: this daemon's own end (a node lost, both processes
killed): the slots are memory.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from checkpointd.core.ports import PhaseSink
from checkpointd.protocol import standby
from checkpointd.protocol.errors import CheckpointdError, InvalidRequestError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.saves import catalog
from checkpointd.saves.checkpoint_dirs import directory_of
from checkpointd.saves.pipeline import Result, SavePipeline
from checkpointd.saves.requests import SaveRequest
from checkpointd.saves.sinks import PartWriter, write_views

_LOGGER = logging.getLogger(__name__)
_T = TypeVar("_T")

POLL_SECONDS = 0.02  # between looks at the watched trainers' locks
SLOTS = 2
_WAIT_SECONDS = 120.0  # longest a save of a gone trainer may take, for the flush before it


class Standbys:
    """The watched trainers' slots, the watcher thread, and the writes once a trainer is gone."""

    def __init__(
        self,
        pipeline: SavePipeline,
        folder: Path,
        decode: Callable[[bytes], SaveRequest],
        phases: PhaseSink,
        poll: float = POLL_SECONDS,
    ) -> None:
        """Watches slots in `folder` (the shared-memory folder); `decode` reads a record's SaveHeader.

        Raises from `decode`: InvalidRequestError (or any CheckpointdError) for a header that is no valid save.
        """
        self._pipeline = pipeline
        self._folder = folder
        self._decode = decode
        self._phases = phases
        self._poll = poll
        self._lock = threading.Lock()
        self._watched: dict[str, list[int]] = {}  # run -> the slots' fds (this daemon's own descriptions)
        self._writing: dict[str, threading.Event] = {}  # run -> set once its gone trainer's slot is handled
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, run: str, paths: Sequence[str]) -> None:
        """Watches `run`'s trainer through its slots at `paths` (none: stops watching); replaces a last watch.

        Raises:
            InvalidRequestError: a slot is not a regular file of this user in the folder, or
                the trainer does not hold its first slot's lock.
            RunNotFoundError: the run is not registered.
        """
        if not paths:
            self._replace(run, None)
            return
        self._pipeline.lanes.folder(run)  # RunNotFoundError
        if len(paths) != SLOTS:
            raise InvalidRequestError(f"WatchStandby: {len(paths)} slot paths; send exactly {SLOTS} (or none)")
        fds: list[int] = []
        try:
            for path in paths:
                fds.append(self._open(path))
            if _take(fds[0]):
                raise InvalidRequestError(
                    f"WatchStandby: nobody holds a lock of {paths[0]!r}: the trainer holds a shared flock(2) "
                    "of its first slot while it lives, taken before this call"
                )
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self._replace(run, fds)
        self._start()

    def wait(self, run: str | None, timeout: float | None) -> None:
        """Waits (up to `timeout` s) until the write of `run`'s gone trainer's slot (None: every run's) is done."""
        with self._lock:
            writing = [e for r, e in self._writing.items() if run is None or r == run]
        deadline = None if timeout is None else time.monotonic() + timeout
        for event in writing:
            if not event.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                _LOGGER.warning("a gone trainer's standby snapshot is still being written (run %s)", run or "any")
                return

    def close(self) -> None:
        """Stops watching (writes in progress go on to their end); lets go of every slot."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            watched, self._watched = self._watched, {}
        for fds in watched.values():
            _close(fds)

    def _open(self, path: str) -> int:
        where = Path(path)
        if where.parent != self._folder or not standby.SLOT_NAME.match(where.name):
            raise InvalidRequestError(
                f"WatchStandby: {path!r} is not a slot in this daemon's shared-memory folder {str(self._folder)!r} "
                "named standby-<pid>-<16 hex>-<0 or 1>"
            )
        try:
            fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise InvalidRequestError(f"WatchStandby: slot {path!r} cannot be opened: {e.strerror}") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            os.close(fd)
            raise InvalidRequestError(f"WatchStandby: slot {path!r} is not a regular file of this daemon's user")
        return fd

    def _replace(self, run: str, fds: list[int] | None) -> None:
        with self._lock:
            old = self._watched.pop(run, None)
            if fds is not None:
                self._watched[run] = fds
        if old is not None:
            _close(old)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._watch, name="standby-watch", daemon=True)
                self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll):
            with self._lock:
                gone = [(run, fds) for run, fds in self._watched.items() if _take(fds[0])]
                for run, _ in gone:
                    del self._watched[run]
                    self._writing[run] = threading.Event()
            for run, fds in gone:
                threading.Thread(target=self._write_gone, args=(run, fds), name=f"standby-{run}", daemon=True).start()

    def _write_gone(self, run: str, fds: list[int]) -> None:
        outcome = "failed"
        try:
            outcome = self._write(run, fds)
        except Exception as e:  # noqa: BLE001 - logged and counted: a watcher thread has no caller
            _LOGGER.error("run %s: its trainer is gone; its standby snapshot was not written: %s", run, e)
        finally:
            self._phases.standby_save(outcome)
            with self._lock:
                writing = self._writing.pop(run, None)
            if writing is not None:
                writing.set()
            for fd in fds:
                _unlink(self._folder, fd)
            _close(fds)

    def _write(self, run: str, fds: list[int]) -> str:
        with _MappedSlots(fds) as slots:
            found = standby.newest([standby.read(s) for s in slots])
            if found is None:
                _LOGGER.warning(
                    "run %s: its trainer is gone, and neither standby slot holds a whole snapshot (it was killed "
                    "while copying its first); nothing written: its newest checkpoint is its newest durable save",
                    run,
                )
                return "no_whole_slot"
            index, record = found
            request = self._request(run, record.header)
            assert request.checkpoint is not None
            sizes = [t.nbytes for t in request.checkpoint.tensors] + [0]
            views = standby.part_views(slots[index], record.data_offset, sizes)
            self._pipeline.lanes.flush(run, _WAIT_SECONDS)  # the saves it made before it went, first
            folder = self._pipeline.lanes.folder(run)
            directory = directory_of(request.export_dir)
            newest = catalog.find_latest_in_dir(self._pipeline.store, folder, directory)
            if newest is not None and newest.step >= request.step:
                _LOGGER.info(
                    "run %s: its trainer is gone; its standby snapshot of step %d is not newer than %s: not written",
                    run, request.step, newest.export_dir,
                )  # fmt: skip
                return "not_newer"

            def receive(
                parts: Sequence[int], segment: object, deadline: float, sink: PartWriter, then: Callable[[str], _T]
            ) -> _T:
                write_views(sink, views)
                return then("shm")  # from shared memory, as a held save

            for event in self._pipeline.save(request, receive, timeout=_WAIT_SECONDS):
                if isinstance(event, Result):
                    _LOGGER.info(
                        "run %s: its trainer is gone; its standby snapshot of step %d is durable: %s",
                        run, request.step, event.path,
                    )  # fmt: skip
                    return "written"
            return "failed"

    def _request(self, run: str, header: bytes) -> SaveRequest:
        try:
            request = self._decode(header)
        except CheckpointdError as e:
            raise InvalidRequestError(f"its standby record is no valid save: {e}") from None
        if request.run != run or request.kind is not SaveKind.TRAINING_CHECKPOINT or request.checkpoint is None:
            raise InvalidRequestError(
                f"its standby record is a {request.kind.value} save of run {request.run!r}, not a training "
                f"checkpoint of run {run!r}"
            )
        # Never skipped (it waits for the run's saves in flight), and read from the slot, not offered memory.
        return dataclasses.replace(
            request, blocking=True, shared_memory=False, trainer_decided=None, local_skips=(), on_notice=False
        )


def _take(fd: int) -> bool:
    """Takes the exclusive flock of `fd` without waiting: True once nobody else holds the file's lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _close(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _unlink(folder: Path, fd: int) -> None:
    """Removes the slot file `fd` is open on (its memory goes once the last map does)."""
    try:
        name = os.readlink(f"/proc/self/fd/{fd}")
        if Path(name).parent == folder:
            os.unlink(name)
    except OSError:
        pass


class _MappedSlots:
    """The slots mapped read-only, as views, for a `with` block."""

    def __init__(self, fds: Sequence[int]) -> None:
        self._fds = fds
        self._maps: list[mmap.mmap] = []

    def __enter__(self) -> list[memoryview]:
        views = []
        for fd in self._fds:
            size = os.fstat(fd).st_size
            if size < standby.HEAD:  # never sealed
                views.append(memoryview(b""))
                continue
            self._maps.append(mmap.mmap(fd, size, prot=mmap.PROT_READ))
            views.append(memoryview(self._maps[-1]))
        return views

    def __exit__(self, *exc: object) -> None:
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass  # a view is still alive; the map goes with it
