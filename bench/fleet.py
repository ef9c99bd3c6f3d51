"""Section 9: fan-in at fleet scale: 256 simulated trainers, 1 save/s each, on one daemon, then on 3 sharing S3.

`python -m bench` runs it (`--fleet-only` alone, `--no-fleet` skips it;
`--quick` skips it unless `--fleet`); `--fleet-trainers N` (default 256) and
`--fleet-seconds S` (default 60) set its scale.

The trainers are simulated so that the 2 cores go to the daemons: no
TensorFlow in them (each client process checks `sys.modules` and reports
it). One helper process with TensorFlow (`python -m bench.fleet template
DIR`) exports the small policy (bench.agents, 4.6k parameters) once with the
real PolicySaver and writes what a trainer sends: the template files, the
RegisterRunHeader (variables, object graph, template size) and the
snapshot's payload bytes. Then a few client processes (`python -m
bench.fleet clients ...`, 64 trainers each, on grpc.aio) speak the contract
directly, as tests/integration/raw.py does:

- every trainer registers its own run (`fleet-<i>`) with those bytes and
  says so; when all have, the section writes a start time on each
  process's stdin;
- trainer i starts at that time plus i/N of a period (phase-spread) and
  then, once a period, makes a non-blocking save: a Save call (header,
  decision; if accepted, the payload's chunks and a half-close, then the
  result), not waiting for the previous one (skip-if-busy skips a save
  while the run's last is still in flight, as a trainer's `save()` would);
- per save it records accepted, skipped or failed (the gRPC status: a
  RESOURCE_EXHAUSTED at the daemon's --max-concurrent-uploads counts
  here) and call -> durable (the SaveResult's arrival);
- at the end, a Flush per run, and one JSON line of outcomes.

Phase one: one daemon on a local --root. Phase two: radosgw (scripts/rgw.sh,
started by the section and stopped however it ends), 3 daemons on one
`s3://BUCKET/PREFIX`, trainer i on daemon i % 3. For each: saves/s offered
and committed, p50/p99 call -> durable, skipped, failed, accepted against
committed by counting the manifests (files under the local root; objects
in the bucket), the daemons' CPU seconds per save (utime + stime from
/proc/<pid>/stat, from the start time to the last flush), their context
switches per save (every live thread's, from /proc/<pid>/task/*/status: a
thread hand-off is one) and their peak RSS (VmHWM), the simulated trainers' own CPU per save offered (each client
process's rusage over the window: on one machine it comes out of the
daemons' cores), and on S3 the daemons' requests per committed save by
operation and bytes uploaded per committed save (their
checkpointd_s3_requests_total and checkpointd_store_uploaded_bytes_total,
scraped at the start and the end), and the CPU of radosgw, its OSD and mon
per committed save (they share the cores). Targets: zero lost (accepted = committed = manifests), and p99 <=
250 ms on one daemon.

Diagnostics (environment, so a bench run's flags stay the same):
CHECKPOINTD_BENCH_PROFILE=DIR runs each daemon under `bench.sampler` and
leaves its profile in DIR (local.txt, s3-0.txt, ...; the sampler's own CPU
counts in CPU/save then; CHECKPOINTD_BENCH_PROFILE_MODE=cprofile: cProfile
on every thread, by thread CPU time, instead of sampling);
CHECKPOINTD_BENCH_FLEET_S3=0 skips the S3 phase, CHECKPOINTD_BENCH_FLEET_LOCAL=0
the local one (to measure the other alone).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import fleet_store
from bench.fleet_store import MANIFEST, REGION

ROOT = Path(__file__).resolve().parents[1]
RGW_SCRIPT = ROOT / "scripts" / "rgw.sh"
PER_PROCESS = 64  # simulated trainers per client process
CHUNK_BYTES = 1 << 20
RATE_HZ = 1.0
P99_TARGET = 0.250
TRAINERS = 256  # the scale, at which the p99 target is judged
TIMEOUT = 60.0  # every RPC's deadline
READY_TIMEOUT = 600.0
_CANNOT_INSTALL = 3


# The section, in `python -m bench`.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--fleet", dest="fleet", action="store_const", const="on", help="run section 9 (also with --quick)"
    )
    group.add_argument("--no-fleet", dest="fleet", action="store_const", const="off", help="skip section 9 (fleet)")
    group.add_argument(
        "--fleet-only", dest="fleet", action="store_const", const="only", help="run section 9 (fleet) and nothing else"
    )
    parser.add_argument("--fleet-trainers", type=int, default=256, help="section 9's simulated trainers (default 256)")
    parser.add_argument("--fleet-seconds", type=float, default=60.0, help="section 9's saving window (default 60)")


def mode(args: argparse.Namespace) -> str:
    """on, off or only; by default on, except in --quick mode."""
    return args.fleet or ("off" if args.quick else "on")


def run_section(config: Any, progress: Callable[[str], None]) -> dict[str, Any]:
    """Both phases; the S3 one is {"skipped": reason} if Ceph cannot start."""
    trainers, seconds = config.fleet_trainers, config.fleet_seconds
    work = config.workdir / "fleet"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    progress("9. fleet: exporting the small policy's template once (a helper process with TensorFlow)")
    spec = work / "template"
    _run([sys.executable, "-m", "bench.fleet", "template", str(spec)], work / "template.log", 600)
    result: dict[str, Any] = {"trainers": trainers, "seconds": seconds, "rate_hz": RATE_HZ}
    result["template"] = json.loads((spec / "spec.json").read_text())
    if os.environ.get("CHECKPOINTD_BENCH_FLEET_LOCAL", "1") == "0":
        result["local"] = {"skipped": "CHECKPOINTD_BENCH_FLEET_LOCAL=0"}
    else:
        result["local"] = _local_phase(spec, trainers, seconds, work, progress)
    if os.environ.get("CHECKPOINTD_BENCH_FLEET_S3", "1") == "0":
        result["s3"] = {"skipped": "CHECKPOINTD_BENCH_FLEET_S3=0"}
    else:
        result["s3"] = _s3_phase(config, spec, trainers, seconds, work, progress)
    result["targets"] = targets(result)
    return result


def _local_phase(
    spec: Path, trainers: int, seconds: float, work: Path, progress: Callable[[str], None]
) -> dict[str, Any]:
    from tests.integration.daemon import start_daemon

    progress(f"9. fleet, one daemon on a local root: {trainers} trainers x {RATE_HZ:g} save/s for {seconds:g} s")
    local = start_daemon(work / "local-root", work / "local-daemon", wrap=_profiled("local"))
    out: dict[str, Any] = {}
    try:
        out = _phase([local], spec, trainers, seconds, work / "local", progress)
        out["manifests"] = sum(1 for _ in (work / "local-root").glob(f"fleet-*/*/{MANIFEST}"))
    finally:
        out["daemon_exit_codes"] = [local.terminate()]
    return out


def _s3_phase(
    config: Any, spec: Path, trainers: int, seconds: float, work: Path, progress: Callable[[str], None]
) -> dict[str, Any]:
    from tests.integration.daemon import start_daemon

    rgw_dir = config.workdir / "fleet-rgw"
    shutil.rmtree(rgw_dir, ignore_errors=True)
    progress("9. fleet: starting Ceph radosgw on loopback (scripts/rgw.sh)")
    try:
        proc = subprocess.run(
            [str(RGW_SCRIPT), "start", str(rgw_dir)], capture_output=True, text=True, timeout=600, check=False
        )
        if proc.returncode != 0:
            log = work / "rgw-start.log"
            log.write_text(proc.stderr + proc.stdout)
            why = "Ceph cannot be installed" if proc.returncode == _CANNOT_INSTALL else "radosgw did not start"
            reason = f"{why} (scripts/rgw.sh exit {proc.returncode}; log {log})"
            progress(f"9. fleet, S3 phase skipped: {reason}")
            return {"skipped": reason}
        env = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
        endpoint, bucket = env["CHECKPOINTD_TEST_S3_ENDPOINT"], env["CHECKPOINTD_TEST_S3_BUCKET"]
        aws = {k: v for k, v in env.items() if k.startswith("AWS_")}
        prefix = f"fleet-{secrets.token_hex(4)}"
        daemons: list[Any] = []
        out: dict[str, Any] = {"prefix": prefix}
        try:
            for i in range(3):
                daemons.append(
                    start_daemon(
                        f"s3://{bucket}/{prefix}",  # type: ignore[arg-type]  # passed to --root as str(root)
                        work / f"s3-daemon-{i}",
                        "--work-dir",
                        str(work / f"s3-work-{i}"),
                        "--s3-endpoint-url",
                        endpoint,
                        "--s3-region",
                        REGION,
                        env=aws,
                        wrap=_profiled(f"s3-{i}"),
                    )  # fmt: skip
                )
            progress(
                f"9. fleet, 3 daemons on one S3 prefix: {trainers} trainers x {RATE_HZ:g} save/s for {seconds:g} s"
            )
            servers = [int((rgw_dir / f"{n}.pid").read_text()) for n in ("rgw", "osd", "mon")]
            out |= _phase(daemons, spec, trainers, seconds, work / "s3", progress, servers)
            out["manifests"] = fleet_store.bucket_manifests(endpoint, bucket, prefix, aws)
        finally:
            out["daemon_exit_codes"] = [d.terminate() for d in daemons]
        return out
    finally:
        subprocess.run([str(RGW_SCRIPT), "stop", str(rgw_dir)], timeout=120, check=False)
        shutil.rmtree(rgw_dir, ignore_errors=True)


def _profiled(name: str) -> list[str]:
    """The command a daemon runs under: bench.sampler into $CHECKPOINTD_BENCH_PROFILE/<name>.txt, or nothing."""
    folder = os.environ.get("CHECKPOINTD_BENCH_PROFILE")
    if not folder:
        return []
    Path(folder).mkdir(parents=True, exist_ok=True)
    mode = ["--cprofile"] if os.environ.get("CHECKPOINTD_BENCH_PROFILE_MODE") == "cprofile" else []
    return [sys.executable, "-m", "bench.sampler", *mode, str(Path(folder) / f"{name}.txt"), "--"]


def _run(cmd: list[str], log: Path, timeout: float) -> None:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    with open(log, "wb") as err:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=err, stderr=err, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:4])} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")


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


def _phase(
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
                os.kill(d.proc.pid, signal.SIGUSR1)  # bench.sampler: the samples start here
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


def targets(result: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The fleet targets, in bench.judge's form (group FLEET): met, MISSED or not measured.

    p99 is judged at the target's scale only (256 trainers x 1 save/s); zero lost at any.
    """
    from bench.judge import FLEET, Missing, at, at_most, judge, not_measured

    p99_name = (
        f"fleet, one daemon, {TRAINERS} trainers x {RATE_HZ:g} save/s: p99 call -> durable <= {P99_TARGET * 1e3:g} ms"
    )
    lost_names = {
        "local": "fleet, one daemon: zero lost (accepted = committed = manifests)",
        "s3": "fleet, 3 daemons on one S3 prefix: zero lost (accepted = committed = manifests)",
    }
    if not result:
        return [
            {"group": FLEET, **not_measured(name, None, "no section 9 in this run")}
            for name in (p99_name, *lost_names.values())
        ]
    ms = lambda x: f"{1000 * x:.0f} ms"  # noqa: E731

    def p99() -> tuple[float, float, bool, str]:
        value, trainers = float(at(result, "local", "latency_p99")), at(result, "trainers")
        if (trainers, at(result, "rate_hz")) != (TRAINERS, RATE_HZ):
            raise Missing(f"this run's fleet: {trainers} trainers x {result['rate_hz']:g} save/s, p99 {ms(value)}")
        return at_most(value, P99_TARGET, ms)

    def lost(phase: str) -> Callable[[], tuple[float, float, bool, str]]:
        def measure() -> tuple[float, float, bool, str]:
            r = at(result, phase)
            if "skipped" in r and "accepted" not in r:
                raise Missing(f"phase skipped: {r['skipped']}")
            accepted, committed, manifests = at(r, "accepted"), at(r, "committed"), at(r, "manifests")
            n = accepted - min(committed, manifests)
            met = accepted == committed == manifests and at(r, "flush_failed") == 0
            detail = f"{n} lost vs limit 0: accepted {accepted}, committed {committed}, manifests {manifests}"
            if r.get("failed_after_accept"):
                detail += f", failed after the accept (the trainer told) {r['failed_after_accept']}"
            return n, 0, met, detail

        return measure

    return [
        judge(p99_name, None, p99, FLEET),
        *(judge(name, None, lost(phase), FLEET) for phase, name in lost_names.items()),
    ]


def table(results: dict[str, Any]) -> str:
    """Section 9's lines for the printed report ('' if it did not run)."""
    f = results.get("fleet")
    if not f:
        return ""
    lines = [
        f"\n9. fleet: {f['trainers']} simulated trainers (no TensorFlow) x {f['rate_hz']:g} save/s, {f['seconds']:g} s"
    ]
    lines.append(
        f"   template {f['template']['template_bytes']:,} B, snapshot {f['template']['snapshot_bytes']:,} B; daemons at their defaults\n"
        "   refused: before the decision (nothing written); failed: after the accept; "
        "CPU/save: the daemons' CPU over the window / committed"
    )
    head = (
        f"   {'':<22}{'offered/s':>10}{'committed/s':>12}{'p50':>8}{'p99':>8}{'skipped':>8}{'refused':>8}{'failed':>7}"
    )
    lines.append(head + f"{'accepted':>9}{'committed':>10}{'manifests':>10}{'CPU/save':>9}{'peak RSS':>10}")
    for phase, name in (("local", "1 daemon, local root"), ("s3", "3 daemons, one S3")):
        r = f.get(phase, {})
        if "skipped" in r and "accepted" not in r:
            lines.append(f"   {name:<22}skipped: {r['skipped']}")
            continue
        if "accepted" not in r:
            continue
        ms = lambda x: f"{1000 * x:.0f}ms" if x is not None else "-"  # noqa: E731
        cpu = f"{r['daemon_cpu_ms_per_save']:.1f}ms" if r["daemon_cpu_ms_per_save"] is not None else "-"
        lines.append(
            f"   {name:<22}{r['offered_per_second']:>10.1f}{r['committed_per_second']:>12.1f}"
            f"{ms(r['latency_p50']):>8}{ms(r['latency_p99']):>8}{r['skipped']:>8}{r['refused']:>8}{r['failed_after_accept']:>7}"
            f"{r['accepted']:>9}{r['committed']:>10}{r['manifests']:>10}{cpu:>9}"
            f"{max(r['daemon_peak_rss_mib']):>8.0f}Mi"
        )
        for key, n in sorted(r["failure_codes"].items()):
            lines.append(f"     {key}: {n} (e.g. {r['failure_examples'][key][:150]})")
        if r.get("daemon_context_switches_per_save") is not None:  # absent from older runs
            lines.append(
                f"     the daemons' context switches: {r['daemon_context_switches_per_save']:.1f} per committed save "
                f"({r['daemon_voluntary_context_switches_per_save']:.1f} voluntary: waits and hand-offs)"
            )
        if r.get("client_cpu_ms_per_call") is not None:
            lines.append(f"     the simulated trainers' own CPU: {r['client_cpu_ms_per_call']:.2f} ms per save offered")
        if r.get("s3_requests_per_commit") is not None:
            ops = ", ".join(f"{op} {n:.2f}" for op, n in r["s3_requests_per_commit_by_operation"].items())
            lines.append(
                f"     S3 per committed save: {r['s3_requests_per_commit']:.2f} requests ({ops}), "
                f"{r['uploaded_bytes_per_commit']:,.0f} B uploaded"
            )
        if r.get("server_cpu_ms_per_save") is not None:
            lines.append(
                f"     radosgw, its OSD and mon: {r['server_cpu_ms_per_save']:.1f} ms of CPU per committed save"
            )
    return "\n".join(lines) + "\n"


# The template helper (TensorFlow).


def make_template(directory: Path) -> None:
    """Exports the small policy once; writes its files, the RegisterRunHeader and the payload under `directory`."""
    import tensorflow as tf
    from tf_agents.policies import policy_saver

    from bench import agents
    from bench.config import SIZES
    from checkpointd.protocol import wire
    from checkpointd.v1 import checkpointd_pb2 as pb
    from checkpointd_client import snapshot as client_snapshot

    agent = agents.build_agent(SIZES["small"])
    train_step = tf.Variable(0, dtype=tf.int64)
    saver = policy_saver.PolicySaver(agent.policy, train_step=train_step)
    files = directory / "files"
    saver.save(str(files))
    bindings = client_snapshot.bind(saver, str(files))
    snap = client_snapshot.take_snapshot(bindings, train_step)
    payload = b"".join(bytes(p) for p in snap.parts())
    header = pb.RegisterRunHeader(
        variables=bindings.protos(), checkpoint_object_graph=bindings.object_graph,
        template_bytes=wire.template_size(files),
    )  # fmt: skip
    (directory / "header.bin").write_bytes(header.SerializeToString())
    (directory / "payload.bin").write_bytes(payload)
    spec = {"template_bytes": header.template_bytes, "snapshot_bytes": len(payload)}
    (directory / "spec.json").write_text(json.dumps(spec))


# A client process: `count` simulated trainers, no TensorFlow.


async def _clients(addresses: list[str], spec: Path, first: int, count: int, trainers: int, seconds: float) -> None:
    import grpc

    from checkpointd.protocol import wire
    from checkpointd.v1 import checkpointd_pb2 as pb
    from checkpointd.v1 import checkpointd_pb2_grpc

    base = pb.RegisterRunHeader.FromString((spec / "header.bin").read_bytes())
    payload = (spec / "payload.bin").read_bytes()
    template_chunks = list(wire.template_chunks(spec / "files", CHUNK_BYTES))
    chunks = [pb.SaveRequest(chunk=c) for c in wire.chunks([payload], CHUNK_BYTES)]
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    stubs = [checkpointd_pb2_grpc.CheckpointServiceStub(c) for c in channels]
    runs = [(f"fleet-{i}", i) for i in range(first, first + count)]

    async def register(run: str, i: int) -> None:
        header = pb.RegisterRunHeader()
        header.CopyFrom(base)
        header.run = run
        requests = [pb.RegisterRunRequest(header=header), *(pb.RegisterRunRequest(chunk=c) for c in template_chunks)]
        reply = await stubs[i % len(stubs)].RegisterRun(iter(requests), timeout=TIMEOUT)
        if reply.snapshot_bytes != len(payload):
            raise RuntimeError(
                f"{run}: the daemon expects {reply.snapshot_bytes} bytes, the payload has {len(payload)}"
            )

    for k in range(0, count, 16):  # 16 registrations at a time
        await asyncio.gather(*(register(r, i) for r, i in runs[k : k + 16]))
    print(json.dumps({"ready": count}), flush=True)
    start = float(await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline))
    cpu0 = _own_cpu_seconds()

    out: dict[str, Any] = {"offered": 0, "accepted": 0, "skipped": 0, "failed": 0, "committed": 0, "flush_failed": 0}
    latencies: list[float] = []
    lags: list[float] = []
    failures: list[str] = []
    codes: dict[str, int] = {}  # "refused: CODE" or "after accept: CODE" -> calls
    examples: dict[str, str] = {}  # the first message of each
    period = 1.0 / RATE_HZ

    async def save(stub: Any, run: str, n: int) -> None:
        header = pb.SaveRequest(
            header=pb.SaveHeader(
                run=run, kind=pb.SAVED_MODEL, export_dir=f"s{n}", step=n,
                variables=base.variables, snapshot_bytes=len(payload),
            )
        )  # fmt: skip
        began = time.perf_counter()
        call = stub.Save(timeout=TIMEOUT)
        accepted = False
        try:
            await call.write(header)
            first_reply = await call.read()
            if not first_reply.decision.accepted:
                out["skipped"] += 1
                await call.done_writing()
                return
            accepted = True
            out["accepted"] += 1
            for c in chunks:
                await call.write(c)
            await call.done_writing()
            reply = await call.read()
            if reply.WhichOneof("item") != "result":
                raise RuntimeError(f"no SaveResult: {reply}")
            latencies.append(time.perf_counter() - began)
            out["committed"] += 1
        except grpc.aio.AioRpcError as e:
            # Before the decision the daemon refused the call (nothing written or
            # counted); after an accept the save failed and the client knows it.
            out["failed"] += 1
            key = f"{'after accept' if accepted else 'refused'}: {e.code().name}"
            codes[key] = codes.get(key, 0) + 1
            examples.setdefault(key, f"{run} s{n}: {e.details()}")

    async def trainer(run: str, i: int) -> None:
        stub = stubs[i % len(stubs)]
        t0 = start + period * i / trainers
        tasks = []
        n = 0
        while (due := t0 + n * period) < start + seconds:
            await asyncio.sleep(max(0.0, due - time.time()))
            lags.append(time.time() - due)
            out["offered"] += 1
            tasks.append(asyncio.create_task(save(stub, run, n)))
            n += 1
        await asyncio.gather(*tasks)
        try:
            await stub.Flush(pb.FlushRequest(run=run, timeout_seconds=TIMEOUT), timeout=TIMEOUT + 5)
        except grpc.aio.AioRpcError as e:
            out["flush_failed"] += 1
            failures.append(f"{run} flush: {e.code().name}: {e.details()}")

    await asyncio.gather(*(trainer(r, i) for r, i in runs))
    cpu = _own_cpu_seconds() - cpu0
    for c in channels:
        await c.close()
    out |= {
        "cpu_seconds": cpu,
        "latencies": latencies,
        "lags": lags,
        "failures": failures[:5],
        "codes": codes,
        "examples": examples,
        "tensorflow_imported": "tensorflow" in sys.modules,
    }
    print(json.dumps(out), flush=True)


def _own_cpu_seconds() -> float:
    """This process's CPU seconds, every thread (gRPC's own included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("template", help="export the small policy's template (TensorFlow)")
    t.add_argument("dir", type=Path)
    c = sub.add_parser("clients", help="simulated trainers (no TensorFlow); reads the start time on stdin")
    c.add_argument("addresses", help="comma-separated daemon addresses; trainer i uses the (i mod n)th")
    c.add_argument("spec", type=Path)
    c.add_argument("first", type=int)
    c.add_argument("count", type=int)
    c.add_argument("trainers", type=int, help="of the whole fleet (phase spread)")
    c.add_argument("seconds", type=float)
    a = p.parse_args(argv)
    if a.command == "template":
        a.dir.mkdir(parents=True, exist_ok=True)
        make_template(a.dir)
    else:
        asyncio.run(_clients(a.addresses.split(","), a.spec, a.first, a.count, a.trainers, a.seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
