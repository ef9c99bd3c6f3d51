"""A training checkpoint's save: describe, the one save call, and the copy into the segment or reused buffers.

`RemoteCheckpointer` checks the call and owns the ticket; `TrainingSaves`
moves the save: it describes the `tf.train.Checkpoint` with TensorFlow's own
saver code (once, then checked at each save: `checkpointd_client.described_graph`), asks the daemon through `checkpointd_client.save_call`, and,
once accepted, copies the values into the daemon's shared-memory segment
(on its host) or into the buffers of the last uploaded snapshot of the same
layout, so the next save's memory is already touched. Either way only what
changed since the buffers' snapshot is copied (`checkpointd_client.delta`);
over gRPC, when the daemon's base is the save those buffers were uploaded
for, the chunks nothing wrote are sent as the base's without being summed
(`checkpointd.protocol.increments`).

Lock discipline: the session's lock guards `_spare`, `_segment` and
`_durable_step`, and is never held across an RPC or a TF call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from checkpointd.protocol import increments, wire
from checkpointd.protocol.errors import CheckpointdError, InvalidRequestError
from checkpointd.protocol.kinds import SaveKind, to_wire
from checkpointd.protocol.names import checkpoint_prefix
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client import delta, described_graph, standby, tf_checkpoint, trainer_versions
from checkpointd_client.daemon_cpu import DaemonCpu, ThreadCpu, idle_seconds
from checkpointd_client.local_decision import Held, LocalDecision
from checkpointd_client.notice import Notice
from checkpointd_client.save_call import WRITTEN, Decision, Payload, SaveCall, Upload
from checkpointd_client.ticket import SaveResult, SaveTicket
from checkpointd_client.transport import shm
from checkpointd_client.transport.session import DaemonSession, LocalSkips

_LOGGER = logging.getLogger(__name__)
# The objects whose value is the step a save on notice is named by, as TF-Agents names them.
_STEP_NAMES = ("global_step", "train_step", "step")
_NOTICE_POLL = 0.005  # seconds between looks at the save in flight that a save on notice waits for


class TrainingSaves:
    """How a RemoteCheckpointer's accepted save moves (see the module docstring)."""

    def __init__(
        self,
        daemon: DaemonSession,
        checkpoint: tf.train.Checkpoint,
        where: tuple[str, str],
        retention: tuple[int | None, float | None],
        *,
        shared_memory: bool,
        incremental: bool,
    ) -> None:
        """Saves of `checkpoint` on the run of `daemon`.

        Args:
            where: (folder, ckpt_dir): the job's folder and the dir in it.
            retention: (max_to_keep, keep_checkpoint_every_n_hours), as the wire carries them.
        """
        self._daemon = daemon
        self._checkpoint = checkpoint
        self.described = described_graph.DescribedGraph(checkpoint)  # described once, checked at each save
        self._folder, self._dir = where
        self._retention = retention
        self._use_shm = shared_memory
        self._incremental = incremental
        self._segment: shm.SegmentMap | None = None
        self.deltas = delta.SegmentDeltas(daemon.run, checkpoint)  # what a save copies into the segment
        # The buffers of the last snapshot uploaded and durable, reused by the next one of that layout.
        self._spare: _Spare | None = None
        self.last_sent: increments.Sent | None = None  # what the last incremental upload over gRPC sent
        self._durable_step: int | None = None  # of the dir's newest checkpoint known durable
        self._daemon_cpu: tuple[str, DaemonCpu | None] | None = None  # (segment folder, the daemon's CPU there)
        # Told, once a save is durable, the CPU it cost off the training thread: the requests'
        # production and (on this host) the daemon's work. A continuous checkpointer's budget.
        self.charge: Callable[[float], None] | None = None
        self.copied = False  # a save's values were copied (a checkpoint exists, or soon will)
        # Once a save was accepted into shared memory with the run's busy lock, the next non-blocking
        # ones of that layout are decided here, without the decision's round trip on the trainer's
        # thread (`checkpointd_client.local_decision`).
        self.local_skips = LocalSkips()  # skipped under the busy lock, not yet reported
        self._local = LocalDecision(daemon, self.local_skips, incremental=incremental)
        self._layout: tuple[Any, ...] | None = None  # the layout the busy lock's path was adopted for
        self._offsets: tuple[int, ...] = ()  # its tensors' offsets in the segment
        self._standby: standby.StandbySlots | None = None  # a continuous checkpointer's hand-over slots
        self._standby_off = False  # they could not be made or watched: not tried again

    @property
    def durable_step(self) -> int | None:
        """The step of the dir's newest checkpoint known durable, or None."""
        with self._daemon.lock:
            return self._durable_step

    def register(self) -> None:
        """Registers the run: this folder's dir, for training checkpoints."""
        run = self._daemon.run
        kind = to_wire(SaveKind.TRAINING_CHECKPOINT)
        header = pb.RegisterRunHeader(run=run, folder=self._folder, kind=kind, checkpoint_dir=self._dir)
        self._daemon.register_run(iter([pb.RegisterRunRequest(header=header)]), f"registering run {run!r}")

    def lost(self, step: int | None) -> str:
        """What is not in a durable checkpoint if the save on notice of `step` is not made."""
        durable = self.durable_step
        if durable is None:
            return f"lost: every step (no durable checkpoint in {self._dir!r})"
        if step is None:
            return f"lost: the steps after step {durable}, the newest durable checkpoint"
        return f"lost: the {step - durable} step(s) after step {durable}, the newest durable checkpoint"

    def durable(self, step: int) -> None:
        """Records that a checkpoint of `step` is durable (restored, or saved)."""
        with self._daemon.lock:
            self._durable_step = max(step, self._durable_step or 0)

    def save(self, ticket: SaveTicket, blocking: bool, skip_if_busy: bool, notice: Notice | None,
             deadline: float | None) -> bool:  # fmt: skip
        """Asks the daemon, copies and uploads; True if an upload thread took the save over.

        `notice`, `deadline`: a save on notice, ended by the notice's deadline.
        """
        counter = self._checkpoint.save_counter
        counter.assign_add(1)  # as CheckpointManager.save does, before the write
        try:
            state = self.described.describe()
            self._daemon.before_trying()
            payload = Payload(self._dir, state.nbytes, training_checkpoint=state.to_proto(*self._retention))
            call = SaveCall(
                self._daemon, ticket, lambda: payload, shared_memory=self._use_shm, incremental=self._incremental,
                register_again=self.register, notice=notice, deadline=deadline, local_skips=self.local_skips,
            )  # fmt: skip
            held = None
            if not blocking and skip_if_busy and notice is None and self._local.ready:
                held = self._local.hold(self._same_layout(state.layout), state.nbytes)
                if isinstance(held, str):
                    self._local.skip(ticket, held)
            # Not skipped without skip_if_busy: the daemon queues it behind this run's save in flight.
            decision = call.decide(blocking or not skip_if_busy) if held is None else None
        except BaseException:
            counter.assign_sub(1)  # refused before a decision: nothing was saved
            raise
        if ticket.skipped:
            counter.assign_sub(1)  # nothing was saved
            return False
        if isinstance(held, Held):
            self._send_held(held, state, ticket, call)
            return True
        assert decision is not None
        return call.send(decision, blocking, lambda d: self._copy(state, ticket, d, call))

    def hand_over(self, step: int) -> bool:
        """Hands the state at `step` over as a standby snapshot (`checkpointd_client.standby`); False if it cannot.

        It cannot before a save was accepted into this host's shared memory
        (the slots go in that daemon's folder), nor once it failed for good
        (the memory full, a daemon without WatchStandby), which is logged once.
        """
        with self._daemon.lock:
            segment = self._segment
        if segment is None or not self.standby_ready:
            return False
        counter = self._checkpoint.save_counter
        counter.assign_add(1)  # the snapshot holds what the save would: the counter one on
        try:
            state = self.described.describe()
            header = pb.SaveHeader(
                run=self._daemon.run, kind=to_wire(SaveKind.TRAINING_CHECKPOINT), export_dir=self._dir,
                blocking=True, step=step, snapshot_bytes=state.nbytes,
                training_checkpoint=state.to_proto(*self._retention), trainer_versions=trainer_versions.versions(),
            ).SerializeToString()  # fmt: skip
            slots = self._slots_for(segment.path.rsplit("/", 1)[0], state, header)
            if slots is None:
                return False
            slots.hand_over(self._checkpoint, state, header)
            return True
        except Exception as e:  # noqa: BLE001 - a hand-over never stops training: durable saves go on
            self._no_standby(f"a hand-over failed ({type(e).__name__}: {e})")
            return False
        finally:
            counter.assign_sub(1)

    @property
    def standby_ready(self) -> bool:
        """Whether a hand-over may be made: a save went through this host's shared memory, and none failed for good."""
        return self._segment is not None and self._use_shm and not self._standby_off

    def _slots_for(self, folder: str, state: tf_checkpoint.TrainingState, header: bytes) -> standby.StandbySlots | None:
        """This layout's slots in `folder`, made and watched if need be; None if they cannot be (logged once)."""
        sizes = [t.nbytes for t in state.tensors] + [0]
        slots = self._standby
        if slots is not None and slots.fits(folder, sizes, header):
            return slots
        self._drop_standby()
        try:
            slots = standby.StandbySlots(self._daemon.run, folder, sizes, len(header), self._checkpoint)
        except OSError as e:
            self._no_standby(f"its slots cannot be made in {folder} ({e.strerror or e})")
            return None
        try:
            self._daemon.watch_standby(slots.paths)
        except CheckpointdError as e:
            slots.close()
            self._no_standby(f"the daemon does not watch them ({e})")
            return None
        self._standby = slots
        return slots

    def _no_standby(self, why: str) -> None:
        self._standby_off = True
        _LOGGER.warning(
            "run %s: no standby snapshots between durable saves: %s; a SIGKILL loses the time since the last "
            "durable save", self._daemon.run, why,
        )  # fmt: skip

    def _send_held(self, held: Held, state: tf_checkpoint.TrainingState, ticket: SaveTicket, call: SaveCall) -> None:
        """Copies into the segment under the busy lock taken here, and queues the call on an upload thread."""
        try:
            views, upload = self._into_segment(held.path.segment, self._offsets, state, ticket, call, None)
            size = self._daemon.chunk_bytes
            self._local.send(held, call, lambda: wire.save_request_chunks(views, size), upload.durable)
        except BaseException:
            self._local.unlock(held)
            raise

    def _into_segment(
        self, segment: shm.SegmentMap, offsets: Sequence[int], state: tf_checkpoint.TrainingState,
        ticket: SaveTicket, call: SaveCall, parts: list[Any] | None,
    ) -> tuple[list[memoryview], Upload]:  # fmt: skip
        """Copies `state` into `segment` at `offsets` (what changed since its last snapshot); its views and upload."""
        whole = segment.view()
        views = [whole[o : o + t.nbytes] for o, t in zip(offsets, state.tensors, strict=False)]
        daemon_cpu = self._cpu_of(segment.path) if self.charge is not None else None
        started = (daemon_cpu.seconds(), idle_seconds()) if daemon_cpu is not None else None
        self.deltas.copy(self._checkpoint, state, segment, views)
        self.copied = True
        return views, self._upload([WRITTEN], ticket, call, state, None, parts, (daemon_cpu, started))

    def _same_layout(self, layout: tuple[Any, ...]) -> tuple[Any, ...]:
        """The layout the busy lock's path was adopted for, if `layout` equals it (the path compares identity)."""
        with self._daemon.lock:
            return self._layout if self._layout is not None and self._layout == layout else layout

    def _copy(
        self, state: tf_checkpoint.TrainingState, ticket: SaveTicket, decision: Decision, call: SaveCall
    ) -> Upload:
        """Copies the values now: into the offered segment, else into spare buffers.

        Requests over gRPC are serialized against the base's digests, if
        offered: computed as gRPC sends them, off the trainer's thread.
        """
        offer, base = decision.offer, decision.base
        if offer is not None and self._use_shm:
            with self._daemon.lock:
                current = self._segment
            segment = shm.open_offer(offer, current, self._daemon.run)
            if segment is not None and len(offer.offsets) == len(state.tensors) + 1:
                with self._daemon.lock:
                    self._segment = segment
                _, upload = self._into_segment(
                    segment, offer.offsets, state, ticket, call, [] if base is not None else None
                )
                layout = self._same_layout(state.layout)
                with self._daemon.lock:
                    self._layout, self._offsets = layout, tuple(offer.offsets)
                self._local.adopt(segment, offer, layout, state.nbytes)
                return upload
            self._use_shm = False  # the daemon is not on this host (or not this user's)
        with self._daemon.lock:  # no segment now (a daemon elsewhere, or out of room): no hand-overs either
            spare, self._spare, self._segment = self._spare, None, None
        self._drop_standby()
        if spare is None or spare.layout != state.layout:  # Python state needs none: it is bytes already
            spare = _Spare(state.layout, [np.empty(0 if tf_checkpoint.is_string(t) else t.nbytes, np.uint8) for t in state.tensors])  # fmt: skip
        held, spare.export_dir = spare.export_dir, None  # the save whose snapshot the buffers hold, until this copy
        parts = self.deltas.copy_parts(self._checkpoint, state, spare, [b.data for b in spare.buffers], strings=False)
        self.copied = True
        size = self._daemon.chunk_bytes
        if base is not None:
            copied = self.deltas.last
            # The base is the save the buffers held: what this copy did not write is the base's bytes.
            written = copied.written if copied is not None and held == base.export_dir and copied.written else None
            self.last_sent = sent = increments.Sent()
            requests = increments.save_requests(parts, base, size, sent, written)
            return self._upload(requests, ticket, call, state, spare, parts)
        return self._upload(wire.save_request_chunks(parts, size), ticket, call, state, spare, None)

    def _upload(
        self, requests: Any, ticket: SaveTicket, call: SaveCall, state: tf_checkpoint.TrainingState,
        spare: _Spare | None, parts: list[Any] | None,
        daemon_cpu: tuple[DaemonCpu | None, tuple[float | None, float | None] | None] = (None, None),
    ) -> Upload:  # fmt: skip
        """The upload of `requests`; `parts` sent again whole after DATA_LOSS (an incremental save's).

        `daemon_cpu`: the same-host daemon's CPU meter and (its CPU, the machine's idle CPU) at the
        accept: once durable, the daemon's CPU since, less the idle CPU since, is charged.
        """
        size = self._daemon.chunk_bytes
        charge, produced = self.charge, ThreadCpu()
        if charge is not None:
            requests = produced.timed(requests)

        def durable(result: SaveResult) -> None:
            with self._daemon.lock:
                self._durable_step = max(ticket.step, self._durable_step or 0)
                if spare is not None:  # gRPC has let go of every chunk: the next save may reuse them
                    spare.export_dir = ticket.export_dir
                    self._spare = spare
            if charge is not None:  # on the upload thread: its CPU for this save so far counts too
                charge(produced.seconds + call.upload_cpu() + _taken(*daemon_cpu))

        whole = (lambda: wire.save_request_chunks(parts, size)) if parts is not None else None
        return Upload(requests, whole, durable)

    def _cpu_of(self, segment_path: str) -> DaemonCpu | None:
        """The CPU meter of the daemon that made the segment (looked up once per daemon folder)."""
        folder = segment_path.rsplit("/", 1)[0]
        cached = self._daemon_cpu
        if cached is None or cached[0] != folder:
            cached = self._daemon_cpu = (folder, DaemonCpu.of_segment(segment_path))
        return cached[1]

    def release(self) -> None:
        """Drops the spare snapshot buffers and unmaps the segment: no save follows, and each holds the state's bytes."""
        with self._daemon.lock:
            self._spare, self._segment = None, None
        self._local.close()
        self._drop_standby()

    def _drop_standby(self) -> None:
        slots, self._standby = self._standby, None
        if slots is not None:
            slots.close()


class _Spare:
    """A gRPC upload's snapshot buffers; once its save is durable, `export_dir` names it (its bytes are theirs)."""

    def __init__(self, layout: tuple[Any, ...], buffers: list[np.ndarray]) -> None:
        self.layout = layout
        self.buffers = buffers
        self.export_dir: str | None = None


def _taken(meter: DaemonCpu | None, started: tuple[float | None, float | None] | None) -> float:
    """The daemon's CPU since `started` that idle cores could not have run (see `checkpointd_client.daemon_cpu`)."""
    if meter is None or started is None:
        return 0.0
    (cpu, idle), cpu_now, idle_now = started, meter.seconds(), idle_seconds()
    if cpu is None or cpu_now is None:
        return 0.0
    spare = idle_now - idle if idle is not None and idle_now is not None else 0.0
    return max(0.0, cpu_now - cpu - spare)


def checkpoint_name(ckpt_dir: str, step: int) -> str:
    """`<ckpt_dir>/ckpt-<step>`; ValueError for a negative step."""
    try:
        return checkpoint_prefix(ckpt_dir, step)
    except InvalidRequestError as e:
        raise ValueError(str(e)) from None


def step_variable(objects: dict[str, Any]) -> tf.Variable | None:
    """The integer scalar variable that is the training step: by its name, else an agent's counter."""
    candidates = [objects.get(name) for name in _STEP_NAMES]
    candidates += [getattr(o, "train_step_counter", None) for o in objects.values()]
    for candidate in candidates:
        if isinstance(candidate, tf.Variable) and candidate.dtype.is_integer and candidate.shape.rank == 0:
            return candidate
    return None


def wait_unlocked(ticket: SaveTicket, deadline: float) -> None:
    """Waits until `ticket` ends by looking, not on its lock: the notice may have interrupted a wait holding that lock.

    Raises:
        TimeoutError: it has not ended by `deadline` (monotonic).
    """
    while not ticket.done():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the save of step {ticket.step} in flight did not end by the notice's deadline")
        time.sleep(_NOTICE_POLL)
