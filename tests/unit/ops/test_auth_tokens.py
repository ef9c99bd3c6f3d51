"""Auth without a daemon: token parsing, the bind check, the CLI flags, and the
token interceptor and client channels against an in-process gRPC server.

The in-process server has the real CheckpointService surface (every method in
the descriptor, so methods added later are covered too), a servicer that
records what reached it, and the standard health service.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from checkpointd.cli import OpsCommand, config_from_args, ops
from checkpointd.core.config import DEFAULT_SHM_ROOT, ServeConfig
from checkpointd.rpc import auth
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc as pb_grpc
from tests.certs import Certs, make_certs

TOKEN = "s3cr3t-t0ken-for-unit-tests"
OTHER = "second-token-also-valid"
WRONG = "n0t-the-t0ken"
SERVICE = pb.DESCRIPTOR.services_by_name["CheckpointService"]
RPC_TIMEOUT = 10.0


# Tokens.


def test_token_file_lines_comments_and_blanks() -> None:
    text = f"# rotated 2024-05\n\n  {TOKEN}  \n#{WRONG}\n{OTHER}\n"
    assert auth.parse_tokens(text, "f") == (TOKEN, OTHER)


@pytest.mark.parametrize("bad", ["two words", "tab\there", "naïve"])
def test_a_bad_token_line_is_named_never_echoed(bad: str) -> None:
    with pytest.raises(auth.AuthSetupError) as raised:
        auth.parse_tokens(f"{TOKEN}\n{bad}\n", "tokens.txt")
    assert "tokens.txt line 2" in str(raised.value)
    assert bad not in str(raised.value)


def test_env_tokens_are_comma_separated() -> None:
    assert auth.env_tokens({auth.TOKENS_ENV: f" {TOKEN},,{OTHER} ,"}) == (TOKEN, OTHER)
    assert auth.env_tokens({}) == ()


def test_token_files_must_hold_a_token_and_a_client_file_exactly_one(tmp_path: Path) -> None:
    empty, two = tmp_path / "empty", tmp_path / "two"
    empty.write_text("# nothing yet\n")
    two.write_text(f"{TOKEN}\n{OTHER}\n")
    with pytest.raises(auth.AuthSetupError, match="no token"):
        auth.read_tokens(empty)
    assert auth.read_tokens(two) == (TOKEN, OTHER)
    with pytest.raises(auth.AuthSetupError, match="one token, found 2"):
        auth.read_token(two)


def test_a_token_file_others_can_read_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "tokens"
    path.write_text(TOKEN)
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="checkpointd.rpc.auth"):
        auth.read_tokens(path)
    assert caplog.records == []
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="checkpointd.rpc.auth"):
        auth.read_tokens(path)
    assert "readable by other users" in caplog.text
    assert TOKEN not in caplog.text


# The bind check.


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
        ("0.0.0.0", False), ("::", False), ("[::]", False), ("10.1.2.3", False), ("ckpt.example.com", False),
    ],
)  # fmt: skip
def test_is_loopback(host: str, loopback: bool) -> None:
    assert auth.is_loopback(host) is loopback


def test_an_exposed_host_without_auth_is_refused() -> None:
    with pytest.raises(auth.AuthSetupError, match="refusing to serve on 0.0.0.0.*--insecure"):
        auth.load_server_auth(ServeConfig(host="0.0.0.0"), environ={})


def test_insecure_allows_it_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="checkpointd.rpc.auth"):
        got = auth.load_server_auth(ServeConfig(host="0.0.0.0", insecure=True), environ={})
    assert got.credentials is None and got.tokens == () and got.interceptors() == []
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "--insecure" in caplog.text


def test_loopback_needs_nothing_and_warns_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="checkpointd.rpc.auth"):
        got = auth.load_server_auth(ServeConfig(), environ={})
    assert got.describe() == "none"
    assert caplog.records == []


def test_env_tokens_protect_an_exposed_host_but_warn_about_cleartext(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="checkpointd.rpc.auth"):
        got = auth.load_server_auth(ServeConfig(host="::"), environ={auth.TOKENS_ENV: f"{TOKEN},{OTHER}"})
    assert got.tokens == (TOKEN, OTHER)
    assert got.describe() == "bearer tokens (2)"
    assert "cleartext" in caplog.text
    assert TOKEN not in repr(got) and TOKEN not in caplog.text


def test_token_file_and_env_tokens_add_up(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"{TOKEN}\n")
    got = auth.load_server_auth(ServeConfig(token_file=path), environ={auth.TOKENS_ENV: f"{OTHER},{TOKEN}"})
    assert got.tokens == (TOKEN, OTHER)


def test_tls_files_are_read_and_checked(tmp_path: Path, certs: Certs) -> None:
    got = auth.load_server_auth(
        ServeConfig(host="0.0.0.0", tls_cert=certs.server.cert, tls_key=certs.server.key, tls_client_ca=certs.ca),
        environ={},
    )
    assert got.credentials is not None and got.mutual and got.describe() == "mutual TLS"
    not_pem = tmp_path / "key.txt"
    not_pem.write_text("hello")
    with pytest.raises(auth.AuthSetupError, match="--tls-key .* is not a PEM file"):
        auth.load_server_auth(ServeConfig(tls_cert=certs.server.cert, tls_key=not_pem), environ={})
    with pytest.raises(auth.AuthSetupError, match="cannot read --tls-cert"):
        auth.load_server_auth(ServeConfig(tls_cert=tmp_path / "missing", tls_key=certs.server.key), environ={})
    with pytest.raises(auth.AuthSetupError, match="cannot read --token-file"):
        auth.load_server_auth(ServeConfig(token_file=tmp_path / "missing"), environ={})


@pytest.mark.parametrize(
    "kwargs",
    [{"tls_cert": Path("c")}, {"tls_key": Path("k")}, {"tls_client_ca": Path("ca")}],
    ids=["cert-without-key", "key-without-cert", "client-ca-without-cert"],
)
def test_config_refuses_half_a_tls_setup(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="tls"):
        ServeConfig(**kwargs)


# The CLI.


def test_serve_security_flags() -> None:
    config, _ = config_from_args(
        ["serve", "--host", "0.0.0.0", "--tls-cert", "s.crt", "--tls-key", "s.key",
         "--tls-client-ca", "ca.crt", "--token-file", "tokens", "--insecure"]
    )  # fmt: skip
    assert config == ServeConfig(
        shm_root=DEFAULT_SHM_ROOT,
        host="0.0.0.0", tls_cert=Path("s.crt"), tls_key=Path("s.key"), tls_client_ca=Path("ca.crt"),
        token_file=Path("tokens"), insecure=True,
    )  # fmt: skip


def test_security_is_off_by_default() -> None:
    config, _ = config_from_args(["serve"])
    assert isinstance(config, ServeConfig)
    assert (config.tls_cert, config.tls_key, config.tls_client_ca, config.token_file, config.insecure) == (
        None, None, None, None, False,
    )  # fmt: skip


@pytest.mark.parametrize(
    "argv", [["serve", "--token", TOKEN], ["serve", f"--token={TOKEN}"], ["status", "--token", TOKEN]]
)
def test_a_token_on_the_command_line_is_refused_without_echo(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as raised:
        config_from_args(argv)
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert "never go on the command line" in err and TOKEN not in err


@pytest.mark.parametrize("command", ["serve", "flush"])
def test_option_names_are_not_abbreviated(command: str) -> None:
    # With argparse's prefix matching, a typo such as `--token-f` would be
    # taken for --token-file: close to reading a file named after a token.
    with pytest.raises(SystemExit) as raised:
        config_from_args([command, "--token-f", "tokens.txt"])
    assert raised.value.code == 2


@pytest.mark.parametrize(
    "argv", [["serve", "--tls-cert", "c"], ["serve", "--tls-client-ca", "ca"], ["flush", "--tls-cert", "c"]]
)
def test_half_a_tls_setup_is_a_usage_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        config_from_args(argv)
    assert raised.value.code == 2


def test_ops_security_flags() -> None:
    command, _ = config_from_args(
        ["flush", "--tls-ca", "ca.crt", "--tls-cert", "c.crt", "--tls-key", "c.key", "--token-file", "t"]
    )
    assert command == OpsCommand(
        "flush", "127.0.0.1:7431", None, None, False,
        tls_ca=Path("ca.crt"), tls_cert=Path("c.crt"), tls_key=Path("c.key"), token_file=Path("t"),
    )  # fmt: skip
    assert isinstance(command, OpsCommand) and command.uses_tls
    plain, _ = config_from_args(["status"])
    assert isinstance(plain, OpsCommand) and not plain.uses_tls
    system_roots, _ = config_from_args(["status", "--tls"])
    assert isinstance(system_roots, OpsCommand) and system_roots.uses_tls


def test_ops_with_an_unreadable_token_file_exits_2(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    command = OpsCommand("status", "127.0.0.1:1", None, 1.0, token_file=tmp_path / "missing")
    assert ops.run(command, out, err, environ={}) == 2
    assert "cannot read --token-file" in err.getvalue()
    assert out.getvalue() == ""


def test_ops_takes_the_token_from_the_environment(plain: InProcess) -> None:
    command = OpsCommand("status", plain.address, None, RPC_TIMEOUT)
    out, err = io.StringIO(), io.StringIO()
    assert ops.run(command, out, err, environ={auth.TOKEN_ENV: f"{TOKEN}\n"}) == 0, err.getvalue()
    assert "(no runs registered)" in out.getvalue()
    assert ops.run(command, out, err, environ={}) == 2
    assert (
        "wants a bearer token and none was given: give it with --token-file FILE or the CHECKPOINTD_TOKEN"
        in err.getvalue()
    )


# Client-side helpers.


def test_client_credentials_need_cert_and_key_together(certs: Certs) -> None:
    with pytest.raises(ValueError, match="both"):
        auth.credentials(certs.ca, cert_file=certs.client.cert)
    with pytest.raises(ValueError, match="not a PEM file"):
        auth.credentials(Path(__file__))
    assert isinstance(auth.credentials(certs.ca, certs.client.cert, certs.client.key), grpc.ChannelCredentials)


@pytest.mark.parametrize("token", ["", "with space", "line\nbreak"])
def test_open_channel_refuses_an_unsendable_token(token: str) -> None:
    with pytest.raises(ValueError):
        auth.open_channel("127.0.0.1:1", token=token)


# The interceptor, against an in-process server.


class Recorder(pb_grpc.CheckpointServiceServicer):
    """Answers GetStatus, RegisterRun and Save; remembers each call that reached it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def GetStatus(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        self.calls.append("GetStatus")
        return pb.StatusResponse()

    def RegisterRun(self, request_iterator: Iterator, context: grpc.ServicerContext) -> pb.RegisterRunResponse:
        self.calls.append("RegisterRun")
        for _ in request_iterator:
            pass
        return pb.RegisterRunResponse()

    def Save(self, request_iterator: Iterator, context: grpc.ServicerContext) -> Iterator[pb.SaveResponse]:
        self.calls.append("Save")
        for _ in request_iterator:
            yield pb.SaveResponse()


class InProcess:
    def __init__(self, tokens: tuple[str, ...], credentials: grpc.ServerCredentials | None = None) -> None:
        self.recorder = Recorder()
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4),
            interceptors=[auth.TokenInterceptor(tokens)],
        )
        pb_grpc.add_CheckpointServiceServicer_to_server(self.recorder, self.server)
        servicer = health.HealthServicer()
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, self.server)
        if credentials is None:
            self.port = self.server.add_insecure_port("127.0.0.1:0")
        else:
            self.port = self.server.add_secure_port("127.0.0.1:0", credentials)
        self.server.start()
        self.address = f"127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def plain() -> Iterator[InProcess]:
    server = InProcess((TOKEN, OTHER))
    yield server
    server.server.stop(None)


@pytest.fixture(scope="module")
def tls(certs: Certs) -> Iterator[InProcess]:
    cert, key = certs.server.read()
    server = InProcess((TOKEN,), grpc.ssl_server_credentials([(key, cert)]))
    yield server
    server.server.stop(None)


def _raw_call(channel: grpc.Channel, method: object, metadata: list[tuple[str, str]] | None) -> grpc.StatusCode:
    """Calls one CheckpointService method with an empty request; the status code it ended with."""
    path = f"/{SERVICE.full_name}/{method.name}"  # type: ignore[attr-defined]
    kind = {(False, False): "unary_unary", (False, True): "unary_stream",
            (True, False): "stream_unary", (True, True): "stream_stream"}[
        (method.client_streaming, method.server_streaming)]  # type: ignore[attr-defined]  # fmt: skip
    call = getattr(channel, kind)(path, request_serializer=None, response_deserializer=None)
    request = iter([b""]) if method.client_streaming else b""  # type: ignore[attr-defined]
    try:
        reply = call(request, timeout=RPC_TIMEOUT, metadata=metadata)
        if method.server_streaming:  # type: ignore[attr-defined]
            list(reply)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("method", SERVICE.methods, ids=lambda m: m.name)
@pytest.mark.parametrize(
    "metadata",
    [
        None,
        [("authorization", f"Bearer {WRONG}")],
        [("authorization", f"Basic {TOKEN}")],
        [("authorization", "Bearer ")],
    ],
    ids=["none", "wrong", "basic-scheme", "empty"],
)
def test_every_checkpoint_method_is_refused_without_the_right_token(
    plain: InProcess, method: object, metadata: list | None
) -> None:
    before = list(plain.recorder.calls)
    with grpc.insecure_channel(plain.address) as channel:
        assert _raw_call(channel, method, metadata) == grpc.StatusCode.UNAUTHENTICATED
    assert plain.recorder.calls == before  # the servicer never saw it


@pytest.mark.parametrize("token", [TOKEN, OTHER])
@pytest.mark.parametrize("method", SERVICE.methods, ids=lambda m: m.name)
def test_every_checkpoint_method_passes_with_any_accepted_token(plain: InProcess, method: object, token: str) -> None:
    with grpc.insecure_channel(plain.address) as channel:
        code = _raw_call(channel, method, [("authorization", f"bearer {token}")])
    # Methods the Recorder does not implement answer UNIMPLEMENTED from the base class.
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.UNIMPLEMENTED)
    assert code != grpc.StatusCode.UNAUTHENTICATED


def test_refusals_name_the_problem_without_echoing_the_token(
    plain: InProcess, caplog: pytest.LogCaptureFixture
) -> None:
    stub_of = pb_grpc.CheckpointServiceStub
    details = {}
    with (
        grpc.insecure_channel(plain.address) as channel,
        caplog.at_level(logging.WARNING, logger="checkpointd.rpc.auth"),
    ):
        for name, metadata in (("missing", None), ("wrong", [("authorization", f"Bearer {WRONG}")])):
            with pytest.raises(grpc.RpcError) as raised:
                stub_of(channel).GetStatus(pb.StatusRequest(), timeout=RPC_TIMEOUT, metadata=metadata)
            details[name] = raised.value.details()
    assert "missing credentials" in details["missing"]
    assert details["wrong"] == "invalid bearer token"
    assert WRONG not in caplog.text and TOKEN not in caplog.text
    assert "refused /checkpointd.v1.CheckpointService/GetStatus from ipv4:127.0.0.1:" in caplog.text


def test_health_needs_no_token(plain: InProcess) -> None:
    with grpc.insecure_channel(plain.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _exercise(channel: grpc.Channel) -> None:
    """One call of each shape the client makes: unary, client stream, bidi stream."""
    stub = pb_grpc.CheckpointServiceStub(channel)
    stub.GetStatus(pb.StatusRequest(), timeout=RPC_TIMEOUT)
    stub.RegisterRun(iter([pb.RegisterRunRequest()]), timeout=RPC_TIMEOUT)
    assert len(list(stub.Save(iter([pb.SaveRequest(), pb.SaveRequest()]), timeout=RPC_TIMEOUT))) == 2


def test_open_channel_sends_the_token_as_a_header_over_plaintext(plain: InProcess) -> None:
    before = len(plain.recorder.calls)
    with auth.open_channel(plain.address, token=OTHER) as channel:
        _exercise(channel)
    assert plain.recorder.calls[before:] == ["GetStatus", "RegisterRun", "Save"]
    with auth.open_channel(plain.address) as channel, pytest.raises(grpc.RpcError) as raised:
        pb_grpc.CheckpointServiceStub(channel).GetStatus(pb.StatusRequest(), timeout=RPC_TIMEOUT)
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_open_channel_sends_the_token_as_call_credentials_over_tls(tls: InProcess, certs: Certs) -> None:
    with auth.open_channel(tls.address, auth.credentials(certs.ca), token=TOKEN) as channel:
        _exercise(channel)
    assert tls.recorder.calls == ["GetStatus", "RegisterRun", "Save"]
    with auth.open_channel(tls.address, auth.credentials(certs.ca), token=WRONG) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            pb_grpc.CheckpointServiceStub(channel).GetStatus(pb.StatusRequest(), timeout=RPC_TIMEOUT)
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert tls.recorder.calls == ["GetStatus", "RegisterRun", "Save"]


def test_the_interceptor_needs_a_token() -> None:
    with pytest.raises(ValueError):
        auth.TokenInterceptor([])
