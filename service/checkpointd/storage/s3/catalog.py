"""The committed saves of the bucket as their manifests describe them: a folder's, one place's, a base's data object.

`S3Store` (`checkpointd.storage.s3.store`) answers `committed`,
`committed_at` and `base_source` with these. Readers trust manifests only:
an object no readable manifest lists is no save.
"""

from __future__ import annotations

import logging
from pathlib import PurePosixPath

from checkpointd.core.ports import CommittedSave
from checkpointd.protocol.errors import RunNotFoundError
from checkpointd.protocol.names import RESERVED_PREFIX
from checkpointd.storage import save_manifest
from checkpointd.storage.s3.bucket import Bucket
from checkpointd.storage.s3.keys import ETAGS, MANIFEST, STORE_FIELDS, keys_of, save_of
from checkpointd.storage.s3.part_copy import MAX_PARTS, Source

_LOGGER = logging.getLogger(__name__)


def committed(bucket: Bucket, folder: str, run: str | None) -> list[CommittedSave]:
    folder_key = bucket.folder_key(folder)
    saves = []
    with bucket.reading(f"listing folder {folder!r}"):
        for key, obj in bucket.list_objects(folder_key):
            relative = key[len(folder_key) :]
            if any(part.startswith(RESERVED_PREFIX) for part in relative.split("/")):
                continue
            found = save_of(relative)
            if found is None:
                continue
            save = _read(bucket, key, folder_key + found[0], folder_key, obj["ETag"], is_prefix=found[1])
            if save is not None and (run is None or save.run == run):
                saves.append(save)
    return saves


def committed_at(bucket: Bucket, target: PurePosixPath, folder: str, export_dir: str) -> CommittedSave:
    folder_key = bucket.folder_key(folder)
    with bucket.reading(f"reading {export_dir!r} of folder {folder!r}"):
        save = _read(bucket, keys_of(target, prefix=False).manifest, str(target), folder_key, None, is_prefix=False)
        if save is None:
            save = _read(bucket, keys_of(target, prefix=True).manifest, str(target), folder_key, None, is_prefix=True)
    if save is None:
        raise RunNotFoundError(
            f"no committed save at {export_dir!r} in folder {folder!r} of {bucket.url} (no {MANIFEST})"
        )
    return save


def base_source(bucket: Bucket, save: CommittedSave, data_file: str, size: int) -> Source | None:
    """The committed data object (`save`'s path + `data_file`, `size` bytes) a new save's parts may copy, or None.

    See `checkpointd.saves.bases.RemoteBases`. None for a file not
    streamed in parts (under the store's part size), one of too many
    parts to leave part numbers for copies, or an object its manifest
    does not list with that size and an ETag.
    """
    if size < bucket.part_bytes or -(-size // bucket.part_bytes) > MAX_PARTS // 4:
        return None
    place = bucket.keys_of(save)
    try:
        document = bucket.manifest(place.manifest, None)
    except Exception as e:  # noqa: BLE001 - no base: the save is sent in full
        _LOGGER.info("no S3 base in %s: %s", place.manifest, e)
        return None
    if document is None:
        return None
    key = str(save.path) + data_file
    rel = key[len(place.files_base) :] if key.startswith(place.files_base) else None
    etag = (document.get(ETAGS) or {}).get(rel)
    sizes = {e.path: e.size for e in document.get("files", [])}
    if rel is None or not etag or sizes.get(rel) != size:
        return None
    return Source(key, str(etag).strip('"'))


def _read(
    bucket: Bucket, manifest_key: str, save_key: str, folder_key: str, etag: str | None, *, is_prefix: bool
) -> CommittedSave | None:
    try:
        document = bucket.manifest(manifest_key, etag)
        if document is None:
            return None
        return save_manifest.committed_save(
            document,
            PurePosixPath(save_key),
            save_key[len(folder_key) :],
            prefix=is_prefix,
            store_fields=STORE_FIELDS,
        )
    except (save_manifest.ManifestError, KeyError, TypeError, ValueError) as e:
        _LOGGER.debug("not a committed save: %s (%s)", manifest_key, e)
        return None
