"""`checkpointd serve`: start the daemon, drain it on SIGTERM or SIGINT.

The first SIGTERM or SIGINT puts the daemon on notice, then drains: health
NOT_SERVING and new runs refused at once; the runs registered here keep saving
for --notice-window (their trainers' final saves); then new saves refused,
accepted ones finish within --grace-seconds, the run leases are released,
exit 0 (1 if some did not). A
second one during the drain stops at once: the unfinished saves are logged
and abandoned (their temp dirs are left for the next start's recovery; no
export dir is torn), every open call's caller gets UNAVAILABLE saying so,
exit 1 if there were any unfinished saves.

Signal handlers run on the main thread between two bytecodes, possibly while
it holds a lock, so they do nothing here: Python's C-level handler writes the
signal's number to a pipe (`signal.set_wakeup_fd`), and the main thread reads
it and does the work. The drain runs on a thread of its own, so the main
thread is free to hear the second signal.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING

from checkpointd.core.config import ServeConfig

if TYPE_CHECKING:
    from checkpointd.server import Server

_LOGGER = logging.getLogger("checkpointd")

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_DRAINED = 0  # the byte the drain thread writes to the pipe when it is done
# What the daemon extra brings that the client extra does not (pyproject.toml).
_DAEMON_MODULES = frozenset({"grpc_health", "grpc_reflection", "prometheus_client"})


def serve(config: ServeConfig) -> int:
    """Runs the daemon until SIGTERM or SIGINT; returns the exit code (0, 1 or 2)."""
    try:
        return _serve(config)
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in _DAEMON_MODULES:
            raise
        _LOGGER.error(
            "cannot start: the daemon needs %s, which is not installed; install the daemon's "
            "dependencies with: pip install 'checkpointd[daemon]'",
            exc.name,
        )
        return 2


def _serve(config: ServeConfig) -> int:
    from checkpointd.rpc.auth import load_server_auth  # grpc only: refuse before anything starts

    try:
        auth = load_server_auth(config)
    except ValueError as exc:
        _LOGGER.error("cannot start: %s", exc)
        return 2
    from checkpointd.server import Server

    server = Server(config, auth=auth)
    with _SignalPipe() as signals:
        try:
            server.start()
        except OSError as exc:
            _LOGGER.error("cannot start: %s", exc)
            return 2
        first = signals.next()
        _LOGGER.info(
            "%s: on notice: new runs refused, the runs registered here keep saving for up to %gs; then draining "
            "accepted saves (grace %.0fs); SIGTERM or SIGINT again stops at once",
            signal.Signals(first).name, config.notice_window_seconds, config.grace_seconds,
        )  # fmt: skip
        started = time.monotonic()
        outcome: list[bool] = []

        def drain() -> None:
            try:
                outcome.append(server.stop())
            finally:
                signals.notify(_DRAINED)

        threading.Thread(target=drain, name="drain", daemon=True).start()
        while (got := signals.next()) != _DRAINED:
            _stop_now(server, signal.Signals(got).name)
        _LOGGER.info("stopped after %.3fs", time.monotonic() - started)
        return 0 if outcome == [True] else 1


def _stop_now(server: Server, name: str) -> None:
    """A second signal: log what is abandoned, free the shared memory, exit without waiting."""
    unfinished = server.unfinished()
    if unfinished:
        _LOGGER.error(
            "%s again: stopping now, abandoning %d unfinished saves: %s",
            name, len(unfinished), "; ".join(unfinished),
        )  # fmt: skip
    else:
        _LOGGER.warning("%s again: stopping now; no save was unfinished", name)
    told = server.abandon(f"{name} again during its drain")
    if told:
        _LOGGER.error("%s again: told %d open calls the daemon stopped at once (UNAVAILABLE)", name, told)
    logging.shutdown()  # flush the log: os._exit skips it
    # Not sys.exit: the threads of the abandoned saves (an upload waiting on
    # its stream, a write on a slow disk) would hold the interpreter's exit.
    os._exit(1 if unfinished else 0)


class _SignalPipe:
    """SIGTERM and SIGINT as bytes on a pipe, read by the main thread.

    The handler installed is a no-op; what matters is the byte Python's own
    C handler writes to the wakeup fd, which takes no lock.
    """

    def __enter__(self) -> _SignalPipe:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # set_wakeup_fd requires it
        self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        for sig in _SIGNALS:
            signal.signal(sig, _noted)
        return self

    def next(self) -> int:
        """Blocks until a signal arrives (its number) or `notify` writes a byte."""
        while True:
            data = os.read(self._read, 1)  # retried across signals (PEP 475)
            if data and (data[0] in _SIGNALS or data[0] == _DRAINED):
                return data[0]

    def notify(self, byte: int) -> None:
        """Wakes `next` from another thread."""
        os.write(self._write, bytes([byte]))

    def __exit__(self, *exc: object) -> None:
        # The no-op handlers stay: the process is on its way out, and a late
        # signal must not kill it with another exit code than the drain's.
        signal.set_wakeup_fd(self._old_fd)
        os.close(self._read)
        os.close(self._write)


def _noted(signum: int, frame: FrameType | None) -> None:
    """Does nothing: the signal already went into the pipe (see _SignalPipe)."""
