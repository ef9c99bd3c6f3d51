"""The store's small S3 requests without botocore: the signature botocore would compute, its errors, its retries."""

from __future__ import annotations

import hashlib
import http.client
from typing import Any

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from botocore.exceptions import ClientError

from checkpointd.storage import s3_signed
from checkpointd.storage.s3_client import error_code, make_client, small_requests

_NOW = 1_780_000_000.0


class _Events:
    def __init__(self) -> None:
        self.emitted: list[str] = []

    def emit(self, name: str, **_: Any) -> list[Any]:
        self.emitted.append(name)
        return []


def _signed(endpoint: str = "http://127.0.0.1:7480", token: str | None = None) -> s3_signed.SignedRequests:
    return s3_signed.SignedRequests(endpoint, "us-east-1", Credentials("AKID", "SECRET", token), _Events())


@pytest.mark.parametrize("token", [None, "session-token"])
@pytest.mark.parametrize(
    ("method", "key", "body", "extra"),
    [
        ("PUT", "run/s1/checkpointd.manifest.json", b'{"files": []}\n', {"if-none-match": "*"}),
        ("PUT", "run/s 2+x~/variables/variables.index", b"\x00\x01", {"if-match": "0123abcd"}),
        ("PUT", "run/s3/saved_model.pb", b"", {"x-amz-copy-source": "b/run/s2/saved_model.pb"}),
        ("HEAD", "run/s1/checkpointd.manifest.json", b"", {}),
    ],
)
def test_the_signature_is_the_one_botocore_computes_for_the_same_request(
    monkeypatch: pytest.MonkeyPatch, token: str | None, method: str, key: str, body: bytes, extra: dict[str, str]
) -> None:
    import datetime

    import botocore.auth

    signed = _signed(token=token)
    path = "/bucket/" + s3_signed.quote(key, safe="/~")
    payload = hashlib.sha256(body).hexdigest()
    ours = signed._sign(method, path, extra, payload, now=_NOW)

    moment = datetime.datetime.fromtimestamp(_NOW, datetime.timezone.utc)  # noqa: UP017 - botocore's own call
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: moment)
    request = AWSRequest(method, "http://127.0.0.1:7480" + path, headers={"X-Amz-Content-SHA256": payload, **extra})
    request.data = body
    S3SigV4Auth(Credentials("AKID", "SECRET", token), "s3", "us-east-1").add_auth(request)
    assert ours["authorization"] == request.headers["Authorization"]
    assert ours["x-amz-date"] == request.headers["X-Amz-Date"]
    assert ours.get("x-amz-security-token") == token


def _answering(signed: s3_signed.SignedRequests, answers: list[Any]) -> list[tuple[str, str]]:
    """Makes `signed` take its answers from the list (an exception is raised); returns the requests it sends."""
    sent: list[tuple[str, str]] = []

    def exchange(method: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        sent.append((method, path))
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    signed._exchange = exchange  # type: ignore[method-assign]
    signed._drop_connection = lambda: None  # type: ignore[method-assign]
    return sent


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
    assert sent == [("PUT", "/b/a/k")] * 3 + [("PUT", "/b/a/k2")] * 2
    assert len(signed._events.emitted) == 5  # type: ignore[attr-defined]  # each attempt counted


def test_a_connection_that_keeps_failing_raises_after_the_clients_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3_signed, "_backoff", lambda attempt: None)
    signed = _signed()
    sent = _answering(signed, [ConnectionRefusedError()] * 4)
    with pytest.raises(ConnectionRefusedError):
        signed.get_object(Bucket="b", Key="k")
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
