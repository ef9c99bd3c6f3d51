"""The bucket as the S3 crash harness reads it: directly with boto3, beside the daemon.

- `Reader.snapshot`: every object and open multipart upload under a prefix,
  and its manifests parsed; `check_manifests`: every object a manifest lists
  is there with its size, ETag and CRC32C (each object version read back
  once); `leftovers`: what no manifest lists.
- `Staging`: the daemon's staging dir, whose manifest lists a save's files
  before its upload starts, with the ETags S3 gives their bytes.
- `phase`: which moment of a save a kill hit, from both (see
  `tests.integration.support.s3_crash_harness`).

radosgw completes its bucket index asynchronously: a listing can miss a
new object or show a deleted one for a moment, so callers confirm with
`Reader.head` what a listing says before they report it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import tensorflow as tf

from checkpointd.protocol.names import RESERVED_PREFIX
from checkpointd.storage import save_manifest

MANIFEST = save_manifest.MANIFEST_NAME
PREFIX_MANIFEST = save_manifest.PREFIX_MANIFEST_SUFFIX
PART_BYTES = 16 << 20  # the daemon's multipart threshold and part size (S3Store's default)
PHASES = ("idle", "rpc", "write", "upload", "multipart", "unmanifested", "state-file", "committed")


@dataclass
class Bucket:
    """The objects and multipart uploads under the test's prefix, and its manifests parsed."""

    objects: dict[str, tuple[int, str, float]]  # key -> (size, ETag, LastModified)
    uploads: list[tuple[str, str]]  # (key, upload id)
    manifests: dict[str, dict[str, Any]]  # manifest key -> document

    def files_base(self, manifest_key: str) -> str:
        if manifest_key.endswith("/" + MANIFEST):
            return manifest_key[: -len(MANIFEST)]
        return manifest_key.rpartition("/")[0] + "/"

    def listed(self) -> set[str]:
        """Every key a manifest lists, and the manifests."""
        keys = set(self.manifests)
        for key, doc in self.manifests.items():
            keys.update(self.files_base(key) + f["path"] for f in doc["files"])
        return keys


class Reader:
    """Reads the bucket directly with boto3; caches manifests and CRC32Cs by (key, ETag)."""

    def __init__(self, client: Any, bucket: str, base: str) -> None:
        self.client, self.bucket, self.base = client, bucket, base
        self._manifests: dict[tuple[str, str], dict[str, Any]] = {}
        self._crcs: dict[tuple[str, str], tuple[int, int]] = {}
        self.read_back = 0  # object versions read in full for their CRC32C

    def keys(self, key_prefix: str) -> Iterator[dict[str, Any]]:
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=key_prefix):
            yield from page.get("Contents", [])

    def uploads(self, key_prefix: str) -> list[tuple[str, str]]:
        found = []
        for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=key_prefix):
            found += [(u["Key"], u["UploadId"]) for u in page.get("Uploads", [])]
        return found

    def snapshot(self) -> Bucket:
        objects = {
            o["Key"]: (o["Size"], o["ETag"].strip('"'), o["LastModified"].timestamp()) for o in self.keys(self.base)
        }
        manifests = {}
        for key, (_, etag, _) in objects.items():
            if key.endswith("/" + MANIFEST) or key.endswith(PREFIX_MANIFEST):
                if (key, etag) not in self._manifests:
                    body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
                    self._manifests[key, etag] = json.loads(body)
                manifests[key] = self._manifests[key, etag]
        return Bucket(objects, self.uploads(self.base), manifests)

    def head(self, key: str) -> tuple[int, str, float] | None:
        """(size, ETag, LastModified) of the object, read directly (not from a listing); None if absent."""
        try:
            h = self.client.head_object(Bucket=self.bucket, Key=key)
        except Exception as e:
            if getattr(e, "response", {}).get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return h["ContentLength"], h["ETag"].strip('"'), h["LastModified"].timestamp()

    def crc(self, key: str, etag: str) -> tuple[int, int]:
        """(size, CRC32C) of the object's bytes, read back once per ETag."""
        if (key, etag) not in self._crcs:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
            size, value = 0, 0
            for block in iter(lambda: body.read(4 << 20), b""):
                size, value = size + len(block), crc32c.crc32c(block, value)
            self._crcs[key, etag] = (size, value)
            self.read_back += 1
        return self._crcs[key, etag]

    def delete_all(self) -> None:
        """Deletes everything under the prefix, open multipart uploads included."""
        for key, upload in self.uploads(self.base):
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
        keys = [o["Key"] for o in self.keys(self.base)]
        for start in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[start : start + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})


def check_manifests(bucket: Bucket, reader: Reader) -> list[str]:
    """Never a manifest without all its data: every listed object there, its size, ETag and CRC32C."""
    problems = []
    for key, doc in sorted(bucket.manifests.items()):
        base, etags = bucket.files_base(key), doc.get("s3_etags", {})
        for entry in doc["files"]:
            # A listing can miss a new object for a moment (rgw completes its
            # bucket index asynchronously); the object itself is read directly.
            found = bucket.objects.get(base + entry["path"]) or reader.head(base + entry["path"])
            if found is None:
                problems.append(f"{key} lists {entry['path']}, which is not in the bucket")
                continue
            size, etag, _ = found
            if size != entry["size"] or etags.get(entry["path"]) != etag:
                problems.append(f"{key}: {entry['path']} has {size} bytes, ETag {etag}; listed {entry}, {etags}")
                continue
            read, value = reader.crc(base + entry["path"], etag)
            if (read, f"{value:08x}") != (entry["size"], entry["crc32c"]):
                problems.append(f"{key}: {entry['path']} reads back {read} bytes, CRC32C {value:08x}; listed {entry}")
    return problems


def leftovers(bucket: Bucket, planted: set[str]) -> list[str]:
    """Objects no manifest lists, then open multipart uploads.

    State files, planted objects and the daemons' own (`.checkpointd*`: run leases) are not leftovers.
    """
    listed = bucket.listed() | planted
    objects = [
        k
        for k in bucket.objects
        if k not in listed
        and k.rpartition("/")[2] != "checkpoint"
        and not any(part.startswith(RESERVED_PREFIX) for part in k.split("/"))
    ]
    return sorted(objects) + [f"multipart upload of {key}" for key, _ in bucket.uploads]


def state_names(reader: Reader, key: str, scratch: Path) -> list[str] | None:
    """The checkpoints a `checkpoint` state file names, as TensorFlow parses it (newest last); None if absent."""
    try:
        data = reader.client.get_object(Bucket=reader.bucket, Key=key)["Body"].read()
    except reader.client.exceptions.NoSuchKey:
        return None
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "checkpoint").write_bytes(data)
    state = tf.train.get_checkpoint_state(str(scratch))
    if state is None:
        return []
    names = [Path(p).name for p in state.all_model_checkpoint_paths]
    if names and Path(state.model_checkpoint_path).name != names[-1]:
        names.append(Path(state.model_checkpoint_path).name)  # a disagreement the checks will report
    return names


# The daemon's staged saves, and the phase of a kill.


def _etag(path: Path) -> str:
    """The ETag S3 gives the file's bytes as s3transfer uploads them (multipart at PART_BYTES)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        if size < PART_BYTES:
            return hashlib.md5(f.read(), usedforsecurity=False).hexdigest()
        parts = [hashlib.md5(block, usedforsecurity=False).digest() for block in iter(lambda: f.read(PART_BYTES), b"")]
    return f"{hashlib.md5(b''.join(parts), usedforsecurity=False).hexdigest()}-{len(parts)}"


@dataclass
class Staged:
    """A save the daemon staged and began to upload: where its files go, and their ETags."""

    run: str
    export_dir: str
    step: int
    manifest_key: str
    files: dict[str, tuple[int, str]]  # key -> (size, ETag)


class Staging:
    """Reads the daemon's staging dir: `.checkpointd-tmp-<name>-<hex>`, with a manifest once the upload starts."""

    def __init__(self, work_dir: Path, base: str) -> None:
        self.root = work_dir / ".checkpointd" / "s3-staging"
        self.base = base
        self._seen: dict[Path, Staged] = {}

    def dirs(self) -> list[Path]:
        return sorted(self.root.iterdir()) if self.root.is_dir() else []

    def staged(self, path: Path) -> Staged | None:
        if path in self._seen:
            return self._seen[path]
        try:
            doc = json.loads((path / MANIFEST).read_bytes())
            target = f"{self.base}{doc['run']}/{doc['export_dir']}"
            if doc["kind"] == "training_checkpoint":
                files_base, manifest_key = target.rpartition("/")[0] + "/", target + PREFIX_MANIFEST
            else:
                files_base, manifest_key = target + "/", f"{target}/{MANIFEST}"
            files = {files_base + f["path"]: (f["size"], _etag(path / f["path"])) for f in doc["files"]}
        except (OSError, ValueError):
            # Not written yet or half written (the upload has not begun), or
            # discarded meanwhile (the save is over).
            return None
        self._seen[path] = Staged(doc["run"], doc["export_dir"], doc["step"], manifest_key, files)
        return self._seen[path]

    def forget(self) -> None:
        self._seen.clear()


def _all_up(staged: Staged, objects: dict[str, tuple[int, str, float]]) -> bool:
    return all(objects.get(key, (None, None))[:2] == want for key, want in staged.files.items())


@dataclass(frozen=True)
class Pending:
    """A run's save call in flight at the kill: its staging dir's name, step and manifest's key."""

    name: str  # the export dir's last component (`.checkpointd-tmp-<name>-<hex>`)
    step: int
    manifest_key: str


def phase(
    pending: Pending | None, staged_dirs: list[tuple[Path, Staged | None]], bucket: Bucket, state: list[str] | None
) -> str:
    """The moment of a run's save the kill hit; `state`: the training dir's state file's names."""
    if pending is None:
        return "idle"
    doc = bucket.manifests.get(pending.manifest_key)
    if doc is not None and doc["step"] == pending.step:  # steps are never sent twice
        return "state-file" if state is not None and pending.name not in state else "committed"
    mine = [s for p, s in staged_dirs if p.name.rpartition("-")[0] == f".checkpointd-tmp-{pending.name}"]
    staged = next((s for s in mine if s is not None and s.step == pending.step), None)
    if staged is None:  # (a staging dir with a manifest of another step is an older save's)
        return "write" if any(s is None for s in mine) else "rpc"
    if any(key in staged.files for key, _ in bucket.uploads):
        return "multipart"
    return "unmanifested" if _all_up(staged, bucket.objects) else "upload"
