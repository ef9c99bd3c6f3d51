"""Committed saves already read, kept by their manifest file's identity: a run's dir is listed at every save.

A training run's state file and retention list every checkpoint of the dir
at each commit (`checkpointd.saves.checkpoint_dirs`), and a continuous
trainer commits several times a second: parsing each kept checkpoint's
manifest (JSON, with its chunk digests) again at every listing would cost
more than the small save itself. A committed manifest is never written in place: it is created once, under
a temporary name, and renamed there, and a save replaced or deleted takes
its manifest with it. So one whose stat is unchanged (device, inode, size,
mtime and ctime in ns) holds the bytes that were parsed, and its save is
the one read then. Anything else (a new file, a changed one, a link) is
read again by the caller; only saves read whole are kept.

Stdlib only; thread-safe; at most `limit` entries (least recently used go).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Hashable

from checkpointd.core.ports import CommittedSave

# Enough for every checkpoint kept by many runs (TF's max_to_keep is 5, TF-Agents' Checkpointer 20).
DEFAULT_LIMIT = 8192


def identity(st: os.stat_result) -> tuple[int, ...]:
    """What says a manifest file is the one read before: its device, inode, size, mtime and ctime."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class ManifestCache:
    """(where, the manifest's identity) -> the CommittedSave read from it."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self._limit = limit
        self._lock = threading.Lock()
        self._saves: OrderedDict[Hashable, tuple[tuple[int, ...], CommittedSave]] = OrderedDict()

    def get(self, where: Hashable, manifest: tuple[int, ...]) -> CommittedSave | None:
        """The save read at `where` from a manifest of this identity, if it is the one kept."""
        with self._lock:
            kept = self._saves.get(where)
            if kept is None or kept[0] != manifest:
                return None
            self._saves.move_to_end(where)
            return kept[1]

    def put(self, where: Hashable, manifest: tuple[int, ...], save: CommittedSave) -> None:
        with self._lock:
            self._saves[where] = (manifest, save)
            self._saves.move_to_end(where)
            while len(self._saves) > self._limit:
                self._saves.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._saves)
