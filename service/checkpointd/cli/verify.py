"""`checkpointd verify`: save dirs checked against their manifests, offline.

Stdlib and `crc32c` only (through `checkpointd.storage.save_manifest`):
verifying a multi-GB root must not wait for TensorFlow to import.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import IO

from checkpointd.storage.save_manifest import (
    MANIFEST_NAME,
    PREFIX_MANIFEST_SUFFIX,
    ManifestError,
    Progress,
    Report,
    find_prefixes,
    find_save_dirs,
    read_manifest,
    verify_dir,
    verify_prefix,
)


def verify_paths(paths: Iterable[Path], progress: Progress | None = None) -> list[Report]:
    """Verifies every save at or under each path, in order: save dirs, then checkpoint prefixes.

    A checkpoint prefix (a training checkpoint, `<dir>/ckpt-<step>`) may be
    named itself; its files without a manifest beside them fail.
    """
    reports = []
    for path in paths:
        path = Path(path)
        prefixes = find_prefixes(path, orphans=True)
        if not path.exists() and not prefixes:
            reports.append(Report(str(path), False, "does not exist"))
            continue
        dirs = find_save_dirs(path) if path.is_dir() else []
        if not dirs and not prefixes:
            reports.append(Report(str(path), False, f"no save dirs ({MANIFEST_NAME}) found here"))
        reports.extend(verify_dir(d, progress) for d in dirs)
        reports.extend(verify_prefix(p, progress) for p in prefixes)
    return reports


class _ProgressLine:
    """Bytes checked so far, on one rewritten stderr line, at most 5 times a second."""

    def __init__(self, stream: IO[str], total: int) -> None:
        self._stream, self._total = stream, total
        self._done, self._shown = 0, 0.0

    def __call__(self, n: int) -> None:
        self._done += n
        now = time.monotonic()
        if now - self._shown >= 0.2:
            self._shown = now
            self._stream.write(f"\rchecked {self._done / (1 << 20):,.1f} of {self._total / (1 << 20):,.1f} MiB")
            self._stream.flush()

    def end(self) -> None:
        if self._shown:
            self._stream.write(f"\rchecked {self._done / (1 << 20):,.1f} MiB\n")
            self._stream.flush()


def _listed_bytes(dirs: Iterable[Path], prefixes: Iterable[Path] = ()) -> int:
    total = 0
    manifests = [(d, MANIFEST_NAME) for d in dirs] + [(p.parent, p.name + PREFIX_MANIFEST_SUFFIX) for p in prefixes]
    for where, name in manifests:
        try:
            total += sum(e.size for e in read_manifest(where, name)["files"])
        except ManifestError:
            pass
    return total


def run(
    paths: Sequence[Path],
    *,
    as_json: bool = False,
    progress: bool | None = None,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
) -> int:
    """`checkpointd verify`: prints OK/FAILED per save dir.

    Args:
        paths: save dirs, or dirs (a run, the root) to search for them.
        as_json: print one JSON document instead of lines.
        progress: show bytes checked on stderr; None = only if stderr is a TTY.
        out, err: streams (default stdout, stderr).

    Returns:
        0 if every save dir is OK, 1 otherwise.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    if progress is None:
        progress = err.isatty()
    line = None
    if progress:
        dirs = [d for p in paths if Path(p).is_dir() for d in find_save_dirs(Path(p))]
        prefixes = [x for p in paths for x in find_prefixes(Path(p))]
        line = _ProgressLine(err, _listed_bytes(dirs, prefixes))
    reports = verify_paths(paths, line)
    if line is not None:
        line.end()
    return print_reports(reports, as_json, out)


def print_reports(reports: Sequence[Report], as_json: bool, out: IO[str]) -> int:
    """Prints OK/FAILED per save (or one JSON document); returns the exit code, 0 if all are OK."""
    ok = all(r.ok for r in reports)
    if as_json:
        json.dump({"ok": ok, "dirs": [asdict(r) for r in reports]}, out, indent=1)
        out.write("\n")
    else:
        for r in reports:
            if r.ok:
                out.write(f"OK      {r.path} ({r.kind}, step {r.step}, {r.files} files, {r.bytes} bytes)\n")
            else:
                out.write(f"FAILED  {r.path}: {r.reason}\n")
        failed = sum(not r.ok for r in reports)
        out.write(f"{len(reports) - failed} OK, {failed} FAILED\n")
    return 0 if ok else 1
