"""Transport security and bearer tokens for the gRPC port, the daemon's side.

Daemon: `load_server_auth` turns the serve config (and `CHECKPOINTD_TOKENS`)
into TLS server credentials and a token list, and refuses a non-loopback bind
that has neither; `TokenInterceptor` then requires `authorization: Bearer
<token>` on every call except the health and reflection services, which
probes and `grpcurl list` use without credentials.

Clients use `checkpointd.protocol.credentials`, which also holds the token
rules shared with the daemon.

Tokens never appear in a message, a log line or a repr: errors name the file
and line, never the value.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from checkpointd.core.config import ServeConfig
from checkpointd.protocol.credentials import (
    HEADER,
    SCHEME,
    TOKEN_ENV,
    TOKENS_ENV,
    AuthSetupError,
    credentials,
    env_tokens,
    open_channel,
    parse_tokens,
    read_token,
    read_tokens,
    warn_if_shared,
)

_LOGGER = logging.getLogger(__name__)

OPEN_SERVICES = frozenset({"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"})
"""Services served without a token: probes and `grpcurl list` carry none."""

__all__ = [
    "OPEN_SERVICES",
    "TOKEN_ENV",
    "TOKENS_ENV",
    "AuthSetupError",
    "ServerAuth",
    "TokenInterceptor",
    "credentials",
    "env_tokens",
    "is_loopback",
    "load_server_auth",
    "open_channel",
    "parse_tokens",
    "read_token",
    "read_tokens",
]


# The daemon.


def is_loopback(host: str) -> bool:
    """Whether a bind address only accepts connections from this machine.

    Hostnames other than `localhost` are not resolved: they count as exposed.
    """
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerAuth:
    """What the daemon enforces on its gRPC port.

    Attributes:
        credentials: TLS server credentials; None serves plaintext.
        tokens: accepted bearer tokens; empty means no token is required.
        mutual: clients must present a certificate from the client CA.
    """

    credentials: grpc.ServerCredentials | None = None
    tokens: tuple[str, ...] = field(default=(), repr=False)
    mutual: bool = False

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        return [TokenInterceptor(self.tokens)] if self.tokens else []

    def describe(self) -> str:
        """For the startup log line; never the tokens themselves."""
        parts = []
        if self.credentials is not None:
            parts.append("mutual TLS" if self.mutual else "TLS")
        if self.tokens:
            parts.append(f"bearer tokens ({len(self.tokens)})")
        return " + ".join(parts) or "none"


def _read_pem(path: Path, flag: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise AuthSetupError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise AuthSetupError(f"{flag} {path} is not a PEM file")
    return data


def load_server_auth(config: ServeConfig, environ: Mapping[str, str] | None = None) -> ServerAuth:
    """Reads the daemon's certificates and tokens and checks the bind is protected.

    Args:
        config: the serve config (TLS files, token file, host, insecure).
        environ: where `CHECKPOINTD_TOKENS` is read; default os.environ.

    Returns:
        The credentials and tokens to serve with.

    Raises:
        AuthSetupError: a file is unreadable or invalid, or `config.host` is
            not loopback, neither TLS nor tokens are configured and
            `config.insecure` is not set.
    """
    environ = os.environ if environ is None else environ
    tokens: tuple[str, ...] = ()
    if config.token_file is not None:
        try:
            tokens = read_tokens(config.token_file)
        except OSError as exc:
            raise AuthSetupError(f"cannot read --token-file {config.token_file}: {exc.strerror or exc}") from None
    tokens += tuple(t for t in env_tokens(environ) if t not in tokens)

    credentials = None
    if config.tls_cert is not None and config.tls_key is not None:
        cert = _read_pem(config.tls_cert, "--tls-cert")
        key = _read_pem(config.tls_key, "--tls-key")
        warn_if_shared(config.tls_key, "TLS key")
        client_ca = None if config.tls_client_ca is None else _read_pem(config.tls_client_ca, "--tls-client-ca")
        credentials = grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
        )
    auth = ServerAuth(credentials, tokens, mutual=config.tls_client_ca is not None)

    if not is_loopback(config.host):
        if credentials is None and not tokens:
            if not config.insecure:
                raise AuthSetupError(
                    f"refusing to serve on {config.host}, which is not a loopback address, without "
                    "authentication: give --tls-cert and --tls-key (and --tls-client-ca), "
                    f"--token-file or {TOKENS_ENV}; or --insecure to let anyone who can reach "
                    "the port write and read checkpoints"
                )
            _LOGGER.warning(
                "--insecure: serving on %s without TLS or tokens; anyone who can reach the "
                "port can write checkpoints and read run status",
                config.host,
            )
        elif credentials is None:
            _LOGGER.warning(
                "bearer tokens on %s without TLS travel in cleartext; add --tls-cert/--tls-key", config.host
            )
    return auth


class TokenInterceptor(grpc.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every method outside OPEN_SERVICES.

    A refused call never reaches the servicer: nothing is read, written or
    counted. Tokens are compared as SHA-256 digests with hmac.compare_digest,
    against every accepted token, so timing reveals neither a token's length
    nor which one matched.
    """

    def __init__(self, tokens: Iterable[str], open_services: Iterable[str] = OPEN_SERVICES) -> None:
        self._digests = tuple(_digest(t) for t in tokens)
        if not self._digests:
            raise ValueError("TokenInterceptor needs at least one token")
        self._open = frozenset(open_services)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.lstrip("/").split("/", 1)[0] in self._open:
            return handler
        problem = self._problem(handler_call_details.invocation_metadata or ())
        return handler if problem is None else _refusal(handler, method, problem)

    def _problem(self, metadata: Sequence[tuple[str, str | bytes]]) -> str | None:
        values = [v for k, v in metadata if k.lower() == HEADER]
        if not values:
            return "missing credentials: send metadata 'authorization: Bearer <token>'"
        value = values[0]
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, token = value.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != SCHEME or not token:
            return "malformed authorization metadata: expected 'Bearer <token>'"
        candidate = _digest(token)
        matched = False
        for digest in self._digests:  # no early exit: constant time in the match
            matched |= hmac.compare_digest(digest, candidate)
        return None if matched else "invalid bearer token"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def _refusal(handler: grpc.RpcMethodHandler, method: str, problem: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call UNAUTHENTICATED."""

    def abort(context: grpc.ServicerContext) -> None:
        _LOGGER.warning("refused %s from %s: %s", method, context.peer(), problem)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        abort(context)

    def streaming(request: Any, context: grpc.ServicerContext) -> Any:
        abort(context)
        yield  # pragma: no cover - a generator, so grpc treats it as a response stream

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(
        streaming if handler.response_streaming else unary,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
