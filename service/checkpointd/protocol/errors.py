"""Domain errors. The gRPC status each maps to lives in `checkpointd.protocol.codes`."""


class CheckpointdError(Exception):
    """Base of every error checkpointd raises on purpose."""


class InvalidRequestError(CheckpointdError):
    """The request is malformed: bad run name, path, manifest, template."""


class RunNotFoundError(CheckpointdError):
    """The run was never registered on this daemon (or the daemon restarted)."""


class RunClosedError(CheckpointdError, ValueError):
    """The run's lane was closed; register the run again to reopen it."""


class ChecksumError(CheckpointdError):
    """A chunk's CRC32C does not match its data."""


class LimitExceededError(CheckpointdError):
    """A payload or a count is larger than the daemon allows."""


class UnavailableError(CheckpointdError):
    """The daemon is shutting down or cannot be reached: retry the same call later."""


class DeadlineError(CheckpointdError):
    """A flush, close or wait did not finish before its deadline."""


class SaveFailedError(CheckpointdError):
    """The save was accepted but could not be written (I/O error, internal error)."""


class UnauthenticatedError(CheckpointdError):
    """The caller's credentials are missing or wrong."""


class AlreadyExistsError(CheckpointdError):
    """What the request would create is another's: a checkpoint dir another open run of the folder claims."""


class RunHeldError(CheckpointdError):
    """Another daemon holds the run's lease: it writes the run's saves until it lets go or the lease expires."""


def describe(e: BaseException) -> str:
    """A one-line reason for an OS or TensorFlow error, for messages a person reads."""
    if isinstance(e, OSError) and e.strerror:
        where = f" ({e.filename})" if e.filename else ""
        return f"{e.strerror}{where}"
    message = getattr(e, "message", None) or str(e) or type(e).__name__
    return message.strip().splitlines()[0]
