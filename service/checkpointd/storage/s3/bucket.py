"""The bucket as the S3 store and its helpers share it: the clients, the keys, the manifest cache, a commit's state.

`S3Store` (`checkpointd.storage.s3.store`) owns one `Bucket` and passes it
to each helper (`catalog`, `commit`, `recovery`, `restore`), so a
helper reaches what it needs by name, not through the store's private
attributes, and imports nothing of the store.

Thread-safe: boto3 clients and the transfer manager are; `lock` guards the
manifest cache and the streams.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpointd.core.ports import CommittedSave
from checkpointd.protocol.names import RESERVED_PREFIX, check_run_name, is_run_name
from checkpointd.storage import save_manifest
from checkpointd.storage.s3.client import ETagLog, S3Url, error_code, unavailable_on_error
from checkpointd.storage.s3.copies import Sources
from checkpointd.storage.s3.keys import SaveKeys, keys_of
from checkpointd.storage.s3.parts import PartUpload


@dataclass
class Bucket:
    """A bucket under a prefix, its clients, and the state a save's commit shares with the store."""

    url: S3Url
    staging_root: Path  # a local dir for staging and restore copies
    client: Any  # boto3's S3 client
    transfer: Any  # s3transfer's manager: multipart above part_bytes, in parallel
    small: Any  # a save's small requests (`signed` where it can, else the client)
    part_bytes: int
    parts_pool: ThreadPoolExecutor  # a streamed data file's parts, and the server-side copies
    fence: Callable[[str], None]  # raises RunHeldError unless this daemon holds the run's lease
    writer: str | None  # this daemon's lease owner id, recorded in each manifest
    etag_log: ETagLog
    sources: Sources = field(default_factory=Sources)  # what a run's next save may copy server-side
    lock: threading.Lock = field(default_factory=threading.Lock)
    streams: dict[str, PartUpload] = field(default_factory=dict)  # staging dir -> its data file's upload
    manifests: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)  # key -> (ETag, parsed)

    @property
    def name(self) -> str:
        return self.url.bucket

    # Keys.

    def key_base(self) -> str:
        return f"{self.url.prefix}/" if self.url.prefix else ""

    def folder_key(self, folder: str) -> str:
        return f"{self.key_base()}{check_run_name(folder)}/"

    def keys_of(self, save: CommittedSave) -> SaveKeys:
        """Where a committed save's files and manifest are in the bucket."""
        return keys_of(save.path, prefix=save.prefix)

    # Reading.

    def reading(self, what: str) -> contextlib.AbstractContextManager[None]:
        return unavailable_on_error(f"{what} in {self.url} (at {self.client.meta.endpoint_url})")

    def list_objects(self, key_prefix: str, *, recursive: bool = True) -> Iterator[tuple[str, dict[str, Any]]]:
        """(key, object) of every object under `key_prefix`, without crossing '/' unless recursive."""
        paginator = self.client.get_paginator("list_objects_v2")
        kwargs: dict[str, Any] = {"Bucket": self.name, "Prefix": key_prefix}
        if not recursive:
            kwargs["Delimiter"] = "/"
        for page in paginator.paginate(**kwargs):
            for obj in page.get("Contents", []):
                yield obj["Key"], obj

    def folders(self) -> list[str]:
        found = []
        with self.reading("listing run folders"):
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.name, Prefix=self.key_base(), Delimiter="/"):
                for common in page.get("CommonPrefixes", []):
                    name = common["Prefix"][len(self.key_base()) :].rstrip("/")
                    if not name.startswith(RESERVED_PREFIX) and is_run_name(name):
                        found.append(name)
        return sorted(found)

    def manifest(self, key: str, etag: str | None) -> dict[str, Any] | None:
        """The parsed manifest at `key`, from the cache if its ETag is known and unchanged; None if absent."""
        with self.lock:
            cached = self.manifests.get(key)
        if cached is not None and etag is not None and cached[0] == etag:
            return cached[1]
        try:
            response = self.small.get_object(Bucket=self.name, Key=key)
        except Exception as e:
            if error_code(e) in ("NoSuchKey", "404"):
                return None
            raise
        data = response["Body"].read()
        document = save_manifest.parse_manifest(data, key.rpartition("/")[2])
        with self.lock:
            self.manifests[key] = (response["ETag"], document)
        return document

    def last_read_manifest(self, key: str) -> dict[str, Any] | None:
        """The manifest at `key` as this store last read it (a lookup or listing), with no round trip; None if never."""
        with self.lock:
            cached = self.manifests.get(key)
        return cached[1] if cached is not None else None

    # Deleting.

    def delete_keys(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = keys[start : start + 1000]
            if len(batch) == 1:
                self.client.delete_object(Bucket=self.name, Key=batch[0])
                continue
            response = self.client.delete_objects(
                Bucket=self.name, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
            )
            errors = response.get("Errors", [])
            if errors:
                raise OSError(f"could not delete {len(errors)} objects, e.g. {errors[0].get('Key')}: {errors[0]}")
        with self.lock:
            for key in keys:
                self.manifests.pop(key, None)

    # A streamed save's upload.

    def stream_of(self, staged: Path) -> PartUpload | None:
        with self.lock:
            return self.streams.get(str(staged))

    def discard_stream(self, staged: Path) -> None:
        """Aborts the streamed upload of a staged save, if it has one."""
        with self.lock:
            part = self.streams.pop(str(staged), None)
        if part is not None:
            part.abort()
