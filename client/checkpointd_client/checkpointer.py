"""RemoteCheckpointer: TF-Agents' `common.Checkpointer`, with the saving done by checkpointd.

`tf_agents.utils.common.Checkpointer(ckpt_dir, max_to_keep, **objects)`
wraps a `tf.train.Checkpoint(**objects)` and a `tf.train.CheckpointManager`,
restores the newest checkpoint when it is made, and writes synchronously in
`save(global_step)`: the trainer stalls for the whole write, optimizer
slots, target network and replay buffer included.

Here `save()` costs the trainer what a point-in-time save must: describing
the checkpoint with TensorFlow's own saver code and copying its values to
host memory (or into the daemon's shared memory on its host); the daemon
writes them with SaveV2 as `<root>/<folder>/<ckpt_dir>/ckpt-<step>.*`, keeps
the dir's `checkpoint` state file, and applies `max_to_keep` and
`keep_checkpoint_every_n_hours` as CheckpointManager does, off the save path.
Each save has the semantics of every checkpointd save: one in flight per run,
a non-blocking save skipped (reported, counted) while one is in flight,
`blocking=True` waits its turn and returns once durable, failures reach the
ticket, and the run keeps saving.

A restarted trainer restores over the daemon's Restore call, so it need not
share the daemon's disk: build the same objects, construct the checkpointer,
call `initialize_or_restore()`. See `checkpointd_client.tf_checkpoint` for what
is saved and how it is put back.

The connection, busy accounting, flush, close and what a non-blocking save
does when the daemon cannot take it are the session's
(`checkpointd_client.session`): the Learner's interval saves never stop
training. Lock discipline: the session's lock guards `_spare`,
`_segment` and `_durable_step`, and is never held across an RPC or a TF call.

By default a checkpointer also saves on notice: on SIGTERM it saves the
step reached, blocking, waits until it is durable within `notice_deadline`,
and lets the process end as SIGTERM would have. Where and when that
snapshot is taken (never inside this client's own calls) is
`checkpointd_client.notice`'s to say; the save is `_save_on_notice` here.

With `continuous=True`, `save()` may be called after every step: each call
decides locally whether it saves, within a budget of training time
(`checkpointd_client.continuous`), and the last call not saved is saved by
flush(), close() or a save on notice.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc
import numpy as np
import tensorflow as tf

from checkpointd.protocol import increments, wire
from checkpointd.protocol.errors import CheckpointdError, InvalidRequestError, RunClosedError
from checkpointd.protocol.kinds import SaveKind, to_wire
from checkpointd.protocol.names import check_export_dir, checkpoint_prefix
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client import checkpoint_restore, delta, notice, shm, streams, tf_checkpoint
from checkpointd_client.checkpoint_manager import Latest, RemoteCheckpointManager, checked_max_to_keep
from checkpointd_client.connection import ConnectionOptions
from checkpointd_client.continuous import DEFAULT_BUDGET, ContinuousSaves, Decisions, NotSavedTicket, check_budget
from checkpointd_client.notice import Notice, NoticeOutcome, client_call
from checkpointd_client.outage import survivable
from checkpointd_client.session import DaemonSession, deadline_after, time_left
from checkpointd_client.stream import SaveStream
from checkpointd_client.ticket import SaveCounts, SaveTicket

_LOGGER = logging.getLogger(__name__)

# tf.train.Checkpoint's own child, restored with the objects given.
_SAVE_COUNTER = "save_counter"
# The objects whose value is the step a save on notice is named by, as TF-Agents names them.
_STEP_NAMES = ("global_step", "train_step", "step")
_NOTICE_POLL = 0.005  # seconds between looks at the save in flight that a save on notice waits for


class RemoteCheckpointer:
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
                `<run>.<ckpt_dir with '/' as '.'>` (`checkpointd_client.streams`).
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
        self._max_to_keep = checked_max_to_keep(max_to_keep)
        if keep_checkpoint_every_n_hours is not None and not (
            isinstance(keep_checkpoint_every_n_hours, int | float)
            and not isinstance(keep_checkpoint_every_n_hours, bool)
            and 0 < keep_checkpoint_every_n_hours < float("inf")
        ):
            raise ValueError(
                "keep_checkpoint_every_n_hours must be a finite number of hours > 0, or None; got "
                f"{keep_checkpoint_every_n_hours!r}"
            )
        for argument, value in (
            ("shared_memory", shared_memory),
            ("incremental", incremental),
            ("read_only", read_only),
            ("save_on_notice", save_on_notice),
            ("continuous", continuous),
            ("skip_if_busy", skip_if_busy),
        ):
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
        self._keep_hours = keep_checkpoint_every_n_hours
        self._checkpoint = tf.train.Checkpoint(**objects)
        self._objects = tuple(objects)
        self._step = _step_variable(objects)
        self._last_ticket: SaveTicket | None = None  # of the last save call
        self._durable_step: int | None = None  # of the dir's newest checkpoint known durable
        self._daemon = DaemonSession(address, self._run, connection, owner="checkpointer", upload_threads=2)
        self._use_shm = shared_memory
        self._incremental = incremental
        self._segment: shm.SegmentMap | None = None
        self._deltas = delta.SegmentDeltas(self._run, self._checkpoint)  # what a save copies into the segment
        # (layout, buffers) of the last uploaded snapshot, reused by the next one of that layout.
        self._spare: tuple[tuple[Any, ...], list[np.ndarray]] | None = None
        self._copies: list[checkpoint_restore.Copy] = []  # restored checkpoints TF may still read
        self._manager = RemoteCheckpointManager(self)
        try:
            if not read_only:
                self._register()
            latest = self._latest()
            if latest is not None:
                _LOGGER.info("run %s: checkpoint available: %s (step %d)", self._run, latest.path, latest.step)
                self._load_status = self._restore(latest.export_dir)
                self._durable_step = latest.step
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
        return self._checkpoint_exists

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
        """How the `save()` calls of a continuous checkpointer decided (saved, skipped_by_budget,
        skipped_busy); None unless `continuous=True`."""
        return self._continuous.decisions if self._continuous is not None else None

    @property
    def folder(self) -> str:
        return self._folder

    @property
    def snapshot_copy(self) -> delta.SnapshotCopy | None:
        """What the last save copied into the daemon's shared memory (bytes, and why whole); None before one."""
        return self._deltas.last

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
        return continuous.save(global_step, blocking, self._daemon.busy > 0, self._save, self._not_saved)

    def _not_saved(self, global_step: Any, reason: str) -> SaveTicket:
        """A continuous call that does not save: a skipped ticket, counted in `decisions`, not `counts`."""
        ticket = NotSavedTicket(global_step, self._name_of, SaveKind.TRAINING_CHECKPOINT, reason)
        self._last_ticket = ticket
        return ticket

    def _name_of(self, step: int) -> str:
        """`<ckpt_dir>/ckpt-<step>`; ValueError for a negative step."""
        try:
            return checkpoint_prefix(self._dir, step)
        except InvalidRequestError as e:
            raise ValueError(str(e)) from None

    def _save_pending(self) -> None:
        """Saves the last continuous call not saved (unless a save came after it), blocking: flush and close."""
        if self._continuous is None or self._daemon.closing:
            return
        global_step = self._continuous.take_pending()
        if global_step is None:
            return
        try:
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
        daemon.begin()
        handed_off = False
        try:
            step = int(np.asarray(global_step))
            export_dir = self._name_of(step)
            daemon.last_step = step
            ticket = daemon.ticket(export_dir, SaveKind.TRAINING_CHECKPOINT, step)
            self._last_ticket = ticket
            if not blocking and daemon.fail_fast(ticket):
                return ticket
            try:
                handed_off = self._save_now(ticket, blocking, on_notice)
            except CheckpointdError as e:
                if blocking or not survivable(e) or ticket.done():
                    raise
                return daemon.survive(ticket, e)
            return ticket
        finally:
            if not handed_off:
                daemon.release()

    def _save_now(self, ticket: SaveTicket, blocking: bool, on_notice: Notice | None = None) -> bool:
        """Asks the daemon, copies and uploads; True if an upload thread took the save over."""
        counter = self._checkpoint.save_counter
        counter.assign_add(1)  # as CheckpointManager.save does, before the write
        try:
            state = tf_checkpoint.describe(self._checkpoint)
            self._daemon.before_trying()
            # Not skipped without skip_if_busy: the daemon queues it behind this run's save in flight.
            stream, offer, base = self._decide(ticket, state, blocking or not self._skip_if_busy, on_notice=on_notice)
        except BaseException:
            counter.assign_sub(1)  # refused before a decision: nothing was saved
            raise
        self._daemon.answered()
        if ticket.skipped:
            counter.assign_sub(1)  # nothing was saved
            return False
        try:
            requests, spare, parts = self._copy(state, offer, base)
        except BaseException:
            stream.close()
            raise
        self._checkpoint_exists = True
        resend = self._resender(ticket, state, parts, on_notice) if base is not None else None
        if blocking:
            self._upload(stream, requests, ticket, state, spare, resend)
            ticket.result()
            return False
        self._daemon.uploads.submit(self._upload_then_release, stream, requests, ticket, state, spare, resend)
        return True

    def _decide(
        self,
        ticket: SaveTicket,
        state: tf_checkpoint.TrainingState,
        blocking: bool,
        incremental: bool = True,
        on_notice: Notice | None = None,
    ) -> tuple[SaveStream, pb.SharedMemory | None, pb.IncrementalBase | None]:
        """Opens the Save call and reads the decision; registers again once on NOT_FOUND.

        A save on notice is marked so, and its call ends by the notice's deadline.
        Returns the call, and the shared memory and base its accept offered.
        """
        header = pb.SaveHeader(
            run=self._run,
            kind=to_wire(SaveKind.TRAINING_CHECKPOINT),
            export_dir=self._dir,
            blocking=blocking,
            step=ticket.step,
            snapshot_bytes=state.nbytes,
            shared_memory=self._use_shm,
            training_checkpoint=state.to_proto(self._max_to_keep, self._keep_hours),
            incremental=self._incremental and incremental,
            on_notice=on_notice is not None,
            notice_unix_seconds=on_notice.unix_seconds if on_notice is not None else 0.0,
        )
        daemon = self._daemon
        timeout = daemon.timeout
        if on_notice is not None:
            left = time_left(on_notice.monotonic + self._notice_deadline) or 0.0
            timeout = left if timeout is None else min(timeout, left)

        def attempt() -> tuple[SaveStream, pb.SaveDecision]:
            stream = SaveStream(daemon.save_stub, header, timeout)
            try:
                return stream, stream.decision()
            except BaseException:
                stream.close()
                raise

        doing = f"saving run {self._run!r} step {ticket.step} to {ticket.export_dir!r}"
        stream, decision = daemon.retrying_lost_run(attempt, self._register, doing)
        if not decision.accepted:
            stream.skip(ticket, decision.reason, self._run)
        offer = decision.shared_memory if decision.HasField("shared_memory") else None
        return stream, offer, decision.base if decision.HasField("base") else None

    def _copy(
        self, state: tf_checkpoint.TrainingState, offer: pb.SharedMemory | None, base: pb.IncrementalBase | None
    ) -> tuple[Iterable[bytes], list[np.ndarray] | None, list[Any]]:
        """Copies the values now: into the offered segment, else into spare buffers.

        Returns the requests that complete the call, serialized (against
        `base`'s digests, if offered: computed as gRPC sends them, off the
        trainer's thread), the arrays the next save may reuse (None for a
        segment's), and the payload's parts ([] for a segment's).
        """
        if offer is not None and self._use_shm:
            with self._daemon.lock:
                current = self._segment
            segment = shm.open_offer(offer, current, self._run)
            if segment is not None and len(offer.offsets) == len(state.tensors) + 1:
                with self._daemon.lock:
                    self._segment = segment
                whole = segment.view()
                views = [whole[o : o + t.nbytes] for o, t in zip(offer.offsets, state.tensors, strict=False)]
                self._deltas.copy(self._checkpoint, state, segment, views)
                return [shm.WRITTEN], None, []
            self._use_shm = False  # the daemon is not on this host (or not this user's)
        with self._daemon.lock:
            spare, self._spare = self._spare, None
        buffers = spare[1] if spare is not None and spare[0] == state.layout else None
        if buffers is None:  # Python state needs none: it is bytes already
            buffers = [np.empty(0 if tf_checkpoint.is_string(t) else t.nbytes, np.uint8) for t in state.tensors]
        parts = list(state.copy([b.data for b in buffers]))
        if base is not None:
            return increments.save_requests(parts, base, self._daemon.chunk_bytes), buffers, parts
        return wire.save_request_chunks(parts, self._daemon.chunk_bytes), buffers, parts

    def _resender(
        self, ticket: SaveTicket, state: tf_checkpoint.TrainingState, parts: list[Any], on_notice: Notice | None
    ) -> Callable[[], tuple[SaveStream, Iterable[bytes]]]:
        """Opens the save again, blocking and not incremental, to send `parts` in full (see SaveStream.finish)."""

        def resend() -> tuple[SaveStream, Iterable[bytes]]:
            stream, _, _ = self._decide(ticket, state, blocking=True, incremental=False, on_notice=on_notice)
            return stream, wire.save_request_chunks(parts, self._daemon.chunk_bytes)

        return resend

    def _upload(
        self,
        stream: SaveStream,
        requests: Iterable[bytes],
        ticket: SaveTicket,
        state: tf_checkpoint.TrainingState,
        spare: list[np.ndarray] | None,
        resend: Callable[[], tuple[SaveStream, Iterable[bytes]]] | None = None,
    ) -> None:
        stream.finish(ticket, requests, self._run, resend=resend)
        if ticket.done() and ticket.exception(0) is None:
            with self._daemon.lock:
                self._durable_step = max(ticket.step, self._durable_step or 0)
                if spare is not None:  # gRPC has let go of every chunk: the next save may reuse them
                    self._spare = (state.layout, spare)

    def _upload_then_release(self, *args: Any) -> None:
        try:
            self._upload(*args)
        finally:
            self._daemon.release()

    # The save on notice (`checkpointd_client.notice` calls it at a safe point of the main thread).

    def _save_on_notice(self, on_notice: Notice) -> NoticeOutcome:
        """Saves the step reached as a save on notice and waits until it is durable, by the deadline; never raises.

        A save of that step already made by this checkpointer (in flight, or
        durable) is waited for instead of sending another.
        """
        deadline = on_notice.monotonic + self._notice_deadline
        step: int | None = None
        # The last continuous call not saved: saved now (its step, if no object names one).
        pending = self._continuous.take_pending() if self._continuous is not None else None
        try:
            # Eager even inside a tf.function's trace, and unseen by a gradient tape.
            with tf.init_scope():
                if self._step is None and pending is None:
                    return NoticeOutcome(
                        self._run, None, False,
                        lost="none of its objects is a step (global_step, train_step, step, or an agent's "
                        f"train_step_counter), which names a checkpoint; {self._lost(None)}",
                    )  # fmt: skip
                step = int(self._step.numpy() if self._step is not None else np.asarray(pending))
                last = self._last_ticket
                if last is not None and last.step == step and not last.skipped:
                    _wait_unlocked(last, deadline)
                    if last._error is None:  # noqa: SLF001 - read once ended, without the ticket's lock
                        return self._durable(step, on_notice)
                    # That one failed: the save on notice sends its own.
                ticket = self._save(step, True, on_notice)
                ticket.result(time_left(deadline))
        except Exception as e:  # noqa: BLE001 - the outcome reports it
            return NoticeOutcome(self._run, step, False, lost=f"{type(e).__name__}: {e}; {self._lost(step)}")
        return self._durable(step, on_notice)

    def _durable(self, step: int, on_notice: Notice) -> NoticeOutcome:
        return NoticeOutcome(self._run, step, True, durable_ms=(time.monotonic() - on_notice.monotonic) * 1000)

    def _lost(self, step: int | None) -> str:
        """What is not in a durable checkpoint if the save on notice is not made."""
        with self._daemon.lock:
            durable = self._durable_step
        if durable is None:
            return f"lost: every step (no durable checkpoint in {self._dir!r})"
        if step is None:
            return f"lost: the steps after step {durable}, the newest durable checkpoint"
        return f"lost: the {step - durable} step(s) after step {durable}, the newest durable checkpoint"

    # Registration and restore.

    def _register(self) -> None:
        header = pb.RegisterRunHeader(
            run=self._run, folder=self._folder, kind=to_wire(SaveKind.TRAINING_CHECKPOINT), checkpoint_dir=self._dir
        )
        self._daemon.register_run(iter([pb.RegisterRunRequest(header=header)]), f"registering run {self._run!r}")

    @client_call
    def _latest(self) -> Latest | None:
        """The newest checkpoint in this dir of the folder, whichever run committed it (as latest_checkpoint(dir))."""
        request = pb.LatestRequest(
            run=self._run, kind=to_wire(SaveKind.TRAINING_CHECKPOINT), folder=self._folder, checkpoint_dir=self._dir
        )
        with self._daemon.calling(f"looking up the newest checkpoint in {self._dir!r} of folder {self._folder!r}"):
            response = self._daemon.stub.GetLatest(request, timeout=self._daemon.timeout)
        return Latest(response) if response.found else None

    def _restore(self, export_dir: str) -> Any:
        children = {*self._objects, _SAVE_COUNTER}
        restored = checkpoint_restore.restore(self._daemon, self._checkpoint, children, export_dir, self._folder)
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
        self._daemon.flush(time_left(deadline), registered=not self._read_only)

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
        with self._daemon.lock:
            self._spare, self._segment = None, None

    def __enter__(self) -> RemoteCheckpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _wait_unlocked(ticket: SaveTicket, deadline: float) -> None:
    """Waits until `ticket` ends by looking, not on its lock: the notice may have interrupted a wait holding that lock.

    Raises:
        TimeoutError: it has not ended by `deadline` (monotonic).
    """
    while not ticket.done():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the save of step {ticket.step} in flight did not end by the notice's deadline")
        time.sleep(_NOTICE_POLL)


def _step_variable(objects: dict[str, Any]) -> tf.Variable | None:
    """The integer scalar variable that is the training step: by its name, else an agent's counter."""
    candidates = [objects.get(name) for name in _STEP_NAMES]
    candidates += [getattr(o, "train_step_counter", None) for o in objects.values()]
    for candidate in candidates:
        if isinstance(candidate, tf.Variable) and candidate.dtype.is_integer and candidate.shape.rank == 0:
            return candidate
    return None
