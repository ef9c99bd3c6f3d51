"""Section 6: the daemon's resident memory at idle and at its peak during a save.

Reads VmRSS and VmHWM from /proc/<pid>/status. Between saves the peak is
reset by writing 5 to /proc/<pid>/clear_refs (Linux >= 4.0), so each save's
peak is its own; where that is refused, the first save's peak is the
daemon's peak since it started.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from bench.stats import summarize


def status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of `pid`, in bytes."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) * 1024
    return found


def reset_peak(pid: int) -> bool:
    """Resets VmHWM to the current RSS; False if the kernel refuses."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def daemon_memory(
    saver: Any,
    warmup: Any,
    daemon_pid: int,
    run_root: Path,
    payload_bytes: int,
    reps: int,
    timeout: float,
) -> dict[str, Any]:
    """Blocking saves of `saver`'s policy, and the daemon's peak RSS during each.

    Call it on a daemon that has served nothing yet. "Idle" is measured
    after one save of the tiny `warmup` policy, so it is a daemon ready to
    work (its first registration done)
    holding nothing of this run. The fresh daemon's RSS is reported too.

    Args:
        saver: a RemotePolicySaver, not yet registered.
        warmup: a RemotePolicySaver of a tiny policy, for another run.
        daemon_pid: the daemon's process id.
        run_root: `<daemon root>/<run>` of `saver`; saves are deleted there.
        payload_bytes: the snapshot's size (every variable's bytes).
        reps: saves after the first.
        timeout: seconds each save may take.
    """
    fresh = status(daemon_pid)["VmRSS"]
    warmup.save("warmup", blocking=True)
    idle = status(daemon_pid)["VmRSS"]
    resettable = reset_peak(daemon_pid)
    ticket = saver.save("mem-first", blocking=True)
    first = status(daemon_pid)
    shutil.rmtree(run_root / "mem-first", ignore_errors=True)
    written = int(ticket.result(timeout).bytes_written)
    peaks, befores = [], []
    for i in range(reps if resettable else 0):
        reset_peak(daemon_pid)
        befores.append(status(daemon_pid)["VmRSS"])
        saver.save(f"mem-{i}", blocking=True)
        peaks.append(status(daemon_pid)["VmHWM"])
        shutil.rmtree(run_root / f"mem-{i}", ignore_errors=True)
    result: dict[str, Any] = {
        "fresh_rss_bytes": fresh,
        "idle_rss_bytes": idle,
        # Registering the run (template upload) and its first save.
        "first_save_peak_bytes": first["VmHWM"],
        "rss_after_first_save_bytes": first["VmRSS"],
        "payload_bytes": payload_bytes,
        "bytes_written": written,
        "peak_resettable": resettable,
    }
    if peaks:
        result["rss_before_save_bytes"] = summarize(befores)
        result["save_peak_bytes"] = summarize(peaks)
    return result


def grpc_peaks(saver: Any, daemon_pid: int, run_root: Path, reps: int) -> dict[str, Any]:
    """The daemon's peak RSS during each blocking save of `saver` (shared memory off: every byte over gRPC).

    Call it on a daemon already measured by `daemon_memory` (idle is that
    one's); the run's first save (its registration) is not counted. The
    daemon writes each chunk as it arrives, so the peak should not grow
    with the payload.
    """
    saver.save("mem-grpc-first", blocking=True)
    shutil.rmtree(run_root / "mem-grpc-first", ignore_errors=True)
    peaks, befores = [], []
    for i in range(reps):
        if not reset_peak(daemon_pid):
            break
        befores.append(status(daemon_pid)["VmRSS"])
        saver.save(f"mem-grpc-{i}", blocking=True)
        peaks.append(status(daemon_pid)["VmHWM"])
        shutil.rmtree(run_root / f"mem-grpc-{i}", ignore_errors=True)
    if not peaks:
        return {}
    return {"rss_before_save_bytes": summarize(befores), "save_peak_bytes": summarize(peaks)}
