"""Authentication and transport security against real `checkpointd serve` processes.

Certificates are made at test time (tests/certs.py): a CA that signs the
daemon's cert (SAN 127.0.0.1, ::1, localhost) and a client cert, and an
unrelated CA with a client cert of its own. Three daemons:

- `tls`: TLS (--tls-cert/--tls-key) and two bearer tokens in --token-file;
- `mtls`: mutual TLS (--tls-client-ca), no tokens;
- `plain`: plaintext on loopback, tokens from CHECKPOINTD_TOKENS.

Every refused attempt is checked to have left nothing: no path under the
root naming its run, no save counted in /metrics, no run registered.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import tensorflow as tf
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from checkpointd.protocol import wire
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc
from checkpointd_client import (
    RemotePolicySaver,
    UnauthenticatedError,
    UnavailableError,
    credentials,
)
from tests.certs import Certs, make_certs
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon, start_daemon
from tests.integration.support.raw import saver_header
from tests.integration.support.scrape import Metrics

RPC_TIMEOUT = 30.0
SERVICE = "checkpointd.v1.CheckpointService"
CHECKPOINTD = str(Path(sys.executable).with_name("checkpointd"))
# Unique per session, so a match in a log or a scrape can only be a leak.
TOKEN, OTHER_TOKEN, WRONG_TOKEN = (f"ckpt-{secrets.token_urlsafe(18)}" for _ in range(3))


@dataclass
class Secrets:
    certs: Certs
    server_tokens: Path  # the daemon's --token-file: both tokens
    client_token: Path  # one token, for RemotePolicySaver(token_file=) and the CLI


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Secrets:
    folder = tmp_path_factory.mktemp("secrets")
    server_tokens = folder / "server-tokens"
    server_tokens.write_text(f"# checkpointd tokens, one per line\n{TOKEN}\n\n{OTHER_TOKEN}\n")
    client_token = folder / "client-token"
    client_token.write_text(f"{OTHER_TOKEN}\n")
    for path in (server_tokens, client_token):
        path.chmod(0o600)
    return Secrets(make_certs(folder / "certs"), server_tokens, client_token)


@contextlib.contextmanager
def _daemon(base: Path, *args: str, **kwargs: object) -> Iterator[Daemon]:
    daemon = start_daemon(base / "root", base / "work", *args, **kwargs)  # type: ignore[arg-type]
    try:
        yield daemon
    finally:
        daemon.terminate()


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory, files: Secrets) -> Iterator[Daemon]:
    c = files.certs
    with _daemon(
        tmp_path_factory.mktemp("tls"),
        "--tls-cert", str(c.server.cert), "--tls-key", str(c.server.key),
        "--token-file", str(files.server_tokens),
        credentials=credentials(c.ca),
    ) as daemon:  # fmt: skip
        yield daemon


@pytest.fixture(scope="module")
def mtls(tmp_path_factory: pytest.TempPathFactory, files: Secrets) -> Iterator[Daemon]:
    c = files.certs
    with _daemon(
        tmp_path_factory.mktemp("mtls"),
        "--tls-cert", str(c.server.cert), "--tls-key", str(c.server.key), "--tls-client-ca", str(c.ca),
        credentials=credentials(c.ca, c.client.cert, c.client.key),
    ) as daemon:  # fmt: skip
        yield daemon


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with _daemon(tmp_path_factory.mktemp("plain"), env={"CHECKPOINTD_TOKENS": f"{TOKEN},{OTHER_TOKEN}"}) as daemon:
        yield daemon


# Helpers.


def new_saver(daemon: Daemon, run: str, **kwargs: object) -> RemotePolicySaver:
    return RemotePolicySaver(
        policies.build(policies.q()),
        daemon.address,
        run=run,
        train_step=tf.Variable(7, dtype=tf.int64),
        timeout=RPC_TIMEOUT,
        **kwargs,  # type: ignore[arg-type]
    )


def scrape(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=RPC_TIMEOUT) as reply:
            return reply.status, reply.read().decode("utf-8")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")


def saves_counted(daemon: Daemon) -> float:
    """Every save decision the daemon counted (all kinds and outcomes), plus runs registered."""
    return Metrics(daemon.metrics_url).total("checkpointd_saves_total", "checkpointd_runs")


def paths_naming(daemon: Daemon, run: str) -> list[str]:
    """Every path under the daemon's root (its state dir included) that names `run`."""
    if not daemon.root.exists():
        return []
    return sorted(
        str(p.relative_to(daemon.root)) for p in daemon.root.rglob("*") if run in str(p.relative_to(daemon.root))
    )


@contextlib.contextmanager
def leaves_nothing(daemon: Daemon, run: str) -> Iterator[None]:
    """Asserts the block wrote nothing for `run` and counted no save or run."""
    counted, before = saves_counted(daemon), paths_naming(daemon, run)
    yield
    assert paths_naming(daemon, run) == before
    assert saves_counted(daemon) == counted


def raw_calls(channel: grpc.Channel, run: str, metadata: list[tuple[str, str]] | None) -> dict[str, grpc.StatusCode]:
    """GetStatus, Flush, RegisterRun and Save (a valid-looking header and a chunk) on `channel`."""
    stub = checkpointd_pb2_grpc.CheckpointServiceStub(channel)
    header = pb.SaveHeader(run=run, kind=pb.SAVED_MODEL, export_dir="policy_1", step=1, snapshot_bytes=4)
    chunk = pb.Chunk(offset=0, data=b"\0\0\0\0")
    calls = {
        "GetStatus": lambda: stub.GetStatus(pb.StatusRequest(), timeout=RPC_TIMEOUT, metadata=metadata),
        "Flush": lambda: stub.Flush(pb.FlushRequest(run=run), timeout=RPC_TIMEOUT, metadata=metadata),
        "RegisterRun": lambda: stub.RegisterRun(
            iter([pb.RegisterRunRequest(header=pb.RegisterRunHeader(run=run))]), timeout=RPC_TIMEOUT, metadata=metadata
        ),
        "Save": lambda: list(
            stub.Save(
                iter([pb.SaveRequest(header=header), pb.SaveRequest(chunk=chunk)]),
                timeout=RPC_TIMEOUT,
                metadata=metadata,
            )
        ),
    }
    codes = {}
    for name, call in calls.items():
        try:
            call()
            codes[name] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            codes[name] = exc.code()
            assert TOKEN not in (exc.details() or "") and WRONG_TOKEN not in (exc.details() or "")
    return codes


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CHECKPOINTD_TOKEN")}
    return subprocess.run(
        [CHECKPOINTD, *args], capture_output=True, text=True, timeout=RPC_TIMEOUT,
        check=False, env={**clean, **(env or {})},
    )  # fmt: skip


def health_status(channel: grpc.Channel) -> int:
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=SERVICE), timeout=RPC_TIMEOUT
    )
    return reply.status


# TLS: the transport.


def test_a_plaintext_client_cannot_reach_a_tls_daemon(tls: Daemon) -> None:
    run = "plaintext-client"
    with leaves_nothing(tls, run):
        with grpc.insecure_channel(tls.address) as channel:
            codes = raw_calls(channel, run, bearer(TOKEN))
            with pytest.raises(grpc.RpcError) as raised:
                health_status(channel)
        with pytest.raises(UnavailableError):
            new_saver(tls, run, token=TOKEN).save("policy_1").result(60)
    assert set(codes.values()) == {grpc.StatusCode.UNAVAILABLE}
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_trusting_another_ca_is_refused(tls: Daemon, files: Secrets) -> None:
    run = "wrong-ca"
    with leaves_nothing(tls, run):
        with tls.channel(credentials(files.certs.other_ca)) as channel:
            codes = raw_calls(channel, run, bearer(TOKEN))
        with pytest.raises(UnavailableError):
            new_saver(tls, run, channel_credentials=credentials(files.certs.other_ca), token=TOKEN).save(
                "policy_1"
            ).result(60)
    assert set(codes.values()) == {grpc.StatusCode.UNAVAILABLE}


# Tokens.


@pytest.mark.parametrize(
    "metadata", [None, bearer(WRONG_TOKEN), [("authorization", TOKEN)]], ids=["missing", "wrong", "no-scheme"]
)
def test_missing_or_wrong_token_is_unauthenticated_and_leaves_nothing(tls: Daemon, metadata: list | None) -> None:
    run = "no-token"
    with leaves_nothing(tls, run), tls.channel() as channel:
        codes = raw_calls(channel, run, metadata)
    assert codes == dict.fromkeys(("GetStatus", "Flush", "RegisterRun", "Save"), grpc.StatusCode.UNAUTHENTICATED)


@pytest.mark.parametrize("token", [None, WRONG_TOKEN], ids=["missing", "wrong"])
def test_the_client_raises_unauthenticated_error(tls: Daemon, files: Secrets, token: str | None) -> None:
    run = "client-no-token"
    with leaves_nothing(tls, run):
        saver = new_saver(tls, run, channel_credentials=credentials(files.certs.ca), token=token)
        with pytest.raises(UnauthenticatedError) as registering:
            saver.register()
        with pytest.raises(UnauthenticatedError):
            saver.save("policy_1", blocking=True)
    assert "token" in str(registering.value) or "credentials" in str(registering.value)
    assert WRONG_TOKEN not in str(registering.value)


def test_a_refused_save_of_a_registered_run_writes_and_counts_nothing(tls: Daemon, files: Secrets) -> None:
    run = "registered-then-refused"
    saver = new_saver(tls, run, channel_credentials=credentials(files.certs.ca), token=TOKEN)
    saver.register()
    train_step = saver._saver._train_step  # noqa: SLF001 - the variable new_saver gave it
    header, snap = saver_header(saver, train_step, "refused")
    requests = [pb.SaveRequest(header=header), *(pb.SaveRequest(chunk=c) for c in wire.chunks(snap.parts(), 1 << 20))]
    with leaves_nothing(tls, run), tls.channel() as channel:
        stub = checkpointd_pb2_grpc.CheckpointServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.Save(iter(requests), timeout=RPC_TIMEOUT, metadata=bearer(WRONG_TOKEN)))
        status = stub.GetStatus(pb.StatusRequest(run=run), timeout=RPC_TIMEOUT, metadata=bearer(TOKEN))
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert not (tls.root / run / "refused").exists()
    [row] = status.runs
    assert (row.saves_ok, row.saves_skipped, row.saves_failed) == (0, 0, 0)
    assert not row.HasField("in_flight")
    # The same request with the token is accepted and written: the refusal was the token's.
    with tls.channel() as channel:
        stub = checkpointd_pb2_grpc.CheckpointServiceStub(channel)
        replies = list(stub.Save(iter(requests), timeout=RPC_TIMEOUT, metadata=bearer(OTHER_TOKEN)))
    assert replies[0].decision.accepted and replies[-1].HasField("result")
    assert (tls.root / run / "refused" / "saved_model.pb").is_file()
    saver.close()


# The right credentials, end to end.


def test_tls_and_token_work_end_to_end_with_the_client_and_the_cli(tls: Daemon, files: Secrets) -> None:
    run = "tls-ok"
    ca = str(files.certs.ca)
    with new_saver(tls, run, channel_credentials=credentials(ca), token_file=files.client_token) as saver:
        saver.register()
        result = saver.save("policy_7", blocking=True).result()
        assert result is not None and result.step == 7
        assert (tls.root / run / "policy_7" / "saved_model.pb").is_file()
        assert saver.save_checkpoint("ckpt_7").result(RPC_TIMEOUT) is not None

        status = cli(
            "status",
            "--address",
            tls.address,
            "--tls-ca",
            ca,
            "--token-file",
            str(files.client_token),
            "--run",
            run,
            "--json",
        )
        assert status.returncode == 0, status.stderr
        [row] = json.loads(status.stdout)["runs"]
        assert (row["run"], int(row["saves_ok"])) == (run, 2)
        flush = cli(
            "flush", "--address", tls.address, "--tls-ca", ca, "--timeout", "20", env={"CHECKPOINTD_TOKEN": TOKEN}
        )
        assert flush.returncode == 0, flush.stderr
        assert run in flush.stdout

    # The same CLI without the token, or without TLS, is refused.
    no_token = cli("status", "--address", tls.address, "--tls-ca", ca)
    # Exit 2: the command could not do its job; the message names the fix.
    assert no_token.returncode == 2 and "--token-file" in no_token.stderr and "CHECKPOINTD_TOKEN" in no_token.stderr
    no_tls = cli("status", "--address", tls.address, "--token-file", str(files.client_token), "--timeout", "10")
    assert no_tls.returncode == 2 and "cannot reach" in no_tls.stderr
    wrong = cli("flush", "--address", tls.address, "--tls-ca", ca, env={"CHECKPOINTD_TOKEN": WRONG_TOKEN})
    assert wrong.returncode == 2 and "invalid bearer token" in wrong.stderr and "use one of its tokens" in wrong.stderr
    assert WRONG_TOKEN not in wrong.stderr + wrong.stdout


def test_health_and_reflection_need_no_token(tls: Daemon) -> None:
    with tls.channel() as channel:
        assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        [reply] = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=RPC_TIMEOUT
        )
    assert SERVICE in {s.name for s in reply.list_services_response.service}


# The metrics port and the logs.


def test_the_metrics_port_serves_only_metrics(tls: Daemon, files: Secrets) -> None:
    # prometheus_client serves the same exposition on every GET path (for
    # backwards compatibility), an empty 200 for /favicon.ico, and 405 for
    # other methods: nothing but metrics, wherever one looks.
    base = f"http://127.0.0.1:{tls.metrics_port}"
    secret = [
        TOKEN,
        OTHER_TOKEN,
        str(tls.root),
        str(files.server_tokens),
        str(files.certs.server.key),
        "policy_secret_dir",
    ]
    bodies = {}
    # Scraped while the run is open: a closed run drops its last-success series.
    with new_saver(tls, "metrics-leak", channel_credentials=credentials(files.certs.ca), token=TOKEN) as saver:
        saver.save("policy_secret_dir", blocking=True)
        for path in ("/metrics", "/", "/anything", "/status", "/../../etc/passwd", "/metrics?name[]=checkpointd_runs"):
            status, body = scrape(base + path)
            assert status == 200, path
            families = {f.name for f in text_string_to_metric_families(body)}
            assert families and all(
                name.startswith(("checkpointd_", "python_", "process_")) or name == "checkpointd" for name in families
            ), path
            bodies[path] = body
    assert scrape(base + "/favicon.ico") == (200, "")
    request = urllib.request.Request(base + "/metrics", data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as posted:
        urllib.request.urlopen(request, timeout=RPC_TIMEOUT)
    assert posted.value.code == 405
    for path, body in bodies.items():
        for text in secret:
            assert text not in body, (path, text)
        # Run names appear only as label values.
        for line in body.splitlines():
            if "metrics-leak" in line:
                assert re.search(r'\{(?:[^}]*,)?run="metrics-leak"[,}]', line), line
    assert 'checkpointd_last_success_timestamp_seconds{run="metrics-leak"}' in bodies["/metrics"]


def test_tokens_never_reach_the_log(tls: Daemon) -> None:
    with tls.channel() as channel:
        raw_calls(channel, "log-check", bearer(WRONG_TOKEN))
        raw_calls(channel, "log-check", None)
    log = tls.log()
    assert "auth TLS + bearer tokens (2)" in log
    assert re.search(
        r"refused /checkpointd\.v1\.CheckpointService/Save from ipv4:127\.0\.0\.1:\d+: invalid bearer token", log
    )
    assert "refused /checkpointd.v1.CheckpointService/GetStatus" in log and "missing credentials" in log
    for token in (TOKEN, OTHER_TOKEN, WRONG_TOKEN):
        assert token not in log


# Mutual TLS.


def test_mtls_refuses_a_client_without_a_certificate(mtls: Daemon, files: Secrets) -> None:
    run = "no-client-cert"
    with leaves_nothing(mtls, run):
        with mtls.channel(credentials(files.certs.ca)) as channel:
            codes = raw_calls(channel, run, None)
            with pytest.raises(grpc.RpcError) as health:
                health_status(channel)
        with pytest.raises(UnavailableError):
            new_saver(mtls, run, channel_credentials=credentials(files.certs.ca)).register()
    assert set(codes.values()) == {grpc.StatusCode.UNAVAILABLE}
    assert health.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_refuses_a_certificate_from_another_ca(mtls: Daemon, files: Secrets) -> None:
    run = "other-ca-cert"
    c = files.certs
    with leaves_nothing(mtls, run):
        with mtls.channel(credentials(c.ca, c.other_client.cert, c.other_client.key)) as channel:
            codes = raw_calls(channel, run, None)
        other = credentials(c.ca, c.other_client.cert, c.other_client.key)
        with pytest.raises(UnavailableError):
            new_saver(mtls, run, channel_credentials=other).register()
    assert set(codes.values()) == {grpc.StatusCode.UNAVAILABLE}


def test_mtls_accepts_the_right_certificate(mtls: Daemon, files: Secrets) -> None:
    run = "mtls-ok"
    c = files.certs
    with new_saver(mtls, run, channel_credentials=credentials(c.ca, c.client.cert, c.client.key)) as saver:
        assert saver.save_checkpoint("ckpt_7", blocking=True).result() is not None
    assert (mtls.root / run / "ckpt_7" / "variables" / "variables.index").is_file()
    flags = [
        "--address",
        mtls.address,
        "--tls-ca",
        str(c.ca),
        "--tls-cert",
        str(c.client.cert),
        "--tls-key",
        str(c.client.key),
    ]
    status = cli("status", *flags, "--json")
    assert status.returncode == 0, status.stderr
    assert [r["run"] for r in json.loads(status.stdout)["runs"]] == [run]
    assert cli("flush", *flags, "--timeout", "20").returncode == 0
    without_cert = cli("status", "--address", mtls.address, "--tls-ca", str(c.ca), "--timeout", "10")
    assert without_cert.returncode == 2


# Plaintext on loopback with tokens: the client sends the header itself.


def test_a_plaintext_loopback_daemon_takes_tokens_from_the_environment(plain: Daemon) -> None:
    run = "plain-token"
    with leaves_nothing(plain, run):
        with pytest.raises(UnauthenticatedError):
            new_saver(plain, run).register()
        with pytest.raises(UnauthenticatedError):
            new_saver(plain, run, token=WRONG_TOKEN).register()
    with plain.channel() as channel:
        assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
    with new_saver(plain, run, token=TOKEN) as saver:
        assert saver.save("policy_7", blocking=True).result() is not None
    assert (plain.root / run / "policy_7" / "saved_model.pb").is_file()
    status = cli("status", "--address", plain.address, "--json", env={"CHECKPOINTD_TOKEN": OTHER_TOKEN})
    assert status.returncode == 0, status.stderr
    assert [int(r["saves_ok"]) for r in json.loads(status.stdout)["runs"]] == [1]
    no_token = cli("status", "--address", plain.address)
    assert no_token.returncode == 2 and "--token-file" in no_token.stderr
    assert "auth bearer tokens (2)" in plain.log()
    assert TOKEN not in plain.log() and WRONG_TOKEN not in plain.log()


# Startup refusals.


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_non_loopback_host_without_auth_refuses_to_start(tmp_path: Path, host: str) -> None:
    root, port_file = tmp_path / "root", tmp_path / "port"
    env = {k: v for k, v in os.environ.items() if k != "CHECKPOINTD_TOKENS"}
    done = subprocess.run(
        [CHECKPOINTD, "serve", "--host", host, "--port", "0", "--port-file", str(port_file),
         "--metrics-port", "-1", "--root", str(root)],
        capture_output=True, text=True, timeout=RPC_TIMEOUT, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 2
    assert f"refusing to serve on {host}" in done.stderr and "--insecure" in done.stderr
    assert not port_file.exists() and not root.exists()
