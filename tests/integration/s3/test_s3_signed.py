"""The store's small requests (storage/s3_signed.py) against a real S3 server (radosgw, tests/integration/support/rgw.py).

What SignedRequests signs with botocore's signer the server accepts, and the
body's SHA-256 in that signature is checked: the same signed request with
one byte of its body changed is refused and stores nothing. What it stores
is read back through the boto3 client, the other path.
"""

from __future__ import annotations

import hashlib
import http.client
import secrets
from typing import Any
from urllib.parse import urlsplit

import pytest

from checkpointd.storage.s3 import signed as s3_signed
from checkpointd.storage.s3.client import error_code, small_requests
from tests.integration.support.rgw import Rgw


@pytest.fixture
def signed(rgw: Rgw) -> tuple[Any, s3_signed.SignedRequests, str]:
    """The boto3 client, its SignedRequests, and a key prefix of this test's own."""
    client = rgw.client()
    requests = small_requests(client)
    assert isinstance(requests, s3_signed.SignedRequests)  # radosgw's endpoint is plain HTTP
    return client, requests, f"signed-{secrets.token_hex(4)}"


def test_puts_copies_heads_and_gets_it_signs_are_accepted_and_store_the_bytes(
    rgw: Rgw, signed: tuple[Any, s3_signed.SignedRequests, str]
) -> None:
    client, requests, prefix = signed
    body = secrets.token_bytes(1500)
    key = f"{prefix}/run/s 1+x~/variables/variables.index"  # escaped in the path and in the signature alike

    put = requests.put_object(Bucket=rgw.bucket, Key=key, Body=body, IfNoneMatch="*")
    assert client.get_object(Bucket=rgw.bucket, Key=key)["Body"].read() == body
    assert put["ETag"] == client.head_object(Bucket=rgw.bucket, Key=key)["ETag"]

    copy = f"{prefix}/run/s2/variables/variables.index"
    copied = requests.copy_object(
        Bucket=rgw.bucket, Key=copy, CopySource={"Bucket": rgw.bucket, "Key": key}, CopySourceIfMatch=put["ETag"]
    )
    assert copied["CopyObjectResult"]["ETag"].strip('"') == put["ETag"].strip('"')  # radosgw's copy ETag is bare
    assert requests.head_object(Bucket=rgw.bucket, Key=copy)["ContentLength"] == len(body)
    assert requests.get_object(Bucket=rgw.bucket, Key=copy)["Body"].read() == body

    with pytest.raises(Exception) as again:  # the signed condition header is honoured
        requests.put_object(Bucket=rgw.bucket, Key=key, Body=b"other", IfNoneMatch="*")
    assert error_code(again.value) == "PreconditionFailed"


def test_a_body_that_does_not_match_its_signed_sha256_is_refused_and_nothing_stored(
    rgw: Rgw, signed: tuple[Any, s3_signed.SignedRequests, str]
) -> None:
    client, requests, prefix = signed
    body = secrets.token_bytes(1024)
    tampered = bytes([body[0] ^ 1]) + body[1:]
    key = f"{prefix}/run/s1/checkpointd.manifest.json"
    path = f"/{rgw.bucket}/{key}"
    request = requests._signed("PUT", path, {}, body)  # what put_object would send
    assert request.headers["X-Amz-Content-SHA256"] == hashlib.sha256(body).hexdigest()

    def send(data: bytes) -> tuple[int, bytes]:
        endpoint = urlsplit(rgw.endpoint)
        assert endpoint.hostname is not None
        conn = http.client.HTTPConnection(endpoint.hostname, endpoint.port, timeout=30)
        try:
            conn.request("PUT", path, body=data, headers=request.headers)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    status, answer = send(tampered)
    assert status == 400, answer
    assert b"XAmzContentSHA256Mismatch" in answer
    assert not client.list_objects_v2(Bucket=rgw.bucket, Prefix=f"{prefix}/").get("Contents")

    status, answer = send(body)  # the same signed request with its own body: accepted
    assert status == 200, answer
    assert client.get_object(Bucket=rgw.bucket, Key=key)["Body"].read() == body
