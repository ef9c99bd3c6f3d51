"""The daemon's object-store requests counted by operation (botocore's before-send hook)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from checkpointd.metrics import Metrics
from checkpointd.server import _count_request


def test_each_request_counts_under_its_operation_and_the_hook_returns_none() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    for event in ("before-send.s3.PutObject", "before-send.s3.PutObject", "before-send.s3.ListObjectsV2"):
        # A value returned from before-send would be taken as the response and the request not sent.
        assert _count_request(metrics, event_name=event, request=object()) is None

    def count(operation: str) -> float | None:
        return registry.get_sample_value("checkpointd_s3_requests_total", {"operation": operation})

    assert count("PutObject") == 2
    assert count("ListObjectsV2") == 1
    assert count("GetObject") is None
