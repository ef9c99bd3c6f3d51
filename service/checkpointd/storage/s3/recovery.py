"""Start-up tidying of the object store: what crashed or failed saves left behind.

Two parts. `remove_staging` deletes the daemon's local staging leftovers, at
once, before the daemon serves. `tidy` aborts multipart uploads under the
prefix and deletes objects no manifest lists, both only older than the
store's `grace_seconds` (a save in progress, a peer's or this daemon's, is
younger) and only of names checkpointd writes. It lists every folder and
reads every manifest of the prefix, which takes minutes under thousands of
saves or a slow store, so the daemon runs it in the background after it
serves: saves need none of it (readers trust manifests only). Tidying only:
leftovers are not saves, so a failure here is logged and the daemon serves
on.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from collections.abc import Callable

from checkpointd.protocol.names import TMP_PREFIX
from checkpointd.storage import save_manifest
from checkpointd.storage.s3.bucket import Bucket
from checkpointd.storage.s3.keys import keys_of, save_of

_LOGGER = logging.getLogger(__name__)

# What `tidy` may delete: the files checkpointd writes, relative to a save dir...
_SAVE_DIR_FILE = re.compile(r"^(saved_model\.pb|fingerprint\.pb|policy_specs\.pbtxt|assets/.+|variables/.+)$")
# ... and a training checkpoint's files beside others.
_PREFIX_FILE = re.compile(r"^(?P<name>.+)\.(index|data-\d{5}-of-\d{5})$")


def remove_staging(bucket: Bucket) -> int:
    """Deletes the daemon's local staging leftovers (its own dir: no peer's); returns how many."""
    fixed = 0
    if bucket.staging_root.is_dir():
        for entry in bucket.staging_root.iterdir():
            if entry.name.startswith(TMP_PREFIX):
                shutil.rmtree(entry, ignore_errors=True)
                fixed += 1
    return fixed


def tidy(bucket: Bucket, grace_seconds: float, stopping: Callable[[], bool]) -> int:
    """Aborts stale multipart uploads and deletes uncommitted objects; returns how many. Never raises.

    Args:
        bucket: the store's bucket.
        grace_seconds: only what is older than this is touched.
        stopping: true once the daemon stops; checked between folders.
    """
    fixed = 0
    cutoff = time.time() - grace_seconds
    # Tidying only: a bucket policy that denies listing uploads or
    # deleting must not stop the daemon from serving (leftovers are not saves).
    try:
        fixed += _abort_stale_uploads(bucket, cutoff, stopping)
    except Exception as e:
        _LOGGER.warning("recover: could not abort stale multipart uploads under %s: %s", bucket.url, e)
    try:
        for folder in bucket.folders():
            if stopping():
                break
            doomed = _uncommitted(bucket, bucket.folder_key(folder), cutoff)
            for key in doomed:
                _LOGGER.info("recover: deleting %s, of no committed save", key)
            bucket.delete_keys(doomed)
            fixed += len(doomed)
    except Exception as e:
        _LOGGER.warning("recover: could not delete uncommitted objects under %s: %s", bucket.url, e)
    return fixed


def _abort_stale_uploads(bucket: Bucket, cutoff: float, stopping: Callable[[], bool]) -> int:
    aborted = 0
    paginator = bucket.client.get_paginator("list_multipart_uploads")
    for page in paginator.paginate(Bucket=bucket.name, Prefix=bucket.key_base()):
        if stopping():
            break
        for upload in page.get("Uploads", []):
            if upload["Initiated"].timestamp() < cutoff:
                _LOGGER.info("recover: aborting the stale multipart upload of %s", upload["Key"])
                bucket.client.abort_multipart_upload(Bucket=bucket.name, Key=upload["Key"], UploadId=upload["UploadId"])
                aborted += 1
    return aborted


def _uncommitted(bucket: Bucket, folder_key: str, cutoff: float) -> list[str]:
    """Keys under a folder that no manifest lists, that checkpointd writes, older than `cutoff`."""
    objects = {key: obj for key, obj in bucket.list_objects(folder_key)}
    listed: set[str] = set()
    for key in objects:
        found = save_of(key)
        if found is None:
            continue
        base = keys_of(found[0], prefix=found[1]).files_base
        try:
            document = bucket.manifest(key, objects[key]["ETag"])
        except save_manifest.ManifestError:
            continue
        if document is not None:
            listed.update(base + e.path for e in document["files"])
        listed.add(key)
    doomed = []
    for key, obj in objects.items():
        if key in listed or obj["LastModified"].timestamp() >= cutoff:
            continue
        relative = key[len(folder_key) :]
        name = relative.rpartition("/")[2]
        if _PREFIX_FILE.match(name) or any(
            _SAVE_DIR_FILE.match("/".join(relative.split("/")[i:])) for i in range(1, relative.count("/") + 1)
        ):
            doomed.append(key)
    return doomed
