"""A sampling profiler for the daemon under a bench load: every thread's Python stack, a few hundred times a second.

`python -m bench.probes.sampler OUT -- python -m checkpointd serve ...` runs the
command's module in this process (so the daemon keeps this pid) with a
thread that samples `sys._current_frames()` every `--interval` seconds, and
at exit writes OUT: per thread-name group (rpc, write, fsync, ...) the
functions by self samples (the leaf frame) and by inclusive samples (on the
stack), as text. py-spy is not installed on the bench machine; this needs
nothing but the stdlib. A sample is taken only when the sampler gets the
GIL, so a thread's time in C without the GIL (gRPC's core, fsync) shows as
the Python frame that called it; `perf` on the pid tells C from Python.

SIGUSR1 forgets the samples so far: the bench's fleet section, which runs
its daemons under it when CHECKPOINTD_BENCH_PROFILE names a folder, sends
it when the trainers start saving, so registration does not count.
"""

from __future__ import annotations

import atexit
import collections
import os
import re
import runpy
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

_TOP = 40
# Leaf frames of a thread that waits (for work, a lock, the network): counted
# apart, so a pool's idle threads do not drown the busy ones.
_IDLE = frozenset(
    {
        "threading.py:wait",
        "threading.py:_wait_for_tstate_lock",
        "queue.py:get",
        "selectors.py:select",
        "socketserver.py:serve_forever",
        "grpc/_channel.py:_next",
        "grpc/_server.py:_serve",
        "concurrent/futures/thread.py:_worker",
    }
)


def _where(frame: FrameType) -> str:
    code = frame.f_code
    path = code.co_filename
    for marker in ("site-packages/", "service/", "lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{code.co_name}"


def _group(name: str) -> str:
    """A thread's pool: `rpc_12` and `write_3` are `rpc` and `write`."""
    return re.sub(r"[-_]?\d+$", "", name) or name


def _running(thread: threading.Thread | None) -> bool:
    """Whether the thread is on a CPU or waiting for one (state R): not blocked on a lock, the GIL or the disk."""
    if thread is None or thread.native_id is None:
        return True
    try:
        with open(f"/proc/self/task/{thread.native_id}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"R"
    except OSError:
        return True


class Sampler:
    """Samples every other thread's stack until stopped; `report` says where they were."""

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._self: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self._inclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self._samples: collections.Counter[str] = collections.Counter()
        self._idle: collections.Counter[str] = collections.Counter()
        self._reset = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def reset(self) -> None:
        """Forgets the samples so far (the load's start; SIGUSR1 from the bench)."""
        self._reset = True

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self._interval):
            if self._reset:
                self._reset = False
                for counters in (self._self, self._inclusive):
                    counters.clear()
                self._samples.clear()
                self._idle.clear()
            threads = {t.ident: t for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():  # noqa: SLF001 - the point of it
                if ident == me:
                    continue
                thread = threads.get(ident)
                group = _group(thread.name if thread is not None else "?")
                leaf = _where(frame)
                if leaf in _IDLE or not _running(thread):
                    self._idle[group] += 1
                    continue
                self._samples[group] += 1
                self._self[group][leaf] += 1
                seen = set()
                f: FrameType | None = frame
                while f is not None:
                    where = _where(f)
                    if where not in seen:
                        seen.add(where)
                        self._inclusive[group][where] += 1
                    f = f.f_back

    def report(self) -> str:
        lines = [
            f"samples every {self._interval * 1e3:g} ms, per thread group; threads not in state R (waiting, blocked) counted apart"
        ]
        for group, n in self._samples.most_common():
            lines.append(f"\n== {group}: {n} busy samples ({self._idle[group]} waiting)")
            lines.append("  self:")
            lines += [f"    {c / n:6.1%}  {w}" for w, c in self._self[group].most_common(_TOP)]
            lines.append("  inclusive:")
            lines += [f"    {c / n:6.1%}  {w}" for w, c in self._inclusive[group].most_common(_TOP)]
        return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    interval = 0.02
    if args[:1] == ["--cprofile"]:
        return _cprofile(args[1:])
    if args[:1] == ["--interval"]:
        interval, args = float(args[1]), args[2:]
    out, sep, command = args[0], args[1], args[2:]
    if sep != "--" or len(command) < 3 or command[1] != "-m":
        raise SystemExit("usage: python -m bench.probes.sampler [--interval S] OUT -- python -m MODULE ARGS...")
    sampler = Sampler(interval)
    started = time.monotonic()

    def write() -> None:
        sampler.stop()
        text = sampler.report()
        Path(out).write_text(f"pid {os.getpid()}, {time.monotonic() - started:.1f} s\n" + text)

    atexit.register(write)
    signal.signal(signal.SIGUSR1, lambda *_: sampler.reset())
    sampler.start()
    sys.argv = [command[2], *command[3:]]
    runpy.run_module(command[2], run_name="__main__", alter_sys=True)
    return 0


class _Snapshot:
    """A profile's stats taken already, in the shape pstats.Stats loads."""

    def __init__(self, stats: dict[object, object]) -> None:
        self.stats = stats

    def create_stats(self) -> None:
        pass


def _cprofile(args: list[str]) -> int:
    """`--cprofile OUT -- python -m MODULE ...`: cProfile on every thread, timed by each thread's CPU clock.

    Deterministic where the sampler is statistical, and CPU where it is
    state: a thread blocked in a wait or a syscall's sleep adds nothing.
    Slower (every call is timed); SIGUSR1 clears what was recorded so far.
    """
    import cProfile
    import pstats

    out, command = args[0], args[2:]
    profiles: list[cProfile.Profile] = []
    lock = threading.Lock()

    def start(*_: object) -> None:
        profile = cProfile.Profile(time.thread_time)
        with lock:
            profiles.append(profile)
        profile.enable()

    def clear(*_: object) -> None:
        with lock:
            for profile in profiles:
                profile.clear()

    def write() -> None:
        with lock, open(out, "w") as f:
            stats = None
            for profile in profiles:
                try:
                    profile.snapshot_stats()
                except Exception:  # noqa: BLE001,S112 - a thread's profile mid-update: skip it
                    continue
                if not profile.stats:  # type: ignore[attr-defined]
                    continue  # a thread that ran nothing since the last clear
                held = _Snapshot(profile.stats)  # type: ignore[attr-defined]
                if stats is None:
                    stats = pstats.Stats(held, stream=f)  # type: ignore[arg-type]
                else:
                    stats.add(held)
            if stats is not None:
                stats.sort_stats("tottime").print_stats(60)
                stats.sort_stats("cumulative").print_stats(80)

    threading.setprofile(start)
    atexit.register(write)
    signal.signal(signal.SIGUSR1, clear)
    sys.argv = [command[2], *command[3:]]
    runpy.run_module(command[2], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
