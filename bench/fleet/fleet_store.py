"""The fleet section's object-store figures: the manifests in the bucket, and the daemons' request and upload counters."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

REGION = "us-east-1"
MANIFEST = "checkpointd.manifest.json"


def bucket_manifests(endpoint: str, bucket: str, prefix: str, aws: dict[str, str]) -> int:
    """The save manifests under the prefix (the store's reserved .checkpointd* keys aside)."""
    os.environ.update(aws)
    from checkpointd.storage.s3 import make_client

    client = make_client(endpoint, REGION)
    keys = [
        obj["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
        for obj in page.get("Contents", [])
    ]
    return sum(1 for k in keys if k.endswith("/" + MANIFEST) and "/.checkpointd" not in k)


def counts(url: str) -> dict[str, Any]:
    """A daemon's counters: object-store requests by operation, bytes uploaded by committed saves, and
    its saves' accept -> durable seconds and count (checkpointd_save_duration_seconds, every kind)."""
    from bench.scrape import scrape

    requests: dict[str, float] = {}
    uploaded = accepted_seconds = accepted_saves = 0.0
    for name, labels, value in scrape(url):
        if name == "checkpointd_s3_requests_total":
            requests[labels["operation"]] = requests.get(labels["operation"], 0.0) + value
        elif name == "checkpointd_store_uploaded_bytes_total":
            uploaded += value
        elif name == "checkpointd_save_duration_seconds_sum":
            accepted_seconds += value
        elif name == "checkpointd_save_duration_seconds_count":
            accepted_saves += value
    return {
        "requests": requests,
        "uploaded_bytes": uploaded,
        "accepted_seconds": accepted_seconds,
        "accepted_saves": accepted_saves,
    }


def delta(before: Sequence[dict[str, Any]], after: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The daemons' counters over the window, summed over the daemons; their saves' mean accept -> durable."""
    requests: dict[str, float] = {}
    for b, a in zip(before, after, strict=True):
        for op, n in a["requests"].items():
            requests[op] = requests.get(op, 0.0) + n - b["requests"].get(op, 0.0)
    pairs = list(zip(before, after, strict=True))
    uploaded = sum(a["uploaded_bytes"] - b["uploaded_bytes"] for b, a in pairs)
    seconds = sum(a["accepted_seconds"] - b["accepted_seconds"] for b, a in pairs)
    saves = sum(a["accepted_saves"] - b["accepted_saves"] for b, a in pairs)
    return {
        "requests": {op: n for op, n in requests.items() if n},
        "uploaded_bytes": uploaded,
        "accept_to_durable_mean": seconds / saves if saves else None,
    }
