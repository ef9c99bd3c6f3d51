"""The CLI's rough edges, each said so a person can act on it: mistyped flags, flags that do not apply,
an unreachable default address, and S3 setup failures (a missing bucket, AWS's endpoint by mistake)."""

from __future__ import annotations

import dataclasses
import io
import re
import socket
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from checkpointd.cli import ops, parse
from checkpointd.cli.flags import with_flags
from checkpointd.cli.parse import OpsCommand, config_from_args
from checkpointd.core.config import ServeConfig
from checkpointd.storage import s3
from checkpointd.storage.s3 import client as s3_client


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as caught:
        config_from_args(argv)
    assert caught.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "usage", "suggestion"),
    [
        (["serve", "--prot", "33140"], "usage: checkpointd serve", "--prot: did you mean --port?"),
        (["serve", "--metric-port=1"], "usage: checkpointd serve", "--metric-port: did you mean --metrics-port?"),
        (["status", "--adress", "h:1"], "usage: checkpointd status", "--adress: did you mean --address?"),
    ],
)
def test_a_mistyped_flag_gets_the_commands_usage_and_the_flag_meant(
    argv: list[str], usage: str, suggestion: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(argv, capsys)
    assert err.startswith(usage), err
    assert f"unrecognized arguments: {' '.join(argv[1:])} ({suggestion})" in err


def test_an_unknown_flag_like_no_other_gets_no_guess(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(["flush", "--bogus"], capsys)
    assert err.rstrip().endswith("unrecognized arguments: --bogus")


@pytest.mark.parametrize("command", ["flush", "status", "close"])
def test_a_url_for_the_address_is_refused_with_the_host_port_to_give(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused([command, "--address", "http://localhost:50051", "--run", "r"], capsys)
    assert err.startswith(f"usage: checkpointd {command}"), err
    assert "is a URL; give its gRPC address as HOST:PORT, not a URL (here 'localhost:50051')" in err


def test_an_empty_root_is_refused_not_the_current_directory(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(["serve", "--root", ""], capsys)
    assert "--root is empty: give the dir to write runs under" in err


def test_work_dir_with_a_local_root_is_refused_naming_where_a_local_root_keeps_its_state(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = refused(["serve", "--root", "/data/ckpt", "--work-dir", "/w"], capsys)
    assert "--work-dir applies to s3:// roots only; a local --root (/data/ckpt) keeps" in err
    assert "ROOT/.checkpointd/: drop --work-dir" in err


def test_an_s3_root_without_work_dir_keeps_its_state_in_checkpointd_work() -> None:
    config, _ = config_from_args(["serve", "--root", "s3://bkt/pre"])
    assert isinstance(config, ServeConfig) and config.root == Path("checkpointd-work")


def test_the_default_address_unreachable_hints_at_address(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as probe:  # a port that was free a moment ago
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setattr(ops, "DEFAULT_ADDRESS", address)
    for given, hinted in ((address, True), (address.replace("127.0.0.1", "localhost"), False)):
        err = io.StringIO()
        code = ops.run(OpsCommand("status", given, None, 5.0), io.StringIO(), err, environ={})
        assert code == 2
        assert ("(the default address: give the daemon's with --address HOST:PORT" in err.getvalue()) is hinted


def _check(tmp_path: Path, endpoint: str, failure: Exception) -> str:
    """S3Store.check's message when the bucket check fails with `failure` (no request is sent)."""
    client = s3_client.make_client(endpoint, "us-east-1")

    def head_bucket(**_: Any) -> None:
        raise failure

    client.head_bucket = head_bucket
    store = s3.S3Store("s3://bkt/pre", tmp_path, client=client)
    try:
        with pytest.raises(OSError) as caught:
            store.check()
    finally:
        store.close()
    return str(caught.value)


def test_a_missing_bucket_names_the_command_that_creates_it(tmp_path: Path) -> None:
    missing = ClientError({"Error": {"Code": "NoSuchBucket"}}, "HeadBucket")
    message = _check(tmp_path, "http://127.0.0.1:9000", missing)
    assert message.startswith("bucket 'bkt' does not exist (--root s3://bkt/pre) at http://127.0.0.1:9000")
    assert "create it first: aws s3 mb s3://bkt --endpoint-url http://127.0.0.1:9000" in message
    assert "boto3.client('s3', endpoint_url='http://127.0.0.1:9000').create_bucket(Bucket='bkt')" in message
    on_aws = _check(tmp_path, "https://s3.amazonaws.com", missing)
    assert "aws s3 mb s3://bkt (or" in on_aws and "boto3.client('s3').create_bucket" in on_aws


def test_a_connection_failure_at_awss_endpoint_names_s3_endpoint_url(tmp_path: Path) -> None:
    down = EndpointConnectionError(endpoint_url="https://bkt.s3.amazonaws.com/")
    message = _check(tmp_path, "https://s3.amazonaws.com", down)
    assert "this went to AWS (https://s3.amazonaws.com): for another S3 server" in message
    assert "give --s3-endpoint-url URL or set AWS_ENDPOINT_URL" in message
    assert "--s3-endpoint-url" not in _check(tmp_path, "http://127.0.0.1:9000", down)  # it was given


def test_aws_endpoint_url_is_honoured_and_the_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:7480")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    assert s3_client.make_client(None, None).meta.endpoint_url == "http://127.0.0.1:7480"
    assert s3_client.make_client("http://10.0.0.1:80", None).meta.endpoint_url == "http://10.0.0.1:80"
    assert s3_client.resolve_endpoint(None) == "http://127.0.0.1:7480"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9000")  # the service's own, as boto3 reads it
    assert s3_client.resolve_endpoint(None) == "http://127.0.0.1:9000"


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--admission-wait", "-1"),
        ("--upload-timeout", "0"),
        ("--grace-seconds", "-1"),
        ("--notice-window", "-1"),
        ("--write-nice", "30"),
        ("--max-workers", "0"),
        ("--max-concurrent-uploads", "0"),
        ("--max-snapshot-bytes", "0"),
        ("--max-template-bytes", "0"),
        ("--max-staging-bytes", "0"),
        ("--port", "70000"),
        ("--metrics-port", "70000"),
        ("--keep-last", "0"),
        ("--s3-read-timeout", "0"),
        ("--s3-grace-seconds", "-1"),
        ("--lease-seconds", "0"),
        ("--lease-idle-seconds", "-1"),
    ],
)
def test_a_value_out_of_range_names_the_flag_typed_not_the_configs_field(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(["serve", "--root", "/data/ckpt", flag, value], capsys)
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"checkpointd serve: error: {flag} must"), line
    assert not re.search(r"\b[a-z][a-z0-9]*_[a-z0-9_]+\b", line), f"a config field's name in: {line}"


def test_every_config_field_an_error_may_name_has_a_flag_of_serve() -> None:
    _, commands = parse._parser()
    serve = commands["serve"]
    options = {o for action in serve._actions for o in action.option_strings}  # noqa: SLF001
    for field in dataclasses.fields(ServeConfig):
        shown = with_flags(f"{field.name} must be so", serve).split()[0]
        assert shown in options, f"ServeConfig.{field.name} is shown as {shown!r}, not a flag of serve"
