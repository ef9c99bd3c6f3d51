"""A policy's save path: register the template, ask the daemon (or decide locally), copy, upload.

`PolicySaves` is the half of RemotePolicySaver that moves a save: its public
methods (`save`, `save_checkpoint`, ...) check their arguments and call
`_save`. Each save asks the daemon, which answers at once whether it
accepted or skipped the save; an accepted one then costs a host copy of the
variables (taken before save() returns) and a stream to the daemon. A
non-blocking save the daemon cannot take returns a failed ticket (see
`checkpointd_client.session`).

Lock discipline: the session's lock guards `_spare` and the local-decision
fields, and is never held across an RPC or a TF call; `_register_lock`
serializes template exports and registrations (and guards `_bindings` and
the template's options); a re-export waits under it for this saver's
accepted uploads to end, since the daemon writes a save with the run's
template at write time, not at accept.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable

import numpy as np
import tensorflow as tf
from tf_agents.policies import policy_saver

from checkpointd.protocol import increments
from checkpointd.protocol.errors import CheckpointdError
from checkpointd.protocol.kinds import SaveKind, to_wire
from checkpointd.protocol.names import check_export_dir
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client import numpy_state as numpy_state_lib
from checkpointd_client import options as options_lib
from checkpointd_client import shm, snapshot, template
from checkpointd_client.local_decision import DecidesLocally
from checkpointd_client.numpy_state import NumpySnapshot
from checkpointd_client.outage import survivable
from checkpointd_client.stream import SaveStream
from checkpointd_client.ticket import SaveTicket

_LOGGER = logging.getLogger(__name__)


class PolicySaves(DecidesLocally):
    """RemotePolicySaver's save path (see the module docstring); the saver sets these fields."""

    _saver: policy_saver.PolicySaver
    _run: str
    _folder: str | None
    _numpy: numpy_state_lib.NumpySource | None
    _register_lock: threading.Lock
    _bindings: snapshot.Bindings | None
    _dirty: bool  # the template must be (re-)exported before the next save
    _template_options: tf.saved_model.SaveOptions | None
    _template_key: tuple[object, ...]
    _spare: tuple[snapshot.Bindings, tuple[np.ndarray, ...]] | None
    _use_shm: bool
    _incremental: bool  # changed chunks only (see RemotePolicySaver)
    _segment: shm.SegmentMap | None

    def _save(
        self,
        export_dir: str,
        kind: SaveKind,
        blocking: bool,
        *,
        template_options: tf.saved_model.SaveOptions | None = None,
        callbacks: tuple[options_lib.WriteCallback, ...] = (),
    ) -> SaveTicket:
        daemon = self._daemon
        daemon.begin()
        handed_off = False
        try:
            check_export_dir(export_dir)
            train_step = self._saver._train_step  # noqa: SLF001 - PolicySaver exposes no other way
            if not blocking:
                ticket = daemon.ticket(export_dir, kind, self._read_step(train_step))
                if daemon.fail_fast(ticket):
                    return ticket
            try:
                ticket, handed_off = self._save_now(export_dir, kind, blocking, train_step, template_options,
                                                    callbacks)  # fmt: skip
            except CheckpointdError as e:
                if blocking or not survivable(e):
                    raise
                return daemon.survive(daemon.ticket(export_dir, kind, daemon.last_step or 0), e)
            return ticket
        finally:
            if not handed_off:
                daemon.release()

    def _save_now(
        self,
        export_dir: str,
        kind: SaveKind,
        blocking: bool,
        train_step: tf.Variable,
        template_options: tf.saved_model.SaveOptions | None,
        callbacks: tuple[options_lib.WriteCallback, ...],
    ) -> tuple[SaveTicket, bool]:
        """The save, asking the daemon (or deciding locally); the ticket, and whether an upload took it over."""
        daemon = self._daemon
        daemon.before_trying()
        bindings = self._register_template(options=template_options)
        numpy_state = self._numpy.take() if self._numpy is not None else None
        if not blocking and self._local_path is not None:
            ticket = self._save_deciding_locally(export_dir, kind, bindings, train_step, numpy_state, callbacks)
            if ticket is not None:
                return ticket, not ticket.skipped  # a skip needs no upload
        ticket = daemon.ticket(export_dir, kind, self._read_step(train_step))
        stream, bindings, offer, base = self._decide(ticket, numpy_state, bindings, blocking)
        daemon.answered()
        if ticket.skipped:
            return ticket, False  # nothing was copied
        daemon.start_upload()
        handed_off = False
        try:
            # The caller is still inside save(), so the variables still hold
            # the values of the call: copying them now, after the decision,
            # is as point-in-time as copying before it, and a skip costs no copy.
            try:
                snap, chunks = self._snapshot(bindings, train_step, numpy_state, offer)
            except BaseException:
                stream.close()
                raise
            again = self._resender(ticket, numpy_state, bindings, snap) if base is not None and chunks is None else None
            if blocking:
                self._upload(stream, snap, chunks, ticket, bindings, callbacks, base, again)
                ticket.result()  # raises the save's error
                return ticket, False
            daemon.uploads.submit(
                self._upload_then_release, stream, snap, chunks, ticket, bindings, callbacks, base, again
            )
            handed_off = True
            return ticket, True
        finally:
            if not handed_off:
                daemon.uploaded()

    def _read_step(self, train_step: tf.Variable) -> int:
        step = self._graph_reads.step() if self._graph_reads is not None else int(train_step.numpy())
        self._daemon.last_step = step
        return step

    def _decide(
        self,
        ticket: SaveTicket,
        numpy_state: NumpySnapshot | None,
        bindings: snapshot.Bindings,
        blocking: bool,
        incremental: bool = True,
    ) -> tuple[SaveStream, snapshot.Bindings, pb.SharedMemory | None, pb.IncrementalBase | None]:
        """Opens the Save call and reads the decision; registers again once if the daemon lost the run.

        Returns the call, the bindings (new ones after a re-registration), and
        the shared memory and the base the accept offered, if any.
        """
        daemon = self._daemon
        current = [bindings]

        def attempt() -> tuple[SaveStream, pb.SaveDecision]:
            b = current[0]
            header = pb.SaveHeader(
                run=self._run,
                kind=to_wire(ticket.kind),
                export_dir=ticket.export_dir,
                blocking=blocking,
                step=ticket.step,
                variables=b.header_protos,
                snapshot_bytes=snapshot.nbytes(b) + (numpy_state.nbytes if numpy_state is not None else 0),
                numpy_state=numpy_state.to_proto() if numpy_state is not None else None,
                shared_memory=self._use_shm,
                local_skips=self._local_skips.take(),
                incremental=self._incremental and incremental,
            )
            stream = SaveStream(daemon.save_stub, header, daemon.timeout)
            try:
                return stream, stream.decision()
            except BaseException:
                stream.close()
                raise

        def register_again() -> None:
            current[0] = self._register_template(stale=current[0])

        doing = f"saving run {self._run!r} step {ticket.step} to {ticket.export_dir!r}"
        stream, decision = daemon.retrying_lost_run(attempt, register_again, doing)
        if not decision.accepted:
            stream.skip(ticket, decision.reason, self._run)
        offer = decision.shared_memory if decision.HasField("shared_memory") else None
        return stream, current[0], offer, decision.base if decision.HasField("base") else None

    def _resender(
        self, ticket: SaveTicket, numpy_state: NumpySnapshot | None, bindings: snapshot.Bindings,
        snap: snapshot.Snapshot,
    ) -> Callable[[], tuple[SaveStream, Iterable[bytes]]]:  # fmt: skip
        """Opens the save again, blocking and not incremental, to send `snap` in full (see SaveStream.finish)."""

        def resend() -> tuple[SaveStream, Iterable[bytes]]:
            stream, _, _, _ = self._decide(ticket, numpy_state, bindings, blocking=True, incremental=False)
            return stream, snap.encoded_chunks(self._daemon.chunk_bytes)

        return resend

    def _snapshot(
        self,
        bindings: snapshot.Bindings,
        train_step: tf.Variable,
        numpy_state: NumpySnapshot | None,
        offer: pb.SharedMemory | None,
    ) -> tuple[snapshot.Snapshot, list[bytes] | None]:
        """Copies the variables now: into the offered segment, else into spare arrays.

        A graph-mode policy's variables are read in one session run first;
        without a segment, the arrays that run returned are the snapshot.

        Returns the snapshot and, for a snapshot in shared memory, the one
        message that completes the call (None: send the snapshot's chunks).
        """
        values = self._graph_reads.values(bindings) if self._graph_reads is not None else None
        if offer is not None and self._use_shm:
            segment = shm.open_offer(offer, self._segment, self._run)
            if segment is not None:
                self._segment = segment
                nbytes = snapshot.nbytes(bindings) + (numpy_state.nbytes if numpy_state is not None else 0)
                self._adopt_local_decision(segment, offer, bindings, nbytes)
                return segment.snapshot(bindings, train_step, numpy_state, values), [shm.WRITTEN]
            self._use_shm = False  # the daemon is not on this host (or not this user's)
            self._segment = None
        spare = self._take_spare(bindings) if values is None else None
        return snapshot.take_snapshot(bindings, train_step, numpy_state=numpy_state, into=spare, values=values), None

    def _take_spare(self, bindings: snapshot.Bindings) -> tuple[np.ndarray, ...] | None:
        """The arrays of the last uploaded snapshot of `bindings`, if no upload holds them."""
        with self._daemon.lock:
            spare, self._spare = self._spare, None
        if spare is None or spare[0] is not bindings:
            return None
        return spare[1]

    def _upload(
        self, stream: SaveStream, snap: snapshot.Snapshot, chunks: list[bytes] | None,
        ticket: SaveTicket, bindings: snapshot.Bindings, callbacks: tuple[options_lib.WriteCallback, ...],
        base: pb.IncrementalBase | None = None, resend: Callable[[], tuple[SaveStream, Iterable[bytes]]] | None = None,
    ) -> None:  # fmt: skip
        if chunks is not None:  # in shared memory: the daemon's segment, not ours to reuse
            stream.finish(ticket, chunks, self._run)
        else:
            size = self._daemon.chunk_bytes
            # Against the base's digests, if offered: each chunk's CRC32C computed as gRPC sends, off this thread.
            requests = (
                increments.save_requests(snap.parts(), base, size) if base is not None else snap.encoded_chunks(size)
            )
            stream.finish(ticket, requests, self._run, resend=resend)
            if ticket.done() and ticket.exception(0) is None and self._graph_reads is None:
                # Uploaded and answered: gRPC has let go of every chunk, so the
                # next snapshot may reuse these arrays (a failed call may not
                # have, and keeps its own; a graph-mode read brings its own).
                with self._daemon.lock:
                    self._spare = (bindings, snap.arrays)
        result = ticket.result(0) if callbacks and ticket.exception(0) is None else None
        if result is not None:
            options_lib.call_write_callbacks(callbacks, result.path)

    def _upload_then_release(
        self, stream: SaveStream, snap: snapshot.Snapshot, chunks: list[bytes] | None,
        ticket: SaveTicket, bindings: snapshot.Bindings, callbacks: tuple[options_lib.WriteCallback, ...],
        base: pb.IncrementalBase | None = None, resend: Callable[[], tuple[SaveStream, Iterable[bytes]]] | None = None,
    ) -> None:  # fmt: skip
        try:
            self._upload(stream, snap, chunks, ticket, bindings, callbacks, base, resend)
        except Exception:
            # Only a write callback raises here (the upload's own errors end
            # the ticket); the save itself is durable.
            _LOGGER.exception(
                "run %s: a write callback of the save of step %s to %r raised", self._run, ticket.step,
                ticket.export_dir,
            )  # fmt: skip
        finally:
            self._daemon.uploaded()
            self._daemon.release()

    def _register_template(
        self, stale: snapshot.Bindings | None = None, options: tf.saved_model.SaveOptions | None = None
    ) -> snapshot.Bindings:
        """Exports and registers the template if needed (or if the daemon lost `stale`); the bindings.

        Args:
            stale: bindings the daemon lost (it answered NOT_FOUND).
            options: the SaveOptions the template must have been exported
                with (a save()'s); None: whichever the current one was.
        """
        with self._register_lock:
            key = options_lib.template_key(options) if options is not None else self._template_key
            if key != self._template_key:
                self._dirty = True
            if self._bindings is None or self._dirty or self._bindings is stale:
                export_options = options if options is not None else self._template_options
                if self._bindings is not None and self._bindings is not stale:
                    self._daemon.await_uploads()  # else one could be written with the new template
                self._dirty = False  # a register_function() from now on dirties it again
                try:
                    reads = self._graph_reads
                    self._bindings = template.register(
                        self._daemon,
                        self._saver,
                        folder=self._folder,
                        options=export_options,
                        exporting=reads.exporting if reads is not None else contextlib.nullcontext,
                    )
                except BaseException:
                    self._dirty = True
                    raise
                # Kept with its key: function_aliases count by identity.
                self._template_options, self._template_key = export_options, key
            return self._bindings
