"""The store's small S3 requests without the boto3 client: what botocore's signer is given and signs, the errors, the retries.

That the server accepts what SignedRequests signs, and refuses a body that does
not match, is tests/integration/s3/test_s3_signed.py's, against radosgw.
"""

from __future__ import annotations

import hashlib
import http.client
from collections.abc import Mapping
from typing import Any, NamedTuple

import pytest
from botocore.credentials import Credentials, ReadOnlyCredentials
from botocore.exceptions import ClientError, EndpointConnectionError

from checkpointd.storage.s3 import signed as s3_signed
from checkpointd.storage.s3.client import error_code, make_client, small_requests


class _Events:
    def __init__(self) -> None:
        self.emitted: list[str] = []

    def emit(self, name: str, **_: Any) -> list[Any]:
        self.emitted.append(name)
        return []


def _signed() -> s3_signed.SignedRequests:
    return s3_signed.SignedRequests("http://127.0.0.1:7480", "us-east-1", Credentials("AKID", "SECRET"), _Events())


class _Sent(NamedTuple):
    method: str
    path: str
    headers: dict[str, str]
    body: bytes | None


def _answering(signed: s3_signed.SignedRequests, answers: list[Any]) -> list[_Sent]:
    """Makes `signed` take its answers from the list (an exception is raised); returns the requests it sends."""
    sent: list[_Sent] = []

    def exchange(
        method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> tuple[int, dict[str, str], bytes]:
        sent.append(_Sent(method, path, dict(headers), body))
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    signed._exchange = exchange  # type: ignore[method-assign]
    signed._drop_connection = lambda: None  # type: ignore[method-assign]
    return sent


class _Rotating:
    """Credentials that a refresh rotates: each read gives the next key, as a refreshed `Credentials` would."""

    def __init__(self, *tokens: str | None) -> None:
        self._tokens = list(tokens)
        self.reads = 0

    def get_frozen_credentials(self) -> ReadOnlyCredentials:
        self.reads += 1
        return ReadOnlyCredentials(f"AKID{self.reads}", f"SECRET{self.reads}", self._tokens.pop(0))


def test_each_attempt_is_signed_anew_with_that_moments_credentials_and_the_bodys_sha256(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(s3_signed, "_backoff", lambda attempt: None)
    credentials = _Rotating(None, "session-token")
    signed = s3_signed.SignedRequests("http://127.0.0.1:7480", "eu-west-3", credentials, _Events())
    body = b'{"files": []}\n'
    sent = _answering(signed, [(503, {}, b"<Error><Code>SlowDown</Code></Error>"), (200, {"etag": '"e"'}, b"")])
    signed.put_object(Bucket="b", Key="run/s 1/checkpointd.manifest.json", Body=body, IfNoneMatch="*")

    assert [request.path for request in sent] == ["/b/run/s%201/checkpointd.manifest.json"] * 2
    first, second = (request.headers for request in sent)
    for n, headers in enumerate((first, second), 1):
        # Over plain HTTP the payload is signed, never UNSIGNED-PAYLOAD: the server checks the body by it.
        assert headers["X-Amz-Content-SHA256"] == hashlib.sha256(body).hexdigest()
        assert headers["Authorization"].startswith(f"AWS4-HMAC-SHA256 Credential=AKID{n}/")
        assert "/eu-west-3/s3/aws4_request, " in headers["Authorization"]
        signed_names = headers["Authorization"].split("SignedHeaders=")[1].split(",")[0].split(";")
        assert {"host", "if-none-match", "x-amz-content-sha256", "x-amz-date"} <= set(signed_names)
        assert headers["host"] == "127.0.0.1:7480"
    assert "X-Amz-Security-Token" not in first and second["X-Amz-Security-Token"] == "session-token"
    assert "x-amz-security-token" in second["Authorization"]
    assert [request.body for request in sent] == [body, body]
    assert credentials.reads == 2


@pytest.mark.parametrize(
    ("endpoint", "host", "path"),
    [
        ("http://[::1]", "[::1]", "/b/k"),
        ("http://[::1]:7480", "[::1]:7480", "/b/k"),
        ("http://RGW.example:80/base/", "rgw.example", "/base/b/k"),
        ("http://rgw.example:7480/base", "rgw.example:7480", "/base/b/k"),
    ],
)
def test_the_signed_host_and_path_are_the_ones_sent(endpoint: str, host: str, path: str) -> None:
    signed = s3_signed.SignedRequests(endpoint, "us-east-1", Credentials("AKID", "SECRET"), _Events())
    sent = _answering(signed, [(200, {}, b"")])
    signed.head_object(Bucket="b", Key="k")
    [request] = sent
    assert (request.method, request.path, request.headers["host"]) == ("HEAD", path, host)


def test_a_failed_answer_raises_the_clienterror_botocore_would_with_the_s3_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(s3_signed, "_backoff", lambda attempt: None)
    signed = _signed()
    error = b"<?xml version='1.0'?><Error><Code>PreconditionFailed</Code><Message>no</Message></Error>"
    sent = _answering(signed, [(412, {}, error), (404, {}, b""), (200, {}, b"<Error><Code>NoSuchKey</Code></Error>")])
    with pytest.raises(ClientError) as put:
        signed.put_object(Bucket="b", Key="k", Body=b"x", IfNoneMatch="*")
    with pytest.raises(ClientError) as head:
        signed.head_object(Bucket="b", Key="k")
    with pytest.raises(ClientError) as copy:  # a copy's failure may come in a 200
        signed.copy_object(Bucket="b", Key="k2", CopySource={"Bucket": "b", "Key": "k"})
    assert (error_code(put.value), error_code(head.value), error_code(copy.value)) == (
        "PreconditionFailed",
        "404",
        "NoSuchKey",
    )
    assert len(sent) == 3  # none of them is retried
    assert signed._events.emitted == [  # type: ignore[attr-defined]
        "before-send.s3.PutObject",
        "before-send.s3.HeadObject",
        "before-send.s3.CopyObject",
    ]


def test_a_dropped_connection_or_a_5xx_is_retried_and_the_answer_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3_signed, "_backoff", lambda attempt: None)
    signed = _signed()
    copied = b"<CopyObjectResult><ETag>&quot;abc&quot;</ETag></CopyObjectResult>"
    sent = _answering(
        signed,
        [
            http.client.RemoteDisconnected("closed"),
            (503, {}, b"<Error><Code>SlowDown</Code></Error>"),
            (200, {"etag": '"e1"'}, b""),
            ConnectionResetError(),
            (200, {}, copied),
        ],
    )
    assert signed.put_object(Bucket="b", Key="a/k", Body=b"x")["ETag"] == '"e1"'
    assert signed.copy_object(Bucket="b", Key="a/k2", CopySource={"Bucket": "b", "Key": "a/k"}) == {
        "CopyObjectResult": {"ETag": '"abc"'}
    }
    assert [(request.method, request.path) for request in sent] == [("PUT", "/b/a/k")] * 3 + [("PUT", "/b/a/k2")] * 2
    emitted = signed._events.emitted
    assert [e for e in emitted if e.startswith("before-send.")] == [  # each attempt counted
        "before-send.s3.PutObject"
    ] * 3 + ["before-send.s3.CopyObject"] * 2
    assert [e for e in emitted if e.startswith(s3_signed.FAILED_ATTEMPT)] == [  # and each failed one
        f"{s3_signed.FAILED_ATTEMPT}.PutObject"
    ] * 2 + [f"{s3_signed.FAILED_ATTEMPT}.CopyObject"]


def test_a_connection_that_keeps_failing_raises_after_the_clients_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3_signed, "_backoff", lambda attempt: None)
    signed = _signed()
    sent = _answering(signed, [ConnectionRefusedError()] * 4)
    with pytest.raises(EndpointConnectionError, match="127.0.0.1") as raised:  # as the client raises it
        signed.get_object(Bucket="b", Key="k")
    assert isinstance(raised.value.__cause__, ConnectionRefusedError)
    assert len(sent) == 4


@pytest.mark.parametrize(
    ("endpoint", "signed"),
    [("http://127.0.0.1:9", True), ("https://rgw.example:443", False), (None, False)],
)
def test_only_a_plain_http_endpoints_client_gets_signed_requests(
    monkeypatch: pytest.MonkeyPatch, endpoint: str | None, signed: bool
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKID")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "SECRET")
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    client = make_client(endpoint, "us-east-1")
    small = small_requests(client)
    assert isinstance(small, s3_signed.SignedRequests) is signed
    assert (small is client) is not signed
