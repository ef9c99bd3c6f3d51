"""The daemon's object-store requests counted by operation (botocore's before-send event)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from checkpointd.metrics import Metrics
from checkpointd.storage.s3_client import count_requests, make_client


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
