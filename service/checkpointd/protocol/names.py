"""Run names and export dirs: what a client may name, and where it lands."""

from __future__ import annotations

import re
import unicodedata
from pathlib import PurePosixPath

from checkpointd.protocol.errors import InvalidRequestError

_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
# Temp and backup dirs the daemon makes start with this; clients may not.
RESERVED_PREFIX = ".checkpointd"
_MAX_PATH = 1024
_MAX_COMPONENT = 255


def check_run_name(run: str) -> str:
    """Returns `run` if it is a valid run name.

    Raises:
        InvalidRequestError: if it is not.
    """
    if not _RUN_NAME.match(run or ""):
        raise InvalidRequestError(
            f"run name {run!r} is invalid: use 1-128 characters of A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return run


def check_export_dir(export_dir: str) -> PurePosixPath:
    """Checks a client's export dir as text; returns it normalized.

    Raises:
        InvalidRequestError: if it is empty, absolute, leaves its folder with
            `..`, names a reserved entry or holds control characters.
    """
    if not export_dir:
        raise InvalidRequestError("export_dir is empty")
    if len(export_dir.encode("utf-8", "surrogatepass")) > _MAX_PATH:
        raise InvalidRequestError(f"export_dir is longer than {_MAX_PATH} bytes")
    bad = [c for c in export_dir if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn")]
    if bad:
        raise InvalidRequestError(
            f"export_dir {export_dir!r} contains control or unassigned characters ({bad[0]!r})"
        )
    if "\\" in export_dir:
        raise InvalidRequestError(f"export_dir {export_dir!r} contains a backslash; use '/'")
    path = PurePosixPath(export_dir)
    if path.is_absolute():
        raise InvalidRequestError(
            f"export_dir {export_dir!r} is absolute; give a path relative to the run's folder"
        )
    parts = [p for p in path.parts if p != "."]
    if not parts:
        raise InvalidRequestError(f"export_dir {export_dir!r} names the run's folder itself")
    for part in parts:
        if part == "..":
            raise InvalidRequestError(f"export_dir {export_dir!r} contains '..'")
        if part.startswith(RESERVED_PREFIX):
            raise InvalidRequestError(
                f"export_dir {export_dir!r}: names starting {RESERVED_PREFIX!r} are reserved"
            )
        if len(part.encode("utf-8")) > _MAX_COMPONENT:
            raise InvalidRequestError(f"export_dir component {part[:32]!r}... is too long")
    return PurePosixPath(*parts)
