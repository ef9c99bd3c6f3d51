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
    """A daemon's object-store counters: requests by operation, bytes uploaded by committed saves."""
    from bench.scrape import scrape

    requests: dict[str, float] = {}
    uploaded = 0.0
    for name, labels, value in scrape(url):
        if name == "checkpointd_s3_requests_total":
            requests[labels["operation"]] = requests.get(labels["operation"], 0.0) + value
        elif name == "checkpointd_store_uploaded_bytes_total":
            uploaded += value
    return {"requests": requests, "uploaded_bytes": uploaded}


def delta(before: Sequence[dict[str, Any]], after: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The daemons' object-store counters over the window, summed over the daemons."""
    requests: dict[str, float] = {}
    for b, a in zip(before, after, strict=True):
        for op, n in a["requests"].items():
            requests[op] = requests.get(op, 0.0) + n - b["requests"].get(op, 0.0)
    uploaded = sum(a["uploaded_bytes"] - b["uploaded_bytes"] for b, a in zip(before, after, strict=True))
    return {"requests": {op: n for op, n in requests.items() if n}, "uploaded_bytes": uploaded}
