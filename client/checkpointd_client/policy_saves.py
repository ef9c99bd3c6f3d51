"""A policy's save path: register the template, ask the daemon (or decide locally), copy, upload.

`PolicySaves` is RemotePolicySaver's collaborator that moves a save: the
saver checks its arguments and calls `save`. Each save goes through the one
save call (`checkpointd_client.save_call`): the daemon answers at once
whether it accepted or skipped the save; an accepted one then costs a host
copy of the variables (taken before save() returns) and a stream to the
daemon. On the daemon's host, once a save has been accepted into shared
memory, a later non-blocking save of the same layout is decided here under
the run's busy lock (`checkpointd_client.local_decision`). A non-blocking
save the daemon cannot take returns a failed ticket (see
`checkpointd_client.transport.session`).

Lock discipline: the session's lock guards `_spare` and `_segment`, and is
never held across an RPC or a TF call; `_register_lock` serializes template
exports and registrations (and guards `bindings` and the template's
options); a re-export waits under it for this saver's accepted uploads to
end, since the daemon writes a save with the run's template at write time,
not at accept.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import numpy as np
import tensorflow as tf
from tf_agents.policies import policy_saver

from checkpointd.protocol import increments
from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.names import check_export_dir
from checkpointd_client import options as options_lib
from checkpointd_client import snapshot, template
from checkpointd_client.graph_mode import GraphReads
from checkpointd_client.local_decision import LocalDecision, LocalSave
from checkpointd_client.numpy_state import NumpySnapshot, NumpySource
from checkpointd_client.save_call import WRITTEN, Decision, Payload, SaveCall, Upload, guarded
from checkpointd_client.ticket import SaveResult, SaveTicket
from checkpointd_client.transport import shm
from checkpointd_client.transport.session import DaemonSession, LocalSkips


class PolicySaves:
    """RemotePolicySaver's save path (see the module docstring)."""

    def __init__(
        self,
        daemon: DaemonSession,
        saver: policy_saver.PolicySaver,
        *,
        folder: str,
        numpy_source: NumpySource | None,
        graph_reads: GraphReads | None,
        shared_memory: bool,
        incremental: bool,
    ) -> None:
        """Saves of `saver`'s policy on the run of `daemon`; the template is exported at the first save.

        Args:
            folder: the job's folder on the daemon.
            numpy_source: the NumpyState saved with every save, if any.
            graph_reads: a graph-mode policy's reads (one session run), if any.
            shared_memory, incremental: as RemotePolicySaver takes them.
        """
        self._daemon = daemon
        self._saver = saver
        self._folder = folder
        self._numpy = numpy_source
        self._graph_reads = graph_reads
        self._register_lock = threading.Lock()
        self.bindings: snapshot.Bindings | None = None  # of the registered template
        self._dirty = True  # the template must be (re-)exported before the next save
        # The options the template was exported with, and their template_key.
        self._template_options: tf.saved_model.SaveOptions | None = None
        self._template_key = options_lib.template_key(None)
        # (bindings, arrays) of the last uploaded snapshot, reused by the next one.
        self._spare: tuple[snapshot.Bindings, tuple[np.ndarray, ...]] | None = None
        self._use_shm = shared_memory
        self._incremental = incremental
        self._segment: shm.SegmentMap | None = None  # the daemon's segment, mapped here
        self.local_skips = LocalSkips()  # skipped under the busy lock, not yet reported
        self._local = LocalDecision(daemon, self.local_skips, incremental=incremental)

    def template_changed(self) -> None:
        """A function was registered: the template is exported again before the next save."""
        self._dirty = True

    def close(self) -> None:
        """Lets go of the busy locks: no save follows."""
        self._local.close()

    def save(
        self,
        export_dir: str,
        kind: SaveKind,
        blocking: bool,
        *,
        template_options: tf.saved_model.SaveOptions | None = None,
        callbacks: tuple[options_lib.WriteCallback, ...] = (),
    ) -> SaveTicket:
        """A save of the policy (see RemotePolicySaver.save)."""
        daemon = self._daemon
        train_step = self._saver._train_step  # noqa: SLF001 - PolicySaver exposes no other way

        def early() -> SaveTicket | None:
            check_export_dir(export_dir)
            # A ticket (a read of the step) only for a save that fails at once: the save makes its own.
            if blocking or not daemon.failing_fast():
                return None
            return daemon.ticket(export_dir, kind, self._read_step(train_step))

        def save(_: SaveTicket | None) -> tuple[SaveTicket, bool]:
            return self._save_now(export_dir, kind, blocking, train_step, template_options, callbacks)

        return guarded(daemon, blocking, early, save, lambda _: daemon.ticket(export_dir, kind, daemon.last_step or 0))

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
        bindings = self.register_template(options=template_options)
        numpy_state = self._numpy.take() if self._numpy is not None else None
        durable = _write_callbacks(callbacks)
        if not blocking and self._local.ready:
            reads = self._graph_reads
            local = LocalSave(
                export_dir, kind, bindings, train_step, numpy_state, lambda: self._read_step(train_step),
                (lambda: reads.values(bindings)) if reads is not None else None, durable,
            )  # fmt: skip
            ticket = self._local.save(local)
            if ticket is not None:
                return ticket, not ticket.skipped  # a skip needs no upload
        ticket = daemon.ticket(export_dir, kind, self._read_step(train_step))
        current = [bindings]  # new ones after a registration again

        def payload() -> Payload:
            b = current[0]
            nbytes = snapshot.nbytes(b) + (numpy_state.nbytes if numpy_state is not None else 0)
            proto = numpy_state.to_proto() if numpy_state is not None else None
            return Payload(export_dir, nbytes, b.header_protos, proto)

        def register_again() -> None:
            current[0] = self.register_template(stale=current[0])

        call = SaveCall(
            daemon, ticket, payload, shared_memory=self._use_shm, incremental=self._incremental,
            register_again=register_again, local_skips=self.local_skips,
        )  # fmt: skip
        decision = call.decide(blocking)

        # The caller is still inside save(), so the variables still hold
        # the values of the call: copying them now, after the decision,
        # is as point-in-time as copying before it, and a skip costs no copy.
        def copy(accepted: Decision) -> Upload:
            return self._copy(current[0], train_step, numpy_state, accepted, durable)

        return ticket, call.send(decision, blocking, copy)

    def _read_step(self, train_step: tf.Variable) -> int:
        step = self._graph_reads.step() if self._graph_reads is not None else int(train_step.numpy())
        self._daemon.last_step = step
        return step

    def _copy(
        self, bindings: snapshot.Bindings, train_step: tf.Variable, numpy_state: NumpySnapshot | None,
        decision: Decision, durable: Callable[[SaveResult], None] | None,
    ) -> Upload:  # fmt: skip
        """Copies the variables now: into the offered segment, else into spare arrays.

        A graph-mode policy's variables are read in one session run first;
        without a segment, the arrays that run returned are the snapshot.
        Over gRPC the chunks are serialized against the base's digests, if
        offered: each chunk's CRC32C computed as gRPC sends, off this thread.
        """
        offer, base = decision.offer, decision.base
        values = self._graph_reads.values(bindings) if self._graph_reads is not None else None
        if offer is not None and self._use_shm:
            segment = shm.open_offer(offer, self._segment, self._daemon.run)
            if segment is not None:
                self._segment = segment
                nbytes = snapshot.nbytes(bindings) + (numpy_state.nbytes if numpy_state is not None else 0)
                self._local.adopt(segment, offer, bindings, nbytes)
                segment.snapshot(bindings, train_step, numpy_state, values)
                return Upload([WRITTEN], durable=durable)  # the daemon's segment, not ours to reuse
            self._use_shm = False  # the daemon is not on this host (or not this user's)
            self._segment = None
        spare = self._take_spare(bindings) if values is None else None
        snap = snapshot.take_snapshot(bindings, train_step, numpy_state=numpy_state, into=spare, values=values)
        size = self._daemon.chunk_bytes
        requests = increments.save_requests(snap.parts(), base, size) if base is not None else snap.encoded_chunks(size)
        keep = self._graph_reads is None  # a graph-mode read brings its own arrays

        def uploaded(result: SaveResult) -> None:
            if keep:
                # Uploaded and answered: gRPC has let go of every chunk, so the
                # next snapshot may reuse these arrays (a failed call may not
                # have, and keeps its own).
                with self._daemon.lock:
                    self._spare = (bindings, snap.arrays)
            if durable is not None:
                durable(result)

        whole = (lambda: snap.encoded_chunks(size)) if base is not None else None
        return Upload(requests, whole, uploaded)

    def _take_spare(self, bindings: snapshot.Bindings) -> tuple[np.ndarray, ...] | None:
        """The arrays of the last uploaded snapshot of `bindings`, if no upload holds them."""
        with self._daemon.lock:
            spare, self._spare = self._spare, None
        if spare is None or spare[0] is not bindings:
            return None
        return spare[1]

    def register_template(
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
            if self.bindings is None or self._dirty or self.bindings is stale:
                export_options = options if options is not None else self._template_options
                if self.bindings is not None and self.bindings is not stale:
                    self._daemon.await_uploads()  # else one could be written with the new template
                self._dirty = False  # a register_function() from now on dirties it again
                try:
                    reads = self._graph_reads
                    self.bindings = template.register(
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
            return self.bindings


def _write_callbacks(callbacks: tuple[options_lib.WriteCallback, ...]) -> Callable[[SaveResult], None] | None:
    """Calls `callbacks` with a durable save's file prefix; None if there are none."""
    if not callbacks:
        return None
    return lambda result: options_lib.call_write_callbacks(callbacks, result.path)
