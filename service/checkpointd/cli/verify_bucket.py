"""`checkpointd verify`/`fetch` on an object store: every committed save read back and checked against its manifest.

Uses the store's public surface only (`committed`, `keys_of`, `manifest`, its
client), so the store's own layout and cache stay its own.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import crc32c

from checkpointd.core.ports import CommittedSave
from checkpointd.storage import save_manifest, verify
from checkpointd.storage.s3 import ETAGS, S3Store, error_code


def verify_bucket(store: S3Store, folders: list[str] | None = None, below: str = "") -> list[verify.Report]:
    """Checks every committed save under the store's prefix (or in `folders`) against its manifest.

    `below`: only the save at that export dir, or the saves under it ("" for all).

    Every listed object must be there with the listed size, ETag and CRC32C
    (read back in full). Objects no manifest lists are not saves and are
    not reported (recovery deletes checkpointd's own after the grace age).
    """
    reports = []
    for folder in store.folders() if folders is None else folders:
        for save in sorted(store.committed(folder, None), key=lambda s: str(s.path)):
            if not below or save.export_dir == below or save.export_dir.startswith(below.rstrip("/") + "/"):
                reports.append(_verify_save(store, save))
    return reports


def _verify_save(store: S3Store, save: CommittedSave) -> verify.Report:
    place = store.keys_of(save)
    files_base, manifest_key = place.files_base, place.manifest
    where = f"s3://{store.bucket}/{save.path}"
    document = store.manifest(manifest_key, None)
    if document is None:
        return verify.Report(where, False, "its manifest is gone")
    entries: list[save_manifest.FileEntry] = document["files"]
    etags = document.get(ETAGS) or {}
    problems = []
    for entry in entries:
        key = files_base + entry.path
        try:
            response = store.client.get_object(Bucket=store.bucket, Key=key)
        except Exception as e:
            problems.append(
                f"{entry.path} is missing" if error_code(e) in ("NoSuchKey", "404") else f"{entry.path}: {e}"
            )
            continue
        size, value, body = 0, 0, response["Body"]
        for block in iter(functools.partial(body.read, 4 << 20), b""):
            size += len(block)
            value = crc32c.crc32c(block, value)
        etag = str(response.get("ETag", "")).strip('"')
        if size != entry.size:
            problems.append(f"{entry.path} has {size} bytes, the manifest says {entry.size}")
        elif f"{value:08x}" != entry.crc32c.lower():
            problems.append(f"{entry.path} has CRC32C {value:08x}, the manifest says {entry.crc32c}")
        elif entry.path in etags and etags[entry.path] != etag:
            problems.append(f"{entry.path} has ETag {etag}, the manifest says {etags[entry.path]} (rewritten)")
    passed = verify.Report(
        where, True, run=save.run, kind=save.kind.value, step=save.step, files=len(entries),
        bytes=sum(e.size for e in entries),
    )  # fmt: skip
    if problems:
        more = len(problems) - 3
        return replace(passed, ok=False, reason="; ".join(problems[:3]) + (f" (and {more} more)" if more > 0 else ""))
    return passed
