"""Memory during one restore: the daemon's and the trainer's peak RSS over what they held before, and tmpfs held.

Peak RSS is the kernel's own high-water mark (VmHWM in /proc/PID/status),
reset just before the restore by writing 5 to /proc/PID/clear_refs, so no
sampling can miss a peak. The tmpfs (/dev/shm) bytes in use are sampled
every few milliseconds (its pages are in no process's RSS unless mapped):
the staged or fetched files, and anything else on that tmpfs at the time
(other processes' segments), over the figure just before.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

TMPFS = "/dev/shm"
SAMPLE_SECONDS = 0.005


def _status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(f"no {field} in /proc/{pid}/status")


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def _tmpfs_used() -> int:
    st = os.statvfs(TMPFS)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def measure(daemon_pid: int, restore: Callable[[], Any]) -> dict[str, int]:
    """Runs `restore` once in this process (the trainer) and returns the memory it took on each side."""
    me = os.getpid()
    daemon_before, trainer_before = _status(daemon_pid, "VmRSS"), _status(me, "VmRSS")
    tmpfs_before = _tmpfs_used()
    peak = [tmpfs_before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(SAMPLE_SECONDS):
            peak[0] = max(peak[0], _tmpfs_used())

    sampler = threading.Thread(target=sample, name="tmpfs-sampler", daemon=True)
    _reset_peak(daemon_pid)
    _reset_peak(me)
    sampler.start()
    try:
        restore()
    finally:
        done.set()
        sampler.join()
    daemon_peak, trainer_peak = _status(daemon_pid, "VmHWM"), _status(me, "VmHWM")
    return {
        "daemon_before_bytes": daemon_before,
        "daemon_peak_bytes": daemon_peak,
        "daemon_over_bytes": max(0, daemon_peak - daemon_before),
        "trainer_before_bytes": trainer_before,
        "trainer_peak_bytes": trainer_peak,
        "trainer_over_bytes": max(0, trainer_peak - trainer_before),
        "tmpfs_over_bytes": max(0, peak[0] - tmpfs_before),
    }
