"""The daemon's object-store requests counted by operation (botocore's before-send event)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from checkpointd.metrics import Metrics
from checkpointd.storage.s3 import signed as s3_signed
from checkpointd.storage.s3.client import count_errors, count_requests, make_client


def test_each_request_counts_under_its_operation_and_the_hook_lets_it_be_sent() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    client = make_client("http://127.0.0.1:9", "us-east-1")  # nothing is sent: the events are emitted here
    count_requests(client, metrics.s3_request)
    for operation in ("PutObject", "PutObject", "ListObjectsV2"):
        responses = client.meta.events.emit(f"before-send.s3.{operation}", request=object())
        # A value a before-send handler returns is taken as the response and the request not sent.
        assert all(response is None for _, response in responses)

    def count(operation: str) -> float | None:
        return registry.get_sample_value("checkpointd_s3_requests_total", {"operation": operation})

    assert count("PutObject") == 2
    assert count("ListObjectsV2") == 1
    assert count("GetObject") is None


def test_each_attempt_the_store_failed_counts_under_its_operation_and_kind() -> None:
    from types import SimpleNamespace

    from botocore.exceptions import EndpointConnectionError, ReadTimeoutError
    from botocore.hooks import HierarchicalEmitter

    registry = CollectorRegistry()
    metrics = Metrics(registry)
    # A client's own emitter, without its retry handler (which needs a whole request to decide).
    client = SimpleNamespace(meta=SimpleNamespace(events=HierarchicalEmitter()))
    count_errors(client, metrics.s3_error)

    def answer(status: int, code: str = "") -> tuple[object, dict[str, object]]:
        return object(), {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}

    attempts = [
        ("PutObject", {"response": None, "caught_exception": EndpointConnectionError(endpoint_url="u")}),
        ("UploadPart", {"response": None, "caught_exception": ReadTimeoutError(endpoint_url="u")}),
        ("UploadPart", {"response": answer(503, "SlowDown"), "caught_exception": None}),
        ("PutObject", {"response": answer(500, "InternalError"), "caught_exception": None}),
        ("HeadObject", {"response": answer(404, "404"), "caught_exception": None}),  # the request's, not the store's
        ("PutObject", {"response": answer(200), "caught_exception": None}),
    ]
    for operation, kwargs in attempts:
        responses = client.meta.events.emit(f"needs-retry.s3.{operation}", attempts=1, **kwargs)
        # The retry handler's answer (a delay, or None) is the one taken: this hook adds none.
        assert [response for _, response in responses] == [None]
    client.meta.events.emit(f"{s3_signed.FAILED_ATTEMPT}.CopyObject", kind="connection")  # a SignedRequests attempt

    def count(operation: str, kind: str) -> float | None:
        return registry.get_sample_value("checkpointd_s3_errors_total", {"operation": operation, "kind": kind})

    assert count("PutObject", "connection") == 1
    assert count("UploadPart", "timeout") == 1
    assert count("UploadPart", "throttled") == 1
    assert count("PutObject", "server") == 1
    assert count("CopyObject", "connection") == 1
    assert count("HeadObject", "server") is None and count("HeadObject", "connection") is None
