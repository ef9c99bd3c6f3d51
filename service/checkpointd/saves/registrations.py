"""The runs registered on this daemon as `Lanes` keeps them, and who may register one.

One stream per run name, one run per claimed checkpoint dir.

`checkpointd.saves.runs.Lanes` keeps a `RunEntry` per run (a `RunView` is
a copy of one, for status) and asks `check_registration`, under its lock,
before it registers a run or lets the pipeline take the run's lease: a
refused registration changes nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from checkpointd.core.lane import Lane, LaneState, LaneStats, Ticket
from checkpointd.core.variable_manifest import Manifest
from checkpointd.protocol.errors import AlreadyExistsError, RunNotFoundError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.transport.shm import RunLock


@dataclass
class RunEntry:
    """One registered run as `Lanes` keeps it; guarded by its lock."""

    lane: Lane
    manifest: Manifest
    folder: str
    claim: str | None = None  # the checkpoint dir of `folder` a training run writes (None: no claim)
    kinds: tuple[SaveKind, ...] = ()  # the saves it makes (a policy run's or a training run's)
    lock: RunLock | None = None  # the run's busy lock
    decided_ticket: Ticket | None = None  # the trainer-decided save in flight (its trainer holds the lock)

    @property
    def locked(self) -> bool:
        """The daemon holds the run's busy lock (for the save in flight)."""
        return self.lock is not None and self.lock.held


@dataclass(frozen=True)
class RunView:
    """A copy of one run's state, safe to read without the lock."""

    run: str
    state: LaneState
    in_flight: Ticket | None
    waiting: int
    stats: LaneStats
    manifest: Manifest

    @classmethod
    def of(cls, run: str, entry: RunEntry) -> RunView:
        """A copy of `entry`'s state; the caller holds the lock that guards it."""
        lane = entry.lane
        return cls(
            run=run,
            state=lane.state,
            in_flight=dataclasses.replace(lane.in_flight) if lane.in_flight else None,
            waiting=len(lane.waiting),
            stats=dataclasses.replace(lane.stats),
            manifest=entry.manifest,
        )


def unknown_run(run: str, runs: Mapping[str, RunEntry]) -> RunNotFoundError:
    """The error for a run an operator names (flush, close, status) that is not among `runs`."""
    open_runs = sorted(n for n, e in runs.items() if e.lane.state is not LaneState.CLOSED)
    closed = sorted(set(runs) - set(open_runs))
    return RunNotFoundError(
        f"no run named {run!r} is open on this daemon; open runs: {_listed(open_runs)}"
        + (f"; closed runs: {_listed(closed)}" if closed else "")
        + " (a run is known from its trainer's registration until the daemon restarts)"
    )


def _listed(names: list[str], most: int = 20) -> str:
    """Names for a message, at most `most` of them."""
    if not names:
        return "none"
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def check_registration(
    runs: Mapping[str, RunEntry], run: str, folder: str, claim: str | None, kinds: tuple[SaveKind, ...]
) -> None:
    """Raises AlreadyExistsError if `run` may not register for `folder`, `claim` and `kinds` among `runs`.

    Another open run of the folder may already claim the dir, or `run` may be
    open for another folder, kind of save or dir (another stream of that name).
    """
    if claim is not None:
        holder = _claimant(runs, folder, claim)
        if holder is not None and holder != run:
            raise AlreadyExistsError(
                f"checkpoint dir {claim!r} of folder {folder!r} is written by run {holder!r}, which is "
                f"open on this daemon: one checkpointer per dir, as one CheckpointManager per dir. Give "
                f"this checkpointer another ckpt_dir, or close run {holder!r} first (`checkpointd close --run "
                f"{holder}`); to only read its checkpoints, use RemoteCheckpointer(..., read_only=True)"
            )
    entry = runs.get(run)
    if entry is not None and entry.lane.state is not LaneState.CLOSED:
        _refuse_another_stream(run, entry, folder, claim, kinds)


def _claimant(runs: Mapping[str, RunEntry], folder: str, claim: str) -> str | None:
    """The open run that claims `claim` of `folder`, if any."""
    for name, entry in runs.items():
        if entry.claim == claim and entry.folder == folder and entry.lane.state is not LaneState.CLOSED:
            return name
    return None


def _refuse_another_stream(
    run: str, entry: RunEntry, folder: str, claim: str | None, kinds: tuple[SaveKind, ...]
) -> None:
    """Raises AlreadyExistsError unless a registration of open `run` is its own stream again.

    A restarted trainer registers the same folder, kinds and dir; another
    saver whose name came out the same (another job's folder, a policy
    saver named like a job's checkpointer) would take the run over: its
    saves would land in the other's folder, or fail the other's.
    """
    differences = []
    if entry.folder != folder:
        differences.append(f"folder {entry.folder!r}, not {folder!r}")
    if entry.kinds and kinds and entry.kinds != kinds:
        differences.append(f"{', '.join(k.value for k in entry.kinds)} saves, not {', '.join(k.value for k in kinds)}")
    if entry.claim != claim:
        differences.append(f"checkpoint dir {entry.claim!r}, not {claim!r}")
    if differences:
        raise AlreadyExistsError(
            f"run {run!r} is open on this daemon for {'; '.join(differences)}: another saver of that name "
            f"is writing. Give this job another run= (a checkpointer's run is <run>.<ckpt_dir>, a policy "
            f"saver's <run>), or close run {run!r} first (`checkpointd close --run {run}`) if its trainer is gone"
        )
