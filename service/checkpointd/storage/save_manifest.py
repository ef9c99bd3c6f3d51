"""Save manifests: what a committed save holds (the format: write, read, parse).

Every save the daemon publishes carries `checkpointd.manifest.json`, written
last into its temp dir before the fsync and rename: the save's run, kind,
step, export dir, creation time and versions, and every other file with its
size and CRC32C. The check of a save against its manifest (`checkpointd
verify`) is `storage.verify`'s.

Stdlib and `crc32c` only: verifying a multi-GB root must not wait for
TensorFlow to import, and must work on a host without it.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import crc32c

from checkpointd import durable
from checkpointd.core.ports import CommittedSave, SaveMeta, Staged
from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.names import MANIFEST_NAME

# A checkpoint prefix's manifest beside its files: `<prefix>.checkpointd.manifest.json`.
PREFIX_MANIFEST_SUFFIX = "." + MANIFEST_NAME
FORMAT = "checkpointd.save-manifest"
FORMAT_VERSION = 1
_READ_BYTES = 4 << 20

Progress = Callable[[int], None]  # called with the bytes just checked


class ManifestError(ValueError):
    """A manifest is missing, unreadable or malformed."""


@dataclass(frozen=True)
class FileEntry:
    """One file of a save: its path relative to the save dir, size and CRC32C."""

    path: str
    size: int
    crc32c: str  # 8 lowercase hex digits


# The window `file_checksum(mapped=True)` maps at once; a multiple of any page size.
# Mapped page-cache pages count in the daemon's RSS while mapped, so a save's
# peak grows by one window: small enough to stay well under a medium save's
# payload, large enough that the checksum runs as fast as with a bigger one.
_MAP_BYTES = 4 << 20


def file_checksum(path: Path | str, progress: Progress | None = None, *, mapped: bool = False) -> tuple[int, int]:
    """Returns (size, CRC32C) of a file, read in 4 MiB blocks.

    `mapped` checksums a file of 4 MiB or more through a read-only map of the
    page cache instead of copying it out (half the time); only for files
    nobody truncates meanwhile (a save's own temp dir), as a read past a
    truncation is a SIGBUS, not an error.
    """
    size, value = 0, 0
    with open(path, "rb", buffering=0) as f:
        length = os.fstat(f.fileno()).st_size
        if mapped and length >= _READ_BYTES:
            # A window at a time (see _MAP_BYTES): the whole file mapped
            # would add its size to the daemon's RSS.
            for start in range(0, length, _MAP_BYTES):
                size = min(_MAP_BYTES, length - start)
                with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ, offset=start) as window:
                    with memoryview(window) as view:
                        value = crc32c.crc32c(view, value)
                if progress is not None:
                    progress(size)
            return length, value
        # No bigger than the file (+1 to see its end in one read): a zeroed
        # 4 MiB buffer costs more than checksumming a small save's file.
        buffer = bytearray(min(_READ_BYTES, length + 1))
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            value = crc32c.crc32c(view[:n], value)
            size += n
            if progress is not None:
                progress(n)
    return size, value


def _hex(value: int) -> str:
    return f"{value:08x}"


def _files(save_dir: Path) -> list[str]:
    """Every entry but dirs and the manifest under `save_dir`, '/'-separated, sorted."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(save_dir):
        rel = Path(dirpath).relative_to(save_dir)
        # A symlinked dir is listed as an entry, not followed.
        names = filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        found.extend((rel / name).as_posix() for name in names)
    return sorted(f for f in found if f != MANIFEST_NAME)


def _staged_entries(save_dir: str) -> list[tuple[str, str, os.stat_result]]:
    """(relative '/'-path, path, lstat) of every entry `_files` lists, sorted as it sorts them.

    One scandir per dir and one lstat per entry, for the manifest a commit
    writes (pathlib's parsing and three stats a file cost more than
    checksumming a small save's files).
    """
    found: list[tuple[str, str, os.stat_result]] = []
    pending = [("", save_dir)]
    while pending:
        rel_dir, directory = pending.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                rel = rel_dir + entry.name
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    pending.append((rel + "/", entry.path))
                elif rel != MANIFEST_NAME:
                    found.append((rel, entry.path, st))
    found.sort(key=lambda e: e[0])
    return found


def write_staged_manifest(staged: Staged, meta: SaveMeta, *, fsync: bool = False) -> int:
    """`write_manifest` for a staged save: what every Store's commit writes last; returns its bytes."""
    return write_manifest(
        staged.path,
        run=meta.run,
        kind=meta.kind.value,
        step=meta.step,
        export_dir=meta.export_dir,
        versions={**meta.trainer_versions, **staged.versions},  # the daemon's own win
        known=staged.known,
        extra=staged.extra,
        fsync=fsync,
    )


def write_manifest(
    save_dir: Path,
    *,
    run: str,
    kind: str,
    step: int,
    export_dir: str,
    versions: Mapping[str, str],
    known: Mapping[str, tuple[int, int]] | None = None,
    created: float | None = None,
    extra: Mapping[str, Any] | None = None,
    fsync: bool = False,
) -> int:
    """Writes `save_dir/checkpointd.manifest.json` listing every other file there.

    Call it last, once the save's files are complete and before they are
    fsynced and published.

    Args:
        save_dir: the finished save's (temp) dir.
        run, kind, step, export_dir: what the save is.
        versions: software versions to record, e.g. {"tensorflow": "2.15.1"}.
        known: (size, CRC32C) of files whose content the caller already
            checksummed (template files written from memory); used when the
            size on disk agrees, every other file is read back.
        created: Unix time of the save; default now.
        extra: more top-level fields (e.g. "numpy_state"); they may not
            replace the ones above.
        fsync: fsync the manifest once written (its dir is the caller's).

    Returns:
        The manifest's size in bytes.

    Raises:
        OSError: a file could not be read or the manifest written.
    """
    where = os.fspath(save_dir)  # joined as text: pathlib's parsing costs more than a small save's CRCs
    known = known or {}
    entries = []
    for rel, path, st in _staged_entries(where):
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file; a save holds only regular files")
        size, value = known.get(rel, (-1, 0))
        if size != st.st_size:
            size, value = file_checksum(path, mapped=True)  # the save's own files
        entries.append(FileEntry(rel, size, _hex(value)))
    document = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "run": run,
        "kind": kind,
        "step": step,
        "export_dir": export_dir,
        "created_unix_seconds": time.time() if created is None else created,
        "versions": dict(versions),
        "files": [{"path": e.path, "size": e.size, "crc32c": e.crc32c} for e in entries],  # FileEntry's fields
    }
    for key, value in (extra or {}).items():
        if key in document:
            raise ValueError(f"extra manifest field {key!r} would replace a standard one")
        document[key] = value
    data = encode_manifest(document)
    durable.write_new(os.path.join(where, MANIFEST_NAME), data, fsync=fsync)
    return len(data)


def encode_manifest(document: Mapping[str, Any]) -> bytes:
    """A manifest's bytes: JSON, one line per top-level field, a list field's items one a line.

    Each value is encoded whole by `json.dumps` without `indent`, which is
    the C encoder (with `indent` it is the pure-Python one, the largest piece
    of a small save's commit CPU); the line breaks keep it readable by people
    and by line-oriented tools. Any JSON parser reads it.
    """
    encode = json.dumps
    lines = []
    for key, value in document.items():
        if isinstance(value, list) and value:
            items = ",\n  ".join(encode(item) for item in value)
            lines.append(f" {encode(key)}: [\n  {items}\n ]")
        else:
            lines.append(f" {encode(key)}: {encode(value)}")
    return ("{\n" + ",\n".join(lines) + "\n}\n").encode("utf-8")


def read_manifest(save_dir: Path, name: str = MANIFEST_NAME) -> dict[str, Any]:
    """Reads and checks the shape of a save dir's manifest.

    Args:
        save_dir: the dir the manifest's paths are relative to.
        name: the manifest's file name there: MANIFEST_NAME for a dir of its
            own, `<prefix>` + PREFIX_MANIFEST_SUFFIX for a checkpoint prefix
            sharing the dir (`checkpointd.storage.prefix`).

    Returns:
        The manifest, with "files" as a list of FileEntry.

    Raises:
        ManifestError: it is missing, not JSON, of another format or version,
            or lists an unsafe or duplicate path.
    """
    path = Path(save_dir) / name
    try:
        # A link in the manifest's place is not followed: a save's files are its own.
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ManifestError(f"no {name} (not a checkpointd save, or not complete)") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ManifestError(f"{name} is a symlink, not the save's own file (not followed)") from None
        raise ManifestError(f"{name} is unreadable: {e}") from None
    return parse_manifest(data, name)


def parse_manifest(data: bytes, name: str = MANIFEST_NAME) -> dict[str, Any]:
    """Checks the shape of a manifest's bytes (read from a file or an object store); as `read_manifest`."""
    try:
        document = json.loads(data)
    except ValueError as e:
        raise ManifestError(f"{name} is unreadable: {e}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ManifestError(f"{name} is not a {FORMAT}")
    version = document.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ManifestError(f"{name} has format_version {version!r}; this checkpointd reads up to {FORMAT_VERSION}")
    try:
        entries = [FileEntry(str(f["path"]), int(f["size"]), str(f["crc32c"])) for f in document["files"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{name} has a malformed file list ({e!r})") from None
    seen: set[str] = set()
    for entry in entries:
        pure = PurePosixPath(entry.path)
        if pure.is_absolute() or ".." in pure.parts or entry.path in seen or entry.path == name:
            raise ManifestError(f"{name} lists an invalid or repeated path {entry.path!r}")
        seen.add(entry.path)
    document["files"] = entries
    return document


# A manifest's own fields; the rest are its format's or its store's (`CommittedSave.extra`).
STANDARD_FIELDS = frozenset(
    "format format_version run kind step export_dir created_unix_seconds versions files".split()
)


def committed_save(
    document: Mapping[str, Any], path: Any, export_dir: str, *, prefix: bool, store_fields: frozenset[str] = frozenset()
) -> CommittedSave:
    """The committed save a manifest describes, at `path` (a dir, a prefix or a key).

    Raises:
        KeyError, TypeError, ValueError: the manifest lacks or mistypes a field.
    """
    extra = {k: v for k, v in document.items() if k not in STANDARD_FIELDS and k not in store_fields}
    return CommittedSave(
        path=path,
        export_dir=export_dir,
        run=str(document["run"]),
        kind=SaveKind(document["kind"]),
        step=int(document["step"]),
        created=float(document["created_unix_seconds"]),
        prefix=prefix,
        extra=extra or None,
    )
