"""Channel credentials and bearer tokens, the client side of the daemon's auth.

`credentials` reads PEM files into TLS channel credentials; `open_channel`
sends a token as call credentials over TLS, or as the same metadata header on
a plaintext channel, where gRPC refuses to attach call credentials. Token
files and their rules are shared with the daemon (`checkpointd.rpc.auth`).

Tokens never appear in a message, a log line or a repr: errors name the file
and line, never the value.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from checkpointd.protocol.address import with_default_port

_LOGGER = logging.getLogger(__name__)

TOKENS_ENV = "CHECKPOINTD_TOKENS"
"""The daemon's tokens, comma-separated (added to --token-file's)."""
TOKEN_ENV = "CHECKPOINTD_TOKEN"
"""The ops CLI's token when --token-file is not given."""

HEADER = "authorization"
SCHEME = "bearer"


class AuthSetupError(ValueError):
    """The auth options cannot be used, or are missing for the bind address."""


# Tokens.


def check_token(token: str, where: str) -> str:
    # What a header value can carry and Bearer allows, minus spaces: a token
    # with a space or a newline would be split or refused on the wire.
    if not all("\x21" <= ch <= "\x7e" for ch in token):
        raise AuthSetupError(f"{where}: a token must be printable ASCII without spaces")
    return token


def parse_tokens(text: str, source: str) -> tuple[str, ...]:
    """Tokens from a token file's text: one per line; blank lines and `#` lines skipped.

    Args:
        text: the file's content.
        source: names the file in error messages.

    Raises:
        AuthSetupError: a line is not a valid token (the message names the
            line, never its content).
    """
    tokens = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            tokens.append(check_token(line, f"{source} line {number}"))
    return tuple(tokens)


def read_tokens(path: Path) -> tuple[str, ...]:
    """The tokens in a token file; warns if others may read it.

    Raises:
        OSError: the file cannot be read.
        AuthSetupError: it holds no token or an invalid one.
    """
    tokens = parse_tokens(path.read_text(encoding="utf-8"), str(path))
    if not tokens:
        raise AuthSetupError(f"{path}: no token in it (one per line, # for comments)")
    warn_if_shared(path, "token file")
    return tokens


def read_token(path: Path) -> str:
    """The one token in a client's token file.

    Raises:
        OSError: the file cannot be read.
        AuthSetupError: it holds no token, an invalid one, or more than one.
    """
    tokens = read_tokens(path)
    if len(tokens) != 1:
        raise AuthSetupError(f"{path}: a client token file holds one token, found {len(tokens)}")
    return tokens[0]


def env_tokens(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The tokens in `CHECKPOINTD_TOKENS` (comma-separated), if set."""
    parts = (p.strip() for p in environ.get(TOKENS_ENV, "").split(","))
    return tuple(check_token(p, f"{TOKENS_ENV} item {i}") for i, p in enumerate(parts, 1) if p)


def warn_if_shared(path: Path, what: str) -> None:
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if mode & 0o077:
        _LOGGER.warning("%s %s is readable by other users (mode %o); chmod 600 it", what, path, mode & 0o777)


# Clients.


def credentials(
    ca_file: str | os.PathLike[str] | None = None,
    cert_file: str | os.PathLike[str] | None = None,
    key_file: str | os.PathLike[str] | None = None,
) -> grpc.ChannelCredentials:
    """TLS channel credentials from PEM files.

    Args:
        ca_file: the CA that signed the daemon's certificate; None trusts the
            system's roots.
        cert_file, key_file: this client's certificate and key, for a daemon
            started with --tls-client-ca; give both or neither.

    Raises:
        ValueError: only one of cert_file and key_file was given, or a file is
            not PEM.
        OSError: a file cannot be read.
    """
    if (cert_file is None) != (key_file is None):
        raise ValueError("give both cert_file and key_file (a client certificate and its key), or neither")

    def read(path: str | os.PathLike[str] | None, what: str) -> bytes | None:
        if path is None:
            return None
        data = Path(path).read_bytes()
        if b"-----BEGIN " not in data:
            raise ValueError(f"{what} {os.fspath(path)} is not a PEM file")
        return data

    return grpc.ssl_channel_credentials(
        root_certificates=read(ca_file, "ca_file"),
        private_key=read(key_file, "key_file"),
        certificate_chain=read(cert_file, "cert_file"),
    )


def open_channel(
    address: str,
    channel_credentials: grpc.ChannelCredentials | None = None,
    token: str | None = None,
    options: Sequence[tuple[str, Any]] | None = None,
) -> grpc.Channel:
    """A channel to a daemon that sends `token` (if any) on every call.

    Over TLS the token goes as call credentials; over plaintext (a loopback
    daemon), where gRPC will not attach call credentials, an interceptor adds
    the same `authorization` header. An address without a port gets the
    daemon's (7431), not gRPC's 443.

    Raises:
        ValueError: the token has spaces or non-ASCII characters.
    """
    if token is not None:
        if not token:
            raise ValueError("token must not be empty")
        try:
            check_token(token, "token")
        except AuthSetupError as exc:
            raise ValueError(str(exc)) from None
    address = with_default_port(address)
    if channel_credentials is None:
        channel = grpc.insecure_channel(address, options=options)
        return channel if token is None else grpc.intercept_channel(channel, _BearerHeader(token))
    if token is not None:
        channel_credentials = grpc.composite_channel_credentials(
            channel_credentials, grpc.access_token_call_credentials(token)
        )
    return grpc.secure_channel(address, channel_credentials, options=options)


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class _BearerHeader(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call on a plaintext channel."""

    def __init__(self, token: str) -> None:
        self._header = (HEADER, f"Bearer {token}")

    def __repr__(self) -> str:
        return "_BearerHeader(<token>)"

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [(k, v) for k, v in (details.metadata or ()) if k.lower() != HEADER]
        return _CallDetails(
            details.method,
            details.timeout,
            [*metadata, self._header],
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, requests: Any
    ) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, requests: Any
    ) -> Any:
        return continuation(self._details(details), requests)
