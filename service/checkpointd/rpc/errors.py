"""Domain errors become gRPC statuses here, once, for every servicer method."""

from __future__ import annotations

import functools
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from checkpointd.protocol import errors
from checkpointd.protocol.codes import code_for

_LOGGER = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])

REFUSALS_EVERY = 60.0
"""Seconds between the WARNINGs of calls refused at a limit (RESOURCE_EXHAUSTED), while they go on."""


class _Refusals:
    """Calls refused at a limit in the log: one at WARNING, then the count since, at most every `every` seconds.

    A daemon at its --max-concurrent-uploads refuses thousands of calls a
    minute; a line for each would cost it more than the refusal, and each
    caller hears its own. Thread-safe.
    """

    def __init__(self, every: float = REFUSALS_EVERY, clock: Callable[[], float] = time.monotonic) -> None:
        self._every = every
        self._clock = clock
        self._lock = threading.Lock()
        self._since = 0  # refusals not logged at WARNING since the last line
        self._last = -math.inf

    def refused(self, method: str, exc: BaseException) -> None:
        now = self._clock()
        with self._lock:
            if now - self._last < self._every:
                self._since += 1
                quiet = True
            else:
                since, self._since, self._last = self._since, 0, now
                quiet = False
        if quiet:
            _LOGGER.debug("%s ended with RESOURCE_EXHAUSTED: %s", method, exc)
            return
        _LOGGER.warning(
            "%s ended with RESOURCE_EXHAUSTED: %s (%d more calls refused at a limit since the last such line; "
            "the next are logged at DEBUG for %.0fs)",
            method, exc, since, self._every,
        )  # fmt: skip


_REFUSALS = _Refusals()


def grpc_errors(method: _F) -> _F:
    """Turns domain errors raised by a servicer method into gRPC statuses.

    Works for unary methods and for generator (streaming) methods. An
    unexpected exception is logged once with its traceback and becomes
    INTERNAL with a short message and no traceback. Decorated methods raise
    domain errors and never call `context.abort` themselves: grpc's abort
    raises a bare Exception this wrapper could not tell from a bug.
    """

    def _abort(context: grpc.ServicerContext, exc: BaseException) -> None:
        if isinstance(exc, errors.CheckpointdError):
            code = code_for(exc)
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                _REFUSALS.refused(method.__name__, exc)
            else:
                _LOGGER.warning("%s ended with %s: %s", method.__name__, code.name, exc)
            context.abort(code, str(exc))
        _LOGGER.exception("%s failed unexpectedly", method.__name__)
        context.abort(
            grpc.StatusCode.INTERNAL,
            f"internal error in {method.__name__} ({type(exc).__name__}); see the daemon log",
        )

    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            try:
                yield from method(self, request, context)
            except Exception as exc:  # noqa: BLE001 - mapped to a status here, once
                if _is_abort(exc):
                    raise
                _abort(context, exc)

        return stream  # type: ignore[return-value]

    @functools.wraps(method)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - mapped to a status here, once
            if _is_abort(exc):
                raise
            _abort(context, exc)

    return unary  # type: ignore[return-value]


def _is_abort(exc: BaseException) -> bool:
    # A grpc.RpcError here means the call already ended (the client cancelled
    # and the request iterator raised): there is no status left to set.
    return isinstance(exc, grpc.RpcError)
