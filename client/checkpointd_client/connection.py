"""The connection options every saver takes, as one value."""

from __future__ import annotations

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
        """Raises ValueError for an invalid chunk_bytes or timeout, or both token and token_file."""
        wire.check_chunk_bytes(self.chunk_bytes)
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"timeout must be None or > 0 seconds, saw {self.timeout!r}")
        if self.token is not None and self.token_file is not None:
            raise ValueError("give token or token_file, not both")

    def read_token(self) -> str | None:
        """The token, read from token_file if given (OSError, ValueError if it cannot be)."""
        return read_token(Path(self.token_file)) if self.token_file is not None else self.token


CONNECTION_OPTIONS = tuple(f.name for f in fields(ConnectionOptions))
"""The keyword names of ConnectionOptions, as the savers' constructors take them."""
