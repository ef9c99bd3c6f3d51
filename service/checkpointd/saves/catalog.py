"""The catalog of committed saves: a run's newest one, and every run the store holds.

What counts as committed is the Store's to say (a save with a valid manifest);
"newest" is `checkpointd.core.retention.age`'s order: the latest creation
time, then the highest step. The catalog reads manifests only, so it sees the
saves of every daemon that writes to the same store (a fleet on one bucket),
including daemons that are gone.

`stored_runs` answers `status --stored`. It is bounded: at most `STORED_CAP`
folders are searched and `STORED_CAP` runs returned (a bucket may hold many
thousands), and folders are read a few at a time in parallel, because on an
object store each one is a listing plus a read of each manifest not read
before. The lease holders come from the Leases object in one call if it
offers `holders(runs)` (one listing of the lease objects), else one
`holder(run)` per run returned, which the cap bounds.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from checkpointd.core.ports import CommittedSave, LeaseHolders, Leases, Store
from checkpointd.core.retention import age
from checkpointd.protocol.kinds import SaveKind

STORED_CAP = 1000
"""Most folders `stored_runs` searches, and most runs it returns."""

_READERS = 8  # folders read at once: enough to hide an object store's round trips


def find_latest(store: Store, folder: str, run: str, kind: SaveKind | None = None) -> CommittedSave | None:
    """The run's newest committed save in `folder`.

    Args:
        store: where the saves live.
        folder: the run's folder (a valid run name; usually the run's name).
        run: only saves whose manifest names this run count.
        kind: only saves of this kind count; None for either.

    Returns:
        The save, or None if the run has none (or its folder does not exist).
    """
    return _newest([s for s in store.committed(folder, run) if kind is None or s.kind is kind])


def find_latest_in_dir(store: Store, folder: str, directory: str) -> CommittedSave | None:
    """The newest committed training checkpoint in `folder`'s checkpoint dir `directory`, whichever run committed it.

    As `tf.train.latest_checkpoint(dir)` finds it: restores go by where the
    checkpoints are, so a renamed run (or a reader) finds the dir's.
    """
    return _newest(
        [
            s
            for s in store.committed(folder, None)
            if s.kind is SaveKind.TRAINING_CHECKPOINT and s.prefix and posixpath.dirname(s.export_dir) == directory
        ]
    )


def _newest(saves: list[CommittedSave]) -> CommittedSave | None:
    # Not max(..., default=None): mypy infers the key's argument from the
    # Optional return type and rejects age.
    return max(saves, key=age) if saves else None


@dataclass(frozen=True)
class StoredRun:
    """A run with committed saves in one folder of the store.

    Attributes:
        folder: the folder under the root.
        run: the run its manifests name.
        saves: how many committed saves it has there, of every kind.
        newest: the newest of them (as `find_latest` with no kind finds it).
        holder: its lease holder: "" this daemon, else the holder's
            description; None if nobody holds it or the store has no leases.
    """

    folder: str
    run: str
    saves: int
    newest: CommittedSave
    holder: str | None = None


@dataclass(frozen=True)
class StoredRuns:
    """What `stored_runs` found.

    Attributes:
        runs: by folder, then run name.
        folders: how many run folders the store has (or were asked for).
        truncated: the cap cut the search or the answer short.
    """

    runs: list[StoredRun]
    folders: int
    truncated: bool


def stored_runs(
    store: Store,
    leases: Leases | None = None,
    *,
    folders: Sequence[str] | None = None,
    run: str | None = None,
    cap: int = STORED_CAP,
) -> StoredRuns:
    """Every run with a committed save in the store, with its newest save and lease holder.

    Args:
        store: where the saves live.
        leases: who holds each run's lease (None: nobody is asked).
        folders: the folders to search; None for every folder the store has.
        run: only this run counts; None for every run.
        cap: the most folders searched and runs returned.

    Returns:
        The runs found; `truncated` if `cap` cut the search or the answer.

    Raises:
        UnavailableError: the store could not be read.
    """
    names = sorted(store.folders() if folders is None else folders)
    truncated = len(names) > cap
    with ThreadPoolExecutor(max_workers=_READERS, thread_name_prefix="checkpointd-catalog") as pool:
        found = [
            stored for in_folder in pool.map(lambda f: _runs_in(store, f, run), names[:cap]) for stored in in_folder
        ]
        if len(found) > cap:
            found, truncated = found[:cap], True
        holders = _holders(leases, sorted({s.run for s in found}), pool) if leases is not None else {}
    runs = [StoredRun(s.folder, s.run, s.saves, s.newest, holders.get(s.run)) for s in found]
    return StoredRuns(runs, len(names), truncated)


def _runs_in(store: Store, folder: str, run: str | None) -> list[StoredRun]:
    """The runs of one folder, by name, each with its count and newest save."""
    by_run: dict[str, list[CommittedSave]] = {}
    for save in store.committed(folder, run):
        by_run.setdefault(save.run, []).append(save)
    return [StoredRun(folder, name, len(saves), max(saves, key=age)) for name, saves in sorted(by_run.items())]


def _holders(leases: Leases, runs: list[str], pool: ThreadPoolExecutor) -> Mapping[str, str | None]:
    """Each run's lease holder: in one call if the Leases offer `holders`, else one lookup per run."""
    if isinstance(leases, LeaseHolders):  # one listing of the lease objects
        return dict(leases.holders(runs))
    return dict(zip(runs, pool.map(leases.holder, runs), strict=True))
