"""Skip-if-busy decided by the trainer itself, under the run's busy lock (see `checkpointd.saves.shm`).

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

Skips decided here are reported to the daemon on the saver's next Save
header or Flush (`session.LocalSkips`), so its counts and skip log lag by at
most one save or flush. The lock file's st_nlink drops to 0 when the daemon
that made it stops (its folder is removed); the saver then goes the ordinary
way (which registers again if the daemon lost the run).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import grpc
import tensorflow as tf

from checkpointd.protocol.busy_lock import BusyLock
from checkpointd.protocol.errors import SaveFailedError
from checkpointd.protocol.kinds import SaveKind, to_wire
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client import options as options_lib
from checkpointd_client import shm, snapshot
from checkpointd_client.graph_mode import GraphReads
from checkpointd_client.numpy_state import NumpySnapshot
from checkpointd_client.outage import survivable
from checkpointd_client.session import DaemonSession, LocalSkips
from checkpointd_client.stream import SaveStream
from checkpointd_client.ticket import SaveTicket

_LOGGER = logging.getLogger(__name__)


@dataclass
class LocalDecisionPath:
    """What a saver needs to decide a save itself: the mapped segment, the busy lock, the layout it fits."""

    segment: shm.SegmentMap
    lock: BusyLock
    bindings: snapshot.Bindings
    snapshot_bytes: int

    def fits(self, bindings: snapshot.Bindings, snapshot_bytes: int) -> bool:
        return bindings is self.bindings and snapshot_bytes == self.snapshot_bytes

    def to_proto(self) -> pb.HeldSave:
        return pb.HeldSave(segment_path=self.segment.path, lock_path=self.lock.path)


class DecidesLocally:
    """RemotePolicySaver's saves decided under the run's busy lock (see the module docstring).

    The saver sets these in its constructor; `_local_path`, `_local_owner`
    and `_busy_locks` are guarded by the session's lock.
    """

    _daemon: DaemonSession
    _graph_reads: GraphReads | None
    _local_skips: LocalSkips
    # The busy lock and segment once a save was accepted into shared memory.
    _local_path: LocalDecisionPath | None
    # This saver's locally decided save in flight, if any: its token, so that
    # only its own end lets go of the lock (the next one may hold it by then).
    _local_owner: object | None
    _busy_locks: dict[str, BusyLock]  # by path: one fd each, closed by close()

    def _read_step(self, train_step: tf.Variable) -> int:
        raise NotImplementedError

    def _save_deciding_locally(
        self,
        export_dir: str,
        kind: SaveKind,
        bindings: snapshot.Bindings,
        train_step: tf.Variable,
        numpy_state: NumpySnapshot | None,
        callbacks: tuple[options_lib.WriteCallback, ...],
    ) -> SaveTicket | None:
        """A non-blocking save decided here under the run's busy lock.

        Returns None if it must go the ordinary way (another layout, or the
        daemon that offered the lock stopped); else its ticket: skipped, or
        not once the snapshot is in the segment and the Save call is queued
        on the upload thread (which ends the ticket and lets go of the lock).
        An eager policy's step is the snapshot's own (one read fewer).
        """
        daemon = self._daemon
        path = self._local_path
        nbytes = snapshot.nbytes(bindings) + (numpy_state.nbytes if numpy_state is not None else 0)
        if path is None or not path.fits(bindings, nbytes):
            return None
        with daemon.lock:
            reason = ""
            if self._local_owner is not None:
                reason = "this saver's previous save of the run is in flight"
            elif path.lock.stale():
                self._local_path = None  # the daemon that made it stopped
                return None
            elif not path.lock.try_take():
                reason = "another save of the run is in flight (its busy lock is taken)"
            else:
                owner = self._local_owner = object()
                daemon.uploading += 1
        if reason:
            ticket = daemon.ticket(export_dir, kind, self._read_step(train_step))
            _LOGGER.warning(
                "run %s: %s of step %s to %r skipped: %s",
                *(daemon.run, ticket.kind.value, ticket.step, ticket.export_dir, reason),
            )
            self._local_skips.add(to_wire(ticket.kind), ticket.export_dir, ticket.step)
            ticket._skip(reason)  # noqa: SLF001 - the saver's side completes tickets
            return ticket
        try:
            reads = self._graph_reads
            step = self._read_step(train_step) if reads is not None else None
            values = reads.values(bindings) if reads is not None else None
            snap = path.segment.snapshot(bindings, train_step, numpy_state, values)
            if step is None:
                step = daemon.last_step = snap.step
            ticket = daemon.ticket(export_dir, kind, step)
            daemon.uploads.submit(self._upload_decided_locally, path, owner, ticket, bindings, numpy_state, snap,
                                   callbacks)  # fmt: skip
        except BaseException:
            self._end_local_decision(path, owner)
            raise
        return ticket

    def _upload_decided_locally(
        self, path: LocalDecisionPath, owner: object, ticket: SaveTicket, bindings: snapshot.Bindings,
        numpy_state: NumpySnapshot | None, snap: snapshot.Snapshot, callbacks: tuple[options_lib.WriteCallback, ...],
    ) -> None:  # fmt: skip
        """The locally decided save's call, on the upload thread: header, decision, then the end of the snapshot."""
        daemon = self._daemon
        try:
            header = pb.SaveHeader(
                run=daemon.run,
                kind=to_wire(ticket.kind),
                export_dir=ticket.export_dir,
                step=ticket.step,
                variables=bindings.header_protos,
                snapshot_bytes=path.snapshot_bytes,
                numpy_state=numpy_state.to_proto() if numpy_state is not None else None,
                shared_memory=True,
                held=path.to_proto(),
                incremental=getattr(self, "_incremental", False),  # the daemon compares the segment's chunks
                local_skips=self._local_skips.take(),
            )
            stream = SaveStream(daemon.save_stub, header, daemon.timeout)
            try:
                decision = stream.decision()
                if not decision.accepted:
                    raise SaveFailedError(
                        f"the daemon skipped a save sent holding the run's busy lock: {decision.reason}"
                    )
            except BaseException as e:
                stream.close()
                self._drop_local_decision(path)  # the next save asks (and registers again after NOT_FOUND)
                error = e
                if isinstance(e, grpc.RpcError):
                    doing = f"saving run {daemon.run!r} step {ticket.step} to {ticket.export_dir!r}"
                    error = daemon.domain_error(e, doing)
                self._unlock_local_decision(path, owner)
                if survivable(error):
                    daemon.survive(ticket, error)  # an outage: warned once, the next saves wait for its backoff
                else:
                    _LOGGER.warning(
                        "run %s: %s of step %s to %r failed: %s: %s",
                        *(daemon.run, ticket.kind.value, ticket.step, ticket.export_dir, type(error).__name__, error),
                    )
                    ticket._fail(error)  # noqa: SLF001 - the saver's side completes tickets
                if not isinstance(e, Exception):
                    raise
                return
            daemon.answered()
            offer = decision.shared_memory if decision.HasField("shared_memory") else None
            unlock = functools.partial(self._unlock_local_decision, path, owner)
            if offer is not None and offer.path == path.segment.path:
                stream.finish(ticket, [shm.WRITTEN], daemon.run, unlock)
            else:
                # The daemon let the segment go (its cap, a re-registration): the
                # snapshot goes as chunks from our map of it; the next save asks.
                self._drop_local_decision(path)
                stream.finish(ticket, snap.encoded_chunks(daemon.chunk_bytes), daemon.run, unlock)
            result = ticket.result(0) if callbacks and ticket.exception(0) is None else None
            if result is not None:
                options_lib.call_write_callbacks(callbacks, result.path)
        except Exception:
            if not ticket.done():
                raise
            _LOGGER.exception(
                "run %s: a write callback of the save of step %s to %r raised", daemon.run, ticket.step,
                ticket.export_dir,
            )  # fmt: skip
        finally:
            self._end_local_decision(path, owner)
            daemon.release()

    def _unlock_local_decision(self, path: LocalDecisionPath, owner: object) -> None:
        """Lets go of the busy lock the save `owner` took, once its call has ended; idempotent.

        Only while that save is still this saver's locally decided one: once
        its ticket has ended, the trainer's next save may already hold the
        lock (the same file description), and must keep it.
        """
        with self._daemon.lock:
            if self._local_owner is owner:
                path.lock.release()
                self._local_owner = None

    def _end_local_decision(self, path: LocalDecisionPath, owner: object) -> None:
        """Lets go of the busy lock (if `owner` still holds it), then of the save."""
        self._unlock_local_decision(path, owner)
        self._daemon.uploaded()

    def _drop_local_decision(self, path: LocalDecisionPath) -> None:
        """Stops deciding saves through `path`; its lock fd goes once no save holds it."""
        with self._daemon.lock:
            if self._local_path is path:
                self._local_path = None

    def _adopt_local_decision(
        self, segment: shm.SegmentMap, offer: pb.SharedMemory, bindings: snapshot.Bindings, snapshot_bytes: int
    ) -> None:
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
            self._local_path = LocalDecisionPath(segment, lock, bindings, snapshot_bytes)

    def _close_busy_locks(self) -> None:
        with self._daemon.lock:
            locks, self._busy_locks, self._local_path = list(self._busy_locks.values()), {}, None
        for lock in locks:
            lock.close()
