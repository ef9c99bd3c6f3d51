"""Skip-if-busy decided by the trainer itself, under the run's busy lock (see `checkpointd.transport.shm`).

A daemon on this host offers, with the run's segment, a lock file whose
exclusive flock(2) is held exactly while a save of the run is in flight:
by the daemon for every save it decides, by a trainer for a save it decided
locally (the wire calls such a save `held`). Once a saver has mapped the
segment and opened the lock, a non-blocking save needs no answer from the
daemon to know whether it is skipped:

- this saver's own locally decided save still in flight: skipped (an flock
  is not exclusive against the same open file description, so this is
  checked first, under the session's lock);
- `flock(LOCK_EX | LOCK_NB)` fails: another saver's (any process) or the
  daemon's save is in flight: skipped;
- taken: not skipped. The variables are copied into the segment at once and
  the Save call, whose header carries `held`, is made on the upload thread;
  the lock is let go when that call ends, whatever its end.

`LocalDecision` is the saver's collaborator for this: it holds the busy
lock and the segment once a save was accepted into shared memory, decides,
copies into the segment, and sends the save through the one save call
(`checkpointd_client.save_call`, `SaveCall.send_held`).

Skips decided here are reported to the daemon on the saver's next Save
header or Flush (`session.LocalSkips`), so its counts and skip log lag by at
most one save or flush. The lock file's st_nlink drops to 0 when the daemon
that made it stops (its folder is removed); the saver then goes the ordinary
way (which registers again if the daemon lost the run).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from checkpointd.protocol.busy_lock import BusyLock
from checkpointd.protocol.kinds import SaveKind, to_wire
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client import snapshot
from checkpointd_client.numpy_state import NumpySnapshot
from checkpointd_client.save_call import Payload, SaveCall
from checkpointd_client.ticket import SaveResult, SaveTicket
from checkpointd_client.transport import shm
from checkpointd_client.transport.session import DaemonSession, LocalSkips

_LOGGER = logging.getLogger(__name__)


@dataclass
class LocalDecisionPath:
    """What a saver needs to decide a save itself: the mapped segment, the busy lock, the layout it fits.

    `layout` is the saver's own object for what the segment was laid out for
    (a policy's bindings, a training checkpoint's tensor layout), compared by
    identity: the saver hands back the same object while the layout holds.
    """

    segment: shm.SegmentMap
    lock: BusyLock
    layout: object
    snapshot_bytes: int

    def fits(self, layout: object, snapshot_bytes: int) -> bool:
        return layout is self.layout and snapshot_bytes == self.snapshot_bytes

    def to_proto(self) -> pb.HeldSave:
        return pb.HeldSave(segment_path=self.segment.path, lock_path=self.lock.path)


@dataclass(frozen=True)
class Held:
    """A save decided here, not skipped: the path it holds the busy lock of, and its owner token."""

    path: LocalDecisionPath
    owner: object


@dataclass(frozen=True)
class LocalSave:
    """One non-blocking save to decide here: where it goes and what it copies.

    Attributes:
        read_step: reads the train step (and records it as the session's last).
        values: a graph-mode policy's values, read in one session run; None
            for an eager policy, whose step is then the snapshot's own.
        durable: called once the save is durable (write callbacks).
    """

    export_dir: str
    kind: SaveKind
    bindings: snapshot.Bindings
    train_step: tf.Variable
    numpy_state: NumpySnapshot | None
    read_step: Callable[[], int]
    values: Callable[[], Sequence[np.ndarray]] | None = None
    durable: Callable[[SaveResult], None] | None = None


class LocalDecision:
    """A saver's saves decided under the run's busy lock (see the module docstring).

    Lock discipline: the session's lock guards `_path`, `_owner` and `_busy_locks`.
    """

    def __init__(self, daemon: DaemonSession, local_skips: LocalSkips, *, incremental: bool) -> None:
        """No path yet: saves ask the daemon until one is accepted into shared memory (`adopt`).

        Args:
            local_skips: where skips decided here wait to be reported.
            incremental: the saver's: the daemon compares the segment's chunks.
        """
        self._daemon = daemon
        self._local_skips = local_skips
        self._incremental = incremental
        # The busy lock and segment once a save was accepted into shared memory.
        self._path: LocalDecisionPath | None = None
        # This saver's locally decided save in flight, if any: its token, so that
        # only its own end lets go of the lock (the next one may hold it by then).
        self._owner: object | None = None
        self._busy_locks: dict[str, BusyLock] = {}  # by path: one fd each, closed by close()

    @property
    def ready(self) -> bool:
        """Whether a save was accepted into shared memory with a busy lock: the next may be decided here."""
        return self._path is not None

    def hold(self, layout: object, snapshot_bytes: int) -> Held | str | None:
        """Decides a non-blocking save of `layout` here: Held (the busy lock taken), a skip's reason, or None.

        None: it must go the ordinary way (another layout, no path yet, or
        the daemon that offered the lock stopped). A Held save must be sent
        (`send`) or let go (`unlock`).
        """
        path = self._path
        if path is None or not path.fits(layout, snapshot_bytes):
            return None
        with self._daemon.lock:
            if self._owner is not None:
                return "this saver's previous save of the run is in flight"
            if path.lock.stale():
                self._path = None  # the daemon that made it stopped
                return None
            if not path.lock.try_take():
                return "another save of the run is in flight (its busy lock is taken)"
            owner = self._owner = object()
        return Held(path, owner)

    def skip(self, ticket: SaveTicket, reason: str) -> SaveTicket:
        """Ends `ticket` skipped for `reason` (decided here), logged and reported to the daemon later."""
        _LOGGER.warning(
            "run %s: %s of step %s to %r skipped: %s",
            *(self._daemon.run, ticket.kind.value, ticket.step, ticket.export_dir, reason),
        )
        self._local_skips.add(to_wire(ticket.kind), ticket.export_dir, ticket.step)
        ticket._skip(reason)  # noqa: SLF001 - the saver's side completes tickets
        return ticket

    def send(
        self,
        held: Held,
        call: SaveCall,
        chunks: Callable[[], Iterable[bytes]],
        durable: Callable[[SaveResult], None] | None,
    ) -> None:
        """Queues `call` of a held save whose snapshot is in the segment (`SaveCall.send_held`)."""
        path = held.path
        call.send_held(
            path.to_proto(), path.segment.path, chunks=chunks,
            unlock=lambda: self.unlock(held), drop=lambda: self._drop(path), durable=durable,
        )  # fmt: skip

    def save(self, save: LocalSave) -> SaveTicket | None:
        """A policy's non-blocking save decided here under the run's busy lock.

        Returns None if it must go the ordinary way (`hold`); else its
        ticket: skipped, or not once the snapshot is in the segment and the
        Save call is queued on the upload thread (which ends the ticket and
        lets go of the lock). An eager policy's step is the snapshot's own
        (one read fewer).
        """
        daemon = self._daemon
        numpy_state = save.numpy_state
        nbytes = snapshot.nbytes(save.bindings) + (numpy_state.nbytes if numpy_state is not None else 0)
        held = self.hold(save.bindings, nbytes)
        if held is None:
            return None
        if isinstance(held, str):
            return self.skip(daemon.ticket(save.export_dir, save.kind, save.read_step()), held)
        path = held.path
        try:
            step = save.read_step() if save.values is not None else None
            values = save.values() if save.values is not None else None
            snap = path.segment.snapshot(save.bindings, save.train_step, numpy_state, values)
            if step is None:
                step = daemon.last_step = snap.step
            ticket = daemon.ticket(save.export_dir, save.kind, step)
            call = SaveCall(
                daemon, ticket, lambda: Payload(
                    ticket.export_dir, path.snapshot_bytes, save.bindings.header_protos,
                    numpy_state.to_proto() if numpy_state is not None else None,
                ),
                shared_memory=True, incremental=self._incremental, local_skips=self._local_skips,
            )  # fmt: skip
            self.send(held, call, lambda: snap.encoded_chunks(daemon.chunk_bytes), save.durable)
        except BaseException:
            self.unlock(held)
            raise
        return ticket

    def unlock(self, held: Held) -> None:
        """Lets go of the busy lock the `held` save took, once its call has ended (or it was not sent); idempotent.

        Only while that save is still this saver's locally decided one: once
        its ticket has ended, the trainer's next save may already hold the
        lock (the same file description), and must keep it.
        """
        with self._daemon.lock:
            if self._owner is held.owner:
                held.path.lock.release()
                self._owner = None

    def _drop(self, path: LocalDecisionPath) -> None:
        """Stops deciding saves through `path`; its lock fd goes once no save holds it."""
        with self._daemon.lock:
            if self._path is path:
                self._path = None

    def adopt(self, segment: shm.SegmentMap, offer: pb.SharedMemory, layout: object, snapshot_bytes: int) -> None:
        """After an accept into shared memory: later non-blocking saves of this layout need not ask."""
        daemon = self._daemon
        if not offer.lock_path:
            return  # the daemon offers no busy lock: every save asks
        with daemon.lock:
            lock = self._busy_locks.get(offer.lock_path)
        if lock is None:
            try:
                lock = BusyLock(offer.lock_path)
            except OSError as e:
                _LOGGER.info(
                    "run %s: cannot open the run's busy lock %s (%s); saves ask the daemon",
                    *(daemon.run, offer.lock_path, e.strerror or e),
                )
                return
        with daemon.lock:
            self._busy_locks[offer.lock_path] = lock
            self._path = LocalDecisionPath(segment, lock, layout, snapshot_bytes)

    def close(self) -> None:
        """Closes the busy locks' fds: no save follows."""
        with self._daemon.lock:
            locks, self._busy_locks, self._path = list(self._busy_locks.values()), {}, None
        for lock in locks:
            lock.close()
