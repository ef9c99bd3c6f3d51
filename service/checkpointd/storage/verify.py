"""`checkpointd verify`'s check of local saves: each save dir or checkpoint prefix against its manifest.

A dir whose files all match its manifest is the complete save the daemon
committed; anything else (a file missing, short, changed or added, or no
manifest at all) is reported with the reason. The manifest's format itself
(write, read, parse) is `save_manifest`'s.

Stdlib and `crc32c` only (through `save_manifest`): verifying a multi-GB root
must not wait for TensorFlow to import, and must work on a host without it.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from checkpointd.durable import dirs
from checkpointd.protocol.names import MANIFEST_NAME
from checkpointd.storage.save_manifest import (
    PREFIX_MANIFEST_SUFFIX,
    FileEntry,
    ManifestError,
    Progress,
    _files,
    _hex,
    file_checksum,
    read_manifest,
)

# Dirs the daemon owns (temp, replaced, state): never published saves.
_RESERVED_PREFIX = ".checkpointd"
# How many problems one dir's reason names before "(and N more)".
_MAX_REASONS = 3


@dataclass(frozen=True)
class Report:
    """The verdict on one save dir."""

    path: str
    ok: bool
    reason: str = ""
    run: str = ""
    kind: str = ""
    step: int = -1
    files: int = 0
    bytes: int = 0


def verify_dir(save_dir: Path, progress: Progress | None = None) -> Report:
    """Checks one save dir against its manifest.

    Every listed file must be there, a regular file of the listed size and
    CRC32C, and no other file may be there.
    """
    save_dir = Path(save_dir)
    where = str(save_dir)
    if not save_dir.is_dir():
        return Report(where, False, "not a directory" if save_dir.exists() else "does not exist")
    try:
        manifest = read_manifest(save_dir)
    except ManifestError as e:
        return Report(where, False, str(e))
    entries: list[FileEntry] = manifest["files"]
    passed = _passed(where, manifest)
    problems = _entry_problems(save_dir, entries, progress)
    listed = {entry.path for entry in entries}
    problems.extend(f"{rel} is not in the manifest" for rel in _files(save_dir) if rel not in listed)
    return _verdict(passed, problems)


def _passed(where: str, manifest: dict[str, Any]) -> Report:
    """The report of a save that has no problem (yet): what its manifest says it is."""
    entries: list[FileEntry] = manifest["files"]
    return Report(
        where,
        True,
        run=str(manifest.get("run", "")),
        kind=str(manifest.get("kind", "")),
        step=int(manifest.get("step", -1)),
        files=len(entries),
        bytes=sum(entry.size for entry in entries),
    )


def verify_prefix(prefix: Path, progress: Progress | None = None) -> Report:
    """Checks one checkpoint prefix (`<dir>/<name>.*`, a training checkpoint) against its manifest.

    Every listed file must be there with the listed size and CRC32C. Other
    files of the dir belong to other saves (or to TensorFlow's state file)
    and are not checked here.
    """
    prefix = Path(prefix)
    where = str(prefix)
    try:
        manifest = read_manifest(prefix.parent, prefix.name + PREFIX_MANIFEST_SUFFIX)
    except ManifestError as e:
        return Report(where, False, str(e))
    entries: list[FileEntry] = manifest["files"]
    passed = _passed(where, manifest)
    problems = _entry_problems(prefix.parent, entries, progress)
    problems.extend(
        f"{entry.path} is not a file of {prefix.name}"
        for entry in entries
        if not entry.path.startswith(prefix.name + ".")
    )
    return _verdict(passed, problems)


def _entry_problems(base: Path, entries: list[FileEntry], progress: Progress | None) -> list[str]:
    """What is wrong with each listed file under `base`: missing, another size or CRC32C.

    Each file is opened below `base` following no link (`durable.dirs.open_file`):
    a link in its path is reported, never read through.
    """
    problems = []
    try:
        base_fd = dirs.open_dir(os.fspath(base))
    except OSError as e:
        return [f"{base} cannot be opened ({e.strerror or e})"]
    try:
        for entry in entries:
            problem = _entry_problem(base_fd, entry, progress)
            if problem:
                problems.append(problem)
    finally:
        os.close(base_fd)
    return problems


def _entry_problem(base_fd: int, entry: FileEntry, progress: Progress | None) -> str:
    try:
        fd = dirs.open_file(base_fd, entry.path)
    except dirs.Moved as e:
        return f"{entry.path} is missing ({e}, not followed)"
    except FileNotFoundError:
        return f"{entry.path} is missing"
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.ENOTDIR):
            return f"{entry.path} is not a regular file"
        return f"{entry.path} is unreadable ({e.strerror or e})"
    try:
        size = os.fstat(fd).st_size
        if size != entry.size:
            return f"{entry.path} has {size} bytes, the manifest says {entry.size}"
        try:
            _, value = file_checksum(dirs.fd_path(fd), progress)  # the open file itself
        except OSError as err:
            return f"{entry.path} is unreadable ({err.strerror or err})"
    finally:
        os.close(fd)
    if _hex(value) != entry.crc32c.lower():
        return f"{entry.path} has CRC32C {_hex(value)}, the manifest says {entry.crc32c}"
    return ""


def _verdict(passed: Report, problems: list[str]) -> Report:
    if problems:
        more = len(problems) - _MAX_REASONS
        reason = "; ".join(problems[:_MAX_REASONS]) + (f" (and {more} more)" if more > 0 else "")
        return replace(passed, ok=False, reason=reason)
    return passed


def _holds_a_manifest(path: Path) -> bool:
    # A file: a dir of that name is a valid export dir component (a training
    # checkpoint dir may be called so), not a manifest.
    return (path / MANIFEST_NAME).is_file()


def _looks_like_a_save(path: Path) -> bool:
    return (path / "saved_model.pb").is_file() or (path / "variables" / "variables.index").is_file()


def find_save_dirs(path: Path) -> list[Path]:
    """Save dirs at or under `path`, sorted: dirs holding a manifest, or a
    SavedModel or checkpoint without one (reported as lacking it).

    Dirs starting `.checkpointd` (the daemon's temp, replaced and state dirs)
    are not searched; symlinks are not followed; a save dir is not searched
    further.
    """
    path = Path(path)
    if path.name == MANIFEST_NAME and path.is_file():
        return [path.parent]
    if _holds_a_manifest(path) or _looks_like_a_save(path):
        return [path]
    found: list[Path] = []
    for dirpath, dirnames, _ in os.walk(path):
        dirnames.sort()
        keep = []
        for name in dirnames:
            child = Path(dirpath, name)
            if name.startswith(_RESERVED_PREFIX) or child.is_symlink():
                continue
            if _holds_a_manifest(child) or _looks_like_a_save(child):
                found.append(child)
            else:
                keep.append(name)
        dirnames[:] = keep
    return sorted(found)


def find_prefixes(path: Path, *, orphans: bool = False) -> list[Path]:
    """Checkpoint prefixes (training checkpoints) at or under `path`, sorted.

    Each `<prefix>` + PREFIX_MANIFEST_SUFFIX names one. With `orphans`, also
    every `<prefix>.index` without one in a dir that holds such manifests
    (files a save left before its manifest, reported as lacking it). Searched
    as `find_save_dirs` searches: not `.checkpointd*` dirs, not through
    symlinks, not inside a save dir.
    """
    path = Path(path)
    if path.name.endswith(PREFIX_MANIFEST_SUFFIX) and path.is_file():
        return [path.with_name(path.name[: -len(PREFIX_MANIFEST_SUFFIX)])]
    # "." and "/" have no name, so no manifest can sit beside them: search them as dirs.
    if path.name and path.with_name(path.name + PREFIX_MANIFEST_SUFFIX).is_file():
        return [path]
    if not path.is_dir() or _holds_a_manifest(path) or _looks_like_a_save(path):
        return []
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(
            d
            for d in dirnames
            if not d.startswith(_RESERVED_PREFIX)
            and not os.path.islink(os.path.join(dirpath, d))
            and not _holds_a_manifest(Path(dirpath, d))
            and not _looks_like_a_save(Path(dirpath, d))
        )
        names = {f[: -len(PREFIX_MANIFEST_SUFFIX)] for f in filenames if f.endswith(PREFIX_MANIFEST_SUFFIX)}
        if orphans and names:
            names |= {f[: -len(".index")] for f in filenames if f.endswith(".index")}
        found.extend(Path(dirpath, n) for n in names if n)
    return sorted(found)
