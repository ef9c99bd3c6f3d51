"""One run's session with the daemon: what RemotePolicySaver, RemoteCheckpointer and restore share.

A `DaemonSession` holds the connection (its `ConnectionOptions`, the channel and
the stubs), the run's busy accounting (save calls and background uploads
running, closing, closed), the one wrapper that turns a `grpc.RpcError` into
the domain error (`calling`), naming the call and the daemon's address, the
two-try "register again if the daemon lost the run" decision, Flush and
CloseRun, and the outage rule below. The savers hold what is specific to
policies or to training state; nothing here imports TensorFlow.

What a non-blocking save does when the daemon cannot take it is
`checkpointd_client.transport.outage`'s rule, applied here.

Lock discipline: `lock` guards the busy counts, `closing`, `closed`, the
channel and the outage, and is never held across an RPC; the savers guard
their own fields with it too. `close_lock` serializes close().
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from checkpointd.protocol.address import check_address, with_default_port
from checkpointd.protocol.codes import error_for
from checkpointd.protocol.credentials import open_channel
from checkpointd.protocol.errors import (
    CheckpointdError,
    DeadlineError,
    RunClosedError,
    UnavailableError,
)
from checkpointd.protocol.names import LEASE_WAIT_METADATA
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc
from checkpointd_client.ticket import SaveCounts, SaveTicket
from checkpointd_client.transport import probe
from checkpointd_client.transport.connection import ConnectionOptions
from checkpointd_client.transport.outage import Outage
from checkpointd_client.transport.stream import RestoreFilesStub, SaveStub, rpc_error

_LOGGER = logging.getLogger(__name__)
T = TypeVar("T")


# The most local skips one message reports; the rest wait for the next one.
MOST_LOCAL_SKIPS_PER_MESSAGE = 4096


class LocalSkips:
    """Saves skipped under the run's busy lock, waiting to be reported with the next Save or Flush. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._skips: list[pb.LocalSkip] = []

    def add(self, kind: pb.SaveKind, export_dir: str, step: int) -> None:
        with self._lock:
            self._skips.append(pb.LocalSkip(kind=kind, export_dir=export_dir, step=step))

    def take(self) -> list[pb.LocalSkip]:
        """The oldest waiting skips (at most MOST_LOCAL_SKIPS_PER_MESSAGE), now counted as reported."""
        with self._lock:
            most = MOST_LOCAL_SKIPS_PER_MESSAGE
            taken, self._skips = self._skips[:most], self._skips[most:]
            return taken

    def put_back(self, skips: list[pb.LocalSkip]) -> None:
        """Reports that did not reach the daemon, to go with the next message."""
        with self._lock:
            self._skips[:0] = skips

    def __len__(self) -> int:
        with self._lock:
            return len(self._skips)


class DaemonSession:
    """One run's connection, busy accounting and error rules (see the module docstring)."""

    def __init__(self, address: str, run: str, options: ConnectionOptions, *, owner: str, upload_threads: int) -> None:
        """Checks the address, reads the token and opens the channel (no network I/O).

        Args:
            address: the daemon's `host:port` (a bare host gets 7431).
            run: the run's name, already checked.
            options: the connection options.
            owner: what the caller is called in messages ("saver", "checkpointer").
            upload_threads: threads that upload accepted saves after save() returns.

        Raises:
            ValueError: the address is a URL or empty, or the token cannot be used.
            OSError: the token file cannot be read.
        """
        self.run = run
        self.options = options
        self.address = with_default_port(check_address(address))  # what is dialled
        self.owner = owner
        self._token = options.read_token()
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.close_lock = threading.Lock()
        self.busy = 0  # save calls running plus background uploads
        self.uploading = 0  # accepted saves not yet ended
        self.closing = False
        self.closed = False
        self.last_step: int | None = None  # of the last save call, for log lines
        self.outage = Outage()
        self._outage_cause = ""  # the error that began or last extended the outage, for fast-failed tickets
        self.counts = SaveCounts()
        self._old_channels: list[grpc.Channel] = []
        self._dial()
        # Idle threads are reused: starting one per save costs more than a small save's copy.
        self.uploads = concurrent.futures.ThreadPoolExecutor(
            max_workers=upload_threads, thread_name_prefix=f"checkpointd-upload-{run}"
        )

    def _dial(self) -> None:
        self._channel = open_channel(self.address, self.options.channel_credentials, self._token)
        self.stub = checkpointd_pb2_grpc.CheckpointServiceStub(self._channel)
        self.save_stub = SaveStub(self._channel)  # sends chunks serialized once, by the saver
        self.files_stub = RestoreFilesStub(self._channel)  # restore's file chunks, read without a copy

    @property
    def timeout(self) -> float | None:
        return self.options.timeout

    @property
    def chunk_bytes(self) -> int:
        return self.options.chunk_bytes

    def ticket(self, export_dir: str, kind: Any, step: int) -> SaveTicket:
        """A new ticket whose end is counted in `counts`."""
        return SaveTicket(export_dir, kind, step, self.counts)

    # Busy accounting.

    def begin(self) -> None:
        """Counts a save call as running until `release()`.

        Raises:
            RunClosedError: close() was called.
        """
        with self.lock:
            if self.closing:
                raise RunClosedError(f"run {self.run!r}: the {self.owner} was closed")
            self.busy += 1

    def check_open(self) -> None:
        """Raises RunClosedError if close() was called."""
        with self.lock:
            if self.closing:
                raise RunClosedError(f"run {self.run!r}: the {self.owner} was closed")

    def release(self) -> None:
        with self.idle:
            self.busy -= 1
            if not self.busy:
                self.idle.notify_all()

    @contextlib.contextmanager
    def counting_upload(self) -> Iterator[None]:
        """Counts an accepted save's upload while inside: `before_trying` keeps its channel open meanwhile.

        The save call (`checkpointd_client.save_call`) holds it from the
        accept until the call has ended, on whichever thread that is.
        """
        with self.lock:
            self.uploading += 1
        try:
            yield
        finally:
            with self.idle:
                self.uploading -= 1
                if not self.uploading:
                    self.idle.notify_all()

    def await_uploads(self) -> None:
        """Waits until the accepted saves have ended (each is bounded by its RPC deadline)."""
        with self.idle:
            while self.uploading:
                self.idle.wait()

    # Errors.

    def named(self, error: CheckpointdError, doing: str) -> CheckpointdError:
        """`error`, saying what was being done and where, if it is one of reaching the daemon.

        UnavailableError and DeadlineError say nothing of the address in gRPC's
        words ("failed to connect to all addresses", "Deadline Exceeded"); a
        trainer with several daemons or runs must see which call failed, e.g.
        "registering run 'r' at ckpt-host:7431: ...". An UnavailableError
        also says what answers there, if it is not a gRPC server (see
        `probe`). Named once: an inner call's naming is kept.
        """
        if not isinstance(error, (UnavailableError, DeadlineError)) or getattr(error, "_named", False):
            return error
        hint = probe.not_grpc(self.address) if isinstance(error, UnavailableError) else None
        named = type(error)(f"{doing} at {self.address}: {error}" + (f" ({hint})" if hint else ""))
        setattr(named, "_named", True)  # noqa: B010 - a marker, not an attribute of the class
        return named

    def domain_error(self, error: grpc.RpcError, doing: str) -> CheckpointdError:
        """The domain error for a status gRPC raised, named (see `named`), caused by it."""
        mapped = self.named(error_for(*rpc_error(error)), doing)
        mapped.__cause__ = error
        return mapped

    @contextlib.contextmanager
    def calling(self, doing: str) -> Iterator[None]:
        """The one wrapper of RPCs: a grpc.RpcError or CheckpointdError inside leaves as a named domain error."""
        try:
            yield
        except grpc.RpcError as e:
            raise self.domain_error(e, doing) from e
        except CheckpointdError as e:
            named = self.named(e, doing)
            if named is e:
                raise
            raise named from e

    # Calls.

    def retrying_lost_run(
        self,
        attempt: Callable[[], T],
        register_again: Callable[[], object],
        doing: str,
        lost: Callable[[], bool] = lambda: True,
    ) -> T:
        """`attempt()`; if the daemon answers NOT_FOUND and `lost()` (it forgot the run), registers again once.

        A restarted daemon knows no runs; the second try after registering
        again is the last: its errors are raised, named.
        """
        try:
            return attempt()
        except grpc.RpcError as e:
            code, details = rpc_error(e)
            if code != grpc.StatusCode.NOT_FOUND or not lost():
                raise self.domain_error(e, doing) from e
            step = f", then step {self.last_step}" if self.last_step is not None else ""
            _LOGGER.warning("run %s: the daemon lost the run (%s); registering again%s", self.run, details, step)
        register_again()
        with self.calling(doing):
            return attempt()

    def register_run(self, requests: Iterator[pb.RegisterRunRequest], doing: str) -> pb.RegisterRunResponse:
        """Calls RegisterRun; logs the daemon's lease-wait sentence once, at INFO, as soon as it arrives.

        A daemon that must wait for another daemon's lease on the run sends
        `LEASE_WAIT_METADATA` in its initial metadata before the wait; the
        call goes on meanwhile, and is answered once the lease is taken.
        """
        with self.calling(doing):
            call = self.stub.RegisterRun.future(requests, timeout=self.timeout)
            watcher = threading.Thread(
                target=_log_lease_wait, args=(call, self.run, self.address), daemon=True,
                name=f"checkpointd-lease-wait-{self.run}",
            )  # fmt: skip
            watcher.start()
            return call.result()

    def call_run(self, request: type, deadline: float | None, skips: LocalSkips | None = None) -> None:
        """Calls Flush or CloseRun for the run; a daemon that lost the run has nothing to do.

        `skips`: saves skipped under the run's busy lock, reported with a
        Flush (put back if the daemon was unreachable).
        """
        left = time_left(deadline)
        message = request(run=self.run, timeout_seconds=left or 0.0)
        taken = skips.take() if skips is not None and request is pb.FlushRequest else []
        if taken:
            message.local_skips.extend(taken)
        try:
            self.before_trying()  # before the stub is read: it may dial a fresh channel
            method = self.stub.Flush if request is pb.FlushRequest else self.stub.CloseRun
            method(message, timeout=left)
        except grpc.RpcError as e:
            code, _ = rpc_error(e)
            if code == grpc.StatusCode.UNAVAILABLE and skips is not None:
                skips.put_back(taken)  # not delivered: with the next call
            if code != grpc.StatusCode.NOT_FOUND:
                doing = "flushing" if request is pb.FlushRequest else "closing"
                raise self.domain_error(e, f"{doing} run {self.run!r}") from e

    # Flush and close.

    def watch_standby(self, slot_paths: list[str]) -> None:
        """Asks the daemon to watch the run's standby slots (none: to stop), `checkpointd_client.standby`.

        Raises:
            CheckpointdError: the daemon refused it, or cannot be reached.
        """
        try:
            self.before_trying()
            self.stub.WatchStandby(pb.WatchStandbyRequest(run=self.run, slot_paths=slot_paths), timeout=self.timeout)
        except grpc.RpcError as e:
            raise self.domain_error(e, f"watching run {self.run!r}'s standby slots") from e

    def wait_idle(self, deadline: float | None, timeout: float | None) -> None:
        """Waits until no save call or upload of this saver runs.

        Raises:
            DeadlineError: some still run at `deadline`.
        """
        with self.idle:
            while self.busy:
                left = time_left(deadline)
                if left == 0.0:
                    raise DeadlineError(
                        f"run {self.run!r}: {self.busy} save(s) of this {self.owner} still running "
                        f"after {timeout} s (last save call at step {self.last_step})"
                    )
                self.idle.wait(left)

    def flush(self, timeout: float | None, registered: bool, skips: LocalSkips | None = None) -> None:
        """Waits for this saver's saves, then (if registered) for the daemon's run to be idle."""
        timeout = timeout if timeout is not None else self.timeout
        deadline = deadline_after(timeout)
        self.wait_idle(deadline, timeout)
        if registered:  # else the daemon holds nothing of this saver's
            self.call_run(pb.FlushRequest, deadline, skips)
        _LOGGER.debug("run %s: flushed (last save call at step %s)", self.run, self.last_step)

    def close(
        self,
        timeout: float | None,
        flush: Callable[[float | None], None],
        registered: Callable[[], bool],
        release: Callable[[], None] = lambda: None,
    ) -> None:
        """Flushes, closes the run on the daemon, then the channel; idempotent.

        Saves fail with RunClosedError from the moment this is called, even
        if it then fails; calling it again retries the remaining steps.
        `release` lets go of the saver's own resources before the channel closes.
        """
        with self.close_lock:
            with self.lock:
                if self.closed:
                    return
                self.closing = True
            deadline = deadline_after(timeout if timeout is not None else self.timeout)
            flush(time_left(deadline))
            if registered():
                self.call_run(pb.CloseRunRequest, deadline)
            with self.lock:
                self.closed = True
            self.shutdown(release)
            _LOGGER.info("run %s: closed (last save call at step %s)", self.run, self.last_step)

    def shutdown(self, release: Callable[[], None] = lambda: None) -> None:
        """Stops the upload threads (flush saw every upload end), then closes the channels."""
        self.uploads.shutdown(wait=False)
        release()
        with self.lock:
            channels, self._old_channels = [*self._old_channels, self._channel], []
        for channel in channels:
            channel.close()

    # Outages: a non-blocking save never raises what the daemon's state causes.

    def failing_fast(self) -> bool:
        """Whether a non-blocking save now would fail at once (`fail_fast`): an outage's wait is not over."""
        with self.lock:
            return self.outage.retry_in() != 0.0

    def fail_fast(self, ticket: SaveTicket) -> bool:
        """Fails `ticket` at once if an outage's wait is not over; True if it did."""
        with self.lock:
            retry_in = self.outage.retry_in()
            if retry_in == 0.0:
                return False
            self.outage.failed_fast()
            failures, cause = self.outage.failures, self._outage_cause
        # The cause, not "unreachable": a daemon that answers UNAVAILABLE because
        # its object store is down begins an outage too, and says so there.
        error = UnavailableError(
            f"saving run {self.run!r} step {ticket.step} to {ticket.export_dir!r} at {self.address}: "
            f"not tried, the last save could not be taken ({cause}); the next save after {retry_in:.1f} s tries again"
        )
        _LOGGER.debug("run %s: save of step %s failed without trying (%d in this outage)", self.run, ticket.step,
                      failures)  # fmt: skip
        ticket._fail(error)  # noqa: SLF001 - the saver's side completes tickets
        return True

    def survive(self, ticket: SaveTicket, error: BaseException) -> SaveTicket:
        """`ticket`, failed with `error` (a survivable one: see `survivable`); begins or extends the outage."""
        with self.lock:
            began = self.outage.failed()
            retry_in = self.outage.retry_in()
            self._outage_cause = f"{type(error).__name__}: {error}"
        if began:
            _LOGGER.warning(
                "run %s: the daemon at %s cannot take saves (%s: %s); training goes on: non-blocking saves "
                "return failed tickets, and the next save after %.1f s tries again (and registers again "
                "if the daemon restarted)",
                self.run, self.address, type(error).__name__, error, retry_in,
            )  # fmt: skip
        else:
            _LOGGER.debug("run %s: save of step %s failed: %s; next try in %.1f s", self.run, ticket.step, error,
                          retry_in)  # fmt: skip
        ticket._fail(error)  # noqa: SLF001 - the saver's side completes tickets
        return ticket

    def answered(self) -> None:
        """The daemon answered a call: an outage, if any, is over."""
        with self.lock:
            if self.outage.since is None:
                return
            failures = self.outage.failures
            lasted = self.outage.ended()
        _LOGGER.info("run %s: the daemon at %s answers again after %.1f s; %d save(s) failed meanwhile",
                     self.run, self.address, lasted, failures)  # fmt: skip

    def before_trying(self) -> None:
        """Dials a fresh channel if an outage is going on: the old one may be in gRPC's own backoff.

        Called before a save asks the daemon, and before Flush and CloseRun.
        The old channel is closed at once if no upload runs on it, else with
        the session.
        """
        old: grpc.Channel | None
        with self.lock:
            if self.outage.since is None or self.closed:
                return
            old = self._channel
            self._dial()
            if self.uploading:
                self._old_channels.append(old)
                old = None
        if old is not None:
            old.close()


def _log_lease_wait(call: Any, run: str, address: str) -> None:
    try:
        metadata = call.initial_metadata() or ()
    except Exception:  # noqa: BLE001 - the call's own end reports any error
        return
    for key, value in metadata:
        if key == LEASE_WAIT_METADATA:
            _LOGGER.info("run %s: the daemon at %s waits for the run's lease: %s", run, address, value)
            return


def deadline_after(timeout: float | None) -> float | None:
    """The monotonic time `timeout` seconds from now, or None for no deadline."""
    return None if timeout is None else time.monotonic() + timeout


def time_left(deadline: float | None) -> float | None:
    """Seconds left before `deadline` (0.0 once past), or None for no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
