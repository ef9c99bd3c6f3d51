"""The save pipeline: admit → decide → receive → write → commit → retain, without gRPC.

`SavePipeline.save` is the whole life of one save request. It checks the
request against the run's manifest (bad input is refused before a decision,
counted as nothing and writes nothing), reserves its bytes in the upload
budget, asks the run's lane (accept, queue or skip), and for an accepted save
opens its files with the kind's `SaveFormat` in the `Store`'s staging, has
the caller's `Receiver` write the snapshot into them as it arrives
(`checkpointd.saves.writes`), finishes and commits them (manifest last) at
the writer pool's priority (on the receiving thread once it writes there, so
a save needs no hand-off between its last byte and its commit) and queues
retention. Every accepted save ends in the lane as written or failed, and
its error reaches the caller.

When daemons share a store (a fleet on one bucket), a run is written by the
one holding its lease (`Leases`): registration takes it before the template
is stored, waiting for another daemon's to be released or to expire within
the call's deadline; a save confirms it before the lane decides (free while
held: no request), and the store fences the commit with it; closing the run
releases it. A run held elsewhere is refused with RunHeldError (ABORTED).

On the daemon's host a trainer may skip the decision's round trip: it takes
the run's busy lock itself (`checkpointd.transport.shm`, `checkpointd.saves.runs`),
copies into the run's segment and sends a trainer-decided request (`held`
on the wire, `TrainerDecided` here), which is checked
like any other and then started on the idle lane without a decision; the
saves it skipped on its own (the lock was taken) arrive as `local_skips` on
its next request or Flush and are counted and logged like the daemon's own.

The RPC layer (`checkpointd.rpc.servicer`) only translates: it decodes the
header into a `SaveRequest`, hands over a `Receiver` that reads the request
stream, and encodes the `Decision` and `Result` this yields.

A run's registration is `checkpointd.saves.register_run`; an incremental save's base
and path, `checkpointd.saves.incremental_choice`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from checkpointd.core.config import ServeConfig
from checkpointd.core.incremental_path import IncrementalPath, PathChooser
from checkpointd.core.lane import Cancelled, Failed, SaveSpec, Skipped, Ticket, Written
from checkpointd.core.ports import (
    BoundedRequests,
    CommittedSave,
    Leases,
    NoLeases,
    NullPhases,
    PhaseSink,
    SaveMeta,
    SaveSink,
    SegmentLayouts,
    Store,
)
from checkpointd.core.variable_manifest import Manifest, VariableSpec
from checkpointd.protocol.errors import (
    RunNotFoundError,
)
from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.names import check_run_name
from checkpointd.saves import admission, bases, incremental_choice, register_run, writes
from checkpointd.saves.budget import UploadBudget
from checkpointd.saves.checkpoint_dirs import directory_of
from checkpointd.saves.kinds import Formats, own_spec
from checkpointd.saves.outcomes import log_outcome, notice_outcome
from checkpointd.saves.pool import WriterPool
from checkpointd.saves.requests import Decision, LocalSkip, Receiver, Result, SaveRequest, TrainerDecided
from checkpointd.saves.retention import Retainer
from checkpointd.saves.runs import Lanes, TrainerDecidedError
from checkpointd.saves.sinks import AtWriterPriority
from checkpointd.saves.skip_log import SkipLog
from checkpointd.transport.shm import RunLock, SharedMemory

# The request and answer types are defined with the Save call's other values; importable from here too.
__all__ = ["Decision", "Formats", "LocalSkip", "Receiver", "Result", "SavePipeline", "SaveRequest"]

_LOGGER = logging.getLogger(__name__)
_LOCAL_REASON = "skipped by the trainer: another save of the run was in flight (its busy lock was taken)"


class SavePipeline:
    """Registers runs and carries their saves from request to commit. Thread-safe."""

    def __init__(
        self,
        config: ServeConfig,
        lanes: Lanes,
        store: Store,
        formats: Formats,
        pool: WriterPool,
        *,
        budget: UploadBudget,
        retention: Retainer,
        shared_memory: SharedMemory | None = None,
        phases: PhaseSink | None = None,
        leases: Leases | None = None,
        paths: PathChooser | None = None,
    ) -> None:
        self._config = config
        self.lanes = lanes
        self.store = store
        self.formats = formats
        self._pool = pool
        self._budget = budget
        self.retention = retention
        self._shm = shared_memory
        # The same segments' folder stages RestoreFiles for clients on this host.
        self.shared_memory = shared_memory
        self._phases = phases if phases is not None else NullPhases()
        # Who writes each run when daemons share the store; NoLeases: this daemon alone.
        self.leases: Leases = leases if leases is not None else NoLeases()
        # A run's first skip at WARNING, later ones at DEBUG with a periodic count.
        self._skips = SkipLog(_LOGGER)
        # The kinds each registered run takes: its registering format's.
        self._run_kinds: dict[str, tuple[SaveKind, ...]] = {}
        self._incremental = incremental_choice.IncrementalChoice(store, paths)  # each incremental save's base and path

    @property
    def upload_timeout(self) -> float:
        """Seconds an accepted save's upload may take (--upload-timeout)."""
        return self._config.upload_timeout_seconds

    # Registration.

    def register(
        self,
        run: str,
        folder: str,
        variables: Sequence[VariableSpec],
        checkpoint_object_graph: bytes,
        template_bytes: int,
        receive_template: Callable[[], Path],
        kind: SaveKind | None = None,
        timeout: float | None = None,
        on_lease_wait: Callable[[str], None] | None = None,
        checkpoint_dir: str | None = None,
    ) -> Manifest:
        """Registers (or re-registers) a run from its uploaded policy template (`checkpointd.saves.register_run`)."""
        return register_run.register(
            self._config, self.formats, self.lanes, self.leases, self._skips, self._run_kinds, run, folder, variables,
            checkpoint_object_graph, template_bytes, receive_template, kind, timeout, on_lease_wait, checkpoint_dir,
        )  # fmt: skip

    def _bounded(self, deadline: float | None) -> contextlib.AbstractContextManager[None]:
        """The store's requests in the block bounded by `deadline`, where it can bound them."""
        store = self.store
        return store.bounded(deadline) if isinstance(store, BoundedRequests) else contextlib.nullcontext()

    def folder(self, run: str, asked: str = "") -> str:
        """The folder to search: the one asked for, else the registered one, else the run's name."""
        if asked:
            return admission.check_folder(asked)
        try:
            return self.lanes.folder(run)
        except RunNotFoundError:
            return run  # not registered (yet, or since a restart): its default folder

    def active_checkpoints(self, folder: str, save: CommittedSave | None) -> list[CommittedSave]:
        """A training checkpoint's dir's active set (oldest first); [] for other saves."""
        dirs = self.retention.checkpoints
        if save is None or not save.prefix or save.kind is not SaveKind.TRAINING_CHECKPOINT or dirs is None:
            return []
        return dirs.active(folder, directory_of(save.export_dir))

    # Saving.

    def save(
        self,
        request: SaveRequest,
        receive: Receiver,
        *,
        timeout: float | None = None,
        is_active: Callable[[], bool] = lambda: True,
    ) -> Iterator[Decision | Result]:
        """One save: yields its Decision, then (if accepted) its Result.

        Args:
            request: the decoded header.
            receive: reads the snapshot once the save is accepted.
            timeout: seconds a blocking save may wait for the in-flight one
                (the call's remaining deadline).
            is_active: False once the caller has gone away.

        Raises:
            Before the decision (nothing counted or written): InvalidRequestError,
            RunNotFoundError, RunClosedError, UnavailableError, LimitExceededError,
            DeadlineError, RunHeldError (another daemon holds the run). After an accept (the save counts as failed): the
            Receiver's errors, SaveFailedError.
        """
        called = time.monotonic()
        run = check_run_name(request.run)
        manifest = self.lanes.manifest(run)
        folder = self.lanes.folder(run)
        self.count_local_skips(run, request.local_skips)  # counted even if this save is refused
        self.store.target(folder, request.export_dir)  # refuses a bad export dir now
        fmt = self.formats(request.kind)
        admission.check_kind(run, self._run_kinds.get(run, fmt.kinds), request.kind)
        if request.kind is SaveKind.TRAINING_CHECKPOINT:
            admission.check_claimed_dir(run, self.lanes.claim(run), request.export_dir)
            with self._bounded(_store_deadline(called, timeout)):  # a stalled store: UNAVAILABLE within the call
                admission.refuse_replacing_another_runs(self.store, run, folder, request.export_dir)
        fmt.check(
            manifest, request.variables, request.snapshot_bytes, request.numpy_state,
            self._config.max_snapshot_bytes, **own_spec(request.checkpoint),
        )  # fmt: skip
        # This daemon writes the run only while it holds its lease (no request
        # while it does); held elsewhere: refused before anything is counted.
        # A run's lock is made by its first save that may use shared memory:
        # until a trainer has been offered it, nobody else can hold it.
        lock = (
            self._trainer_decided_lock(run, request.trainer_decided)
            if request.trainer_decided is not None
            else self._lock(run, request.shared_memory)
        )
        self.leases.hold(run, None)
        # Reserved before the lane decides: at a limit the request waits in line
        # for room within its call's deadline, then is refused like bad input,
        # before anything is allocated or counted.
        with self._budget.reserve(request.snapshot_bytes, run, _store_deadline(called, timeout)) as release:
            spec = SaveSpec(request.kind, request.export_dir, request.blocking, request.step, request.on_notice)
            asked = time.monotonic()
            decision = self.lanes.begin(
                run,
                spec,
                timeout=timeout,
                is_active=is_active,
                lock=lock,
                trainer_decided=request.trainer_decided is not None,
            )
            if isinstance(decision, Skipped):
                self._skips.skipped(run, request.kind.value, request.export_dir, request.step, decision.reason)
                yield Decision(accepted=False, reason=decision.reason)
                return
            self._phases.observe_phase(request.kind.value, "queue", time.monotonic() - asked)
            deadline = _store_deadline(called, timeout)
            yield from self._accepted(request, run, folder, manifest, decision, receive, release, is_active, deadline)

    def count_local_skips(self, run: str, skips: Sequence[LocalSkip]) -> None:
        """Counts and logs saves of `run` its trainer skipped on its own.

        Raises:
            RunNotFoundError: the run is not registered.
        """
        if not skips:
            return
        self.lanes.skipped_elsewhere(run, [skip.kind for skip in skips])
        for skip in skips:
            self._skips.skipped(run, skip.kind.value, skip.export_dir, skip.step, _LOCAL_REASON)

    def _lock(self, run: str, make: bool = True) -> RunLock | None:
        return self._shm.lock(run, make=make) if self._shm is not None else None

    def _trainer_decided_lock(self, run: str, held: TrainerDecided) -> RunLock:
        """The run's busy lock, if it is the one a trainer-decided request names; else TrainerDecidedError."""
        lock = self._lock(run)
        if lock is None or str(lock.path) != held.lock_path:
            raise TrainerDecidedError(
                f"run {run!r}: the save holds the busy lock {held.lock_path!r}, which is not this "
                f"daemon's for the run ({'none: it has no shared memory' if lock is None else str(lock.path)}); "
                "nothing was written. Send the save without `held`: the daemon then decides it"
            )
        return lock

    def _accepted(
        self,
        request: SaveRequest,
        run: str,
        folder: str,
        manifest: Manifest,
        ticket: Ticket,
        receive: Receiver,
        release: Callable[[], None],
        is_active: Callable[[], bool],
        deadline: float | None,
    ) -> Iterator[Decision | Result]:
        kind = request.kind.value
        accepted = time.monotonic()
        # Until it is written or fails: the caller stopped reading (gRPC closed this generator).
        outcome: Written | Failed | Cancelled = Cancelled("the client went away during the save")
        transport = "none"  # until the snapshot has arrived
        segment = None
        base: bases.OpenBase | None = None
        chosen: IncrementalPath | None = None  # an incremental save's path
        alike = ""  # the saves whose costs compare with this one's
        try:
            if request.checkpoint is not None:  # one part per tensor, no tail
                parts = [t.nbytes for t in request.checkpoint.tensors] + [0]
            else:
                parts = [v.nbytes for v in manifest.variables]
                parts.append(request.snapshot_bytes - manifest.nbytes)  # the numpy state
            lock_path = ""
            fmt = self.formats(request.kind)
            layout = None
            if request.shared_memory and self._shm is not None:
                # A format that can write its data file from an image of it (O_DIRECT) lays the segment out so.
                layout = (
                    fmt.segment_layout(parts, **own_spec(request.checkpoint))
                    if isinstance(fmt, SegmentLayouts)
                    else None
                )
                segment = self._shm.segment(run, parts, layout)  # safe: this save holds the lane
                if (
                    segment is not None
                    and request.trainer_decided is not None
                    and str(segment.path) != request.trainer_decided.segment_path
                ):
                    self._shm.release(run)  # the trainer wrote another (older) segment: it sends chunks
                    segment = None
                lock = self._shm.lock(run)
                lock_path = str(lock.path) if lock is not None and segment is not None else ""
            incremental = request.incremental and bases.worth_a_base(parts)
            alike = incremental_choice.alike(request, segment is not None)
            if incremental:  # through shared memory too: the daemon compares the chunks itself
                image = segment is not None and layout is not None
                base, chosen = self._incremental.open(
                    self.store, folder, request, manifest.variables, alike, image=image
                )
            meta = SaveMeta(run, request.kind, request.step, request.export_dir, request.trainer_versions, deadline)
            # The save's files are open before the accept is answered, and are
            # written as the chunks land; no deletions in the folder meanwhile.
            # Its place is bound there: a path changed after the accept is never
            # followed (the Store holds the dirs open).
            decision = Decision(
                accepted=True,
                segment=segment,
                lock_path=lock_path,
                base=incremental_choice.offer(base) if segment is None else None,
            )
            with contextlib.ExitStack() as opened:
                try:
                    opened.enter_context(self.retention.holding(folder))
                    save = opened.enter_context(
                        writes.streamed(
                            self.store, fmt, meta, manifest, self.store.target(folder, request.export_dir), parts,
                            request.numpy_state, request.checkpoint, gone=lambda: not is_active(),
                        )
                    )  # fmt: skip
                except Exception:
                    yield decision  # accepted, and failed: the caller hears it as the save's result
                    raise
                yield decision
                # A phase is timed when it ends, failed or not, as save_duration is.
                transferred = _Once(lambda: self._phases.observe_phase(kind, "transfer", time.monotonic() - accepted))
                at_priority = AtWriterPriority(save.sink, self._pool)
                incremental_sink = None if base is None else bases.Incremental(at_priority, base, parts)
                sink: SaveSink = at_priority if incremental_sink is None else incremental_sink

                def commit(came_by: str) -> tuple[str, int]:
                    """The received save's commit, on the thread that wrote it (already at writer priority: no hop)."""
                    nonlocal transport
                    transport = came_by
                    try:
                        if base is not None and incremental_sink is not None:
                            incremental_sink.settle()
                            base.check()  # the copied ranges were the bytes its digests describe
                        self._phases.snapshot_received(kind, came_by)
                    finally:
                        transferred()
                    writing = time.monotonic()
                    try:
                        return self._pool.run(lambda: self._commit(request, folder, save))
                    finally:
                        self._phases.observe_phase(kind, "write", time.monotonic() - writing)

                try:
                    path, bytes_written = receive(parts, segment, accepted + self.upload_timeout, sink, commit)
                finally:
                    transferred()
            copied = base.copied if base is not None else 0
            outcome = Written(path, bytes_written, request.snapshot_bytes - copied, copied)
            self._incremental.written(self.store, folder, request, incremental)
            self._phases.payload_bytes(kind, request.snapshot_bytes - copied, copied)
            if request.checkpoint is not None:
                self.retention.after_checkpoint(folder, directory_of(request.export_dir), request.checkpoint.retention)
            else:
                self.retention.after_save(run, folder)
        except Exception as exc:
            # A caller gone (Ctrl-C, a cancelled call) breaks the receive: that is no write failure.
            error = str(exc) or type(exc).__name__
            outcome = Failed(error) if is_active() else Cancelled(f"the client went away during the save ({error})")
            raise
        finally:
            if base is not None:
                base.close()
            if segment is not None and self._shm is not None:
                self._shm.release(run)  # idle again: may give way to another run's
            release()  # before the caller hears the result, so its next save fits
            self.lanes.finish(run, ticket, outcome)
            seconds = time.time() - (ticket.accepted_at or time.time())
            log_outcome(request, run, outcome, seconds, transport)
            if request.on_notice:
                self._phases.preemption_save(*notice_outcome(request, outcome))
        assert isinstance(outcome, Written)
        self._incremental.observed(alike, seconds, outcome.bytes_received, outcome.bytes_copied)
        if chosen is not None:
            self._phases.incremental_path(kind, chosen.value)
        yield Result(
            outcome.path, outcome.bytes_written, seconds, request.step, request.kind,
            bytes_received=outcome.bytes_received, bytes_copied=outcome.bytes_copied,
            incremental_path=chosen.value if chosen is not None else "",
        )  # fmt: skip

    def _commit(self, request: SaveRequest, folder: str, save: writes.StreamedSave) -> tuple[str, int]:
        """Finishes and commits one received save, at the writer pool's priority; returns (path, bytes)."""
        # Again at commit time: a symlink planted during the upload must not
        # redirect the save out of the run's folder.
        target = self.store.target(folder, request.export_dir)
        dirs = self.retention.checkpoints if request.checkpoint is not None else None
        if dirs is not None:
            dirs.replacing(folder, request.export_dir)  # the state file lets go of an old one first
        written = save.commit(target)
        if dirs is not None:
            try:  # the state file names it once committed; it is derived from the manifests, and rewritten whole
                dirs.committed(folder, request.export_dir)
            except Exception as e:  # the save is committed: it is durable, and the caller is told so
                _LOGGER.warning(
                    "committed %s of %s, but its dir's checkpoint state file was not updated (%s); the dir's "
                    "next checkpoint writes it again from the committed saves",
                    request.export_dir, folder, e,
                )  # fmt: skip
        return self.store.location(target), written

    # Closing.

    def close_run(self, run: str, timeout: float | None) -> None:
        """Refuses new saves on the run, waits for its lane to end, frees its segment."""
        run = check_run_name(run)
        self.lanes.close(run, timeout)
        if self._shm is not None:
            self._shm.drop(run)
            self.lanes.forget_lock(run)
            self._shm.drop_lock(run)  # its trainers' next saves ask, and hear the run is closed
        # Retention of its last saves (under the lease, on a shared store) ends
        # before the close returns: the dir is then as CheckpointManager leaves it.
        self.retention.wait_idle()
        self.leases.release(run)  # another daemon may take the run at once
        _LOGGER.info("closed run=%s", run)


class _Once:
    """Calls `action` the first time it is called, and never again."""

    def __init__(self, action: Callable[[], None]) -> None:
        self._action: Callable[[], None] | None = action

    def __call__(self) -> None:
        action, self._action = self._action, None
        if action is not None:
            action()


def _store_deadline(started: float, timeout: float | None) -> float | None:
    """When the store stops retrying a save: the call's deadline less a reserve, so its answer arrives in time."""
    if timeout is None or timeout >= threading.TIMEOUT_MAX:  # gRPC reports no deadline as ~292 years
        return None
    return started + timeout - min(1.0, 0.2 * timeout)
