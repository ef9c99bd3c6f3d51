"""RemotePolicySaver: AsyncPolicySaver's interface, with the saving done by checkpointd.

The trainer keeps a real `PolicySaver` (same arguments, same errors) and uses
it once per template: at the first save, and again after `register_function`.
Each save asks the daemon, which answers at once whether it accepted or
skipped the save; an accepted one then costs a host copy of the variables
(taken before save() returns) and a stream to the daemon.

On the daemon's host, once a save has been accepted into shared memory, a
later non-blocking save of the same layout does not ask: it takes the run's
busy lock itself (`checkpointd_client.held`), copies into the segment and
hands the Save call to the upload thread, so its stall is the copy; a save
skipped that way is reported to the daemon with the next Save or Flush.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import tensorflow as tf
from tf_agents.policies import policy_saver, tf_policy
from tf_agents.typing import types
from tf_agents.utils import numpy_storage

from checkpointd.protocol import wire
from checkpointd.protocol.address import with_default_port
from checkpointd.protocol.codes import error_for
from checkpointd.protocol.credentials import open_channel, read_token
from checkpointd.protocol.errors import (
    CheckpointdError,
    DeadlineError,
    RunClosedError,
    SaveFailedError,
    UnavailableError,
)
from checkpointd.protocol.kinds import SaveKind, to_wire
from checkpointd.protocol.names import check_export_dir, check_run_name
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc
from checkpointd_client import graph_mode, held, shm, snapshot, template
from checkpointd_client import numpy_state as numpy_state_lib
from checkpointd_client import options as options_lib
from checkpointd_client import restore as restore_lib
from checkpointd_client.facade import PolicySaverFacade
from checkpointd_client.numpy_state import NumpySnapshot
from checkpointd_client.stream import SaveStream, SaveStub, rpc_error
from checkpointd_client.ticket import SaveTicket

_LOGGER = logging.getLogger(__name__)


class RemotePolicySaver(PolicySaverFacade):
    """Saves a TF-Agents policy through a checkpointd daemon.

    A drop-in for `AsyncPolicySaver(PolicySaver(policy, ...))`: `save()` and
    `save_checkpoint()` take a snapshot at the call and return at once (or,
    with `blocking=True`, once the save is durable). Unlike AsyncPolicySaver,
    every call returns a `SaveTicket` that says whether the save was skipped
    and, later, whether it was written; a failed save never stops the saver.
    PolicySaver's properties and registrations come from PolicySaverFacade.

    Lock discipline: `_lock` guards `_busy`, `_uploading`, `_closing`, `_closed` and
    `_spare` and is never held across an RPC or a TF call; `_register_lock`
    serializes template exports and registrations (and guards `_bindings`
    and the template's options); a re-export waits under it for this
    saver's accepted uploads to end, since the daemon writes a save with the
    run's template at write time, not at accept; `_close_lock` serializes close().
    """

    def __init__(
        self,
        policy: tf_policy.TFPolicy,
        address: str,
        *,
        run: str,
        batch_size: int | None = None,
        use_nest_path_signatures: bool = True,
        seed: types.Seed | None = None,
        train_step: tf.Variable | None = None,
        metadata: dict[str, tf.Variable] | None = None,
        input_fn_and_spec: policy_saver.InputFnAndSpecType | None = None,
        numpy_state: numpy_storage.NumpyState | None = None,
        folder: str | None = None,
        chunk_bytes: int = wire.CHUNK_BYTES,
        channel_credentials: grpc.ChannelCredentials | None = None,
        timeout: float | None = None,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        shared_memory: bool = True,
        session: tf.compat.v1.Session | None = None,
    ) -> None:
        """Builds the PolicySaver and a channel to the daemon; no network I/O yet.

        Args:
            policy, batch_size, use_nest_path_signatures, seed, train_step,
                metadata, input_fn_and_spec: as for `PolicySaver`.
            address: the daemon's `host:port`.
            run: this run's name on the daemon, 1-128 of [A-Za-z0-9._-].
            numpy_state: a `NumpyState` saved with every save (its arrays
                serialized at the call) as `<export_dir>/numpy_state/`, and
                restored by `restore()`.
            folder: the run's folder under the daemon's root (a valid run
                name); None: the run's name. Runs sharing a folder (one per
                policy, as RemotePolicySavedModelTrigger does) must use
                distinct export dirs.
            chunk_bytes: the largest payload per message (template and snapshot).
            channel_credentials: TLS credentials (`checkpointd_client.credentials(
                ca_file, cert_file, key_file)` or grpc.ssl_channel_credentials);
                None for a plaintext channel.
            timeout: deadline in seconds of every RPC (a Save call includes
                waiting for the daemon's decision, the upload and the write)
                and the default for `flush()` and `close()`; None waits as
                long as the daemon is reachable.
            token: the bearer token of a daemon with --token-file or
                CHECKPOINTD_TOKENS, sent on every call (as call credentials
                over TLS, as an `authorization` header over plaintext).
            token_file: a file holding that token instead (one line; `#`
                comments allowed); read once, here.
            shared_memory: on the daemon's host, copy snapshots into the
                shared-memory segment the daemon offers instead of streaming
                them over gRPC (see checkpointd_client.shm); it turns itself
                off, for this saver, if the segment cannot be opened here.
            session: for a policy built in TF1 graph mode (inside
                `tf.compat.v1.Graph().as_default()`), the session that
                holds its variables; None: the default session at each
                call, as PolicySaver reads them. Snapshots are then one
                `session.run` of the variables' read ops, at the call.

        Raises:
            TypeError: if `policy` is not a TFPolicy or `metadata` is not a
                dict of str to tf.Variable (raised by PolicySaver).
            ValueError: for PolicySaver's invalid arguments (e.g. batch_size),
                an invalid run name, chunk_bytes or timeout, both token and
                token_file, a token file without exactly one token, or a
                session for a policy built eagerly.
            OSError: token_file cannot be read.
        """
        self._saver = policy_saver.PolicySaver(
            policy,
            batch_size=batch_size,
            use_nest_path_signatures=use_nest_path_signatures,
            seed=seed,
            train_step=train_step,
            input_fn_and_spec=input_fn_and_spec,
            metadata=metadata,
        )
        try:
            self._run = check_run_name(run)
        except CheckpointdError as e:
            raise ValueError(str(e)) from None
        wire.check_chunk_bytes(chunk_bytes)
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be None or > 0 seconds, saw {timeout!r}")
        if token is not None and token_file is not None:
            raise ValueError("give token or token_file, not both")
        if token_file is not None:
            token = read_token(Path(token_file))
        try:
            self._folder = check_run_name(folder) if folder is not None else None
        except CheckpointdError as e:
            raise ValueError(f"folder: {e}") from None
        self._numpy = numpy_state_lib.NumpySource(numpy_state) if numpy_state is not None else None
        graph = graph_mode.current_graph()
        if graph is None and session is not None:
            raise ValueError("session= is for a policy built in graph mode; this one was built eagerly")
        train_step_variable = self._saver._train_step  # noqa: SLF001 - PolicySaver exposes no other way
        self._graph_reads = graph_mode.GraphReads(graph, train_step_variable, session) if graph else None
        self._address = with_default_port(address)  # what is dialled: a bare host gets 7431
        self._chunk_bytes = chunk_bytes
        self._timeout = timeout
        self._channel = open_channel(address, channel_credentials, token)
        self._stub = checkpointd_pb2_grpc.CheckpointServiceStub(self._channel)
        self._save_stub = SaveStub(self._channel)  # sends chunks serialized once, by us
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._busy = 0  # save calls running plus background uploads
        self._uploading = 0  # accepted saves not yet ended
        self._last_step: int | None = None  # of the last save call, for log lines
        self._closing = False
        self._closed = False
        self._register_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._bindings: snapshot.Bindings | None = None
        self._dirty = True  # the template must be (re-)exported before the next save
        # The options the template was exported with, and their template_key.
        self._template_options: tf.saved_model.SaveOptions | None = None
        self._template_key = options_lib.template_key(None)
        # (bindings, arrays) of the last uploaded snapshot, reused by the next one.
        self._spare: tuple[snapshot.Bindings, tuple[np.ndarray, ...]] | None = None
        self._use_shm = shared_memory
        # Uploads run here, after save() returns; idle threads are reused
        # (starting one per save cost more than a small save's copy).
        self._uploads = concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix=f"checkpointd-upload-{self._run}"
        )
        self._segment: shm.SegmentMap | None = None  # the daemon's segment, mapped here
        # The busy lock and segment once a save was accepted into shared memory (see held).
        self._held: held.HeldPath | None = None
        # This saver's held save in flight, if any (guarded by _lock): its token, so
        # that only its own end lets go of the lock (the next one may hold it by then).
        self._held_owner: object | None = None
        self._busy_locks: dict[str, held.BusyLock] = {}  # by path: one fd each, closed by close()
        self._local_skips = held.LocalSkips()  # skipped under the lock, not yet reported

    # Saving.

    def save(
        self,
        export_dir: str,
        blocking: bool = False,
        *,
        options: tf.saved_model.SaveOptions | None = None,
    ) -> SaveTicket:
        """Saves the policy as a SavedModel under `<root>/<run>/<export_dir>` on the daemon.

        The variables are copied before this returns (once the daemon has
        accepted the save, so a skipped save copies nothing). Without `blocking`, it
        returns once the daemon has accepted or skipped the save (skipped if
        another save of this run is in flight); an accepted snapshot is then
        uploaded in the background and `ticket.result()` waits until it is
        durable. On the daemon's host, after a save accepted into shared
        memory, the decision is this saver's own, as exact, under the run's
        busy lock (`checkpointd_client.held`): no round trip, and the Save
        call is made in the background; the daemon's refusals of such a save
        (e.g. its budget is full) then fail the ticket instead of raising here. With `blocking`, the daemon waits for the in-flight save and
        this returns once the save is durable.

        Args:
            export_dir: a relative path inside the run's folder.
            blocking: wait for the in-flight save instead of being skipped,
                and for this save to be durable. A SaveOptions given here
                (PolicySaver.save's second argument) is taken as `options`.
            options: as for PolicySaver.save, applied when the template is
                exported: options that differ from the current template's
                export it and register it again first, after this saver's
                uploads in flight have ended (see `checkpointd_client.options`
                for what each option does here).

        Returns:
            The save's ticket (`ticket.skipped` is already known).

        Raises:
            RunClosedError: if `close()` was called (no network call is made).
            InvalidRequestError: if `export_dir` is absolute or leaves the run's folder.
            CheckpointdError: a subclass for the status the daemon (or the
                channel) answered, e.g. UnavailableError when it is unreachable
                or shutting down; with `blocking`, also the save's own error.
            ValueError: if the template's variables cannot be bound, an option
                cannot apply to a save the daemon writes (e.g.
                experimental_io_device), or a graph-mode policy has no session.
            TypeError: `options` is not a tf.saved_model.SaveOptions.
        """
        blocking, options = _options_in_blocking(blocking, options, tf.saved_model.SaveOptions)
        template_options = options_lib.template_options(options) or tf.saved_model.SaveOptions()
        return self._save(export_dir, SaveKind.SAVED_MODEL, blocking, template_options=template_options)

    def save_checkpoint(
        self,
        export_dir: str,
        blocking: bool = False,
        *,
        options: tf.train.CheckpointOptions | None = None,
    ) -> SaveTicket:
        """Saves the variables only, in PolicySaver.save_checkpoint's layout.

        Same rules, arguments, return value and errors as `save()`, and:

        Args:
            options: as for PolicySaver.save_checkpoint; its write callbacks
                are called once the daemon reports the save durable, with
                the daemon's file prefix (see `checkpointd_client.options`).
                A CheckpointOptions given as `blocking` is taken as `options`.

        Raises:
            ValueError: the policy has no variables: PolicySaver.save_checkpoint's
                own error, raised before anything is sent.
        """
        blocking, options = _options_in_blocking(blocking, options, tf.train.CheckpointOptions)
        if not self._saver.policy.model_variables:
            snapshot.checkpoint_root(self._saver)  # raises what PolicySaver.save_checkpoint raises
        callbacks = options_lib.write_callbacks(options)
        return self._save(export_dir, SaveKind.CHECKPOINT, blocking, callbacks=callbacks)

    def _save(
        self,
        export_dir: str,
        kind: SaveKind,
        blocking: bool,
        *,
        template_options: tf.saved_model.SaveOptions | None = None,
        callbacks: tuple[options_lib.WriteCallback, ...] = (),
    ) -> SaveTicket:
        with self._lock:
            if self._closing:
                raise RunClosedError(f"run {self._run!r}: the saver was closed")
            self._busy += 1
        handed_off = False
        try:
            check_export_dir(export_dir)
            bindings = self._registered(options=template_options)
            train_step = self._saver._train_step  # noqa: SLF001 - PolicySaver exposes no other way
            numpy_state = self._numpy.take() if self._numpy is not None else None
            if not blocking and self._held is not None:
                held_ticket = self._save_held(export_dir, kind, bindings, train_step, numpy_state, callbacks)
                if held_ticket is not None:
                    handed_off = not held_ticket.skipped  # a skip needs no upload
                    return held_ticket
            step = self._read_step(train_step)
            ticket = SaveTicket(export_dir, kind, step)
            stream, bindings, offer = self._decide(ticket, numpy_state, bindings, blocking)
            if ticket.skipped:
                return ticket  # nothing was copied
            with self._lock:
                self._uploading += 1
            try:
                # The caller is still inside save(), so the variables still hold
                # the values of the call: copying them now, after the decision,
                # is as point-in-time as copying before it, and a skip costs no copy.
                try:
                    snap, chunks = self._snapshot(bindings, train_step, numpy_state, offer)
                except BaseException:
                    stream.close()
                    raise
                if blocking:
                    self._upload(stream, snap, chunks, ticket, bindings, callbacks)
                    ticket.result()  # raises the save's error
                    return ticket
                self._uploads.submit(self._upload_then_release, stream, snap, chunks, ticket, bindings, callbacks)
                handed_off = True
                return ticket
            finally:
                if not handed_off:
                    self._uploaded()
        finally:
            if not handed_off:
                self._release()

    def _read_step(self, train_step: tf.Variable) -> int:
        step = self._graph_reads.step() if self._graph_reads is not None else int(train_step.numpy())
        self._last_step = step
        return step

    def _save_held(
        self,
        export_dir: str,
        kind: SaveKind,
        bindings: snapshot.Bindings,
        train_step: tf.Variable,
        numpy_state: NumpySnapshot | None,
        callbacks: tuple[options_lib.WriteCallback, ...],
    ) -> SaveTicket | None:
        """A non-blocking save decided here under the run's busy lock (see `checkpointd_client.held`).

        Returns None if it must go the ordinary way (another layout, or the
        daemon that offered the lock stopped); else its ticket: skipped, or
        not once the snapshot is in the segment and the Save call is queued
        on the upload thread (which ends the ticket and lets go of the lock).
        An eager policy's step is the snapshot's own (one read fewer).
        """
        path = self._held
        nbytes = snapshot.nbytes(bindings) + (numpy_state.nbytes if numpy_state is not None else 0)
        if path is None or not path.fits(bindings, nbytes):
            return None
        with self._lock:
            reason = ""
            if self._held_owner is not None:
                reason = "this saver's previous save of the run is in flight"
            elif path.lock.stale():
                self._held = None  # the daemon that made it stopped
                return None
            elif not path.lock.try_take():
                reason = "another save of the run is in flight (its busy lock is taken)"
            else:
                owner = self._held_owner = object()
                self._uploading += 1
        if reason:
            ticket = SaveTicket(export_dir, kind, self._read_step(train_step))
            _LOGGER.warning(
                "run %s: %s of step %s to %r skipped: %s",
                *(self._run, ticket.kind.value, ticket.step, ticket.export_dir, reason),
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
                step = self._last_step = snap.step
            ticket = SaveTicket(export_dir, kind, step)
            self._uploads.submit(self._upload_held, path, owner, ticket, bindings, numpy_state, snap, callbacks)
        except BaseException:
            self._end_held(path, owner)
            raise
        return ticket

    def _upload_held(
        self, path: held.HeldPath, owner: object, ticket: SaveTicket, bindings: snapshot.Bindings,
        numpy_state: NumpySnapshot | None, snap: snapshot.Snapshot, callbacks: tuple[options_lib.WriteCallback, ...],
    ) -> None:  # fmt: skip
        """The held save's call, on the upload thread: header, decision, then the end of the snapshot."""
        try:
            skips = self._local_skips.take()
            header = pb.SaveHeader(
                run=self._run,
                kind=to_wire(ticket.kind),
                export_dir=ticket.export_dir,
                step=ticket.step,
                variables=bindings.header_protos,
                snapshot_bytes=path.snapshot_bytes,
                numpy_state=numpy_state.to_proto() if numpy_state is not None else None,
                shared_memory=True,
                held=path.held(),
                local_skips=skips,
            )
            stream = SaveStream(self._save_stub, header, self._timeout)
            try:
                decision = stream.decision()
                if not decision.accepted:
                    raise SaveFailedError(
                        f"the daemon skipped a save sent holding the run's busy lock: {decision.reason}"
                    )
            except BaseException as e:
                stream.close()
                self._drop_held(path)  # the next save asks (and registers again after NOT_FOUND)
                error = e
                if isinstance(e, grpc.RpcError):
                    code, details = rpc_error(e)
                    doing = f"saving run {self._run!r} step {ticket.step} to {ticket.export_dir!r}"
                    error = self._named(error_for(code, details), doing)
                    error.__cause__ = e
                _LOGGER.warning(
                    "run %s: %s of step %s to %r failed: %s: %s",
                    *(self._run, ticket.kind.value, ticket.step, ticket.export_dir, type(error).__name__, error),
                )
                self._unlock_held(path, owner)
                ticket._fail(error)  # noqa: SLF001 - the saver's side completes tickets
                if not isinstance(e, Exception):
                    raise
                return
            offer = decision.shared_memory if decision.HasField("shared_memory") else None
            unlock = functools.partial(self._unlock_held, path, owner)
            if offer is not None and offer.path == path.segment.path:
                stream.finish(ticket, [shm.WRITTEN], self._run, unlock)
            else:
                # The daemon let the segment go (its cap, a re-registration): the
                # snapshot goes as chunks from our map of it; the next save asks.
                self._drop_held(path)
                stream.finish(ticket, snap.encoded_chunks(self._chunk_bytes), self._run, unlock)
            result = ticket.result(0) if callbacks and ticket.exception(0) is None else None
            if result is not None:
                options_lib.call_write_callbacks(callbacks, result.path)
        except Exception:
            if not ticket.done():
                raise
            _LOGGER.exception(
                "run %s: a write callback of the save of step %s to %r raised", self._run, ticket.step,
                ticket.export_dir,
            )  # fmt: skip
        finally:
            self._end_held(path, owner)
            self._release()

    def _unlock_held(self, path: held.HeldPath, owner: object) -> None:
        """Lets go of the busy lock the held save `owner` took, once its call has ended; idempotent.

        Only while that save is still this saver's held one: once its ticket
        has ended, the trainer's next save may already hold the lock (the same
        file description), and must keep it.
        """
        with self._lock:
            if self._held_owner is owner:
                path.lock.release()
                self._held_owner = None

    def _end_held(self, path: held.HeldPath, owner: object) -> None:
        """Lets go of the busy lock (if `owner` still holds it), then of the save."""
        self._unlock_held(path, owner)
        self._uploaded()

    def _drop_held(self, path: held.HeldPath) -> None:
        """Stops saving without asking through `path`; its lock fd goes once no save holds it."""
        with self._lock:
            if self._held is path:
                self._held = None

    def _adopt_held(
        self, segment: shm.SegmentMap, offer: pb.SharedMemory, bindings: snapshot.Bindings, snapshot_bytes: int
    ) -> None:
        """After an accept into shared memory: later non-blocking saves of this layout need not ask."""
        if not offer.lock_path:
            return  # an older daemon: no busy lock
        with self._lock:
            lock = self._busy_locks.get(offer.lock_path)
        if lock is None:
            try:
                lock = held.BusyLock(offer.lock_path)
            except OSError as e:
                _LOGGER.info(
                    "run %s: cannot open the run's busy lock %s (%s); saves ask the daemon",
                    *(self._run, offer.lock_path, e.strerror or e),
                )
                return
        with self._lock:
            self._busy_locks[offer.lock_path] = lock
            self._held = held.HeldPath(segment, lock, bindings, snapshot_bytes)

    def _decide(
        self,
        ticket: SaveTicket,
        numpy_state: NumpySnapshot | None,
        bindings: snapshot.Bindings,
        blocking: bool,
    ) -> tuple[SaveStream, snapshot.Bindings, pb.SharedMemory | None]:
        """Opens the Save call and reads the decision; re-registers once on NOT_FOUND.

        Returns the call, the bindings (new ones after a re-registration) and
        the shared memory the accept offered, if any.
        """
        for attempt in (1, 2):
            header = pb.SaveHeader(
                run=self._run,
                kind=to_wire(ticket.kind),
                export_dir=ticket.export_dir,
                blocking=blocking,
                step=ticket.step,
                variables=bindings.header_protos,
                snapshot_bytes=snapshot.nbytes(bindings) + (numpy_state.nbytes if numpy_state is not None else 0),
                numpy_state=numpy_state.to_proto() if numpy_state is not None else None,
                shared_memory=self._use_shm,
                local_skips=self._local_skips.take(),
            )
            stream = SaveStream(self._save_stub, header, self._timeout)
            try:
                decision = stream.decision()
            except grpc.RpcError as e:
                stream.close()
                code, details = rpc_error(e)
                if code != grpc.StatusCode.NOT_FOUND or attempt == 2:
                    doing = f"saving run {self._run!r} step {ticket.step} to {ticket.export_dir!r}"
                    raise self._named(error_for(code, details), doing) from e
                msg = "run %s: daemon lost the run (%s); registering again, then step %s"
                _LOGGER.warning(msg, self._run, details, ticket.step)
                bindings = self._registered(stale=bindings)
                continue
            except BaseException:
                stream.close()
                raise
            if not decision.accepted:
                stream.skip(ticket, decision.reason, self._run)
            offer = decision.shared_memory if decision.HasField("shared_memory") else None
            return stream, bindings, offer
        raise AssertionError("unreachable")

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
                self._adopt_held(segment, offer, bindings, nbytes)
                return segment.snapshot(bindings, train_step, numpy_state, values), [shm.WRITTEN]
            self._use_shm = False  # the daemon is not on this host (or not this user's)
            self._segment = None
        spare = self._take_spare(bindings) if values is None else None
        return snapshot.take_snapshot(bindings, train_step, numpy_state=numpy_state, into=spare, values=values), None

    def _take_spare(self, bindings: snapshot.Bindings) -> tuple[np.ndarray, ...] | None:
        """The arrays of the last uploaded snapshot of `bindings`, if no upload holds them."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is None or spare[0] is not bindings:
            return None
        return spare[1]

    def _upload(
        self, stream: SaveStream, snap: snapshot.Snapshot, chunks: list[bytes] | None,
        ticket: SaveTicket, bindings: snapshot.Bindings, callbacks: tuple[options_lib.WriteCallback, ...],
    ) -> None:  # fmt: skip
        if chunks is not None:  # in shared memory: the daemon's segment, not ours to reuse
            stream.finish(ticket, chunks, self._run)
        else:
            stream.finish(ticket, snap.encoded_chunks(self._chunk_bytes), self._run)
            if ticket.done() and ticket.exception(0) is None and self._graph_reads is None:
                # Uploaded and answered: gRPC has let go of every chunk, so the
                # next snapshot may reuse these arrays (a failed call may not
                # have, and keeps its own; a graph-mode read brings its own).
                with self._lock:
                    self._spare = (bindings, snap.arrays)
        result = ticket.result(0) if callbacks and ticket.exception(0) is None else None
        if result is not None:
            options_lib.call_write_callbacks(callbacks, result.path)

    def _upload_then_release(
        self, stream: SaveStream, snap: snapshot.Snapshot, chunks: list[bytes] | None,
        ticket: SaveTicket, bindings: snapshot.Bindings, callbacks: tuple[options_lib.WriteCallback, ...],
    ) -> None:  # fmt: skip
        try:
            self._upload(stream, snap, chunks, ticket, bindings, callbacks)
        except Exception:
            # Only a write callback raises here (the upload's own errors end
            # the ticket); the save itself is durable.
            _LOGGER.exception(
                "run %s: a write callback of the save of step %s to %r raised", self._run, ticket.step,
                ticket.export_dir,
            )  # fmt: skip
        finally:
            self._uploaded()
            self._release()

    def _uploaded(self) -> None:
        with self._idle:
            self._uploading -= 1
            if not self._uploading:
                self._idle.notify_all()

    def _release(self) -> None:
        with self._idle:
            self._busy -= 1
            if not self._busy:
                self._idle.notify_all()

    # Restoring (a restarted trainer).

    def latest(self, kind: SaveKind | None = None) -> restore_lib.LatestSave | None:
        """The run's newest committed save on the daemon, or None if it has none.

        Found from the daemon's save manifests on disk, so it counts saves
        made before a trainer or daemon restart; needs no registration.

        Args:
            kind: only saves of this kind (SaveKind.SAVED_MODEL or
                SaveKind.CHECKPOINT); None for either.

        Raises:
            RunClosedError: if `close()` was called.
            CheckpointdError: a subclass for the status the daemon answered.
        """
        self._check_open()
        with self._naming(f"looking up run {self._run!r}'s newest save"):
            return restore_lib.latest(self._stub, self._run, kind, self._folder, self._timeout)

    def restore(self, export_dir: str | None = None) -> restore_lib.LatestSave:
        """Assigns a committed save's values into the live policy, train_step and metadata.

        Registers the run first if this saver has not (the daemon reads the
        save with the run's manifest). Nothing is assigned until every value
        has arrived and passed its checksum. The NumpyState given as
        `numpy_state` gets the save's arrays (missing attributes are created,
        others left alone, as TensorFlow's restore does).

        Args:
            export_dir: the save, relative to the run's folder; None for the
                run's newest committed save.

        Returns:
            The save restored, with its numpy arrays.

        Raises:
            RunNotFoundError: the run has no committed save (at `export_dir`).
            InvalidRequestError: the save's variables differ from the run's
                (the message names the first key), or `export_dir` is invalid.
            RunClosedError: if `close()` was called.
            CheckpointdError: a subclass for another status the daemon answered.
        """
        self._check_open()
        reads = self._graph_reads
        with self._naming(f"restoring run {self._run!r}"):
            return restore_lib.restore(
                self._stub, self._run, export_dir, self._registered, self._numpy, self._folder,
                self._timeout, assign=reads.assign if reads is not None else None,
            )  # fmt: skip

    def _check_open(self) -> None:
        with self._lock:
            if self._closing:
                raise RunClosedError(f"run {self._run!r}: the saver was closed")

    # Registration.

    def register(self) -> None:
        """Exports the template and registers the run now, not at the first save.

        Optional: the first save registers if this was not called. Calling it
        early moves PolicySaver's export (0.2-1 s; the upload is graph, specs
        and assets only) out of the training loop and fails fast if the
        daemon is unreachable.

        Raises:
            CheckpointdError: the daemon refused the template or is unreachable.
        """
        self._registered()

    def _registered(
        self, stale: snapshot.Bindings | None = None, options: tf.saved_model.SaveOptions | None = None
    ) -> snapshot.Bindings:
        """The bindings, registering first if needed or if the daemon lost `stale`.

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
                    self._await_uploads()  # else one could be written with the new template
                self._dirty = False  # a register_function() from now on dirties it again
                try:
                    reads = self._graph_reads
                    with self._naming(f"registering run {self._run!r}"):
                        self._bindings = template.register(
                            self._stub,
                            self._saver,
                            self._run,
                            chunk_bytes=self._chunk_bytes,
                            timeout=self._timeout,
                            folder=self._folder,
                            options=export_options,
                            step=self._last_step,
                            exporting=reads.exporting if reads is not None else contextlib.nullcontext,
                        )
                except BaseException:
                    self._dirty = True
                    raise
                # Kept with its key: function_aliases count by identity.
                self._template_options, self._template_key = export_options, key
            return self._bindings

    def _await_uploads(self) -> None:
        """Waits until this saver's accepted saves have ended (each is bounded by its RPC deadline)."""
        with self._idle:
            while self._uploading:
                self._idle.wait()

    # Flush and close.

    def flush(self, timeout: float | None = None) -> None:
        """Waits until this saver's saves have ended, then until the daemon's run is idle.

        Args:
            timeout: seconds for both waits together; None uses the saver's timeout.

        Raises:
            DeadlineError: if the saves did not end in time.
            CheckpointdError: a subclass for another status the daemon answered.
        """
        timeout = timeout if timeout is not None else self._timeout
        deadline = _deadline(timeout)
        with self._idle:
            while self._busy:
                left = _left(deadline)
                if left == 0.0:
                    raise DeadlineError(
                        f"run {self._run!r}: {self._busy} save(s) of this saver still running "
                        f"after {timeout} s (last save call at step {self._last_step})"
                    )
                self._idle.wait(left)
        if self._bindings is not None:  # else the daemon holds nothing of this saver's
            self._call_run(self._stub.Flush, pb.FlushRequest, deadline)
        _LOGGER.debug("run %s: flushed (last save call at step %s)", self._run, self._last_step)

    def close(self, timeout: float | None = None) -> None:
        """Flushes, closes the run on the daemon and the channel; idempotent.

        New saves fail with RunClosedError from the moment close() is called,
        even if it then fails; calling it again retries the remaining steps.

        Args:
            timeout: seconds for flush and close together; None uses the saver's timeout.

        Raises:
            DeadlineError: if the saves did not end in time.
            CheckpointdError: a subclass for another status the daemon answered.
        """
        with self._close_lock:
            with self._lock:
                if self._closed:
                    return
                self._closing = True
            deadline = _deadline(timeout if timeout is not None else self._timeout)
            self.flush(_left(deadline))
            if self._bindings is not None:
                self._call_run(self._stub.CloseRun, pb.CloseRunRequest, deadline)
            with self._lock:
                self._closed = True
            self._uploads.shutdown(wait=False)  # flush() saw every upload end
            with self._lock:
                locks, self._busy_locks, self._held = list(self._busy_locks.values()), {}, None
            for lock in locks:
                lock.close()
            self._channel.close()
            # The step of the last save call: reading the live one would need TF
            # (and a session, for a graph-mode policy) just for a log line.
            _LOGGER.info("run %s: closed (last save call at step %s)", self._run, self._last_step)

    def _call_run(self, method: Callable[..., Any], request: type, deadline: float | None) -> None:
        """Calls Flush or CloseRun for this run; a daemon that lost the run has nothing to do."""
        left = _left(deadline)
        message = request(run=self._run, timeout_seconds=left or 0.0)
        skips = self._local_skips.take() if request is pb.FlushRequest else []
        if skips:
            message.local_skips.extend(skips)
        try:
            method(message, timeout=left)
        except grpc.RpcError as e:
            code, details = rpc_error(e)
            if code == grpc.StatusCode.UNAVAILABLE:
                self._local_skips.put_back(skips)  # not delivered: with the next call
            if code != grpc.StatusCode.NOT_FOUND:
                doing = "flushing" if request is pb.FlushRequest else "closing"
                raise self._named(error_for(code, details), f"{doing} run {self._run!r}") from e

    def _named(self, error: CheckpointdError, doing: str) -> CheckpointdError:
        """`error`, saying what was being done and where, if it is one of reaching the daemon.

        UnavailableError and DeadlineError say nothing of the address in gRPC's
        words ("failed to connect to all addresses", "Deadline Exceeded"); a
        trainer with several daemons or runs must see which call failed, e.g.
        "registering run 'r' at ckpt-host:7431: ...". Named once: an inner
        call's naming is kept.
        """
        if not isinstance(error, (UnavailableError, DeadlineError)) or getattr(error, "_named", False):
            return error
        named = type(error)(f"{doing} at {self._address}: {error}")
        setattr(named, "_named", True)  # noqa: B010 - a marker, not an attribute of the class
        return named

    @contextlib.contextmanager
    def _naming(self, doing: str) -> Iterator[None]:
        """Names the call and the address in an UnavailableError or DeadlineError raised inside."""
        try:
            yield
        except CheckpointdError as e:
            named = self._named(e, doing)
            if named is e:
                raise
            raise named from e

    def __enter__(self) -> RemotePolicySaver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _left(deadline: float | None) -> float | None:
    """Seconds left before `deadline` (0.0 once past), or None for no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _options_in_blocking(blocking: Any, options: Any, options_type: type) -> tuple[bool, Any]:
    """(blocking, options), taking an options object passed positionally as PolicySaver's second argument.

    PolicySaver's save(export_dir, options) and AsyncPolicySaver's
    save(export_dir, blocking) share the position; the type tells them apart.

    Raises:
        TypeError: options were given both ways.
    """
    if not isinstance(blocking, options_type):
        return bool(blocking), options
    if options is not None:
        raise TypeError("options given twice: as the second argument and as options=")
    return False, blocking
