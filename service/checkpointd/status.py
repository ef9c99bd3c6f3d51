"""The one table from domain errors to gRPC status codes, both directions.

The daemon applies it in one place (`grpc_errors`); the client inverts it
(`error_for`), so a caller catches the same exception class the daemon raised.
Messages are never matched: only codes cross the wire as meaning.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from checkpointd.core import errors

_LOGGER = logging.getLogger(__name__)

CODES: dict[type[errors.CheckpointdError], grpc.StatusCode] = {
    errors.InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.RunNotFoundError: grpc.StatusCode.NOT_FOUND,
    errors.RunClosedError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ChecksumError: grpc.StatusCode.DATA_LOSS,
    errors.LimitExceededError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.UnavailableError: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineError: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.SaveFailedError: grpc.StatusCode.INTERNAL,
    errors.UnauthenticatedError: grpc.StatusCode.UNAUTHENTICATED,
}
_ERRORS: dict[grpc.StatusCode, type[errors.CheckpointdError]] = {c: e for e, c in CODES.items()}


def code_for(exc: errors.CheckpointdError) -> grpc.StatusCode:
    """The status code of a domain error (its class or nearest base in CODES)."""
    for cls in type(exc).__mro__:
        if cls in CODES:
            return CODES[cls]
    return grpc.StatusCode.INTERNAL


def error_for(code: grpc.StatusCode, details: str) -> errors.CheckpointdError:
    """The domain error for a status the daemon sent (client side).

    CANCELLED and codes outside the table (a daemon that is down answers
    UNAVAILABLE from the channel itself) become the nearest domain error.
    """
    cls = _ERRORS.get(code, errors.SaveFailedError)
    return cls(details or code.name)


_F = TypeVar("_F", bound=Callable[..., Any])


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
