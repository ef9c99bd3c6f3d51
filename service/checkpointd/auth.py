"""Transport security and bearer tokens for the gRPC port, both sides.

Daemon: `load_server_auth` turns the serve config (and `CHECKPOINTD_TOKENS`)
into TLS server credentials and a token list, and refuses a non-loopback bind
that has neither; `TokenInterceptor` then requires `authorization: Bearer
<token>` on every call except the health and reflection services, which
probes and `grpcurl list` use without credentials.

Clients (RemotePolicySaver, the ops CLI): `credentials` reads PEM files into
TLS channel credentials; `open_channel` sends a token as call credentials
over TLS, or as the same metadata header on a plaintext channel, where gRPC
refuses to attach call credentials.

Tokens never appear in a message, a log line or a repr: errors name the file
and line, never the value.
"""

from __future__ import annotations

import collections
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

_LOGGER = logging.getLogger(__name__)

TOKENS_ENV = "CHECKPOINTD_TOKENS"
"""The daemon's tokens, comma-separated (added to --token-file's)."""
TOKEN_ENV = "CHECKPOINTD_TOKEN"
"""The ops CLI's token when --token-file is not given."""
OPEN_SERVICES = frozenset({"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"})
"""Services served without a token: probes and `grpcurl list` carry none."""

_HEADER = "authorization"
_SCHEME = "bearer"


class AuthSetupError(ValueError):
    """The auth options cannot be used, or are missing for the bind address."""


# Tokens.


def _check_token(token: str, where: str) -> str:
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
            tokens.append(_check_token(line, f"{source} line {number}"))
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
    _warn_if_shared(path, "token file")
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
    return tuple(_check_token(p, f"{TOKENS_ENV} item {i}") for i, p in enumerate(parts, 1) if p)


def _warn_if_shared(path: Path, what: str) -> None:
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if mode & 0o077:
        _LOGGER.warning("%s %s is readable by other users (mode %o); chmod 600 it", what, path, mode & 0o777)


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
        _warn_if_shared(config.tls_key, "TLS key")
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
            _LOGGER.warning("bearer tokens on %s without TLS travel in cleartext; add --tls-cert/--tls-key", config.host)
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
        values = [v for k, v in metadata if k.lower() == _HEADER]
        if not values:
            return "missing credentials: send metadata 'authorization: Bearer <token>'"
        value = values[0]
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, token = value.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != _SCHEME or not token:
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
    the same `authorization` header.

    Raises:
        ValueError: the token has spaces or non-ASCII characters.
    """
    if token is not None:
        if not token:
            raise ValueError("token must not be empty")
        try:
            _check_token(token, "token")
        except AuthSetupError as exc:
            raise ValueError(str(exc)) from None
    if channel_credentials is None:
        channel = grpc.insecure_channel(address, options=options)
        return channel if token is None else grpc.intercept_channel(channel, _BearerHeader(token))
    if token is not None:
        channel_credentials = grpc.composite_channel_credentials(
            channel_credentials, grpc.access_token_call_credentials(token)
        )
    return grpc.secure_channel(address, channel_credentials, options=options)


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
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
        self._header = (_HEADER, f"Bearer {token}")

    def __repr__(self) -> str:
        return "_BearerHeader(<token>)"

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [(k, v) for k, v in (details.metadata or ()) if k.lower() != _HEADER]
        return _CallDetails(
            details.method,
            details.timeout,
            [*metadata, self._header],
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, requests: Any) -> Any:
        return continuation(self._details(details), requests)
