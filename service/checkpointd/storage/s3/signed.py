"""The store's small, frequent S3 requests, signed by botocore and sent without its per-request machinery.

A save of a small policy is a handful of tiny requests (the files under one
part, the server-side copies of its graph, the fenced manifest), and a
fleet's leases add one every few seconds per run. Through a boto3 client
each costs several times the CPU of the request itself (parameter building, endpoint
rules, event hooks, urllib3, its response parsing) and a wait for a
`100-continue` before any body; the daemon's Python is serialized by the
GIL, so that CPU is what caps its commits per second. `SignedRequests`
builds the same requests as botocore `AWSRequest`s, signs them with
botocore's own SigV4 signer for S3 (`S3SigV4Auth`, as the client would) and
sends them over `http.client` (bench/README.md has the figures): path-style
URLs under the client's endpoint, the client's own credentials (refreshed as
boto3 refreshes them), every body's SHA-256 signed (`S3SigV4Auth` signs the
payload of any request to a plain-HTTP URL), so the server refuses a body that
does not match it. A failure raises botocore's `ClientError` with the S3 error
code, as the client would, so `client.error_code` and every caller's
handling stay the same; each attempt is counted through the client's own
`before-send` event, so `client.count_requests` sees it.

It is made only for a client of a plain-HTTP endpoint (radosgw or MinIO on
a private network: `make_client` attaches it, `of` finds it), where boto3
too signs each body and there is no TLS trust store to match; AWS's own
endpoints, HTTPS ones and anything else go through boto3 as before.
"""

from __future__ import annotations

import http.client
import random
import re
import socket
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlsplit

ATTRIBUTE = "checkpointd_signed"  # where `make_client` puts a client's SignedRequests
_ATTEMPTS = 4  # as the client's retries={"max_attempts": 4}
_RETRIED_STATUS = frozenset({500, 502, 503, 504})
FAILED_ATTEMPT = "checkpointd-failed-attempt.s3"  # emitted per failed attempt, + ".<operation>", with kind, url, why
_RETRIED_CODES = frozenset({"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable"})


def of(client: Any) -> SignedRequests | None:
    """The SignedRequests `make_client` attached to `client`; None (use the client) for any other."""
    found = getattr(client, ATTRIBUTE, None)
    return found if isinstance(found, SignedRequests) else None


class SignedRequests:
    """PutObject, CopyObject, HeadObject and GetObject of small objects, path-style. Thread-safe.

    Each thread keeps one keep-alive connection to the endpoint.
    """

    def __init__(
        self,
        endpoint_url: str,
        region: str,
        credentials: Any,
        events: Any = None,
        *,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
    ) -> None:
        """Args:
        endpoint_url: `http(s)://host[:port][/path]`, as the client's.
        region: the signing region.
        credentials: botocore `Credentials` (`get_frozen_credentials()` is read per request).
        events: the client's `meta.events`, to emit `before-send.s3.<operation>` per attempt.
        connect_timeout, read_timeout: seconds, as the client's config.
        """
        url = urlsplit(endpoint_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"{endpoint_url!r} is not an http(s) endpoint")
        self._scheme = url.scheme
        self._hostname = url.hostname
        default_port = 443 if self._scheme == "https" else 80
        self._port = url.port or default_port
        name = f"[{url.hostname}]" if ":" in url.hostname else url.hostname  # an IPv6 literal in brackets
        self._host = name if self._port == default_port else f"{name}:{self._port}"  # the Host header, signed
        self._base_path = url.path.rstrip("/")
        self._region = region
        self._credentials = credentials
        self._events = events
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._local = threading.local()

    # The operations, with boto3's arguments and the parts of its answers the store reads.

    def put_object(
        self, *, Bucket: str, Key: str, Body: bytes, IfNoneMatch: str | None = None, IfMatch: str | None = None
    ) -> dict[str, Any]:
        headers = {}
        if IfNoneMatch is not None:
            headers["if-none-match"] = IfNoneMatch
        if IfMatch is not None:
            headers["if-match"] = IfMatch
        status, answer, _ = self._send("PutObject", "PUT", Bucket, Key, bytes(Body), headers)
        return {"ETag": answer.get("etag", "")}

    def copy_object(
        self, *, Bucket: str, Key: str, CopySource: Mapping[str, str], CopySourceIfMatch: str | None = None
    ) -> dict[str, Any]:
        headers = {"x-amz-copy-source": quote(f"{CopySource['Bucket']}/{CopySource['Key']}", safe="/~")}
        if CopySourceIfMatch is not None:
            headers["x-amz-copy-source-if-match"] = CopySourceIfMatch
        _, _, body = self._send("CopyObject", "PUT", Bucket, Key, b"", headers)
        found = re.search(rb"<ETag>([^<]*)</ETag>", body)
        etag = found.group(1).decode().replace("&quot;", '"') if found else ""
        return {"CopyObjectResult": {"ETag": etag}}

    def head_object(self, *, Bucket: str, Key: str) -> dict[str, Any]:
        _, answer, _ = self._send("HeadObject", "HEAD", Bucket, Key, b"", {})
        return {"ETag": answer.get("etag", ""), "ContentLength": int(answer.get("content-length", 0))}

    def get_object(self, *, Bucket: str, Key: str) -> dict[str, Any]:
        """The whole object: `Body` is its bytes (`read()`able, as boto3's stream), `ETag` its ETag."""
        _, answer, body = self._send("GetObject", "GET", Bucket, Key, b"", {})
        return {"ETag": answer.get("etag", ""), "Body": _Body(body), "ContentLength": len(body)}

    # Sending.

    def _send(
        self, operation: str, method: str, bucket: str, key: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, dict[str, str], bytes]:
        from botocore.exceptions import ClientError

        path = f"{self._base_path}/{quote(bucket, safe='')}/{quote(key, safe='/~')}"
        for attempt in range(_ATTEMPTS):
            signed = self._signed(method, path, headers, body)
            if self._events is not None:  # counted, and fenced (`fencing`), as the client's own requests
                self._events.emit(f"before-send.s3.{operation}", request=signed)
            try:
                status, answer, data = self._exchange(method, path, signed.body, signed.headers)
            except (OSError, http.client.HTTPException) as e:
                self._drop_connection()
                url = f"{self._scheme}://{self._host}{path}"
                self._failed(operation, "timeout" if isinstance(e, TimeoutError) else "connection", url, repr(e))
                if attempt + 1 == _ATTEMPTS:
                    raise _transport_error(f"{self._scheme}://{self._host}{path}", e) from e
                _backoff(attempt)
                continue
            if status < 300 and not (operation == "CopyObject" and b"<Error>" in data[:512]):
                return status, answer, data
            code, message = _error(status, data)
            if status >= 500:
                kind = "throttled" if status == 503 or code == "SlowDown" else "server"
                self._failed(operation, kind, f"{self._scheme}://{self._host}{path}", f"HTTP {status} {code}")
            if attempt + 1 < _ATTEMPTS and (status in _RETRIED_STATUS or code in _RETRIED_CODES):
                _backoff(attempt)
                continue
            raise ClientError(
                {
                    "Error": {"Code": code, "Message": message},
                    "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": answer},
                },
                operation,
            )
        raise AssertionError("unreachable")

    def _failed(self, operation: str, kind: str, url: str, why: str) -> None:
        """Emits one failed attempt (`client.ERROR_KINDS`), which `client.count_errors` counts and `save_requests` notes."""
        if self._events is not None:
            self._events.emit(f"{FAILED_ATTEMPT}.{operation}", kind=kind, url=url, why=why)

    def _exchange(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> tuple[int, dict[str, str], bytes]:
        conn = self._connection()
        conn.request(method, path, body=body if method in ("PUT", "POST") else None, headers=headers)
        response = conn.getresponse()
        data = response.read()
        answer = {name.lower(): value for name, value in response.getheaders()}
        if answer.get("connection", "").lower() == "close":
            self._drop_connection()
        return response.status, answer, data

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
            conn = cls(self._hostname, self._port, timeout=self._connect_timeout)
            conn.connect()
            assert conn.sock is not None
            conn.sock.settimeout(self._read_timeout)
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.conn = conn
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def _signed(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Any:
        """The request as botocore prepares it to be sent (`AWSPreparedRequest`), signed now.

        Each attempt is signed anew: its time, and the credentials of that
        moment (frozen, so a refresh cannot mix a key with another's secret).
        """
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        request = AWSRequest(method, f"{self._scheme}://{self._host}{path}", {"host": self._host, **headers}, body)
        S3SigV4Auth(self._credentials.get_frozen_credentials(), "s3", self._region).add_auth(request)
        return request.prepare()


class _Body:
    """A GetObject body already read, with the one method the store calls on boto3's."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def read(self) -> bytes:
        return self._data


def _error(status: int, data: bytes) -> tuple[str, str]:
    """An S3 error answer's code and message; a body-less one (HEAD) is coded by its status, as botocore does."""
    if data:
        try:
            root = ET.fromstring(data)
        except ET.ParseError:
            root = None
        if root is not None:
            code = root.findtext("Code") or root.findtext("{*}Code")
            if code:
                return code, root.findtext("Message") or root.findtext("{*}Message") or ""
    return str(status), http.client.responses.get(status, "")


def _transport_error(url: str, e: BaseException) -> Exception:
    """The botocore error the client raises where a request got no answer, naming the URL and the cause."""
    from botocore.exceptions import ConnectionClosedError, EndpointConnectionError, ReadTimeoutError

    if isinstance(e, TimeoutError):
        return ReadTimeoutError(endpoint_url=url, error=e)
    if isinstance(e, ConnectionRefusedError):
        return EndpointConnectionError(endpoint_url=url, error=e)
    return ConnectionClosedError(endpoint_url=url, error=e)


def _backoff(attempt: int) -> None:
    time.sleep(random.uniform(0, min(0.05 * 2**attempt, 1.0)))  # noqa: S311 - jitter, not a secret
