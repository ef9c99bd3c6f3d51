"""RemoteCheckpointer: TF-Agents' `common.Checkpointer`, with the saving done by checkpointd.

`tf_agents.utils.common.Checkpointer(ckpt_dir, max_to_keep, **objects)`
wraps a `tf.train.Checkpoint(**objects)` and a `tf.train.CheckpointManager`,
restores the newest checkpoint when it is made, and writes synchronously in
`save(global_step)`: the trainer stalls for the whole write, optimizer
slots, target network and replay buffer included.

Here `save()` costs the trainer what a point-in-time save must: describing
the checkpoint with TensorFlow's own saver code and copying its values to
host memory (or into the daemon's shared memory on its host); the daemon
writes the tensor bundle `<root>/<folder>/<ckpt_dir>/ckpt-<step>.*` itself
(it runs no TensorFlow), keeps the dir's `checkpoint` state file, and applies
`max_to_keep` and `keep_checkpoint_every_n_hours` as CheckpointManager does,
off the save path. Each save has the semantics of every checkpointd save:
one in flight per run, a non-blocking save skipped (reported, counted) while
one is in flight, `blocking=True` waits its turn and returns once durable,
failures reach the ticket, and the run keeps saving.

A restarted trainer restores through the daemon, so it need not share its
disk: build the same objects, then the checkpointer (`tf_checkpoint` says
what is saved and how it is put back).

How a save moves (describe, the one save call, the copy, only what changed
into shared memory: `checkpointd_client.delta`) is `training_saves`'s; the
connection, flush, close and a save the daemon cannot take are the session's.

By default a checkpointer also saves on notice: on SIGTERM it saves the
step reached, blocking, waits until it is durable within `notice_deadline`,
and lets the process end as SIGTERM would have. Where and when that
snapshot is taken (never inside this client's own calls) is
`checkpointd_client.notice`'s to say; the save is `checkpointd_client.checkpointer_notice`'s.

With `continuous=True`, `save()` may be called after every step: each call
decides locally whether it saves, within a budget of training time
(`continuous`); flush(), close() and a save on notice save the last one not saved.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import grpc
import numpy as np
import tensorflow as tf

from checkpointd.protocol import wire
from checkpointd.protocol.errors import CheckpointdError, RunClosedError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.names import check_export_dir
from checkpointd_client import delta, notice, training_saves
from checkpointd_client.checkpoint_manager import (
    Latest,
    RemoteCheckpointManager,
    checked_keep_hours,
    checked_max_to_keep,
    latest_checkpoint,
)
from checkpointd_client.checkpointer_notice import SavesOnNotice
from checkpointd_client.continuous import DEFAULT_BUDGET, ContinuousSaves, Decisions, NotSavedTicket, check_budget
from checkpointd_client.notice import Notice, client_call
from checkpointd_client.restore import checkpoints
from checkpointd_client.save_call import guarded
from checkpointd_client.ticket import SaveCounts, SaveTicket
from checkpointd_client.transport import streams
from checkpointd_client.transport.connection import ConnectionOptions
from checkpointd_client.transport.session import DaemonSession, deadline_after, time_left

_LOGGER = logging.getLogger(__name__)

# tf.train.Checkpoint's own child, restored with the objects given.
_SAVE_COUNTER = "save_counter"


class RemoteCheckpointer(SavesOnNotice):
    """Saves and restores a `tf.train.Checkpoint(**objects)` through a checkpointd daemon.

    A drop-in for `tf_agents.utils.common.Checkpointer(ckpt_dir, max_to_keep,
    **objects)`: the same properties and methods, `save()` returning a
    `SaveTicket`, plus the connection options `RemotePolicySaver` takes.
    By default it also saves on notice: on SIGTERM, the step reached, durable
    before the process ends (`checkpointd_client.notice`). With
    `continuous=True`, `save()` may be called after every step and saves
    within a budget of training time (`checkpointd_client.continuous`).
    """

    @client_call
    def __init__(
        self,
        ckpt_dir: str | os.PathLike[str],
        address: str,
        *,
        run: str | None = None,
        max_to_keep: int | None = 20,
        keep_checkpoint_every_n_hours: float | None = None,
        folder: str | None = None,
        chunk_bytes: int = wire.CHUNK_BYTES,
        channel_credentials: grpc.ChannelCredentials | None = None,
        timeout: float | None = None,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        shared_memory: bool = True,
        incremental: bool = True,
        root_dir: str | os.PathLike[str] | None = None,
        read_only: bool = False,
        save_on_notice: bool = True,
        notice_deadline: float = notice.DEFAULT_DEADLINE,
        continuous: bool = False,
        budget: float = DEFAULT_BUDGET,
        skip_if_busy: bool = True,
        **objects: Any,
    ) -> None:
        """Registers the run and restores the dir's newest checkpoint, as Checkpointer's constructor does.

        Args:
            ckpt_dir: the checkpoint dir, relative to the job's folder on the
                daemon (Checkpointer's local `ckpt_dir`, e.g. "train"), or
                under `root_dir`.
            address: the daemon's `host:port`.
            run: the training job's name, the same for every saver and
                checkpointer of the script: its folder on the daemon (unless
                `folder` is given) and the base of this checkpointer's run,
                `<run>.<ckpt_dir with '/' as '.'>` (`checkpointd_client.transport.streams`).
                None: `folder`'s name.
            max_to_keep, keep_checkpoint_every_n_hours: as for
                tf.train.CheckpointManager (None keeps all / never preserves;
                a max_to_keep over 2**32 - 1 keeps all).
            folder: the job's folder under the daemon's root; None: `run`.
            chunk_bytes, channel_credentials, timeout, token, token_file,
                shared_memory: as for RemotePolicySaver.
            incremental: a checkpoint sent over gRPC sends only the chunks
                changed since the dir's newest checkpoint, the rest as
                references the daemon copies from it (each checkpoint is
                still complete on its own); False sends every byte.
            **objects: what to save, as for tf.train.Checkpoint (agent,
                policy, replay_buffer, global_step, metrics, NumpyState...).
            root_dir: the script's local root: a `ckpt_dir` below it is
                saved at the same path under the job's folder (TF-Agents'
                scripts join their dirs to a root_dir).
            read_only: restore only (an evaluation job, a notebook): no run
                is registered, held or closed, so the trainer writing the dir
                keeps saving; `save()` raises RunClosedError.
            save_on_notice: on SIGTERM (and `checkpointd_client.preempted()`),
                save the step reached, blocking, and wait until it is durable
                before the process ends as SIGTERM ends it; the handler is
                chained to the one installed before. The step is the
                `global_step`, `train_step` or `step` object, else an
                agent's `train_step_counter`. False: no save on notice.
            notice_deadline: seconds from the notice within which that save
                must be durable (default 25: Kubernetes gives 30).
            continuous: `save()` may be called after every step: each
                non-blocking call decides locally (no RPC, no snapshot)
                whether it saves, so that checkpointing costs at most
                `budget` of training time, and saves as often as that and
                the previous save allow; a call that does not save returns
                a skipped ticket and is counted in `decisions`. flush(),
                close() and a save on notice save the last call not saved.
                False (default): every call saves, as Checkpointer's does.
            budget: the fraction of training time continuous saves may
                cost (the time the training thread spends in save()), 0 < budget < 1;
                only with `continuous=True`.
            skip_if_busy: a non-blocking save while this checkpointer's
                previous one is in flight is skipped (AsyncPolicySaver's
                rule). False: it waits for that one instead, then returns
                once its values are copied (the write goes on in the
                background), so none is ever skipped: what a drop-in for
                common.Checkpointer, whose save() is synchronous and never
                skips, must do for a script that ignores save()'s return
                (`common_module`'s checkpointers).

        Raises:
            ValueError: an invalid run, folder, ckpt_dir (absolute, or leaving
                the folder), max_to_keep, keep_checkpoint_every_n_hours,
                root_dir, timeout or token option, save_on_notice,
                notice_deadline, continuous or budget, each named.
            AlreadyExistsError: another open run on the daemon writes this
                folder's ckpt_dir (another job of the same folder, or an
                older name of this one): see the message for what to change.
            CheckpointdError: the daemon refused the registration or the
                restore (InvalidRequestError naming the first key of a
                checkpoint saved from objects of another structure), or is
                unreachable.
        """
        job = streams.job_name(run, folder)
        try:
            self._dir = check_export_dir(streams.relative_to(ckpt_dir, root_dir)).as_posix()
        except (CheckpointdError, ValueError) as e:
            raise ValueError(
                f"ckpt_dir={ckpt_dir!r}: {e} (ckpt_dir is relative to the job's folder on the daemon)"
            ) from None
        self._folder = folder if folder is not None else job
        self._run = streams.checkpointer_run(job, self._dir)
        retention = (checked_max_to_keep(max_to_keep), checked_keep_hours(keep_checkpoint_every_n_hours))
        flags = dict(shared_memory=shared_memory, incremental=incremental, read_only=read_only,
                     save_on_notice=save_on_notice, continuous=continuous, skip_if_busy=skip_if_busy)  # fmt: skip
        for argument, value in flags.items():
            if not isinstance(value, bool):
                raise ValueError(f"{argument} must be True or False, got {value!r}")
        self._read_only = read_only
        self._notice_deadline = notice.check_deadline(notice_deadline)
        if not continuous and budget != DEFAULT_BUDGET:
            raise ValueError(f"budget={budget!r} applies to continuous saves: pass continuous=True too")
        # A read-only checkpointer's save() raises, whatever the budget.
        self._continuous = ContinuousSaves(check_budget(budget)) if continuous and not read_only else None
        self._skip_if_busy = skip_if_busy
        connection = ConnectionOptions(
            chunk_bytes=chunk_bytes, channel_credentials=channel_credentials, timeout=timeout, token=token,
            token_file=token_file, shared_memory=shared_memory,
        )  # fmt: skip
        self._checkpoint = tf.train.Checkpoint(**objects)
        self._objects = tuple(objects)
        self._step = training_saves.step_variable(objects)
        self._last_ticket: SaveTicket | None = None  # of the last save call
        self._daemon = DaemonSession(address, self._run, connection, owner="checkpointer", upload_threads=2)
        self._saves = training_saves.TrainingSaves(
            self._daemon, self._checkpoint, (self._folder, self._dir), retention,
            shared_memory=shared_memory, incremental=incremental,
        )  # fmt: skip
        if self._continuous is not None:  # what a save costs off the training thread counts against the budget
            self._saves.charge = self._continuous.charge
        self._copies: list[checkpoints.KeptFiles] = []  # restored checkpoints TF may still read
        self._manager = RemoteCheckpointManager(self._dir, self._checkpoint, self._latest)
        try:
            if not read_only:
                self._saves.register()
            latest = self._latest()
            if latest is not None:
                _LOGGER.info("run %s: checkpoint available: %s (step %d)", self._run, latest.path, latest.step)
                self._load_status = self._restore(latest.export_dir)
                self._saves.durable(latest.step)
            else:
                _LOGGER.info("run %s: no checkpoint available in %r", self._run, self._dir)
                self._load_status = self._checkpoint.restore(None)
        except BaseException:
            self._daemon.shutdown(self._release)
            raise
        self._checkpoint_exists = latest is not None
        self._on_notice = save_on_notice and not read_only
        if self._on_notice:
            notice.join(self)

    # Checkpointer's surface.

    @property
    def checkpoint_exists(self) -> bool:
        """True if a checkpoint was restored at construction, or one was saved since."""
        return self._checkpoint_exists or self._saves.copied

    @property
    def manager(self) -> RemoteCheckpointManager:
        return self._manager

    @property
    def checkpoint(self) -> tf.train.Checkpoint:
        return self._checkpoint

    @property
    def run(self) -> str:
        return self._run

    @property
    def address(self) -> str:
        """The daemon's address, as dialled."""
        return self._daemon.address

    @property
    def counts(self) -> SaveCounts:
        """How this checkpointer's saves ended so far (durable, skipped, failed)."""
        return self._daemon.counts

    @property
    def decisions(self) -> Decisions | None:
        """How the `save()` calls of a continuous checkpointer decided (saved, skipped_by_budget, handed_over,
        skipped_busy); None unless `continuous=True`."""
        return self._continuous.decisions if self._continuous is not None else None

    @property
    def folder(self) -> str:
        return self._folder

    @property
    def snapshot_copy(self) -> delta.SnapshotCopy | None:
        """What the last save copied into the daemon's shared memory (bytes, and why whole); None before one."""
        return self._saves.deltas.last

    @property
    def read_only(self) -> bool:
        return self._read_only

    @property
    def notice_deadline(self) -> float:
        """Seconds from a notice within which the save on notice must be durable."""
        return self._notice_deadline

    @property
    def skip_if_busy(self) -> bool:
        """Whether a non-blocking save while this checkpointer's previous one is in flight is skipped."""
        return self._skip_if_busy

    @property
    def ckpt_dir(self) -> str:
        return self._dir

    def initialize_or_restore(self, session: Any = None) -> Any:
        """Runs the restore the constructor started (or the initialization); returns its status."""
        self._load_status.initialize_or_restore(session)
        return self._load_status

    # Saving.

    @client_call
    def save(self, global_step: Any, blocking: bool = False) -> SaveTicket:
        """Saves every object as `<ckpt_dir>/ckpt-<global_step>` on the daemon.

        The values are those of the call: Python state is serialized before
        the daemon decides, variables are copied after it accepts, all
        before this returns. Without `blocking`, a save while another of the
        run is in flight is skipped (`ticket.skipped`), or with
        `skip_if_busy=False` waits for it; an accepted one is
        uploaded in the background and `ticket.result()` waits until it is
        durable. With `blocking`, this waits for the in-flight save, then
        until this one is durable.

        A non-blocking save that the daemon cannot take (unreachable,
        restarting, out of time or budget, failing inside) returns a failed
        ticket instead of raising, as RemotePolicySaver.save does: the
        Learner's interval saves never stop training.

        Args:
            global_step: the step (an int, or an integer tf.Variable/Tensor)
                that names the checkpoint, >= 0.
            blocking: wait for the in-flight save instead of being skipped,
                and for this save to be durable.

        Raises:
            RunClosedError: if `close()` was called, or the daemon closed the run.
            ValueError: an object holds state the daemon cannot carry (see
                `checkpointd_client.tf_checkpoint.describe`), or a negative step.
            InvalidRequestError: the daemon found the request invalid.
            UnauthenticatedError: the daemon refused the token.
            CheckpointdError: with `blocking`, any status the daemon answered
                (UnavailableError naming the address if it cannot be
                reached), and the save's own error.
        """
        if not isinstance(blocking, bool):
            raise TypeError(f"blocking must be a bool, saw {type(blocking)!r} (CheckpointOptions are not taken)")
        continuous = self._continuous
        if continuous is None:
            return self._save(global_step, blocking)
        self._daemon.check_open()  # a closed checkpointer raises, whatever the budget decides
        # busy: a save of this checkpointer in flight (uploading or in another thread's call).
        # On the daemon's host, a call that does not save may hand a standby snapshot over instead.
        hand_over = self._hand_over if self._saves.standby_ready else None
        return continuous.save(global_step, blocking, self._daemon.busy > 0, self._save, self._not_saved, hand_over)

    def _hand_over(self, global_step: Any) -> bool:
        return self._saves.hand_over(int(np.asarray(global_step)))

    def _not_saved(self, global_step: Any, reason: str) -> SaveTicket:
        """A continuous call that does not save: a skipped ticket, counted in `decisions`, not `counts`."""
        ticket = NotSavedTicket(global_step, self._name_of, SaveKind.TRAINING_CHECKPOINT, reason)
        self._last_ticket = ticket
        return ticket

    def _name_of(self, step: int) -> str:
        return training_saves.checkpoint_name(self._dir, step)  # ValueError for a negative step

    def _save_pending(self) -> None:
        """Saves the last continuous call not saved (unless a save came after it), blocking: flush and close."""
        if self._continuous is None or self._daemon.closing:
            return
        global_step = self._continuous.take_pending()
        if global_step is None:
            return
        try:
            with self._continuous.saving_pending():
                self._save(global_step, blocking=True)
        except BaseException:
            self._continuous.put_back(global_step)
            raise

    def _save(self, global_step: Any, blocking: bool, on_notice: Notice | None = None) -> SaveTicket:
        """`save()`; `on_notice`: a save on notice, within the notice's deadline."""
        if self._read_only:
            raise RunClosedError(
                f"the checkpointer of {self._dir!r} in folder {self._folder!r} is read-only (read_only=True): "
                "it restores, it does not save"
            )
        daemon = self._daemon
        deadline = on_notice.monotonic + self._notice_deadline if on_notice is not None else None

        def early() -> SaveTicket:
            step = int(np.asarray(global_step))
            ticket = daemon.ticket(self._name_of(step), SaveKind.TRAINING_CHECKPOINT, step)
            daemon.last_step, self._last_ticket = step, ticket
            return ticket

        def save(ticket: SaveTicket | None) -> tuple[SaveTicket, bool]:
            assert ticket is not None
            return ticket, self._saves.save(ticket, blocking, self._skip_if_busy, on_notice, deadline)

        return guarded(daemon, blocking, early, save, lambda ticket: ticket or early())

    # Registration and restore.

    @client_call
    def _latest(self) -> Latest | None:
        """The newest checkpoint in this dir of the folder, whichever run committed it (as latest_checkpoint(dir))."""
        return latest_checkpoint(self._daemon, self._folder, self._dir)

    def _restore(self, export_dir: str) -> Any:
        children = {*self._objects, _SAVE_COUNTER}
        restored = checkpoints.restore(self._daemon, self._checkpoint, children, export_dir, self._folder)
        if restored.copy is not None:
            self._copies.append(restored.copy)
        return restored.status

    # Flush and close.

    @client_call
    def flush(self, timeout: float | None = None) -> None:
        """Waits until this checkpointer's saves have ended, then until the daemon's run is idle.

        A continuous checkpointer first saves the last call it did not save
        (blocking: within the checkpointer's timeout).

        Raises:
            DeadlineError: if they did not end within `timeout` (None: the
                checkpointer's timeout).
            CheckpointdError: another status the daemon answered
                (UnavailableError, naming the address, if it cannot be reached).
        """
        deadline = deadline_after(timeout if timeout is not None else self._daemon.timeout)
        self._save_pending()
        self._daemon.flush(time_left(deadline), registered=not self._read_only, skips=self._saves.local_skips)

    @client_call
    def close(self, timeout: float | None = None) -> None:
        """Flushes, closes the run on the daemon and the channel; idempotent.

        A continuous checkpointer first saves the last call it did not save.

        Restored checkpoints' local copies are deleted: objects created after
        this are not restored any more, and it no longer saves on notice.

        Raises:
            DeadlineError: if the saves did not end in time.
            CheckpointdError: a subclass for another status the daemon answered.
        """
        if self._on_notice:
            notice.leave(self)
        deadline = deadline_after(timeout if timeout is not None else self._daemon.timeout)
        try:
            self._save_pending()  # before the run closes: close() saves the last call not saved
        finally:  # closed even if that save failed: saves raise RunClosedError from here on
            self._daemon.close(time_left(deadline), self.flush, lambda: not self._read_only, self._release)

    def _release(self) -> None:
        """Deletes restored copies (lets go of files held in place), drops the spare snapshot
        buffers and unmaps the shared-memory segment: no save follows, and each holds as many
        bytes as the state."""
        for copy in self._copies:
            copy.close()
        self._copies.clear()
        self._saves.release()

    def __enter__(self) -> RemoteCheckpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
