"""Summaries of repeated measurements: median and min-max, never a mean of noise."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any


def summarize(samples: Iterable[float]) -> dict[str, Any]:
    """{"median", "min", "max", "n", "samples"} of the samples (n >= 1)."""
    values = [float(s) for s in samples]
    if not values:
        raise ValueError("no samples to summarize")
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "samples": values,
    }


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between closest ranks."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def rates(nbytes: int, seconds: Iterable[float]) -> dict[str, Any]:
    """Bytes per second for each duration."""
    return summarize(nbytes / s for s in seconds)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def busy_cpu_seconds() -> float:
    """CPU-seconds every process on the machine has spent busy since boot (the runs' noise meter)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU-seconds of this process and every child it has waited for (workers, daemons)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system
