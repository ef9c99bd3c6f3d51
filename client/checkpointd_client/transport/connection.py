"""The connection options every saver takes, as one value."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

import grpc

from checkpointd.protocol import wire
from checkpointd.protocol.credentials import read_token


@dataclass(frozen=True)
class ConnectionOptions:
    """How a saver reaches its daemon; every saver takes these as keywords.

    Attributes:
        chunk_bytes: the largest payload per message (template and snapshot).
        channel_credentials: TLS credentials, or None for a plaintext channel.
        timeout: deadline in seconds of every RPC and the default for
            `flush()` and `close()`; None waits as long as the daemon is reachable.
        token: the bearer token of a daemon with --token-file or CHECKPOINTD_TOKENS.
        token_file: a file holding that token instead, read once at construction.
        shared_memory: on the daemon's host, copy snapshots into its shared memory.
    """

    chunk_bytes: int = wire.CHUNK_BYTES
    channel_credentials: grpc.ChannelCredentials | None = None
    timeout: float | None = None
    token: str | None = None
    token_file: str | os.PathLike[str] | None = None
    shared_memory: bool = True

    def __post_init__(self) -> None:
        """Raises ValueError naming the option: an invalid value of any, or both token and token_file."""
        wire.check_chunk_bytes(self.chunk_bytes)
        if isinstance(self.chunk_bytes, bool) or self.chunk_bytes > wire.FILE_CHUNK_BYTES:
            # A chunk rides in one message, and the daemon takes at most 4 MiB per message.
            raise ValueError(
                f"chunk_bytes must be a positive int of at most {wire.FILE_CHUNK_BYTES} (the daemon takes "
                f"4 MiB per message), saw {self.chunk_bytes!r}"
            )
        timeout = self.timeout
        if timeout is not None and not (
            isinstance(timeout, int | float) and not isinstance(timeout, bool) and 0 < timeout < math.inf
        ):
            raise ValueError(f"timeout must be None or a finite number of seconds > 0, saw {timeout!r}")
        if self.channel_credentials is not None and not isinstance(self.channel_credentials, grpc.ChannelCredentials):
            raise ValueError(
                f"channel_credentials must be grpc.ChannelCredentials (checkpointd_client.credentials(...)) "
                f"or None, saw {type(self.channel_credentials)!r}"
            )
        if self.token is not None and not (isinstance(self.token, str) and self.token.strip()):
            raise ValueError(f"token must be a non-empty str or None, saw {type(self.token)!r}")
        if self.token_file is not None and not isinstance(self.token_file, str | os.PathLike):
            raise ValueError(f"token_file must be a path or None, saw {type(self.token_file)!r}")
        if not isinstance(self.shared_memory, bool):
            raise ValueError(f"shared_memory must be True or False, saw {self.shared_memory!r}")
        if self.token is not None and self.token_file is not None:
            raise ValueError("give token or token_file, not both")

    def read_token(self) -> str | None:
        """The token, read from token_file if given (OSError, ValueError if it cannot be)."""
        return read_token(Path(self.token_file)) if self.token_file is not None else self.token


CONNECTION_OPTIONS = tuple(f.name for f in fields(ConnectionOptions))
"""The keyword names of ConnectionOptions, as the savers' constructors take them."""
