"""The daemon's CPU per small policy save, from accept to commit, measured in-process without gRPC.

`python -m bench.probes.commit_cpu` builds the real daemon (`checkpointd.server.Server`
on a local --root, at its defaults but for `--fsync`/`--no-fsync`), registers
`--runs` runs with the fleet section's small policy (`bench.fleet`'s template:
exported once with TensorFlow into `--template`, reused when it is there) and
then makes `--saves` saves round robin over the runs, one at a time, each
through the servicer's own Save (the header decoded, the chunks checked and
written into the bundle, the manifest, the commit) with the requests handed
over in memory: no gRPC machinery, so what is left is the save path's own
Python, the part the fleet's CPU/save is made of besides the RPCs.

It reports the process's CPU seconds (utime + stime, every thread: the
writer, fsync and retention threads too) and context switches per save over
the measured saves, after `--warmup` saves. Both barely move with the load of
the machine, unlike anything timed, so one run of a tree can be compared with
another's. `--profile FILE` also writes a cProfile of the measured saves (the
calling thread only; `pstats` reads it) and prints its top functions.

It drives a private piece of the server (the servicer it makes) because it
measures it; it is a diagnostic, not an API user.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


class _Context:
    """What the servicer asks of a gRPC call's context, for a call that is always active."""

    def time_remaining(self) -> float:
        return 60.0

    def is_active(self) -> bool:
        return True

    def add_callback(self, callback: Any) -> bool:
        return True

    def send_initial_metadata(self, metadata: Any) -> None:
        pass


def _context_switches() -> int:
    """Voluntary and involuntary context switches of every thread of this process so far."""
    total = 0
    tasks = "/proc/self/task"
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/status") as f:
                for line in f:
                    if "ctxt_switches:" in line:  # voluntary_ and nonvoluntary_
                        total += int(line.split()[1])
        except FileNotFoundError:
            continue  # the thread ended meanwhile
    return total


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Snapshot:
    """A profile's stats taken already, in the shape pstats.Stats loads."""

    def __init__(self, stats: dict[object, object]) -> None:
        self.stats = stats

    def create_stats(self) -> None:
        pass


class _ThreadProfiles:
    """cProfile on this thread and every thread started after it, each timed by its own CPU clock."""

    def __init__(self) -> None:
        self._profiles: list[cProfile.Profile] = []
        self._lock = threading.Lock()
        threading.setprofile(self._start)
        self._start()

    def _start(self, *_: object) -> None:
        profile = cProfile.Profile(time.thread_time)
        with self._lock:
            self._profiles.append(profile)
        profile.enable()

    def clear(self) -> None:
        with self._lock:
            for profile in self._profiles:
                profile.clear()

    def dump(self, out: Path) -> None:
        """Writes every thread's profile, summed, to `out` (pstats' format)."""
        threading.setprofile(None)
        stats: pstats.Stats | None = None
        with self._lock:
            for profile in self._profiles:
                try:
                    profile.snapshot_stats()
                except Exception:  # noqa: BLE001,S112 - a thread's profile mid-update: skip it
                    continue
                if not profile.stats:  # type: ignore[attr-defined]
                    continue
                held = _Snapshot(profile.stats)  # type: ignore[attr-defined]
                if stats is None:
                    stats = pstats.Stats(held)  # type: ignore[arg-type]
                else:
                    stats.add(held)
        if stats is not None:
            stats.dump_stats(str(out))


def _template(directory: Path) -> Path:
    """The fleet's small policy template under `directory`, exported (TensorFlow, a subprocess) if missing."""
    if not (directory / "spec.json").exists():
        print(f"exporting the small policy's template into {directory}", flush=True)
        subprocess.run([sys.executable, "-m", "bench.fleet", "template", str(directory)], check=True)
    return directory


def run(
    template: Path, workdir: Path, runs: int, saves: int, warmup: int, fsync: bool, profile: Path | None
) -> dict[str, Any]:
    from checkpointd import server as server_module
    from checkpointd.core.config import ServeConfig
    from checkpointd.protocol import wire
    from checkpointd.rpc.servicer import CheckpointServicer
    from checkpointd.v1 import checkpointd_pb2 as pb

    made: list[CheckpointServicer] = []

    class _Recorded(CheckpointServicer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    server_module.CheckpointServicer = _Recorded  # type: ignore[misc]
    profiles = _ThreadProfiles() if profile is not None else None
    config = ServeConfig(root=workdir / "root", port=0, metrics_port=None, fsync=fsync, shm_root=None)
    config.root.mkdir(parents=True)
    daemon = server_module.Server(config)
    daemon.start()
    try:
        servicer = made[0]
        base = pb.RegisterRunHeader.FromString((template / "header.bin").read_bytes())
        payload = (template / "payload.bin").read_bytes()
        # The client library's chunk size, as the fleet's trainers send.
        template_chunks = list(wire.template_chunks(template / "files", wire.CHUNK_BYTES))
        chunks = [pb.SaveRequest(chunk=c) for c in wire.chunks([payload], wire.CHUNK_BYTES)]
        names = [f"cpu-{i}" for i in range(runs)]
        for name in names:
            header = pb.RegisterRunHeader()
            header.CopyFrom(base)
            header.run = name
            requests = [
                pb.RegisterRunRequest(header=header),
                *(pb.RegisterRunRequest(chunk=c) for c in template_chunks),
            ]
            servicer.RegisterRun(iter(requests), _Context())

        def save(n: int) -> None:
            header = pb.SaveRequest(
                header=pb.SaveHeader(
                    run=names[n % runs], kind=pb.SAVED_MODEL, export_dir=f"s{n}", step=n,
                    variables=base.variables, snapshot_bytes=len(payload),
                )
            )  # fmt: skip
            requests: Iterator[pb.SaveRequest] = iter([header, *chunks])
            replies = list(servicer.Save(requests, _Context()))
            if len(replies) != 2 or replies[1].WhichOneof("item") != "result":
                raise RuntimeError(f"save {n} did not commit: {replies}")

        for n in range(warmup):
            save(n)
        if profiles is not None:
            profiles.clear()
        cpu0, switches0, wall0 = _cpu_seconds(), _context_switches(), time.perf_counter()
        for n in range(warmup, warmup + saves):
            save(n)
        cpu, switches, wall = _cpu_seconds() - cpu0, _context_switches() - switches0, time.perf_counter() - wall0
    finally:
        daemon.stop(grace=10.0)
    result = {
        "saves": saves,
        "runs": runs,
        "fsync": fsync,
        "cpu_ms_per_save": 1e3 * cpu / saves,
        "context_switches_per_save": switches / saves,
        "wall_ms_per_save": 1e3 * wall / saves,
        "snapshot_bytes": len(payload),
    }
    if profiles is not None and profile is not None:
        profiles.dump(profile)
        result["profile"] = str(profile)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.commit_cpu", description=__doc__.split("\n")[0])
    parser.add_argument("--template", type=Path, default=Path(tempfile.gettempdir()) / "checkpointd-fleet-template")
    parser.add_argument("--runs", type=int, default=16, help="runs saved round robin (default 16)")
    parser.add_argument("--saves", type=int, default=1000, help="measured saves (default 1000)")
    parser.add_argument("--warmup", type=int, default=100, help="saves before the measured ones (default 100)")
    parser.add_argument("--no-fsync", dest="fsync", action="store_false", help="run the daemon with --no-fsync")
    parser.add_argument("--profile", type=Path, help="write a cProfile of the measured saves here")
    parser.add_argument("--top", type=int, default=30, help="functions of the profile to print (default 30)")
    args = parser.parse_args(argv)
    template = _template(args.template)
    with tempfile.TemporaryDirectory(prefix="checkpointd-commit-cpu-") as work:
        result = run(template, Path(work), args.runs, args.saves, args.warmup, args.fsync, args.profile)
    if args.profile is not None:
        stats = pstats.Stats(str(args.profile))
        stats.sort_stats("tottime").print_stats(args.top)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
