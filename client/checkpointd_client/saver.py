"""RemotePolicySaver: AsyncPolicySaver's interface, with the saving done by checkpointd.

The trainer keeps a real `PolicySaver` (same arguments, same errors) and uses
it once per template: at the first save, and again after `register_function`.
Each save asks the daemon, which answers at once whether it accepted or
skipped the save; an accepted one then costs a host copy of the variables
(taken before save() returns) and a stream to the daemon.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import tensorflow as tf
from tf_agents.policies import policy_saver, tf_policy
from tf_agents.typing import types
from tf_agents.utils import numpy_storage

from checkpointd.protocol import wire
from checkpointd.protocol.codes import error_for
from checkpointd.protocol.credentials import open_channel, read_token
from checkpointd.protocol.errors import CheckpointdError, DeadlineError, RunClosedError
from checkpointd.protocol.kinds import SaveKind, to_wire
from checkpointd.protocol.names import check_export_dir, check_run_name
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc
from checkpointd_client import numpy_state as numpy_state_lib
from checkpointd_client import restore as restore_lib
from checkpointd_client import shm, snapshot, template
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

    Lock discipline: `_lock` guards `_busy`, `_closing`, `_closed` and `_spare` and is
    never held across an RPC or a TF call; `_register_lock` serializes
    template exports and registrations; `_close_lock` serializes close().
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

        Raises:
            TypeError: if `policy` is not a TFPolicy or `metadata` is not a
                dict of str to tf.Variable (raised by PolicySaver).
            ValueError: for PolicySaver's invalid arguments (e.g. batch_size),
                an invalid run name, chunk_bytes or timeout, both token and
                token_file, or a token file without exactly one token.
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
        self._address = address
        self._chunk_bytes = chunk_bytes
        self._timeout = timeout
        self._channel = open_channel(address, channel_credentials, token)
        self._stub = checkpointd_pb2_grpc.CheckpointServiceStub(self._channel)
        self._save_stub = SaveStub(self._channel)  # sends chunks serialized once, by us
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._busy = 0  # save calls running plus background uploads
        self._closing = False
        self._closed = False
        self._register_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._bindings: snapshot.Bindings | None = None
        self._dirty = True  # the template must be (re-)exported before the next save
        # (bindings, arrays) of the last uploaded snapshot, reused by the next one.
        self._spare: tuple[snapshot.Bindings, tuple[np.ndarray, ...]] | None = None
        self._use_shm = shared_memory
        # Uploads run here, after save() returns; idle threads are reused
        # (starting one per save cost more than a small save's copy).
        self._uploads = concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix=f"checkpointd-upload-{self._run}"
        )
        self._segment: shm.SegmentMap | None = None  # the daemon's segment, mapped here

    # Saving.

    def save(self, export_dir: str, blocking: bool = False) -> SaveTicket:
        """Saves the policy as a SavedModel under `<root>/<run>/<export_dir>` on the daemon.

        The variables are copied before this returns (once the daemon has
        accepted the save, so a skipped save copies nothing). Without `blocking`, it
        returns once the daemon has accepted or skipped the save (skipped if
        another save of this run is in flight); an accepted snapshot is then
        uploaded in the background and `ticket.result()` waits until it is
        durable. With `blocking`, the daemon waits for the in-flight save and
        this returns once the save is durable.

        Args:
            export_dir: a relative path inside the run's folder.
            blocking: wait for the in-flight save instead of being skipped,
                and for this save to be durable.

        Returns:
            The save's ticket (`ticket.skipped` is already known).

        Raises:
            RunClosedError: if `close()` was called (no network call is made).
            InvalidRequestError: if `export_dir` is absolute or leaves the run's folder.
            CheckpointdError: a subclass for the status the daemon (or the
                channel) answered, e.g. UnavailableError when it is unreachable
                or shutting down; with `blocking`, also the save's own error.
            ValueError: if the template's variables cannot be bound.
        """
        return self._save(export_dir, SaveKind.SAVED_MODEL, blocking)

    def save_checkpoint(self, export_dir: str, blocking: bool = False) -> SaveTicket:
        """Saves the variables only, in PolicySaver.save_checkpoint's layout.

        Same rules, arguments, return value and errors as `save()`.
        """
        return self._save(export_dir, SaveKind.CHECKPOINT, blocking)

    def _save(self, export_dir: str, kind: SaveKind, blocking: bool) -> SaveTicket:
        with self._lock:
            if self._closing:
                raise RunClosedError(f"run {self._run!r}: the saver was closed")
            self._busy += 1
        handed_off = False
        try:
            check_export_dir(export_dir)
            bindings = self._registered()
            train_step = self._saver._train_step  # noqa: SLF001 - PolicySaver exposes no other way
            numpy_state = self._numpy.take() if self._numpy is not None else None
            ticket = SaveTicket(export_dir, kind, int(train_step.numpy()))
            stream, bindings, offer = self._decide(ticket, numpy_state, bindings, blocking)
            if ticket.skipped:
                return ticket  # nothing was copied
            # The caller is still inside save(), so the variables still hold
            # the values of the call: copying them now, after the decision,
            # is as point-in-time as copying before it, and a skip costs no copy.
            try:
                snap, chunks = self._snapshot(bindings, train_step, numpy_state, offer)
            except BaseException:
                stream.close()
                raise
            if blocking:
                self._upload(stream, snap, chunks, ticket, bindings)
                ticket.result()  # raises the save's error
                return ticket
            self._uploads.submit(self._upload_then_release, stream, snap, chunks, ticket, bindings)
            handed_off = True
            return ticket
        finally:
            if not handed_off:
                self._release()

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
            )
            stream = SaveStream(self._save_stub, header, self._timeout)
            try:
                decision = stream.decision()
            except grpc.RpcError as e:
                stream.close()
                code, details = rpc_error(e)
                if code != grpc.StatusCode.NOT_FOUND or attempt == 2:
                    raise error_for(code, details) from e
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

        Returns the snapshot and, for a snapshot in shared memory, the one
        message that completes the call (None: send the snapshot's chunks).
        """
        if offer is not None and self._use_shm:
            segment = shm.open_offer(offer, self._segment, self._run)
            if segment is not None:
                self._segment = segment
                return segment.snapshot(bindings, train_step, numpy_state), [shm.WRITTEN]
            self._use_shm = False  # the daemon is not on this host (or not this user's)
            self._segment = None
        spare = self._take_spare(bindings)
        return snapshot.take_snapshot(bindings, train_step, numpy_state=numpy_state, into=spare), None

    def _take_spare(self, bindings: snapshot.Bindings) -> tuple[np.ndarray, ...] | None:
        """The arrays of the last uploaded snapshot of `bindings`, if no upload holds them."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is None or spare[0] is not bindings:
            return None
        return spare[1]

    def _upload(
        self, stream: SaveStream, snap: snapshot.Snapshot, chunks: list[bytes] | None,
        ticket: SaveTicket, bindings: snapshot.Bindings,
    ) -> None:  # fmt: skip
        if chunks is not None:  # in shared memory: the daemon's segment, not ours to reuse
            stream.finish(ticket, chunks, self._run)
            return
        stream.finish(ticket, snap.encoded_chunks(self._chunk_bytes), self._run)
        if ticket.done() and ticket.exception(0) is None:
            # Uploaded and answered: gRPC has let go of every chunk, so the
            # next snapshot may reuse these arrays (a failed call may not
            # have, and keeps its own).
            with self._lock:
                self._spare = (bindings, snap.arrays)

    def _upload_then_release(
        self, stream: SaveStream, snap: snapshot.Snapshot, chunks: list[bytes] | None,
        ticket: SaveTicket, bindings: snapshot.Bindings,
    ) -> None:  # fmt: skip
        try:
            self._upload(stream, snap, chunks, ticket, bindings)
        finally:
            self._release()

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
        return restore_lib.restore(
            self._stub, self._run, export_dir, self._registered, self._numpy, self._folder,
            self._timeout,
        )  # fmt: skip

    def _check_open(self) -> None:
        with self._lock:
            if self._closing:
                raise RunClosedError(f"run {self._run!r}: the saver was closed")

    # Registration.

    def register(self) -> None:
        """Exports the template and registers the run now, not at the first save.

        Optional: the first save registers if this was not called. Calling it
        early moves the export and upload (0.2-3 s) out of the training loop
        and fails fast if the daemon is unreachable.

        Raises:
            CheckpointdError: the daemon refused the template or is unreachable.
        """
        self._registered()

    def _registered(self, stale: snapshot.Bindings | None = None) -> snapshot.Bindings:
        """The bindings, registering first if needed or if the daemon lost `stale`."""
        with self._register_lock:
            if self._bindings is None or self._dirty or self._bindings is stale:
                self._dirty = False  # a register_function() from now on dirties it again
                try:
                    self._bindings = template.register(
                        self._stub,
                        self._saver,
                        self._run,
                        chunk_bytes=self._chunk_bytes,
                        timeout=self._timeout,
                        folder=self._folder,
                    )
                except BaseException:
                    self._dirty = True
                    raise
            return self._bindings

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
                        f"after {timeout} s (step {self._saver.get_train_step()})"
                    )
                self._idle.wait(left)
        if self._bindings is not None:  # else the daemon holds nothing of this saver's
            self._call_run(self._stub.Flush, pb.FlushRequest, deadline)
        _LOGGER.debug("run %s: flushed at step %s", self._run, self._saver.get_train_step())

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
            self._channel.close()
            _LOGGER.info("run %s: closed at step %s", self._run, self._saver.get_train_step())

    def _call_run(self, method: Callable[..., Any], request: type, deadline: float | None) -> None:
        """Calls Flush or CloseRun for this run; a daemon that lost the run has nothing to do."""
        left = _left(deadline)
        try:
            method(request(run=self._run, timeout_seconds=left or 0.0), timeout=left)
        except grpc.RpcError as e:
            code, details = rpc_error(e)
            if code != grpc.StatusCode.NOT_FOUND:
                raise error_for(code, details) from e

    def __enter__(self) -> RemotePolicySaver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _left(deadline: float | None) -> float | None:
    """Seconds left before `deadline` (0.0 once past), or None for no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
