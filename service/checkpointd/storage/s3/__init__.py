"""Saves committed to S3 or an S3-compatible server (radosgw): the store, the fleet's leases, the client.

What code outside this package uses is here; its modules are private to it:
- `store`: `S3Store`, the `Store` seam on a bucket (the commit protocol).
- `bucket`: what the store and its helpers share (clients, keys, manifest cache).
- `commit`, `parts`, `part_copy`, `copies`, `places`: a save's way into the bucket.
- `catalog`: the committed saves, read from their manifests.
- `restore`, `recovery`: a save's way out, and start-up tidying.
- `lease`: `S3Leases`, one writer per run across a fleet.
- `client`, `signed`, `keys`: the boto3 client, the small signed requests, the key layout.

boto3 is imported only when a client or store is made.
"""

from checkpointd.storage.s3.client import (
    S3Url,
    StoreSetupError,
    content_md5,
    count_errors,
    count_requests,
    error_code,
    make_client,
    small_requests,
)
from checkpointd.storage.s3.keys import ETAGS
from checkpointd.storage.s3.lease import LEASES_DIR, S3Leases
from checkpointd.storage.s3.store import S3Store

__all__ = [
    "ETAGS",
    "LEASES_DIR",
    "S3Leases",
    "S3Store",
    "S3Url",
    "StoreSetupError",
    "content_md5",
    "count_errors",
    "count_requests",
    "error_code",
    "make_client",
    "small_requests",
]
