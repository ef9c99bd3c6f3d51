"""One phase of the fleet section: the client processes against some daemons, and what they and the daemons measured.

`run_phase` starts the client processes (`python -m bench.fleet clients
...`, 64 trainers each, trainer i on daemon i % the daemons), starts them
saving at one time once every run is registered, and sums their outcomes:
saves/s offered and committed, p50/p99 call -> durable, skipped, failed,
accepted and committed (the caller counts the manifests), the daemons' CPU
seconds per save (utime + stime from /proc/<pid>/stat, from the start time
to the last flush), their context switches per save (every live thread's,
from /proc/<pid>/task/*/status: a thread hand-off is one) and their peak
RSS (VmHWM), the simulated trainers' own CPU per save offered (each client
process's rusage over the window: on one machine it comes out of the
daemons' cores), the daemons' own mean accept -> durable (their
checkpointd_save_duration_seconds: the rest of a call's time is its wait for
a handler thread and in the admission line, and the trainer's side), and on S3 the daemons' requests per committed save by
operation and bytes uploaded per committed save (their
checkpointd_s3_requests_total and checkpointd_store_uploaded_bytes_total,
scraped at the start and the end), and the CPU of radosgw, its OSD and mon
per committed save (they share the cores).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.fleet import fleet_store

ROOT = Path(__file__).resolve().parents[2]
PER_PROCESS = 64  # simulated trainers per client process
READY_TIMEOUT = 600.0


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _context_switches(pid: int) -> tuple[int, int]:
    """The (voluntary, involuntary) context switches of `pid`'s live threads so far.

    A voluntary one is a thread waiting (a hand-off to another thread, a
    wait for the GIL, for I/O); an involuntary one, a thread preempted (the
    machine's load moves those).
    """
    voluntary = involuntary = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            lines = status.read_text().splitlines()
        except OSError:  # the thread ended meanwhile
            continue
        for line in lines:
            if line.startswith("voluntary_ctxt_switches:"):
                voluntary += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches:"):
                involuntary += int(line.split()[1])
    return voluntary, involuntary


def _peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run_phase(
    daemons: Sequence[Any],
    spec: Path,
    trainers: int,
    seconds: float,
    work: Path,
    progress: Callable[[str], None],
    servers: Sequence[int] = (),
) -> dict[str, Any]:
    """Runs the client processes against `daemons` (trainer i on daemons[i % len]) and sums their outcomes.

    `servers`: the PIDs of the object store's processes (radosgw, its OSD and mon), whose CPU over
    the window is reported per committed save too: on one machine it comes out of the daemons' cores.
    """
    from bench.stats import percentile

    work.mkdir(parents=True, exist_ok=True)
    addresses = ",".join(d.address for d in daemons)
    procs: list[tuple[subprocess.Popen, Any]] = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        for first in range(0, trainers, PER_PROCESS):
            count = min(PER_PROCESS, trainers - first)
            cmd = [sys.executable, "-m", "bench.fleet", "clients", addresses, str(spec), str(first), str(count)]
            cmd += [str(trainers), str(seconds)]
            err = open(work / f"clients-{first}.log", "wb")  # noqa: SIM115 - closed below
            procs.append(
                (
                    subprocess.Popen(
                        cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True
                    ),
                    err,
                )
            )
        for p, _ in procs:  # each says "ready" once its runs are registered
            line = p.stdout.readline() if p.stdout else ""
            if json.loads(line or "{}").get("ready") is None:
                raise RuntimeError(f"a client process did not register its runs: {line!r}")
        start = time.time() + 1.0
        cpu0 = {d.proc.pid: _cpu_seconds(d.proc.pid) for d in daemons}
        switches0 = {d.proc.pid: _context_switches(d.proc.pid) for d in daemons}
        server0 = {pid: _cpu_seconds(pid) for pid in servers}
        store0 = [fleet_store.counts(d.metrics_url) for d in daemons]
        if os.environ.get("CHECKPOINTD_BENCH_PROFILE"):
            for d in daemons:
                os.kill(d.proc.pid, signal.SIGUSR1)  # bench.probes.sampler: the samples start here
        for p, _ in procs:
            assert p.stdin is not None
            p.stdin.write(f"{start}\n")
            p.stdin.flush()
        progress(f"9. fleet: {trainers} runs registered on {len(daemons)} daemon(s); saving")
        outcomes = []
        for p, _ in procs:
            out, _unused = p.communicate(timeout=seconds + READY_TIMEOUT)
            if p.returncode != 0:
                raise RuntimeError(f"a client process exited with {p.returncode}: see {work}/clients-*.log")
            outcomes.append(json.loads(out.strip().splitlines()[-1]))
        cpu = sum(_cpu_seconds(pid) - c for pid, c in cpu0.items())
        switches1 = {pid: _context_switches(pid) for pid in switches0}
        voluntary = sum(switches1[pid][0] - n[0] for pid, n in switches0.items())
        involuntary = sum(switches1[pid][1] - n[1] for pid, n in switches0.items())
        server_cpu = sum(_cpu_seconds(pid) - c for pid, c in server0.items())
        store = fleet_store.delta(store0, [fleet_store.counts(d.metrics_url) for d in daemons])
        rss = [_peak_rss_bytes(d.proc.pid) for d in daemons]
    finally:
        for p, err in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            err.close()
    latencies = [x for o in outcomes for x in o["latencies"]]
    total = {k: sum(o[k] for o in outcomes) for k in ("offered", "accepted", "skipped", "failed", "committed")}
    failures = [f for o in outcomes for f in o["failures"]]
    codes: dict[str, int] = {}
    examples: dict[str, str] = {}
    for o in outcomes:
        for key, n in o["codes"].items():
            codes[key] = codes.get(key, 0) + n
        examples = o["examples"] | examples
    after_accept = sum(n for key, n in codes.items() if key.startswith("after accept"))
    client_cpu = sum(o["cpu_seconds"] for o in outcomes)
    per_commit = (lambda x: x / total["committed"]) if total["committed"] else (lambda x: None)  # noqa: E731
    return {
        "daemons": len(daemons),
        **total,
        "tensorflow_in_clients": any(o["tensorflow_imported"] for o in outcomes),
        "offered_per_second": total["offered"] / seconds,
        "committed_per_second": total["committed"] / seconds,
        "latency_p50": percentile(latencies, 50) if latencies else None,
        "latency_p99": percentile(latencies, 99) if latencies else None,
        "latency_max": max(latencies) if latencies else None,
        # The daemons' own accept -> durable (their save_duration histogram) over the window: what a
        # call spends before it (a handler thread, the admission line) is call -> durable less this.
        "daemon_accept_to_durable_mean": store["accept_to_durable_mean"],
        "lag_p99": percentile([x for o in outcomes for x in o["lags"]], 99),
        "flush_failed": sum(o["flush_failed"] for o in outcomes),
        "refused": total["failed"] - after_accept,
        "failed_after_accept": after_accept,
        "failure_codes": codes,
        "failure_examples": examples,
        "failures": failures[:5],
        "daemon_cpu_seconds": cpu,
        "daemon_cpu_ms_per_save": 1000 * cpu / total["committed"] if total["committed"] else None,
        "daemon_peak_rss_mib": [r / (1 << 20) for r in rss],
        # Over the window, summed over the daemons' live threads (one ended meanwhile drops its count).
        "daemon_context_switches_per_save": per_commit(voluntary + involuntary),
        "daemon_voluntary_context_switches_per_save": per_commit(voluntary),
        # The object store's processes (radosgw, OSD, mon) over the window; None on a local root.
        "server_cpu_ms_per_save": 1000 * server_cpu / total["committed"] if servers and total["committed"] else None,
        # The simulated trainers' own CPU (every client process, the window and the flushes):
        # on one machine it is taken from the daemons' cores.
        "client_cpu_seconds": client_cpu,
        "client_cpu_ms_per_call": 1000 * client_cpu / total["offered"] if total["offered"] else None,
        # Object store traffic over the window (the daemons' own counters); {} on a local root.
        "s3_requests_by_operation": store["requests"],
        "s3_requests_per_commit": per_commit(sum(store["requests"].values())) if store["requests"] else None,
        "s3_requests_per_commit_by_operation": {k: per_commit(n) for k, n in sorted(store["requests"].items())},
        "uploaded_bytes_per_commit": per_commit(store["uploaded_bytes"]) if store["requests"] else None,
    }
