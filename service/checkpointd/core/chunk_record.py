"""The record a committed save keeps of its tensors' chunk digests, for the next save to compare with.

A committed save keeps, in its manifest (`FIELD`), its data file's suffix and
identity (device, inode, size, modification time) and, for each fixed-size
tensor, its place in the data file and the CRC32C of each of its chunks of
`CHUNK_BYTES` (`checkpointd.bundle.chunks` logs them as the bundle is
written). The next save of the run copies unchanged chunks from that file
once its identity says it is still the file the digests describe.

Stdlib only.
"""

from __future__ import annotations

import base64
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# 1 MiB: the client's wire chunk, so a full save's digests are the CRC32Cs
# it already sent; smaller than a replay buffer's changed run of rows, so
# little is sent beside what changed. bench/README.md has the measurements.
CHUNK_BYTES = 1 << 20
# The manifest field (Staged.extra) holding a save's record.
FIELD = "chunks"


def count(size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """How many chunks a tensor of `size` bytes has."""
    return -(-size // chunk_bytes)


@dataclass(frozen=True)
class BaseTensor:
    """One fixed-size tensor of a committed bundle: where it is in the data file, and its chunks' digests."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    size: int
    crcs: tuple[int, ...]


@dataclass(frozen=True)
class Record:
    """A committed save's data file (its suffix after the save's path), its identity, and its tensors."""

    data_file: str
    identity: tuple[int, int, int, int]
    chunk_bytes: int
    tensors: Mapping[str, BaseTensor]


def identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells a file apart from its replacement or a changed copy: device, inode, size, mtime."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _pack(crcs: Sequence[int]) -> str:
    return base64.b64encode(struct.pack(f"<{len(crcs)}I", *crcs)).decode("ascii")


def _unpack(text: str) -> tuple[int, ...]:
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    return struct.unpack(f"<{len(raw) // 4}I", raw) if len(raw) % 4 == 0 else ()


def record(data_file: str, st: os.stat_result, tensors: Sequence[BaseTensor]) -> dict[str, Any]:
    """The manifest field (JSON) describing a bundle written with these tensors' digests."""
    return {
        "data_file": data_file,
        "identity": list(identity(st)),
        "chunk_bytes": CHUNK_BYTES,
        "tensors": [
            {"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "offset": t.offset, "size": t.size,
             "crc32c": _pack(t.crcs)}
            for t in tensors
        ],
    }  # fmt: skip


def parse(extra: Mapping[str, Any] | None) -> Record | None:
    """A save's record from its manifest's fields; None if it has none, or one this daemon cannot use."""
    field = (extra or {}).get(FIELD)
    if not isinstance(field, dict):
        return None
    try:
        tensors = {}
        chunk_bytes = int(field["chunk_bytes"])
        for t in field["tensors"]:
            crcs = _unpack(t["crc32c"])
            size = int(t["size"])
            if len(crcs) != count(size, chunk_bytes):
                return None
            tensors[str(t["key"])] = BaseTensor(
                str(t["key"]), str(t["dtype"]), tuple(int(d) for d in t["shape"]), int(t["offset"]), size, crcs
            )
        ident = tuple(int(x) for x in field["identity"])
        if len(ident) != 4 or chunk_bytes < 1:
            return None
        return Record(str(field["data_file"]), ident, chunk_bytes, tensors)
    except (KeyError, TypeError, ValueError):
        return None
