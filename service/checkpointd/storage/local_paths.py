"""Where a save lives under a local root: `<root>/<run>/<export_dir>`, resolved and kept inside its run's folder.

A symlink on the way is followed and must stay inside `<root>/<run>`. The
root's real path and each target's Path are made once and cached: a save
resolves its target several times (accept, open, commit). Stdlib only.
"""

from __future__ import annotations

import functools
import os
import stat
from pathlib import Path

from checkpointd.protocol.errors import InvalidRequestError
from checkpointd.protocol.names import check_export_dir, check_run_name


def resolve_export_dir(root: Path, run: str, export_dir: str) -> Path:
    """Returns the absolute target of a save: `<root>/<run>/<export_dir>`.

    Symlinks on the way are followed and must stay inside `<root>/<run>`.

    Raises:
        InvalidRequestError: if the run name or export dir is invalid, or the
            path resolves outside the run's folder.
    """
    check_run_name(run)
    relative = check_export_dir(export_dir)
    run_dir = _real_run_dir(os.fspath(root), run)
    # Joined as text and made a Path once: a save resolves its target at the
    # accept, at the stream's open and at the commit (each a check of its own).
    target = os.path.join(run_dir, *relative.parts)
    # `run_dir` is real and `relative` has no '.' or '..': without a symlink
    # below `run_dir`, `target` is its own realpath. Looking for one costs an
    # lstat per part of `relative`, not per part of the whole path.
    if _has_symlink(run_dir, relative.parts):
        real = Path(os.path.realpath(target))
        if real != Path(target) and Path(run_dir) not in real.parents:
            raise InvalidRequestError(
                f"export_dir {export_dir!r} resolves outside the run's folder (through a symlink)"
            )
    return _path_of(target)


# A save's target is resolved (and checked) three times, each making the same
# Path; made once per text (a Path never changes).
_path_of = functools.lru_cache(maxsize=1024)(Path)


def _real_run_dir(root: str, run: str) -> str:
    """`realpath(root/run)`, with the root's own realpath (an lstat per part of it) looked up once.

    The root is the daemon's to own; the run's dir below it is checked at
    every call: a symlink there is followed (realpath), as before.
    """
    candidate = os.path.join(_real_root(root), run)
    if os.path.islink(candidate):
        return os.path.realpath(candidate)
    return candidate


@functools.lru_cache(maxsize=64)
def _real_root(root: str) -> str:
    return os.path.realpath(root)


def _has_symlink(base: str | Path, parts: tuple[str, ...]) -> bool:
    """Whether `base/parts[0]`, `base/parts[0]/parts[1]`, ... holds a symlink (up to the first absent one)."""
    path = os.fspath(base)
    for part in parts:
        path = os.path.join(path, part)
        try:
            if stat.S_ISLNK(os.lstat(path).st_mode):
                return True
        except OSError:
            return False  # absent (or unreadable) here and below: realpath keeps the rest as it is
    return False
