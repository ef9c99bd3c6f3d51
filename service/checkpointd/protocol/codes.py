"""The one table from domain errors to gRPC status codes, both directions.

The daemon applies it in one place (`checkpointd.rpc.errors.grpc_errors`);
the client inverts it (`error_for`), so a caller catches the same exception
class the daemon raised.
Messages are never matched: only codes cross the wire as meaning.
"""

from __future__ import annotations

import grpc

from checkpointd.protocol import errors

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
    errors.RunHeldError: grpc.StatusCode.ABORTED,
    errors.AlreadyExistsError: grpc.StatusCode.ALREADY_EXISTS,
}
_ERRORS: dict[grpc.StatusCode, type[errors.CheckpointdError]] = {c: e for e, c in CODES.items()}


def code_for(exc: errors.CheckpointdError) -> grpc.StatusCode:
    """The status code of a domain error (its class or nearest base in CODES)."""
    for cls in type(exc).__mro__:
        if cls in CODES:
            return CODES[cls]
    return grpc.StatusCode.INTERNAL


def error_for(code: grpc.StatusCode, details: str | None) -> errors.CheckpointdError:
    """The domain error for a status the daemon sent (client side).

    CANCELLED and codes outside the table (a daemon that is down answers
    UNAVAILABLE from the channel itself) become the nearest domain error.
    UNIMPLEMENTED means the address serves something else (another gRPC
    service, an HTTP server answering 404): no daemon there, as when nothing
    listens, so UnavailableError, saying so.
    """
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return errors.UnavailableError(
            f"the address does not serve checkpointd (it answered: {details or code.name}); "
            "is it the daemon's gRPC --port?"
        )
    cls = _ERRORS.get(code, errors.SaveFailedError)
    return cls(details or code.name)
