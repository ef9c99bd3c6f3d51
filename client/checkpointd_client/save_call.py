"""The one save call: header, decide, retry, upload, resend. Every drop-in saves through it.

A save is one `Save` RPC. Its header says where the save goes and what it
carries (`Payload`); the daemon's first answer is the decision (accepted,
possibly into its shared memory or against an incremental base, or
skipped). A daemon that lost the run (NOT_FOUND: it restarted) gets the
run registered again once and the header sent again. An accepted save's
values are copied by the drop-in (`copy`, while save() still holds the
values of the call), then uploaded, on the calling thread for a blocking
save and on the session's upload threads otherwise. An incremental save
whose base changed under it (DATA_LOSS) is opened again, blocking and
whole, and sent with every byte.

RemoteCheckpointer (`training_saves`) and RemotePolicySaver
(`policy_saves`, and its saves decided under the run's busy lock,
`local_decision`) compose `SaveCall`; the trigger and the Learner swap save
through them. `pb.SaveHeader` is built here and nowhere else in the client.

Busy accounting: an accepted save's upload is counted in the session from
the accept (or, for a save decided under the busy lock, from its hand-over)
until its call has ended, on whichever thread it ends: `send` and
`send_held` enter `DaemonSession.counting_upload()` and hand it to the
upload thread, and nothing else in the client counts an upload.
`DaemonSession.before_trying` keeps a channel open while an upload still
uses it, so no save's channel is closed under it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc

from checkpointd.protocol.errors import CheckpointdError, SaveFailedError
from checkpointd.protocol.kinds import to_wire
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client.notice import Notice
from checkpointd_client.ticket import SaveResult, SaveTicket
from checkpointd_client.transport.outage import survivable
from checkpointd_client.transport.session import DaemonSession, LocalSkips, time_left
from checkpointd_client.transport.stream import SaveStream

_LOGGER = logging.getLogger(__name__)

# The one message that completes a Save whose snapshot is in shared memory, serialized once.
WRITTEN = pb.SaveRequest(shared_memory_written=pb.SharedMemoryWritten()).SerializeToString()


def guarded(
    daemon: DaemonSession,
    blocking: bool,
    early: Callable[[], SaveTicket | None],
    save: Callable[[SaveTicket | None], tuple[SaveTicket, bool]],
    failed: Callable[[SaveTicket | None], SaveTicket],
) -> SaveTicket:
    """A drop-in's save call, within the session's rules: busy until it ends, and training never dies of it.

    The call counts as running (`DaemonSession.begin`) until it returns, or,
    if an upload thread took the save over, until that upload ends. A
    non-blocking save fails at once while an outage's wait is not over, and
    one the daemon cannot take (`outage.survivable`) returns a failed ticket
    instead of raising.

    Args:
        daemon: the run's session.
        blocking: the save waits its turn and until it is durable; it raises.
        early: the save's ticket before it asks the daemon, if it has one
            yet (a non-blocking save in an outage fails through it).
        save: the save, given that ticket: its ticket, and whether an upload
            thread took it over (`SaveCall.send`).
        failed: the ticket a survivable error fails, given that ticket.

    Raises:
        RunClosedError: close() was called.
        CheckpointdError: with `blocking`, or one that is not survivable.
    """
    daemon.begin()
    handed_off = False
    try:
        ticket = early()
        if ticket is not None and not blocking and daemon.fail_fast(ticket):
            return ticket
        try:
            ticket, handed_off = save(ticket)
        except CheckpointdError as e:
            if blocking or not survivable(e):
                raise
            failed_ticket = failed(ticket)
            if failed_ticket.done():
                raise
            return daemon.survive(failed_ticket, e)
        return ticket
    finally:
        if not handed_off:
            daemon.release()


@dataclass(frozen=True)
class Payload:
    """What a save's header says of where it goes and what it carries, besides the ticket's kind and step."""

    export_dir: str
    snapshot_bytes: int
    variables: Sequence[pb.Variable] = ()
    numpy_state: pb.NumpyState | None = None
    training_checkpoint: pb.TrainingCheckpoint | None = None


@dataclass(frozen=True)
class Decision:
    """The daemon's accept (or skip) of a save: the open call, and the shared memory and base it offered."""

    stream: SaveStream
    offer: pb.SharedMemory | None
    base: pb.IncrementalBase | None


@dataclass(frozen=True)
class Upload:
    """An accepted save's values, copied, as its call sends them.

    Attributes:
        requests: the messages that complete the call, serialized.
        whole: every byte again, for a resend after DATA_LOSS; None: not resent.
        durable: called once the save is durable, with its result (the
            drop-in keeps its buffers for the next save, calls write
            callbacks); on an upload thread, what it raises is logged.
    """

    requests: Iterable[bytes]
    whole: Callable[[], Iterable[bytes]] | None = None
    durable: Callable[[SaveResult], None] | None = None


class SaveCall:
    """One save's calls to the daemon (see the module docstring)."""

    def __init__(
        self,
        daemon: DaemonSession,
        ticket: SaveTicket,
        payload: Callable[[], Payload],
        *,
        shared_memory: bool,
        incremental: bool,
        register_again: Callable[[], object] = lambda: None,
        local_skips: LocalSkips | None = None,
        notice: Notice | None = None,
        deadline: float | None = None,
    ) -> None:
        """A save of `ticket`; nothing is sent yet.

        Args:
            daemon: the run's session.
            ticket: the save's ticket: its kind and step go in the header.
            payload: the header's payload, read at each attempt (a
                registration again may change what it binds).
            shared_memory: ask for the daemon's shared memory.
            incremental: send only changed chunks, if the daemon offers a base.
            register_again: registers the run again after NOT_FOUND.
            local_skips: saves skipped under the run's busy lock, reported
                with each header.
            notice: a save on notice: marked so in its header.
            deadline: the monotonic time by which every call ends (a
                notice's), besides the session's timeout.
        """
        self._daemon = daemon
        self.ticket = ticket
        self._payload = payload
        self._shared_memory = shared_memory
        self._incremental = incremental
        self._register_again = register_again
        self._local_skips = local_skips
        self._upload_started: float | None = None  # the upload thread's CPU clock when it took this save
        self._notice = notice
        self._deadline = deadline

    def _header(self, blocking: bool, incremental: bool, held: pb.HeldSave | None) -> pb.SaveHeader:
        payload, ticket, notice = self._payload(), self.ticket, self._notice
        return pb.SaveHeader(
            run=self._daemon.run,
            kind=to_wire(ticket.kind),
            export_dir=payload.export_dir,
            blocking=blocking,
            step=ticket.step,
            variables=payload.variables,
            snapshot_bytes=payload.snapshot_bytes,
            numpy_state=payload.numpy_state,
            training_checkpoint=payload.training_checkpoint,
            shared_memory=self._shared_memory or held is not None,
            held=held,
            local_skips=self._local_skips.take() if self._local_skips is not None else (),
            incremental=self._incremental and incremental,
            on_notice=notice is not None,
            notice_unix_seconds=notice.unix_seconds if notice is not None else 0.0,
        )

    def _open(
        self, blocking: bool, incremental: bool = True, held: pb.HeldSave | None = None
    ) -> tuple[SaveStream, pb.SaveDecision]:
        """Opens the call and waits for the decision; the call is closed if that raises."""
        timeout = self._daemon.timeout
        if self._deadline is not None:
            left = time_left(self._deadline) or 0.0
            timeout = left if timeout is None else min(timeout, left)
        stream = SaveStream(self._daemon.save_stub, self._header(blocking, incremental, held), timeout)
        try:
            return stream, stream.decision()
        except BaseException:
            stream.close()
            raise

    def _doing(self) -> str:
        return f"saving run {self._daemon.run!r} step {self.ticket.step} to {self.ticket.export_dir!r}"

    def _decide(self, blocking: bool, incremental: bool) -> Decision:
        stream, decision = self._daemon.retrying_lost_run(
            lambda: self._open(blocking, incremental), self._register_again, self._doing()
        )
        if not decision.accepted:
            stream.skip(self.ticket, decision.reason, self._daemon.run)
        offer = decision.shared_memory if decision.HasField("shared_memory") else None
        return Decision(stream, offer, decision.base if decision.HasField("base") else None)

    def decide(self, blocking: bool) -> Decision:
        """Opens the call and reads the decision; registers again once if the daemon lost the run.

        A skip completes the ticket (`ticket.skipped`). The daemon answered:
        an outage, if any, is over.

        Raises:
            CheckpointdError: the status the daemon answered instead, named.
        """
        decision = self._decide(blocking, incremental=True)
        self._daemon.answered()
        return decision

    def send(self, decision: Decision, blocking: bool, copy: Callable[[Decision], Upload]) -> bool:
        """Copies an accepted save's values (`copy`) and uploads them; True if an upload thread took it over.

        Blocking: uploads here and raises the save's error. Otherwise the
        upload runs on the session's upload threads, which end the ticket
        and `release()` the save call; the upload is counted until then.
        A skipped save sends nothing.
        """
        if self.ticket.skipped:
            return False
        daemon = self._daemon
        with contextlib.ExitStack() as counted:
            counted.enter_context(daemon.counting_upload())
            try:
                upload = copy(decision)
            except BaseException:
                decision.stream.close()
                raise
            if blocking:
                self._upload(decision.stream, upload)
                self.ticket.result()  # raises the save's error
                return False
            handed = counted.pop_all()
            try:
                daemon.uploads.submit(self._upload_then_release, decision.stream, upload, handed)
            except BaseException:
                handed.close()
                raise
            return True

    def _upload(self, stream: SaveStream, upload: Upload, on_end: Callable[[], None] | None = None) -> None:
        ticket, whole = self.ticket, upload.whole
        resend = None
        if whole is not None:

            def resend() -> tuple[SaveStream, Iterable[bytes]]:
                return self._decide(blocking=True, incremental=False).stream, whole()

        stream.finish(ticket, upload.requests, self._daemon.run, on_end, resend)
        if upload.durable is not None and ticket.done() and ticket.exception(0) is None:
            result = ticket.result(0)
            assert result is not None  # accepted and durable
            upload.durable(result)

    def _upload_then_release(
        self,
        stream: SaveStream,
        upload: Upload,
        counted: contextlib.ExitStack,
        on_end: Callable[[], None] | None = None,
    ) -> None:
        self._upload_started = time.thread_time()
        try:
            with counted:
                self._upload(stream, upload, on_end)
        except Exception:
            # Only `durable` raises here (the upload's own errors end the ticket); the save is durable.
            self._log_durable_raised()
        finally:
            self._daemon.release()

    def upload_cpu(self) -> float:
        """The CPU seconds the upload thread has spent on this save so far, asked on that thread (its `durable`
        callback); 0 for a save uploaded on the caller's thread (a blocking one: its stall counts it)."""
        return time.thread_time() - self._upload_started if self._upload_started is not None else 0.0

    def _log_durable_raised(self) -> None:
        _LOGGER.exception(
            "run %s: a write callback of the save of step %s to %r raised",
            *(self._daemon.run, self.ticket.step, self.ticket.export_dir),
        )

    def send_held(
        self,
        held: pb.HeldSave,
        segment_path: str,
        *,
        chunks: Callable[[], Iterable[bytes]],
        unlock: Callable[[], None],
        drop: Callable[[], None],
        durable: Callable[[SaveResult], None] | None = None,
    ) -> None:
        """Queues the call of a save decided under the run's busy lock, already in the segment, on an upload thread.

        The header carries `held`; a refusal fails the ticket (never a
        skip: the busy lock was this trainer's). The snapshot goes as the
        segment's "written" message, or, if the daemon no longer offers
        that segment, as `chunks()`. `unlock` lets go of the busy lock
        once the call has ended, before the ticket ends; `drop` stops
        deciding saves locally (the next one asks the daemon). The upload
        is counted from here until its call has ended; the upload thread
        then releases the save call.
        """
        with contextlib.ExitStack() as counted:
            counted.enter_context(self._daemon.counting_upload())
            handed = counted.pop_all()
            try:
                self._daemon.uploads.submit(
                    self._held_upload, held, segment_path, handed, chunks, unlock, drop, durable
                )
            except BaseException:
                handed.close()
                raise

    def _held_upload(
        self,
        held: pb.HeldSave,
        segment_path: str,
        counted: contextlib.ExitStack,
        chunks: Callable[[], Iterable[bytes]],
        unlock: Callable[[], None],
        drop: Callable[[], None],
        durable: Callable[[SaveResult], None] | None,
    ) -> None:
        self._upload_started = time.thread_time()
        daemon, ticket = self._daemon, self.ticket
        try:
            with counted:
                try:
                    try:
                        stream, decision = self._open(blocking=False, held=held)
                        if not decision.accepted:
                            stream.close()
                            raise SaveFailedError(
                                f"the daemon skipped a save sent holding the run's busy lock: {decision.reason}"
                            )
                    except BaseException as e:
                        drop()  # the next save asks (and registers again after NOT_FOUND)
                        unlock()
                        self._failed(e)
                        if not isinstance(e, Exception):
                            raise
                        return
                    daemon.answered()
                    offer = decision.shared_memory if decision.HasField("shared_memory") else None
                    in_segment = offer is not None and offer.path == segment_path
                    if not in_segment:
                        # The daemon let the segment go (its cap, a re-registration): the
                        # snapshot goes as chunks from our map of it; the next save asks.
                        drop()
                    self._upload(stream, Upload([WRITTEN] if in_segment else chunks(), durable=durable), unlock)
                finally:
                    unlock()
        except Exception:
            if not ticket.done():
                raise
            self._log_durable_raised()
        finally:
            daemon.release()

    def _failed(self, e: BaseException) -> None:
        """Ends the ticket of a held save whose call failed before its upload."""
        daemon, ticket = self._daemon, self.ticket
        error = daemon.domain_error(e, self._doing()) if isinstance(e, grpc.RpcError) else e
        if survivable(error):
            daemon.survive(ticket, error)  # an outage: warned once, the next saves wait for its backoff
            return
        _LOGGER.warning(
            "run %s: %s of step %s to %r failed: %s: %s",
            *(daemon.run, ticket.kind.value, ticket.step, ticket.export_dir, type(error).__name__, error),
        )
        ticket._fail(error)  # noqa: SLF001 - the saver's side completes tickets
