"""`checkpointd serve`: start the daemon, drain it on SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import signal
import threading
import time

from checkpointd.core.config import ServeConfig

_LOGGER = logging.getLogger("checkpointd")


def serve(config: ServeConfig) -> int:
    from checkpointd.rpc.auth import load_server_auth  # grpc only: refuse before TensorFlow loads

    try:
        auth = load_server_auth(config)
    except ValueError as exc:
        _LOGGER.error("cannot start: %s", exc)
        return 2
    from checkpointd.server import Server

    server = Server(config, auth=auth)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    try:
        server.start()
    except OSError as exc:
        _LOGGER.error("cannot start: %s", exc)
        return 2
    stop.wait()
    _LOGGER.info("shutting down: draining accepted saves (grace %.0fs)", config.grace_seconds)
    started = time.monotonic()
    clean = server.stop()
    _LOGGER.info("stopped after %.3fs", time.monotonic() - started)
    return 0 if clean else 1
