"""The S3 client the object store uses: URL, connection and retries, body checks, and what its answers carry.

`make_client` makes a boto3 client that works on AWS and on radosgw, every
upload's body checked by the server (with `signed` beside it for the
store's small requests to a plain-HTTP endpoint, `small_requests`); `ETagLog` reads the ETag of each upload
from the client's own answers; `Progress` reports a transfer's bytes. boto3
is imported when a client is made, so the rest of the daemon does not need it.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from checkpointd.protocol.errors import UnavailableError
from checkpointd.storage.s3 import signed


class StoreSetupError(OSError):
    """The bucket cannot be used: no credentials, refused, missing or unreachable."""


@dataclass(frozen=True)
class S3Url:
    """`s3://bucket/prefix`, parsed."""

    bucket: str
    prefix: str  # no leading or trailing '/'; may be empty

    @classmethod
    def parse(cls, url: str) -> S3Url:
        """Raises ValueError unless `url` is `s3://BUCKET[/PREFIX]`."""
        if not url.startswith("s3://"):
            raise ValueError(f"{url!r} is not an s3:// URL")
        bucket, _, rest = url[len("s3://") :].partition("/")
        if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", bucket):
            raise ValueError(f"{url!r} does not name a valid bucket (s3://BUCKET/PREFIX)")
        key_prefix = rest.strip("/")
        if any(part in ("", ".", "..") for part in key_prefix.split("/")) and key_prefix:
            raise ValueError(f"{url!r} has an empty, '.' or '..' component in its prefix")
        return cls(bucket, key_prefix)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def count_requests(client: Any, count: Callable[[str], None]) -> None:
    """Calls `count(operation)` before each request `client` sends (each attempt of a retried one).

    botocore's documented before-send event names the operation last
    (`before-send.s3.PutObject`); the hook returns None, as a value returned
    there would be taken as the response and the request not sent.
    """

    def hook(event_name: str = "", **_: Any) -> None:
        count(event_name.rpartition(".")[2] or "unknown")

    client.meta.events.register("before-send.s3", hook)


ERROR_KINDS = ("connection", "timeout", "throttled", "server")


def error_kind(status: int = 0, code: str = "", exception: BaseException | None = None) -> str | None:
    """Which of ERROR_KINDS an attempt's failure is; None if the store did not fail (no error, or a 4xx)."""
    from botocore.exceptions import BotoCoreError, ConnectTimeoutError, ReadTimeoutError

    if exception is not None:
        if not isinstance(exception, (BotoCoreError, OSError)):
            return None  # the daemon's own refusal before sending (a lease fence), not the store's
        timeout = isinstance(exception, (ReadTimeoutError, ConnectTimeoutError, TimeoutError))
        return "timeout" if timeout else "connection"
    if status == 503 or code in ("SlowDown", "Throttling", "ThrottlingException"):
        return "throttled"
    return "server" if status >= 500 else None


def count_errors(client: Any, count: Callable[[str, str], None]) -> None:
    """Calls `count(operation, kind)` for each attempt of a request the store failed (see `error_kind`).

    botocore emits `needs-retry.s3.<operation>` after every attempt, the last
    one included, with the parsed answer or the exception caught; the hook
    returns None, so the retry handler's answer is the one taken. The
    requests `signed` sends are counted from its own event, `signed.FAILED_ATTEMPT`.
    """

    def after_attempt(event_name: str = "", response: Any = None, caught_exception: Any = None, **_: Any) -> None:
        parsed = response[1] if isinstance(response, tuple) and len(response) > 1 else {}
        kind = error_kind(
            int(parsed.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0),
            str(parsed.get("Error", {}).get("Code", "")),
            caught_exception if isinstance(caught_exception, Exception) else None,
        )
        if kind is not None:
            count(event_name.rpartition(".")[2] or "unknown", kind)

    def failed_attempt(event_name: str = "", kind: str = "", **_: Any) -> None:
        count(event_name.rpartition(".")[2] or "unknown", kind)

    client.meta.events.register("needs-retry.s3", after_attempt)
    client.meta.events.register(signed.FAILED_ATTEMPT, failed_attempt)


def make_client(
    endpoint_url: str | None, region: str | None, max_connections: int = 32, read_timeout: float = 20.0
) -> Any:
    """An S3 client that works on AWS and on radosgw; every upload's body is checked by the server.

    Over HTTPS, SigV4 sends UNSIGNED-PAYLOAD, so each PutObject/UploadPart
    carries a Content-MD5 (`content_md5`) that the server verifies. Over
    plain HTTP, SigV4 signs the body's SHA-256 and the server refuses a body
    that does not match it, so an MD5 pass would check the same bytes twice.
    """
    import boto3
    from botocore.config import Config

    # Resolved here, not left to boto3, so AWS_ENDPOINT_URL also picks path-style
    # addressing and the body checks of a non-AWS server below.
    endpoint_url = resolve_endpoint(endpoint_url)

    config = Config(
        region_name=region,
        # rgw rejects botocore's default trailing checksums over HTTPS (411)
        # and ignores CRC32C anyway: checksum only where an API requires it,
        # and let the server check each body another way (see the docstring).
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        # standard mode retries what S3 documents as retryable (throttles such
        # as 503 SlowDown, 500 InternalError, connection errors, timeouts) with
        # jittered exponential backoff; 4 attempts of at most connect_timeout +
        # read_timeout each bound how long a save waits on a store that is gone.
        retries={"max_attempts": 4, "mode": "standard"},
        connect_timeout=5,
        # Per socket read (or write), not per request: a server that accepts
        # and then goes silent is cut after this, and the request retried,
        # instead of holding the run's lane (botocore's default is 60 s, so a
        # stalled server held a save for minutes across the 4 attempts).
        read_timeout=read_timeout,
        max_pool_connections=max_connections,
        s3={"addressing_style": "path" if endpoint_url else "auto"},
    )
    session = boto3.session.Session()
    client = session.client("s3", endpoint_url=endpoint_url, config=config)
    if not body_is_signed(endpoint_url):
        for operation in ("PutObject", "UploadPart"):
            client.meta.events.register(f"before-call.s3.{operation}", content_md5)
    credentials = session.get_credentials()
    if endpoint_url is not None and body_is_signed(endpoint_url) and credentials is not None:
        requests = signed.SignedRequests(
            endpoint_url, client.meta.region_name or "us-east-1", credentials, client.meta.events,
            connect_timeout=5, read_timeout=read_timeout,
        )  # fmt: skip
        setattr(client, signed.ATTRIBUTE, requests)  # the store's small requests go this way (`signed`)
    return client


def small_requests(client: Any) -> Any:
    """What sends the store's small PutObject/CopyObject/HeadObject/GetObject: the client's
    `signed.SignedRequests` if `make_client` gave it one, else the client itself (same arguments)."""
    return signed.of(client) or client


def _is_aws(endpoint_url: str | None) -> bool:
    return endpoint_url is None or endpoint_url.rstrip("/").endswith(".amazonaws.com")


def endpoint_hint(endpoint_url: str | None) -> str:
    """For a failure at AWS's own endpoint: the flag (or variable) that names another S3 server."""
    if not _is_aws(endpoint_url):
        return ""
    return (
        f"; this went to AWS ({endpoint_url}): for another S3 server (radosgw, MinIO...) give "
        "--s3-endpoint-url URL or set AWS_ENDPOINT_URL"
    )


def create_bucket_command(bucket: str, endpoint_url: str | None) -> str:
    """A command that creates `bucket` at the endpoint: the AWS CLI's, and one with boto3 (checkpointd's)."""
    aws = f"aws s3 mb s3://{bucket}" + ("" if _is_aws(endpoint_url) else f" --endpoint-url {endpoint_url}")
    endpoint = "" if _is_aws(endpoint_url) else f"endpoint_url={endpoint_url!r}"
    python = f"python -c \"import boto3; boto3.client('s3', {endpoint}).create_bucket(Bucket={bucket!r})\""
    return f"{aws} (or, without the AWS CLI: {python})".replace("('s3', )", "('s3')")


def check_bucket(client: Any, url: S3Url, key_base: str) -> None:
    """Proves the bucket reachable and ours (a HEAD and a one-key listing under `key_base`).

    Raises:
        StoreSetupError: with what to fix (credentials, bucket, endpoint).
    """
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    bucket, endpoint_url = url.bucket, client.meta.endpoint_url
    try:
        client.head_bucket(Bucket=bucket)
        client.list_objects_v2(Bucket=bucket, Prefix=key_base, MaxKeys=1)
    except NoCredentialsError:
        raise StoreSetupError(
            f"no AWS credentials for {url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "or AWS_PROFILE with ~/.aws/credentials"
        ) from None
    except ClientError as e:
        code = error_code(e)
        if code in ("404", "NoSuchBucket"):
            raise StoreSetupError(
                f"bucket {bucket!r} does not exist (--root {url}) at {endpoint_url}; "
                f"create it first: {create_bucket_command(bucket, endpoint_url)}"
            ) from None
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise StoreSetupError(
                f"access to bucket {bucket!r} was refused ({code}): check the AWS credentials "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the AWS config) and the bucket's policy"
                f"{endpoint_hint(endpoint_url)}"
            ) from None
        raise StoreSetupError(f"cannot use bucket {bucket!r}: {code or e}") from None
    except BotoCoreError as e:
        raise StoreSetupError(f"cannot reach the S3 server for {url}: {e}{endpoint_hint(endpoint_url)}") from None


def resolve_endpoint(endpoint_url: str | None) -> str | None:
    """The S3 server to use: the flag's, else AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (as boto3 reads them), else AWS's."""
    return endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def body_is_signed(endpoint_url: str | None) -> bool:
    """True where SigV4 signs each request body's SHA-256 (plain HTTP); AWS's default endpoint is HTTPS."""
    return endpoint_url is not None and endpoint_url.lower().startswith("http://")


def content_md5(params: dict[str, Any], **_: Any) -> None:
    """Adds Content-MD5 to an upload request: the server refuses a body that does not match."""
    headers = params["headers"]
    body = params.get("body")
    if body is None or "Content-MD5" in headers:
        return
    md5 = hashlib.md5(usedforsecurity=False)
    if isinstance(body, (bytes, bytearray, memoryview)):
        md5.update(body)
    else:  # s3transfer's file chunk: read it through, then rewind for the send
        start = body.tell()
        for block in iter(lambda: body.read(1 << 20), b""):
            md5.update(block)
        body.seek(start)
    headers["Content-MD5"] = base64.b64encode(md5.digest()).decode("ascii")


def error_code(e: BaseException) -> str:
    """The S3 error code of a botocore ClientError ("NoSuchKey", "404", ...); "" for any other exception."""
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def store_failed(e: BaseException) -> bool:
    """True if `e` is the object store failing, not the request: unreachable, cut, timed out, 5xx or throttled.

    What S3 documents as retryable: the same request may succeed later.
    """
    from botocore.exceptions import ConnectionError, HTTPClientError

    if isinstance(e, (ConnectionError, HTTPClientError)):
        return True
    status = getattr(e, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return status >= 500 or error_code(e) in ("SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable")


@contextlib.contextmanager
def unavailable_on_error(what: str) -> Iterator[None]:
    """Turns the object store's failures into UnavailableError (retry later)."""
    from botocore.exceptions import BotoCoreError, ClientError

    from checkpointd.storage.s3.save_requests import SaveDeadlineError

    try:
        yield
    except (BotoCoreError, ClientError, SaveDeadlineError) as e:
        raise UnavailableError(f"the object store failed {what}: {e}") from e


class ETagLog:
    """The ETag each upload of an awaited key was answered with, from the client's own responses.

    s3transfer returns nothing per upload; botocore's documented events do:
    `before-parameter-build` sees a request's Key (kept in its context),
    `after-call` its parsed answer. PutObject answers a single-request
    object's ETag, CompleteMultipartUpload a multipart one's, each only once
    the server has the whole object. Keys nobody awaits (the leases', the
    manifests') are not recorded.
    """

    _OPERATIONS = ("PutObject", "CompleteMultipartUpload")

    def __init__(self, client: Any) -> None:
        self._lock = threading.Lock()
        self._awaited: dict[tuple[str, str], dict[str, str]] = {}
        for operation in self._OPERATIONS:
            client.meta.events.register(f"before-parameter-build.s3.{operation}", self._note_key)
            client.meta.events.register(f"after-call.s3.{operation}", self._record)

    @contextlib.contextmanager
    def awaiting(self, bucket: str, keys: Iterable[str]) -> Iterator[dict[str, str]]:
        """Records the ETags of `keys`' uploads made inside the block, into the dict it yields (key -> ETag)."""
        etags: dict[str, str] = {}
        wanted = [(bucket, key) for key in keys]
        with self._lock:
            for item in wanted:
                self._awaited[item] = etags
        try:
            yield etags
        finally:
            with self._lock:
                for item in wanted:
                    if self._awaited.get(item) is etags:
                        del self._awaited[item]

    @staticmethod
    def _note_key(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        context["checkpointd_key"] = (params.get("Bucket"), params.get("Key"))

    def _record(self, parsed: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        item, etag = context.get("checkpointd_key"), str(parsed.get("ETag") or "").strip('"')
        if item is None or not etag or "Error" in parsed:
            return
        with self._lock:
            etags = self._awaited.get(item)
            if etags is not None:
                etags[item[1]] = etag


class Progress:
    """An s3transfer subscriber that reports bytes as they arrive."""

    def __init__(self, report: Callable[[int], None]) -> None:
        self._report = report

    def on_queued(self, **_: Any) -> None:
        pass

    def on_progress(self, bytes_transferred: int, **_: Any) -> None:
        self._report(bytes_transferred)

    def on_done(self, **_: Any) -> None:
        pass
