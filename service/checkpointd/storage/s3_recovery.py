"""Start-up tidying of the object store: what crashed or failed saves left behind.

`recover` deletes the daemon's local staging leftovers, aborts multipart
uploads under the prefix and deletes objects no manifest lists, both only
older than the store's `grace_seconds` (a peer's save in progress is younger)
and only of names checkpointd writes. Tidying only: leftovers are not saves,
so a failure here is logged and the daemon serves anyway.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from typing import TYPE_CHECKING

from checkpointd.protocol.names import TMP_PREFIX
from checkpointd.storage import s3_keys, save_manifest

if TYPE_CHECKING:
    from checkpointd.storage.s3 import S3Store

_LOGGER = logging.getLogger(__name__)

# What `recover` may delete: the files checkpointd writes, relative to a save dir...
_SAVE_DIR_FILE = re.compile(r"^(saved_model\.pb|fingerprint\.pb|policy_specs\.pbtxt|assets/.+|variables/.+)$")
# ... and a training checkpoint's files beside others.
_PREFIX_FILE = re.compile(r"^(?P<name>.+)\.(index|data-\d{5}-of-\d{5})$")


def recover(store: S3Store) -> int:
    """Deletes local staging leftovers, stale multipart uploads and uncommitted objects; returns how many."""
    fixed = 0
    if store.staging_root.is_dir():
        for entry in store.staging_root.iterdir():
            if entry.name.startswith(TMP_PREFIX):
                shutil.rmtree(entry, ignore_errors=True)
                fixed += 1
    cutoff = time.time() - store.grace_seconds
    # Tidying only: a bucket policy that denies listing uploads or
    # deleting must not stop the daemon from serving (leftovers are not saves).
    try:
        fixed += _abort_stale_uploads(store, cutoff)
    except Exception as e:
        _LOGGER.warning("recover: could not abort stale multipart uploads under %s: %s", store.url, e)
    try:
        for folder in store.folders():
            doomed = _uncommitted(store, store.folder_key(folder), cutoff)
            for key in doomed:
                _LOGGER.info("recover: deleting %s, of no committed save", key)
            store.delete_keys(doomed)
            fixed += len(doomed)
    except Exception as e:
        _LOGGER.warning("recover: could not delete uncommitted objects under %s: %s", store.url, e)
    return fixed


def _abort_stale_uploads(store: S3Store, cutoff: float) -> int:
    aborted = 0
    paginator = store.client.get_paginator("list_multipart_uploads")
    for page in paginator.paginate(Bucket=store.bucket, Prefix=store.key_base()):
        for upload in page.get("Uploads", []):
            if upload["Initiated"].timestamp() < cutoff:
                _LOGGER.info("recover: aborting the stale multipart upload of %s", upload["Key"])
                store.client.abort_multipart_upload(Bucket=store.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                aborted += 1
    return aborted


def _uncommitted(store: S3Store, folder_key: str, cutoff: float) -> list[str]:
    """Keys under a folder that no manifest lists, that checkpointd writes, older than `cutoff`."""
    objects = {key: obj for key, obj in store.list_objects(folder_key)}
    listed: set[str] = set()
    for key in objects:
        found = s3_keys.save_of(key)
        if found is None:
            continue
        base = s3_keys.keys_of(found[0], prefix=found[1]).files_base
        try:
            document = store.manifest(key, objects[key]["ETag"])
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
