"""`checkpointd verify`: save dirs checked against their manifests, offline.

Stdlib and `crc32c` only (through `checkpointd.storage.verify`):
verifying a multi-GB root must not wait for TensorFlow to import.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import IO

from checkpointd.storage.save_manifest import (
    MANIFEST_NAME,
    PREFIX_MANIFEST_SUFFIX,
    ManifestError,
    Progress,
    read_manifest,
)
from checkpointd.storage.verify import Report, find_prefixes, find_save_dirs, verify_dir, verify_prefix


def verify_paths(
    paths: Iterable[Path], progress: Progress | None = None, done: Callable[[Report], object] | None = None
) -> list[Report]:
    """Verifies every save at or under each path, in order: save dirs, then checkpoint prefixes.

    A checkpoint prefix (a training checkpoint, `<dir>/ckpt-<step>`) may be
    named itself; its files without a manifest beside them fail.

    Args:
        paths: save dirs, checkpoint prefixes, or dirs to search for them.
        progress: called with the bytes of each piece checked.
        done: called with each save's report as it is made.
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
        for d in dirs:
            reports.append(verify_dir(d, progress))
            if done is not None:
                done(reports[-1])
        for p in prefixes:
            reports.append(verify_prefix(p, progress))
            if done is not None:
                done(reports[-1])
    return reports


def missing(paths: Iterable[Path]) -> list[Path]:
    """The paths that are neither a file or dir nor a checkpoint prefix (a usage error, not a failed save)."""
    return [Path(p) for p in paths if not Path(p).exists() and not find_prefixes(Path(p), orphans=True)]


class ProgressLine:
    """Work done so far (saves, bytes, rate) on one rewritten stderr line, at most 5 times a second.

    For a terminal only: a pipe or a log gets nothing from it. `end()`
    leaves the last state on its own line.
    """

    def __init__(self, stream: IO[str], verb: str, total_bytes: int, total_saves: int | None = None) -> None:
        self._stream, self._verb = stream, verb
        self._total_bytes, self._total_saves = total_bytes, total_saves
        self._bytes, self._saves = 0, 0
        self._started = time.monotonic()
        self._shown: float | None = None

    def __call__(self, n: int) -> None:
        """Counts `n` more bytes."""
        self._bytes += n
        self._show()

    def save_done(self, report: object = None) -> None:
        """Counts one more save."""
        self._saves += 1
        self._show()

    def text(self) -> str:
        """The line as shown now: `checked 3 of 40 saves, 12.0 of 96.5 MiB, 48.1 MiB/s`."""
        parts = []
        if self._total_saves is not None:
            parts.append(f"{self._saves} of {self._total_saves} saves")
        parts.append(f"{self._bytes / _MIB:,.1f} of {self._total_bytes / _MIB:,.1f} MiB")
        seconds = time.monotonic() - self._started
        if seconds > 0:
            parts.append(f"{self._bytes / _MIB / seconds:,.1f} MiB/s")
        return f"{self._verb} " + ", ".join(parts)

    def _show(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or self._shown is None or now - self._shown >= 0.2:
            self._shown = now
            self._stream.write("\r" + self.text() + "\x1b[K")  # erase what a longer line left
            self._stream.flush()

    def end(self) -> None:
        """Shows the final count and ends the line."""
        self._show(force=True)
        self._stream.write("\n")
        self._stream.flush()


_MIB = 1 << 20


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
        progress: show saves and bytes checked, and the rate, on stderr;
            None = only if stderr is a TTY.
        out, err: streams (default stdout, stderr).

    Returns:
        0 if every save dir is OK, 1 otherwise, 2 if a path does not exist
        (nothing is checked then).
    """
    out = out or sys.stdout
    err = err or sys.stderr
    absent = missing(paths)
    if absent:
        err.write(
            f"checkpointd verify: {', '.join(map(str, absent))}: no such file or dir; give a save dir, "
            "a run's or the daemon's root dir, a checkpoint prefix (DIR/ckpt-N) or s3://BUCKET[/PREFIX[/RUN]]\n"
        )
        return 2
    if progress is None:
        progress = err.isatty()
    line = None
    if progress:
        dirs = [d for p in paths if Path(p).is_dir() for d in find_save_dirs(Path(p))]
        prefixes = [x for p in paths for x in find_prefixes(Path(p))]
        line = ProgressLine(err, "checked", _listed_bytes(dirs, prefixes), len(dirs) + len(prefixes))
    reports = verify_paths(paths, line, line.save_done if line is not None else None)
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
