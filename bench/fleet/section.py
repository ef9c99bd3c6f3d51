"""Section 9: fan-in at fleet scale: 256 simulated trainers, 1 save/s each, on one daemon, then on 3 sharing S3.

`python -m bench` runs it (`--fleet-only` alone, `--no-fleet` skips it;
`--quick` skips it unless `--fleet`); `--fleet-trainers N` (default 256) and
`--fleet-seconds S` (default 60) set its scale.

The trainers are simulated so that the 2 cores go to the daemons: no
TensorFlow in them (each client process checks `sys.modules` and reports
it). One helper process with TensorFlow (`python -m bench.fleet template
DIR`) exports the small policy once and writes what a trainer sends; then a
few client processes (`python -m bench.fleet clients ...`, 64 trainers each,
on grpc.aio) speak the contract directly. bench.fleet.fleet_clients is both
processes and says what a trainer does; this module is their command line.

Phase one: one daemon on a local --root. Phase two: radosgw (scripts/rgw.sh,
started by the section and stopped however it ends), 3 daemons on one
`s3://BUCKET/PREFIX`, trainer i on daemon i % 3. For each, bench.fleet.fleet_phase
runs the clients and measures (saves/s, call -> durable, the daemons' CPU,
context switches and peak RSS per save, on S3 their requests and bytes per
save and the object store's CPU), and this module counts the manifests
committed (files under the local root; objects in the bucket) against the
accepted saves. bench.fleet.fleet_report judges the targets (zero lost: accepted =
committed = manifests, and p99 <= 250 ms on one daemon) and prints the table.

Diagnostics (environment, so a bench run's flags stay the same):
CHECKPOINTD_BENCH_PROFILE=DIR runs each daemon under `bench.probes.sampler` and
leaves its profile in DIR (local.txt, s3-0.txt, ...; the sampler's own CPU
counts in CPU/save then; CHECKPOINTD_BENCH_PROFILE_MODE=cprofile: cProfile
on every thread, by thread CPU time, instead of sampling);
CHECKPOINTD_BENCH_FLEET_S3=0 skips the S3 phase, CHECKPOINTD_BENCH_FLEET_LOCAL=0
the local one (to measure the other alone); CHECKPOINTD_BENCH_FLEET_DAEMON_ARGS
adds flags to every daemon's command line (e.g. "--admission-wait 0", to
measure a flag against its default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import rgw
from bench.fleet import fleet_store
from bench.fleet.fleet_clients import RATE_HZ, make_template, run_clients
from bench.fleet.fleet_phase import ROOT, run_phase
from bench.fleet.fleet_report import targets
from bench.fleet.fleet_store import MANIFEST, REGION


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
    from tests.integration.support.daemon import start_daemon

    progress(f"9. fleet, one daemon on a local root: {trainers} trainers x {RATE_HZ:g} save/s for {seconds:g} s")
    local = start_daemon(work / "local-root", work / "local-daemon", *_daemon_args(), wrap=_profiled("local"))
    out: dict[str, Any] = {}
    try:
        out = run_phase([local], spec, trainers, seconds, work / "local", progress)
        out["manifests"] = sum(1 for _ in (work / "local-root").glob(f"fleet-*/*/{MANIFEST}"))
    finally:
        out["daemon_exit_codes"] = [local.terminate()]
    return out


def _daemon_args() -> list[str]:
    """Extra flags for every daemon of the section, from CHECKPOINTD_BENCH_FLEET_DAEMON_ARGS."""
    return shlex.split(os.environ.get("CHECKPOINTD_BENCH_FLEET_DAEMON_ARGS", ""))


def _s3_phase(
    config: Any, spec: Path, trainers: int, seconds: float, work: Path, progress: Callable[[str], None]
) -> dict[str, Any]:
    from tests.integration.support.daemon import start_daemon

    rgw_dir = config.workdir / "fleet-rgw"
    shutil.rmtree(rgw_dir, ignore_errors=True)
    progress("9. fleet: starting Ceph radosgw on loopback (scripts/rgw.sh)")
    try:
        server = rgw.start(rgw_dir)
    except rgw.Unavailable as e:
        reason = rgw.unavailable(e, work / "rgw-start.log")
        progress(f"9. fleet, S3 phase skipped: {reason}")
        return {"skipped": reason}
    try:
        endpoint, bucket, aws = server.endpoint, server.bucket, server.daemon_env()
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
                        *_daemon_args(),
                        env=aws,
                        wrap=_profiled(f"s3-{i}"),
                    )  # fmt: skip
                )
            progress(
                f"9. fleet, 3 daemons on one S3 prefix: {trainers} trainers x {RATE_HZ:g} save/s for {seconds:g} s"
            )
            servers = [int((rgw_dir / f"{n}.pid").read_text()) for n in ("rgw", "osd", "mon")]
            out |= run_phase(daemons, spec, trainers, seconds, work / "s3", progress, servers)
            out["manifests"] = fleet_store.bucket_manifests(endpoint, bucket, prefix, aws)
        finally:
            out["daemon_exit_codes"] = [d.terminate() for d in daemons]
        return out
    finally:
        server.stop()


def _profiled(name: str) -> list[str]:
    """The command a daemon runs under: bench.probes.sampler into $CHECKPOINTD_BENCH_PROFILE/<name>.txt, or nothing."""
    folder = os.environ.get("CHECKPOINTD_BENCH_PROFILE")
    if not folder:
        return []
    Path(folder).mkdir(parents=True, exist_ok=True)
    mode = ["--cprofile"] if os.environ.get("CHECKPOINTD_BENCH_PROFILE_MODE") == "cprofile" else []
    return [sys.executable, "-m", "bench.probes.sampler", *mode, str(Path(folder) / f"{name}.txt"), "--"]


def _run(cmd: list[str], log: Path, timeout: float) -> None:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    with open(log, "wb") as err:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=err, stderr=err, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:4])} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")


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
        asyncio.run(run_clients(a.addresses.split(","), a.spec, a.first, a.count, a.trainers, a.seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
