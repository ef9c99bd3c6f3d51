"""Run names and export dirs: what a client may name, and where it lands."""

from __future__ import annotations

import functools
import re
import unicodedata
from pathlib import PurePosixPath

from checkpointd.protocol.errors import InvalidRequestError

_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
# Temp and backup dirs the daemon makes start with this; clients may not.
RESERVED_PREFIX = ".checkpointd"
# The names the daemon derives from an export dir's last component <name>, in
# the same directory (checkpointd.durable.files and the local store): the
# save is written into `<TMP_PREFIX><name>-<hex>`, a replaced save is parked
# as `<OLD_PREFIX><name>-<hex>`, and retention renames a save it deletes to
# `<RETIRED_PREFIX><name>-<hex>` first. They live here, not in the store,
# because the limit they set on <name> is part of what a client may send.
TMP_PREFIX = RESERVED_PREFIX + "-tmp-"
OLD_PREFIX = RESERVED_PREFIX + "-old-"
RETIRED_PREFIX = TMP_PREFIX + "retired-"
SUFFIX_HEX_LEN = 16  # the random <hex> (secrets.token_hex(8))
# What a filesystem allows in one name (NAME_MAX on Linux, and on most others).
NAME_MAX_BYTES = 255
# An export dir's last component may be at most this long, so that every name
# derived from it still fits in NAME_MAX_BYTES: 255 - 42 = 213 bytes of UTF-8.
MAX_EXPORT_NAME_BYTES = NAME_MAX_BYTES - max(
    len(prefix) + 1 + SUFFIX_HEX_LEN for prefix in (TMP_PREFIX, OLD_PREFIX, RETIRED_PREFIX)
)
_MAX_PATH = 1024
# tf.train.CheckpointManager's default checkpoint_name: a training checkpoint
# of step N is the prefix `<dir>/ckpt-N` (common.Checkpointer.save(N)).
CHECKPOINT_NAME = "ckpt"


def checkpoint_prefix(directory: str, step: int) -> str:
    """A training checkpoint's export dir: `<directory>/ckpt-<step>`, '/'-separated.

    Raises:
        InvalidRequestError: `directory` is not a valid export dir, or `step` is negative.
    """
    if step < 0:
        raise InvalidRequestError(
            f"a training checkpoint's step must be >= 0 (it names the files ckpt-<step>), got {step}"
        )
    return f"{check_export_dir(directory).as_posix()}/{CHECKPOINT_NAME}-{step}"


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


def is_run_name(name: str) -> bool:
    """Whether `name` is a valid run name (`check_run_name` without the error): a folder a listing may report."""
    return _RUN_NAME.match(name) is not None


# A save's export dir is checked at its accept and again at its commit; the
# check is pure text work (a Unicode category per character): done once per name.
@functools.lru_cache(maxsize=4096)
def check_export_dir(export_dir: str) -> PurePosixPath:
    """Checks a client's export dir as text; returns it normalized.

    Raises:
        InvalidRequestError: if it is empty, absolute, leaves its folder with
            `..`, names a reserved entry, holds control characters, has a
            component over NAME_MAX_BYTES or a last component over
            MAX_EXPORT_NAME_BYTES.
    """
    if not export_dir:
        raise InvalidRequestError("export_dir is empty")
    if len(export_dir.encode("utf-8", "surrogatepass")) > _MAX_PATH:
        raise InvalidRequestError(f"export_dir is longer than {_MAX_PATH} bytes")
    bad = [c for c in export_dir if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn")]
    if bad:
        raise InvalidRequestError(f"export_dir {export_dir!r} contains control or unassigned characters ({bad[0]!r})")
    if "\\" in export_dir:
        raise InvalidRequestError(f"export_dir {export_dir!r} contains a backslash; use '/'")
    path = PurePosixPath(export_dir)
    if path.is_absolute():
        raise InvalidRequestError(f"export_dir {export_dir!r} is absolute; give a path relative to the run's folder")
    parts = [p for p in path.parts if p != "."]
    if not parts:
        raise InvalidRequestError(f"export_dir {export_dir!r} names the run's folder itself")
    for part in parts:
        if part == "..":
            raise InvalidRequestError(f"export_dir {export_dir!r} contains '..'")
        if part.startswith(RESERVED_PREFIX):
            raise InvalidRequestError(f"export_dir {export_dir!r}: names starting {RESERVED_PREFIX!r} are reserved")
        if len(part.encode("utf-8")) > NAME_MAX_BYTES:
            raise InvalidRequestError(
                f"export_dir component {part[:32]!r}... is {len(part.encode('utf-8'))} bytes of "
                f"UTF-8; a component may have at most {NAME_MAX_BYTES}"
            )
    name_bytes = len(parts[-1].encode("utf-8"))
    if name_bytes > MAX_EXPORT_NAME_BYTES:
        raise InvalidRequestError(
            f"export_dir's last component {parts[-1][:32]!r}... is {name_bytes} bytes of UTF-8; "
            f"it may have at most {MAX_EXPORT_NAME_BYTES}, because the daemon writes the save "
            f"beside it under a name up to {NAME_MAX_BYTES - MAX_EXPORT_NAME_BYTES} bytes longer "
            f"and a filesystem name holds {NAME_MAX_BYTES}"
        )
    return PurePosixPath(*parts)


MANIFEST_NAME = "checkpointd.manifest.json"
"""A committed save's manifest, written last: the commit marker (`checkpointd.storage.save_manifest`)."""

LEASE_WAIT_METADATA = "checkpointd-lease-wait"
"""RegisterRun's initial-metadata key, sent before the daemon waits for another daemon's lease: a sentence for people."""

SHM_FOLDER = re.compile(r"checkpointd-(\d+)-[0-9a-f]{16}")
"""A daemon's shared-memory folder, `checkpointd-<its pid>-<16 hex>`: the client reads the daemon's CPU by that pid."""
