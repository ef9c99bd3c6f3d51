"""The object store's pure parts, without a server: URLs, keys, Content-MD5, the CLI's s3:// arguments."""

from __future__ import annotations

import base64
import hashlib
import io
from pathlib import Path, PurePosixPath

import pytest

from checkpointd.cli.parse import FetchCommand, VerifyCommand, config_from_args
from checkpointd.core.config import ServeConfig
from checkpointd.storage.s3.client import S3Url, body_is_signed, content_md5, make_client


@pytest.mark.parametrize(
    ("url", "bucket", "prefix"),
    [("s3://bkt", "bkt", ""), ("s3://bkt/", "bkt", ""), ("s3://my.bucket-1/a/b/", "my.bucket-1", "a/b")],
)
def test_an_s3_url_names_a_bucket_and_a_prefix(url: str, bucket: str, prefix: str) -> None:
    parsed = S3Url.parse(url)
    assert (parsed.bucket, parsed.prefix) == (bucket, prefix)


@pytest.mark.parametrize("url", ["/local/dir", "s3://", "s3://UPPER/x", "s3://b/a//c", "s3://bkt/../x", "s3://x"])
def test_a_bad_s3_url_is_refused(url: str) -> None:
    with pytest.raises(ValueError):
        S3Url.parse(url)


@pytest.mark.parametrize("body", [b"some bytes", io.BytesIO(b"x" * (3 << 20))])
def test_content_md5_is_the_bodys_and_a_file_body_is_rewound(body: bytes | io.BytesIO) -> None:
    data = body if isinstance(body, bytes) else body.getvalue()
    if isinstance(body, io.BytesIO):
        body.seek(5)
        data = data[5:]
    params: dict[str, object] = {"headers": {}, "body": body}
    content_md5(params)
    assert params["headers"] == {"Content-MD5": base64.b64encode(hashlib.md5(data).digest()).decode()}
    if isinstance(body, io.BytesIO):
        assert body.tell() == 5


def test_serve_with_an_s3_root_keeps_state_in_the_work_dir() -> None:
    config, _ = config_from_args(
        ["serve", "--root", "s3://bkt/pre", "--work-dir", "/w", "--s3-endpoint-url", "http://h:1", "--s3-region", "r"]
    )
    assert isinstance(config, ServeConfig)
    assert (config.s3_url, config.root, config.s3_endpoint_url, config.s3_region) == (
        "s3://bkt/pre", Path("/w"), "http://h:1", "r",
    )  # fmt: skip
    local, _ = config_from_args(["serve", "--root", "here"])
    assert isinstance(local, ServeConfig) and (local.s3_url, local.root) == (None, Path("here"))


def test_an_endpoint_without_an_s3_root_is_refused() -> None:
    with pytest.raises(ValueError, match="s3:// root"):
        ServeConfig(s3_endpoint_url="http://h:1")


def test_fetch_and_verify_take_s3_urls() -> None:
    fetch, _ = config_from_args(["fetch", "--root", "s3://b/p", "run/ckpt", "out"])
    assert fetch == FetchCommand("s3://b/p", "run/ckpt", Path("out"))
    verify, _ = config_from_args(["verify", "s3://b/p/run", "local"])
    assert isinstance(verify, VerifyCommand)
    assert (verify.urls, verify.paths) == (("s3://b/p/run",), (Path("local"),))
    with pytest.raises(SystemExit):
        config_from_args(["fetch", "--root", "/local", "run", "out"])


def test_keys_are_under_the_prefix_and_checked_like_local_paths(tmp_path: Path) -> None:
    pytest.importorskip("boto3")
    from checkpointd.protocol.errors import InvalidRequestError
    from checkpointd.storage.s3 import S3Store

    store = S3Store("s3://bkt/pre", tmp_path, endpoint_url="http://127.0.0.1:9", region="us-east-1")
    try:
        assert store.target("run", "policies/p") == PurePosixPath("pre/run/policies/p")
        assert store.describe() == "s3://bkt/pre"
        with pytest.raises(InvalidRequestError):
            store.target("run", "../other")
        staging = store.stage(store.target("run", "p"))
        assert staging.parent == tmp_path and staging.name.startswith(".checkpointd-tmp-p-")
    finally:
        store.close()


def test_serve_takes_the_lease_timing_and_refuses_nonsense(capsys: pytest.CaptureFixture[str]) -> None:
    config, _ = config_from_args(["serve", "--root", "s3://bkt/p"])
    assert isinstance(config, ServeConfig)
    assert (config.lease_seconds, config.lease_idle_seconds) == (30.0, 120.0)
    assert config.register_wait_seconds == 180.0  # a dead daemon's lease, or a live one's idle release
    config, _ = config_from_args(["serve", "--root", "s3://bkt/p", "--lease-seconds", "5", "--lease-idle-seconds", "5"])
    assert isinstance(config, ServeConfig) and (config.lease_seconds, config.lease_idle_seconds) == (5.0, 5.0)
    for flags, said in (
        (["--lease-seconds", "2"], "--lease-seconds must be >= 3"),
        (["--lease-seconds", "nan"], "--lease-seconds must be >= 3"),
        (["--lease-seconds", "200"], "--lease-idle-seconds must be >= --lease-seconds (200)"),
    ):
        with pytest.raises(SystemExit):
            config_from_args(["serve", "--root", "s3://bkt/p", *flags])
        assert said in capsys.readouterr().err


@pytest.mark.parametrize(
    ("endpoint", "signed"),
    [(None, False), ("https://rgw.example:443", False), ("HTTP://127.0.0.1:8080", True), ("http://h:1", True)],
)
def test_the_body_is_signed_over_plain_http_only(endpoint: str | None, signed: bool) -> None:
    assert body_is_signed(endpoint) is signed


@pytest.mark.parametrize("endpoint", ["https://rgw.example", "http://rgw.example"])
def test_an_upload_carries_content_md5_exactly_where_its_body_is_not_signed(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from botocore.awsrequest import AWSResponse

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    client = make_client(endpoint, "us-east-1")
    seen: list[dict[str, str]] = []

    def answer(request: object, **_: object) -> AWSResponse:  # never leaves the process
        seen.append({k: v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()})  # type: ignore[attr-defined]
        response = AWSResponse("", 200, {"ETag": '"e"'}, None)  # type: ignore[arg-type]
        response._content = b""  # the body, read already
        return response

    client.meta.events.register("before-send.s3.PutObject", answer)
    client.put_object(Bucket="bkt", Key="k", Body=b"data")
    [headers] = seen
    if endpoint.startswith("https"):
        assert headers["Content-MD5"] == base64.b64encode(hashlib.md5(b"data").digest()).decode()
        assert headers["X-Amz-Content-SHA256"] == "UNSIGNED-PAYLOAD"
    else:
        assert "Content-MD5" not in headers
        assert headers["X-Amz-Content-SHA256"] == hashlib.sha256(b"data").hexdigest()


def test_the_etag_log_keeps_the_answered_etag_of_awaited_keys_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from botocore.awsrequest import AWSResponse

    from checkpointd.storage.s3.client import ETagLog

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    client = make_client("http://rgw.example", "us-east-1")
    log = ETagLog(client)
    etag = {"a": '"e-a"', "b": '"e-b"', "m": '""'}  # radosgw answers a CompleteMultipartUpload with ""

    def put(request: object, **_: object) -> AWSResponse:  # never leaves the process
        key = request.url.rsplit("/", 1)[1].split("?")[0]  # type: ignore[attr-defined]
        response = AWSResponse("", 200, {"ETag": etag[key]}, None)  # type: ignore[arg-type]
        response._content = b""
        return response

    def complete(request: object, **_: object) -> AWSResponse:
        body = f"<CompleteMultipartUploadResult><Key>m</Key><ETag>{etag['m']}</ETag></CompleteMultipartUploadResult>"
        response = AWSResponse("", 200, {}, None)  # type: ignore[arg-type]
        response._content = body.encode()
        return response

    client.meta.events.register("before-send.s3.PutObject", put)
    client.meta.events.register("before-send.s3.CompleteMultipartUpload", complete)
    with log.awaiting("bkt", ["a", "m"]) as etags:
        client.put_object(Bucket="bkt", Key="a", Body=b"1")
        client.put_object(Bucket="bkt", Key="b", Body=b"2")  # not awaited: the lease's, a manifest
        client.complete_multipart_upload(Bucket="bkt", Key="m", UploadId="u", MultipartUpload={"Parts": []})
    assert etags == {"a": "e-a"}  # no ETag for m: the store reads it back with a HEAD
    client.put_object(Bucket="bkt", Key="a", Body=b"3")  # after the block: nobody awaits it
    assert etags == {"a": "e-a"}


def test_the_staged_files_are_the_manifests_list(tmp_path: Path) -> None:
    from checkpointd.storage.s3.commit import MANIFEST, staged_files

    for rel in ("saved_model.pb", "variables/variables.index", "assets/a/b.txt", MANIFEST):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    assert staged_files(tmp_path) == ["assets/a/b.txt", "saved_model.pb", "variables/variables.index"]
    (tmp_path / "variables" / "link").symlink_to(tmp_path / "saved_model.pb")
    with pytest.raises(OSError, match="not a regular file"):
        staged_files(tmp_path)
