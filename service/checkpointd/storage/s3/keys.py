"""Where a save's objects and manifest are in the bucket (the one place deciding dir or prefix), and the store's manifest fields.

A save that is a dir of its own keeps its files under `<save key>/` and its
manifest at `<save key>/<MANIFEST>`; a training checkpoint's prefix keeps its
files beside the others of its dir (`<dir>/<name>.<suffix>`) and its manifest
at `<save key><PREFIX_MANIFEST>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath, PurePosixPath

from checkpointd.storage import save_manifest

MANIFEST = save_manifest.MANIFEST_NAME
PREFIX_MANIFEST = save_manifest.PREFIX_MANIFEST_SUFFIX
ETAGS = "s3_etags"  # the manifest's extra field: path -> ETag
WRITER = "writer"  # the manifest's extra field: the owner id of the daemon that committed it
STORE_FIELDS = frozenset({ETAGS, WRITER})  # manifest fields the store adds, not the format's


@dataclass(frozen=True)
class SaveKeys:
    """A save's place in the bucket."""

    files_base: str  # what its files' manifest paths are relative to, ending in '/'
    manifest: str  # its manifest's key


def keys_of(save_key: PurePath | str, *, prefix: bool) -> SaveKeys:
    """The keys of the save at `save_key`: a dir of its own, or (`prefix`) a checkpoint prefix in a dir."""
    key = PurePosixPath(save_key)
    if prefix:
        return SaveKeys(f"{key.parent}/", f"{key}{PREFIX_MANIFEST}")
    return SaveKeys(f"{key}/", f"{key}/{MANIFEST}")


def save_of(manifest_key: str) -> tuple[str, bool] | None:
    """(save key, whether it is a prefix) of a manifest's key, the inverse of `keys_of`; None if it is no manifest's."""
    if manifest_key.endswith("/" + MANIFEST):
        return manifest_key[: -len(MANIFEST) - 1], False
    if manifest_key.endswith(PREFIX_MANIFEST):
        return manifest_key[: -len(PREFIX_MANIFEST)], True
    return None
