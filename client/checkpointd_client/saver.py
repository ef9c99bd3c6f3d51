"""RemotePolicySaver: AsyncPolicySaver's interface, with the saving done by checkpointd.

The trainer keeps a real `PolicySaver` (same arguments, same errors) and uses
it once per template: at the first save, and again after `register_function`.
The save path is a collaborator, `checkpointd_client.policy_saves`; on the
daemon's host, once a save has been accepted into shared memory, a later
non-blocking save of the same layout decides skip-if-busy itself under the
run's busy lock (`checkpointd_client.local_decision`). The connection, busy accounting,
flush, close and what a non-blocking save does when the daemon cannot take
it are the session's (`checkpointd_client.transport.session`).
"""

from __future__ import annotations

import os
import weakref

import grpc
import tensorflow as tf
from tf_agents.policies import policy_saver, tf_policy
from tf_agents.typing import types
from tf_agents.utils import numpy_storage

from checkpointd.protocol import wire
from checkpointd.protocol.kinds import SaveKind
from checkpointd_client import graph_mode, snapshot
from checkpointd_client import numpy_state as numpy_state_lib
from checkpointd_client import options as options_lib
from checkpointd_client.facade import PolicySaverFacade
from checkpointd_client.notice import client_call
from checkpointd_client.policy_saves import PolicySaves
from checkpointd_client.restore import policies
from checkpointd_client.ticket import SaveCounts, SaveTicket
from checkpointd_client.transport import streams
from checkpointd_client.transport.connection import ConnectionOptions
from checkpointd_client.transport.session import DaemonSession


class RemotePolicySaver(PolicySaverFacade):
    """Saves a TF-Agents policy through a checkpointd daemon.

    A drop-in for `AsyncPolicySaver(PolicySaver(policy, ...))`: `save()` and
    `save_checkpoint()` take a snapshot at the call and return at once (or,
    with `blocking=True`, once the save is durable). Unlike AsyncPolicySaver,
    every call returns a `SaveTicket` that says whether the save was skipped
    and, later, whether it was written; a failed save never stops the saver.
    PolicySaver's properties and registrations come from PolicySaverFacade.

    A non-blocking save whose daemon cannot take it (down, restarting,
    failing) returns a failed ticket and training goes on; the saver dials
    again and re-registers on its own (see `checkpointd_client.transport.session`).
    """

    @client_call
    def __init__(
        self,
        policy: tf_policy.TFPolicy,
        address: str,
        *,
        run: str | None = None,
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
        incremental: bool = True,
    ) -> None:
        """Builds the PolicySaver and a channel to the daemon; no network I/O yet.

        Args:
            policy, batch_size, use_nest_path_signatures, seed, train_step,
                metadata, input_fn_and_spec: as for `PolicySaver`.
            address: the daemon's `host:port`.
            run: the training job's name, the same for every saver and
                checkpointer of the script (1-128 of [A-Za-z0-9._-]): this
                saver's run on the daemon, and its folder unless `folder` is
                given. While a saver of another policy of the job is open
                in this process, this one's run is `<run>.<policy's name>`
                (`checkpointd_client.transport.streams`). None: `folder`'s name.
            numpy_state: a `NumpyState` saved with every save (its arrays
                serialized at the call) as `<export_dir>/numpy_state/`, and
                restored by `restore()`.
            folder: the job's folder under the daemon's root (a valid run
                name); None: `run`. Savers sharing a folder (one per
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
                them over gRPC (see checkpointd_client.transport.shm); it turns itself
                off, for this saver, if the segment cannot be opened here.
            session: for a policy built in TF1 graph mode (inside
                `tf.compat.v1.Graph().as_default()`), the session that
                holds its variables; None: the default session at each
                call, as PolicySaver reads them. Snapshots are then one
                `session.run` of the variables' read ops, at the call.
            incremental: only the variables' chunks that changed since the
                run's newest save of the same kind in the same parent dir
                travel (over gRPC; through shared memory the daemon compares
                them) and the rest are copied from it on the daemon's side;
                every save is still whole. False sends and writes every byte.

        Raises:
            TypeError: if `policy` is not a TFPolicy or `metadata` is not a
                dict of str to tf.Variable (raised by PolicySaver).
            ValueError: for PolicySaver's invalid arguments (e.g. batch_size),
                an address given as a URL (HOST:PORT, not a URL), an invalid
                run or folder, chunk_bytes, timeout, channel_credentials,
                token, shared_memory, incremental, numpy_state or session
                (each named), both token and token_file, a token file
                without exactly one token, or a session for a policy built
                eagerly.
            OSError: token_file cannot be read.
        """
        # Ours first, each named, before PolicySaver's export work.
        job = streams.job_name(run, folder)
        connection = ConnectionOptions(
            chunk_bytes=chunk_bytes, channel_credentials=channel_credentials, timeout=timeout, token=token,
            token_file=token_file, shared_memory=shared_memory,
        )  # fmt: skip
        if not isinstance(incremental, bool):
            raise ValueError(f"incremental must be True or False, got {incremental!r}")
        if numpy_state is not None and not isinstance(numpy_state, numpy_storage.NumpyState):
            raise ValueError(f"numpy_state must be a tf_agents NumpyState or None, got {type(numpy_state)!r}")
        if session is not None and not isinstance(session, tf.compat.v1.Session):
            raise ValueError(f"session must be a tf.compat.v1.Session or None, got {type(session)!r}")
        self._saver = policy_saver.PolicySaver(
            policy,
            batch_size=batch_size,
            use_nest_path_signatures=use_nest_path_signatures,
            seed=seed,
            train_step=train_step,
            input_fn_and_spec=input_fn_and_spec,
            metadata=metadata,
        )
        # The job's folder, also when this saver's run is `<job>.<policy's name>` (streams.PolicyRuns).
        self._folder = folder if folder is not None else job
        self._numpy = numpy_state_lib.NumpySource(numpy_state) if numpy_state is not None else None
        graph = graph_mode.current_graph()
        if graph is None and session is not None:
            raise ValueError("session= is for a policy built in graph mode; this one was built eagerly")
        train_step_variable = self._saver._train_step  # noqa: SLF001 - PolicySaver exposes no other way
        graph_reads = graph_mode.GraphReads(graph, train_step_variable, session) if graph else None
        self._graph_reads = graph_reads
        self._daemon = DaemonSession(address, job, connection, owner="saver", upload_threads=4)
        self._address = self._daemon.address
        # Another policy's open saver of the job in this process has a run of its own (streams.PolicyRuns).
        self._run = streams.POLICY_RUNS.take(self._address, self._folder, job, policy)
        self._daemon.run = self._run
        # Lets go of the run's name at close(), or when this saver is dropped unclosed. (The policy
        # given, not PolicySaver's `policy`, which is a wrapper of it: the name is held for this one.)
        self._release_run = weakref.finalize(
            self, streams.POLICY_RUNS.release, self._address, self._folder, self._run, policy
        )
        self._saves = PolicySaves(
            self._daemon, self._saver, folder=self._folder, numpy_source=self._numpy, graph_reads=graph_reads,
            shared_memory=shared_memory, incremental=incremental,
        )  # fmt: skip

    @property
    def counts(self) -> SaveCounts:
        """How this saver's saves ended so far (durable, skipped, failed)."""
        return self._daemon.counts

    @property
    def _bindings(self) -> snapshot.Bindings | None:
        """The registered template's bindings (None before the first registration)."""
        return self._saves.bindings

    # Saving.

    @client_call
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
        busy lock (`checkpointd_client.local_decision`): no round trip, and
        the Save call is made in the background; the daemon's refusals of
        such a save (e.g. its budget is full) then fail the ticket. With
        `blocking`, the daemon waits for the in-flight save and this returns
        once the save is durable.

        Training never dies of a checkpoint: a non-blocking save that the
        daemon cannot take (unreachable, shutting down, out of time or
        budget, failing inside) returns a failed ticket (`ticket.exception()`
        says why, `counts.failed` counts it); the first such failure is
        logged once at WARNING, later saves fail at once until a backoff
        has passed, and the next one then dials again and re-registers the
        run if the daemon restarted.

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
            RunClosedError: if `close()` was called (no network call is made),
                or the daemon closed the run (FAILED_PRECONDITION).
            InvalidRequestError: if `export_dir` is absolute or leaves the
                run's folder, or the daemon found the request invalid.
            UnauthenticatedError: the daemon refused the token.
            CheckpointdError: with `blocking`, a subclass for any status the
                daemon (or the channel) answered, e.g. UnavailableError
                naming the address when it is unreachable, and the save's
                own error.
            ValueError: if the template's variables cannot be bound, an option
                cannot apply to a save the daemon writes (e.g.
                experimental_io_device), or a graph-mode policy has no session.
            TypeError: `options` is not a tf.saved_model.SaveOptions.
        """
        blocking, options = options_lib.options_in_blocking(blocking, options, tf.saved_model.SaveOptions)
        template_options = options_lib.template_options(options) or tf.saved_model.SaveOptions()
        return self._saves.save(export_dir, SaveKind.SAVED_MODEL, blocking, template_options=template_options)

    @client_call
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
        blocking, options = options_lib.options_in_blocking(blocking, options, tf.train.CheckpointOptions)
        if not self._saver.policy.model_variables:
            snapshot.checkpoint_root(self._saver)  # raises what PolicySaver.save_checkpoint raises
        callbacks = options_lib.write_callbacks(options)
        return self._saves.save(export_dir, SaveKind.CHECKPOINT, blocking, callbacks=callbacks)

    # Restoring (a restarted trainer).

    @client_call
    def latest(self, kind: SaveKind | None = None) -> policies.LatestSave | None:
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
        self._daemon.check_open()
        return policies.latest(self._daemon, kind, self._folder)

    @client_call
    def restore(self, export_dir: str | None = None) -> policies.LatestSave:
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
        self._daemon.check_open()
        reads = self._graph_reads
        return policies.restore_policy(
            self._daemon, export_dir, self._saves.register_template, self._numpy, self._folder,
            assign=reads.assign if reads is not None else None,
        )  # fmt: skip

    # Registration.

    @client_call
    def register(self) -> None:
        """Exports the template and registers the run now, not at the first save.

        Optional: the first save registers if this was not called. Calling it
        early moves PolicySaver's export out of the training loop and fails
        fast if the daemon is unreachable.

        Raises:
            CheckpointdError: the daemon refused the template or is unreachable.
        """
        self._saves.register_template()

    # Flush and close.

    @client_call
    def flush(self, timeout: float | None = None) -> None:
        """Waits until this saver's saves have ended, then until the daemon's run is idle.

        Args:
            timeout: seconds for both waits together; None uses the saver's timeout.

        Raises:
            DeadlineError: if the saves did not end in time.
            CheckpointdError: a subclass for another status the daemon answered
                (UnavailableError, naming the address, if it cannot be reached).
        """
        self._daemon.flush(timeout, self._saves.bindings is not None, self._saves.local_skips)

    @client_call
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
        self._daemon.close(timeout, self.flush, lambda: self._saves.bindings is not None, self._saves.close)
        self._release_run()

    def __enter__(self) -> RemotePolicySaver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
