"""The trainer's skip-if-busy without a round trip: the run's busy lock (see `checkpointd.saves.shm`).

A daemon on this host offers, with the run's segment, a lock file whose
exclusive flock(2) is held exactly while a save of the run is in flight:
by the daemon for every save it decides, by a trainer for a "held" save.
Once a saver has mapped the segment and opened the lock, a non-blocking
save needs no answer from the daemon to know whether it is skipped:

- this saver's own held save still in flight: skipped (an flock is not
  exclusive against the same open file description, so this is checked
  first, under the saver's lock);
- `flock(LOCK_EX | LOCK_NB)` fails: another saver's (any process) or the
  daemon's save is in flight: skipped;
- taken: not skipped. The variables are copied into the segment at once and
  the Save call, whose header says `held`, is made on the upload thread; the
  lock is let go when that call ends, whatever its end.

Skips decided here are reported to the daemon on the saver's next Save
header or Flush (`LocalSkips`), so its counts and skip log lag by at most one
save or flush. The lock file's st_nlink drops to 0 when the daemon that made
it stops (its folder is removed); the saver then goes the ordinary way
(which registers again if the daemon lost the run).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from checkpointd.protocol.busy_lock import BusyLock
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client.shm import SegmentMap
from checkpointd_client.snapshot import Bindings

# The most local skips one message reports; the rest wait for the next one.
MOST_PER_MESSAGE = 4096


@dataclass
class HeldPath:
    """What a saver needs to save without asking: the mapped segment, the lock, the layout it fits."""

    segment: SegmentMap
    lock: BusyLock
    bindings: Bindings
    snapshot_bytes: int

    def fits(self, bindings: Bindings, snapshot_bytes: int) -> bool:
        return bindings is self.bindings and snapshot_bytes == self.snapshot_bytes

    def held(self) -> pb.HeldSave:
        return pb.HeldSave(segment_path=self.segment.path, lock_path=self.lock.path)


class LocalSkips:
    """Saves skipped under the busy lock, waiting to be reported. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._skips: list[pb.LocalSkip] = []

    def add(self, kind: pb.SaveKind, export_dir: str, step: int) -> None:
        with self._lock:
            self._skips.append(pb.LocalSkip(kind=kind, export_dir=export_dir, step=step))

    def take(self) -> list[pb.LocalSkip]:
        """The oldest waiting skips (at most MOST_PER_MESSAGE), now counted as reported."""
        with self._lock:
            taken, self._skips = self._skips[:MOST_PER_MESSAGE], self._skips[MOST_PER_MESSAGE:]
            return taken

    def put_back(self, skips: list[pb.LocalSkip]) -> None:
        """Reports that did not reach the daemon, to go with the next message."""
        with self._lock:
            self._skips[:0] = skips

    def __len__(self) -> int:
        with self._lock:
            return len(self._skips)
