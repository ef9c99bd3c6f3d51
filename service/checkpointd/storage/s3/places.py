"""Which export dirs of a run are known to hold nothing, so a save there needs no HEAD first.

Before a save goes up, the store deletes the manifest of a save already at
its place (`S3Store._unpublish`, step 2): a HEAD per save, even where, as
with a policy's numbered export dirs, there never is one. While this daemon
holds a run's lease without a break (one `tenure`, `S3Leases.tenure`),
nobody else writes the run's saves, and runs that share a folder use
distinct export dirs (the contract), so one listing of the dirs beside a
save's (its parent's, ListObjectsV2 with a delimiter, one page) plus the
dirs this daemon has written into since tell which dirs hold nothing at
all: a save into one of those needs no HEAD. A dir listed or written counts
as possibly holding a save (a failed save's objects, a deleted one's
leftovers) and keeps the HEAD, as does a parent with more dirs than one
page lists, a prefix save (its files sit beside others' in a dir), and
every save with no lease to go by. A new tenure (the lease lost, released
or taken again) lists again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Known:
    tenure: object
    dirs: set[str] | None  # the parent's dirs that may hold a save; None: too many to know


class Places:
    """Per (parent dir, run), the dirs in it that may hold a save, for one tenure of the run's lease. Thread-safe."""

    def __init__(
        self, list_dirs: Callable[[str], set[str] | None], tenure: Callable[[str], object | None] | None
    ) -> None:
        """Args:
        list_dirs: the names of the dirs right under a dir's key ("a/b/"; one
            request), or None if there are more than one answer lists.
        tenure: the run's lease tenure (`S3Leases.tenure`), None unless held;
            None: no leases, every save keeps its HEAD.
        """
        self._list_dirs = list_dirs
        self._tenure = tenure
        self._lock = threading.Lock()
        self._known: dict[tuple[str, str], _Known] = {}
        self._listing: dict[tuple[str, str], threading.Lock] = {}

    def claim(self, parent_key: str, run: str, name: str) -> bool:
        """Records that the run's save goes into dir `name` under `parent_key`; True if that dir is known empty.

        Called before any of the save's objects goes up, so a later save
        there (a replacement) sees the dir as written.
        """
        if self._tenure is None:
            return False
        item = (parent_key, run)
        with self._lock:
            listing = self._listing.setdefault(item, threading.Lock())
        with listing:  # one listing per (parent, run) and tenure, not one per save waiting for it
            tenure = self._tenure(run)
            if tenure is None:
                return False
            with self._lock:
                known = self._known.get(item)
            if known is None or known.tenure != tenure:
                try:
                    dirs = self._list_dirs(parent_key)
                except Exception:  # noqa: BLE001 - the HEAD decides instead; the next save lists again
                    return False
                if self._tenure(run) != tenure:  # lost or taken again while listing: the answer may be stale
                    return False
                known = _Known(tenure, dirs)
            with self._lock:
                self._known[item] = known
                if known.dirs is None:
                    return False
                empty = name not in known.dirs
                known.dirs.add(name)
                return empty
