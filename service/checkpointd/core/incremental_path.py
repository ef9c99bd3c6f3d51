"""Which path an incremental save takes: its unchanged ranges copied from the base, or received like the rest.

An incremental save's unchanged bytes can reach the new save two ways:
- from the base save, by the root: a clone of its extents where the file
  system shares them (XFS with reflink, Btrfs: nearly free), an in-kernel
  copy where it does not (ext4: a read of the base and a write of the
  copy), or a server-side part copy on an object store (no upload);
- from the trainer, as every byte of a full save is: over the link (gRPC)
  or from the shared-memory segment, then written.
The changed bytes cost the same either way, so the choice rests on the cost
of one unchanged byte each way. `PathChooser` learns both from the saves
themselves, per kind of save alike (the caller's key: the same transport,
kind and size class), as seconds per payload byte from accept to durable: a save received whole gives the receive cost; a save that copied
gives the copy cost once its received bytes are priced at the receive cost.
Until both are known (copying from a few saves) it takes the root's own
path (what the probe of the root found); after that, the cheaper one (a
tie, within a margin, copies), and every
`explore_every`-th save in a row on one path (less often the further
behind the other is) it takes the other once so that path's cost follows
the load. Pure: the caller measures and reports.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


class IncrementalPath(enum.Enum):
    """How an incremental save's unchanged ranges got into it (SaveResult.incremental_path)."""

    CLONE = "clone"  # the base's extents shared (reflink)
    COPY = "copy"  # copied in the kernel from the base's file
    SERVER_COPY = "server_copy"  # copied by the object store from the base's object
    RECEIVE = "receive"  # received like the changed bytes: the daemon offered no base
    NO_BASE = "no_base"  # asked for, but there was no base to copy from


# The label values of checkpointd_incremental_path_total{path}.
PATHS = tuple(p.value for p in IncrementalPath)
# The paths that copy from a base: what a root can offer.
COPYING = (IncrementalPath.CLONE, IncrementalPath.COPY, IncrementalPath.SERVER_COPY)
# --incremental-path: measure and choose, or always one way.
CHOICES = ("auto", "copy", "receive")
# A path n times the other's cost is tried again after n times as long a streak, up to this many times.
_MAX_STRETCH = 8


@dataclass(frozen=True)
class ChooserConfig:
    """How `PathChooser` weighs what it measured.

    Attributes:
        choice: "auto" (choose per save from the costs measured), "copy"
            (always the root's copying path), "receive" (never offer a base).
        weight: of each new measurement in a cost's moving average (0, 1].
        samples: copies measured before copying can lose to receiving (one
            save on a busy machine is no verdict).
        margin: copying loses only when it costs more than (1 + margin) x
            receiving: a tie copies, which spares the link for others.
        explore_every: after this many saves in a row on one path (of a
            kind of save alike), the next takes the other one, to measure it again;
            n times that many when the other path cost n times as much
            (n at most 8).
    """

    choice: str = "auto"
    weight: float = 0.3
    explore_every: int = 8
    samples: int = 3
    margin: float = 0.1

    def __post_init__(self) -> None:
        if self.choice not in CHOICES:
            raise ValueError(f"incremental path must be one of {CHOICES}, got {self.choice!r}")
        if not 0.0 < self.weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {self.weight}")
        if self.samples < 1:
            raise ValueError(f"samples must be at least 1, got {self.samples}")
        if not 0.0 <= self.margin < math.inf:
            raise ValueError(f"margin must be >= 0 and finite, got {self.margin}")
        if self.explore_every < 2:
            raise ValueError(f"explore_every must be at least 2, got {self.explore_every}")


@dataclass
class _Costs:
    """Seconds per payload byte of saves alike, each way, and the current streak."""

    receive: float | None = None
    copy: float | None = None
    copies: int = 0  # saves that priced copying
    streak_path: IncrementalPath | None = None
    streak: int = 0


@dataclass
class PathChooser:
    """Chooses each incremental save's path from the measured costs of the root's saves. Not thread-safe.

    Attributes:
        copies: the root's way of copying from a base (one of COPYING).
        config: how measurements are weighed.
    """

    copies: IncrementalPath
    config: ChooserConfig = field(default_factory=ChooserConfig)
    _by_key: dict[str, _Costs] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.copies not in COPYING:
            raise ValueError(f"a root copies by one of {[p.value for p in COPYING]}, not {self.copies.value!r}")

    def choose(self, alike: str) -> IncrementalPath:
        """The path of the next incremental save among the saves `alike` names: `copies`, or RECEIVE."""
        if self.config.choice != "auto":
            return self.copies if self.config.choice == "copy" else IncrementalPath.RECEIVE
        costs = self._by_key.setdefault(alike, _Costs())
        streak = self.config.explore_every
        if costs.receive is None or costs.copy is None or costs.copies < self.config.samples:
            cheaper = self.copies  # the root's own way until both ways have been measured
        else:
            dearer = costs.copy > (1.0 + self.config.margin) * costs.receive
            cheaper = IncrementalPath.RECEIVE if dearer else self.copies
            # The further behind the other path is, the less often it is tried again.
            behind = max(costs.copy, costs.receive) / max(min(costs.copy, costs.receive), 1e-15)
            streak *= min(_MAX_STRETCH, max(1, int(behind + 1e-9)))
        if costs.streak_path is cheaper and costs.streak >= streak - 1:
            chosen = IncrementalPath.RECEIVE if cheaper is self.copies else self.copies
        else:
            chosen = cheaper
        if chosen is costs.streak_path:
            costs.streak += 1
        else:
            costs.streak_path, costs.streak = chosen, 1
        return chosen

    def observed(self, alike: str, seconds: float, received: int, copied: int) -> None:
        """Takes one committed save of those `alike` names: `seconds` accept to durable, payload bytes each way.

        Every save counts, incremental or not: one received whole prices the
        receive path; one that copied prices the copy path (after the first
        received whole has priced its received bytes).
        """
        if seconds < 0 or received < 0 or copied < 0 or received + copied == 0:
            return
        costs = self._by_key.setdefault(alike, _Costs())
        if copied == 0:
            costs.receive = self._blend(costs.receive, seconds / received)
        elif costs.receive is not None:
            copying = max(0.0, seconds - received * costs.receive)
            costs.copy = self._blend(costs.copy, copying / copied)
            costs.copies += 1

    def costs(self, alike: str) -> tuple[float | None, float | None]:
        """Seconds per byte (receive, copy) of the saves `alike` names so far; None where unmeasured."""
        costs = self._by_key.get(alike, _Costs())
        return costs.receive, costs.copy

    def _blend(self, average: float | None, sample: float) -> float:
        if average is None:
            return sample
        return average + self.config.weight * (sample - average)
