"""The CPU a daemon on this host spends, read from /proc: what a save costs the trainer beside its stall.

A save's stall is only part of what it costs training. On the same host the
daemon then writes the save (a copy out of the shared-memory segment, the
bundle's checksums, the files), and where the cores are busy that CPU is
taken from training as surely as the stall is; where a core is idle, the
daemon runs there and costs training nothing. So a continuous
checkpointer's budget (`checkpointd_client.continuous`) charges the daemon's
CPU from the save's accept to durable, read from `/proc/<pid>/stat` (utime +
stime, every thread; the pid from the name of the shared-memory folder the
daemon offered, `checkpointd.protocol.names.SHM_FOLDER`), less the machine's
idle CPU in that time (`/proc/stat`: idle and iowait of every core): only
the part that idle cores could not have run. The daemon's CPU includes its
other work in that time (another run's save): a budget that errs towards
saving less. Nothing is charged where the daemon is not on this host, or
/proc cannot be read.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from pathlib import PurePosixPath

from checkpointd.protocol.names import SHM_FOLDER

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class DaemonCpu:
    """A same-host daemon's CPU seconds so far."""

    def __init__(self, pid: int) -> None:
        self._stat = f"/proc/{pid}/stat"

    @classmethod
    def of_segment(cls, segment_path: str) -> DaemonCpu | None:
        """The daemon that made the shared-memory segment at `segment_path`; None if its CPU cannot be read."""
        match = SHM_FOLDER.fullmatch(PurePosixPath(segment_path).parent.name)
        if match is None:
            return None
        cpu = cls(int(match.group(1)))
        return cpu if cpu.seconds() is not None else None

    def seconds(self) -> float | None:
        """CPU seconds (user + system, every thread) the daemon has spent; None if it cannot be read now."""
        try:
            with open(self._stat, "rb") as f:
                stat = f.read()
        except OSError:
            return None
        fields = stat.rsplit(b")", 1)[-1].split()  # after the command name, which may hold anything
        try:
            return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime: fields 14 and 15 of proc(5)
        except (IndexError, ValueError):
            return None


def idle_seconds() -> float | None:
    """CPU seconds every core of this machine has been idle (or waiting for I/O) so far; None without /proc/stat."""
    try:
        with open("/proc/stat", "rb") as f:
            first = f.readline()  # "cpu  user nice system idle iowait irq softirq steal ...": every core
    except OSError:
        return None
    fields = first.split()
    try:
        return (int(fields[4]) + int(fields[5])) / _TICKS
    except (IndexError, ValueError):
        return None


class ThreadCpu:
    """CPU seconds spent producing an iterable's items, on whichever thread consumes it (gRPC's, for a request
    stream)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, items: Iterable[bytes]) -> Iterator[bytes]:
        iterator = iter(items)
        while True:
            started = time.thread_time()
            try:
                item = next(iterator)
            except StopIteration:
                self.seconds += time.thread_time() - started
                return
            self.seconds += time.thread_time() - started
            yield item
