"""`scripts/demo.sh --fleet`: a run moved to another node's daemon through the bucket, twice.

A local radosgw (scripts/rgw.sh, which installs Ceph's packages when run as
root), a bucket, three daemons on one s3:// root (each its own --work-dir and
ports, a short --lease-seconds so the second move is quick), the trainer on
daemon A. Node A is drained: the trainer and daemon A get SIGTERM together;
the trainer saves the step it reached through A, which takes that save,
drains and releases its run leases as it exits, so a new trainer on daemon
B takes the run at once and resumes at that step (0 steps lost). Then node
B is lost: B and its trainer are SIGKILLed together; a third trainer on
daemon C takes the run when B's lease expires and resumes from the newest
committed save. Then `checkpointd status --stored` and `checkpointd verify`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from cartpole_demo import procs
from cartpole_demo.preempt import Job

RGW = Path(__file__).resolve().parents[1] / "rgw.sh"
BUCKET = "checkpointd-demo"
CANNOT_INSTALL = 3  # rgw.sh's exit code when Ceph cannot be installed (not root, or apt unreachable)


def _start_rgw(where: Path, cleanup: list[Callable[[], object]]) -> dict[str, str]:
    """Starts radosgw in `where`; returns its env lines (the AWS keys and the endpoint)."""
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    print("starting a local S3 server (Ceph radosgw, scripts/rgw.sh) ...", flush=True)
    proc = subprocess.run([str(RGW), "start", str(where)], capture_output=True, text=True, timeout=900)
    cleanup.append(lambda: subprocess.run([str(RGW), "stop", str(where)], capture_output=True, timeout=120))
    if proc.returncode == CANNOT_INSTALL:
        print(f"demo --fleet needs Ceph's packages: {proc.stderr.strip()} (run it as root)", file=sys.stderr)
        raise SystemExit(CANNOT_INSTALL)
    if proc.returncode != 0:
        raise procs.DemoError(f"scripts/rgw.sh start failed (exit {proc.returncode}):\n{proc.stderr}{proc.stdout}")
    return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)


def _endpoint(env: dict[str, str]) -> str:
    for name in ("AWS_ENDPOINT_URL", "CHECKPOINTD_TEST_S3_ENDPOINT"):
        if env.get(name):
            return env[name]
    raise procs.DemoError(f"scripts/rgw.sh printed no endpoint: {sorted(env)}")


def _create_bucket(endpoint: str) -> None:
    import boto3
    from botocore.exceptions import ClientError

    s3 = boto3.client("s3", endpoint_url=endpoint)
    try:
        s3.create_bucket(Bucket=BUCKET)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise


def _cli(args: list[str]) -> int:
    """Runs a `checkpointd` command with its output shown indented under the command line."""
    print("$ checkpointd " + " ".join(args), flush=True)
    proc = subprocess.run([sys.executable, "-m", "checkpointd", *args], capture_output=True, text=True, timeout=300)
    for line in (proc.stdout + proc.stderr).splitlines():
        print("  " + line)
    return proc.returncode


def run_fleet(args: argparse.Namespace, cleanup: list[Callable[[], object]]) -> int:
    """The fleet mode's steps; returns the exit code (0 when status and verify succeed)."""
    base = args.dir.resolve()
    env = _start_rgw(base / "rgw", cleanup)
    endpoint = _endpoint(env)
    for name, value in env.items():
        if name.startswith("AWS_"):
            os.environ[name] = value  # the daemons' and the CLI's credentials
    _create_bucket(endpoint)
    root = f"s3://{BUCKET}/ckpt"
    print(f"S3 at {endpoint}, bucket {BUCKET} created; every daemon on {root}")
    daemons = []
    for name in ("A", "B", "C"):
        work = base / f"node-{name.lower()}"
        shutil.rmtree(work, ignore_errors=True)
        daemon = procs.start_daemon(
            name,
            ["--root", root, "--s3-endpoint-url", endpoint, "--work-dir", str(work / "work")]
            + ["--lease-seconds", f"{args.lease_seconds:g}"],
            work,
        )
        cleanup.append(daemon.stop)
        daemons.append(daemon)
        print(f"daemon {name} (pid {daemon.proc.pid}): gRPC {daemon.address}, work dir {procs.shown(work / 'work')}")
    a, b, c = daemons
    job = Job(args, base / "logs", cleanup)
    trainer = job.train(a)
    trainer.wait_for("step", lambda t: t.step >= args.kill_at and bool(t.saved))
    job.preempt(trainer, a, notice=True, node=True)
    trainer, resumed = job.resume(b)
    lose_at = (args.kill_at + args.steps) // 2  # once it saved again on B
    trainer.wait_for("step", lambda t: t.step >= lose_at and any(s > resumed for s in t.saved))
    job.preempt(trainer, b, notice=False, node=True)
    trainer, _ = job.resume(c)
    job.finish(trainer)
    codes = [
        _cli(["status", "--stored", "--address", c.address]),
        _cli(["verify", root, "--s3-endpoint-url", endpoint]),
    ]
    logs = ", ".join(procs.shown(d.log) for d in daemons)
    print(f"daemon C stopped (exit {c.stop()}); logs in {procs.shown(base / 'logs')}, {logs}")
    return 0 if not any(codes) else 1
