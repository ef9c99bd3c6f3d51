"""`python -m bench`: runs every section, prints the table, writes the JSON.

Run from the repository root (it imports `tests.integration.support.daemon`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from bench import fleet, report, report_targets, s3
from bench.config import FANIN_RATE_HZ, SIZES, BenchConfig
from bench.stats import busy_cpu_seconds, own_cpu_seconds

ROOT = Path(__file__).resolve().parents[1]
FULL_WINDOWS = {"small": 3.0, "medium": 4.0, "large": 8.0}
QUICK_WINDOW = 1.0
_START = time.monotonic()


def progress(message: str) -> None:
    print(f"[{time.monotonic() - _START:6.1f}s] {message}", file=sys.stderr, flush=True)


def config_from_args(argv: Sequence[str] | None) -> BenchConfig:
    """Parses the command line; --quick changes the defaults, explicit flags still win."""
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument(
        "--quick",
        action="store_true",
        help="small policy, 2 reps, fan-in of 2 processes for 3 s (the test suite's mode)",
    )
    p.add_argument("--sizes", help=f"comma-separated, of {','.join(SIZES)} (default: all; quick: small)")
    p.add_argument("--reps", type=int, help="repetitions for small and medium (default 5; quick 2)")
    p.add_argument("--large-reps", type=int, help="repetitions for large (default min(reps, 3))")
    p.add_argument("--fanin-procs", type=int, help="fan-in trainer processes (default 8; quick 2)")
    p.add_argument("--fanin-seconds", type=float, help="fan-in duration (default 30; quick 3)")
    p.add_argument(
        "--training-cases",
        help="section 7's cases, of small,medium,large (default: medium, and large if memory allows; quick: small; "
        "'none' skips it)",
    )
    s3.add_arguments(p)
    fleet.add_arguments(p)
    p.add_argument(
        "--incremental",
        choices=("medium", "large", "none"),
        help="the incremental case's state: medium (200 MiB buffer, the default), large (the 1.23 GB state) or none; "
        "quick: none",
    )
    p.add_argument(
        "--resume",
        choices=("small", "medium", "large", "none"),
        help="the resume section's state: medium (370 MB, the default), large (1.23 GB), small or none; quick: none",
    )
    p.add_argument(
        "--preemption",
        help="the preemption section's cases (bench/preemption.py: the save on notice, continuous saves, the moves), "
        "of small,medium, or none (default: small,medium; quick: none); `--preemption-only` runs it alone",
    )
    p.add_argument("--preemption-only", action="store_true", help="only the preemption section")
    p.add_argument(
        "--orbax",
        choices=("on", "off"),
        help="the Orbax row (bench/peers/orbax.py; makes .venv-orbax with jax[cpu] and orbax-checkpoint on first use, "
        "about 730 MB): on by default, off with --quick",
    )
    p.add_argument("--out", type=Path, default=Path("bench-result.json"), help="JSON results file")
    p.add_argument(
        "--workdir", type=Path, help="scratch directory, kept (default: a new temp dir, removed after success)"
    )
    a = p.parse_args(argv)
    quick = a.quick
    reps = a.reps if a.reps is not None else (2 if quick else 5)
    sizes = tuple(a.sizes.split(",")) if a.sizes else (("small",) if quick else tuple(SIZES))
    sizes = tuple(sorted(sizes, key=list(SIZES).index)) if set(sizes) <= set(SIZES) else sizes
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="checkpointd-bench-"))
    try:
        return BenchConfig(
            sizes=sizes,
            reps=reps,
            large_reps=a.large_reps if a.large_reps is not None else max(1, min(reps, 3)),
            window_seconds={s: QUICK_WINDOW if quick else FULL_WINDOWS[s] for s in SIZES},
            min_window_steps=3 if quick else 5,
            fanin_procs=a.fanin_procs if a.fanin_procs is not None else (2 if quick else 8),
            fanin_seconds=a.fanin_seconds if a.fanin_seconds is not None else (3.0 if quick else 30.0),
            limit_bytes=(32 << 20) if quick else (512 << 20),
            quick=quick,
            training_cases=_training_cases(a.training_cases, quick),
            s3=s3.mode(a),
            fleet=fleet.mode(a),
            fleet_trainers=a.fleet_trainers,
            fleet_seconds=a.fleet_seconds,
            incremental=a.incremental or ("none" if quick else "medium"),
            resume=a.resume or ("none" if quick else "medium"),
            preemption=a.preemption or ("none" if quick else "small,medium"),
            preemption_only=a.preemption_only,
            orbax=(a.orbax or ("off" if quick else "on")) == "on",
            workdir=workdir,
            keep_workdir=a.workdir is not None,
            out=a.out,
        )
    except ValueError as e:
        p.error(str(e))
        raise  # unreachable: error() exits


def _training_cases(asked: str | None, quick: bool) -> tuple[str, ...]:
    from bench.checkpointer import CASES, NEEDS, available_bytes

    if asked == "none":
        return ()
    if asked:
        cases = tuple(asked.split(","))
        if not set(cases) <= set(CASES):
            raise ValueError(f"--training-cases takes {','.join(CASES)} or none, saw {asked}")
        return cases
    if quick:
        return ("small",)
    # The ~1 GB case only where the machine has the memory for it.
    return ("medium", "large") if available_bytes() >= NEEDS["large"] else ("medium",)


def run_training_case(config: BenchConfig, case: str) -> dict[str, Any]:
    """Section 7 for one case, in a worker process (bench.checkpointer)."""
    out = config.workdir / f"training-{case}.json"
    log = config.workdir / f"training-{case}-worker.log"
    reps = 2 if config.quick else 3
    window = QUICK_WINDOW if config.quick else 6.0
    cmd = [sys.executable, "-m", "bench.checkpointer", "--case", case, "--reps", str(reps), "--window", str(window)]
    cmd += ["--min-steps", str(config.min_window_steps), "--workdir", str(config.workdir), "--out", str(out)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    with open(log, "wb") as err:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=sys.stderr, stderr=err, timeout=600 if config.quick else 2400, check=False
        )
    if proc.returncode != 0:
        raise RuntimeError(
            f"the training {case} worker exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}"
        )
    return json.loads(out.read_text())


def machine() -> dict[str, Any]:
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kib = next(
        int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")
    )
    versions = []
    for name in ("tensorflow-cpu", "tensorflow", "tf-agents", "grpcio", "protobuf"):
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": mem_kib / (1 << 20),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "packages": ", ".join(versions),
        "commit": commit,
        "load_average_at_start": os.getloadavg(),
    }


def run_size(config: BenchConfig, size: str) -> dict[str, Any]:
    """Sections 1, 2, 3 and 6 for one size, in a worker process."""
    out = config.workdir / f"{size}.json"
    log = config.workdir / f"{size}-worker.log"
    cmd = [
        sys.executable,
        "-m",
        "bench.worker",
        "--size",
        size,
        "--reps",
        str(config.reps_for(size)),
        "--window",
        str(config.window_seconds[size]),
        "--min-steps",
        str(config.min_window_steps),
        "--workdir",
        str(config.workdir),
        "--out",
        str(out),
    ]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    with open(log, "wb") as err:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=sys.stderr, stderr=err, timeout=600 if config.quick else 1800, check=False
        )
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"the {size} worker exited with {proc.returncode}:\n{tail}")
    return json.loads(out.read_text())


def run(config: BenchConfig, argv: Sequence[str]) -> dict[str, Any]:
    from bench import fanin, limits

    results: dict[str, Any] = {
        "meta": {
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": shlex.join(["python", "-m", "bench", *argv]),
            **machine(),
        },
        "config": {
            "sizes": list(config.sizes),
            "reps": {s: config.reps_for(s) for s in config.sizes},
            "window_seconds": {s: config.window_seconds[s] for s in config.sizes},
            "min_window_steps": config.min_window_steps,
            "fanin_procs": config.fanin_procs,
            "fanin_seconds": config.fanin_seconds,
            "fanin_rate_hz": FANIN_RATE_HZ,
            "limit_bytes": config.limit_bytes,
            "quick": config.quick,
        },
    }
    if config.preemption_only:
        results["preemption"] = run_preemption(config)
        return results
    if config.fleet == "only":
        results["fleet"] = fleet.run_section(config, progress)
        return results
    if config.s3 != "off":
        results["s3"] = s3.run_section(config, progress)
        if config.s3 == "only":
            return results
    progress("4. machine limits: memcpy, fsync'd disk writes, gRPC loopback")
    reps = max(config.reps, 3)
    results["limits"] = {
        "memcpy": {s: limits.memcpy(SIZES[s].weight_bytes, reps) for s in config.sizes},
        "disk_fsync": limits.disk_fsync(config.workdir / "disk", config.limit_bytes, reps),
        "grpc_loopback": limits.grpc_loopback(config.workdir / "grpc", config.limit_bytes, reps),
    }
    per_size = {}
    for s in config.sizes:
        progress(f"{s}: sections 1, 2, 3, 6 in a worker process")
        per_size[s] = run_size(config, s)
    results["sizes"] = {s: per_size[s]["size"] for s in config.sizes}
    for section in ("inprocess", "async", "remote", "remote_wire", "training", "memory"):
        results[section] = {s: per_size[s][section] for s in config.sizes}

    progress(f"5. fan-in: starting {config.fanin_procs} trainer processes")
    daemon = fanin.fanin_daemon(config.workdir)
    try:
        results["fanin"] = fanin.run_fanin(daemon, config.fanin_procs, config.fanin_seconds, FANIN_RATE_HZ, progress)
    finally:
        code = daemon.terminate()
    results["fanin"]["daemon_exit_code"] = code
    results["config"]["training_cases"] = list(config.training_cases)
    results["training_checkpoint"] = {}
    for case in config.training_cases:
        progress(f"7. training checkpoints, {case}: Checkpointer, TF async, RemoteCheckpointer")
        results["training_checkpoint"][case] = run_training_case(config, case)
    if config.incremental != "none":  # incremental saves, in a worker process (bench/incremental.py)
        progress(f"incremental training checkpoints over gRPC, {config.incremental}")
        results["incremental"] = run_incremental(config)
    if config.resume != "none":  # restores, in a worker process (bench/resume.py)
        progress(f"resume: restoring a {config.resume} training state on every path")
        extra = ["--case", config.resume] + ([] if config.s3 == "on" else ["--no-s3"])
        results["resume"] = run_worker(config, "resume", extra)
    if config.fleet == "on":
        results["fleet"] = fleet.run_section(config, progress)
    if config.preemption != "none":
        results["preemption"] = run_preemption(config)
    if config.orbax:  # the peer a JAX user would pick, in a worker process: medians of 8
        progress("Orbax beside checkpointd: the same arrays, interleaved (bench/peers/orbax.py)")
        results["orbax"] = run_worker(config, "peers.orbax", ["--reps", "8"])
    return results


def run_preemption(config: BenchConfig) -> dict[str, Any]:
    """The preemption section (bench/preemption.py), and bench.continuous's DQN CartPole, in worker processes."""
    progress(f"preemption: the save on notice, continuous saves and the moves, {config.preemption}")
    config.workdir.mkdir(parents=True, exist_ok=True)  # the section may run alone (--preemption-only)
    extra = ["--cases", config.preemption] + ([] if config.s3 != "off" else ["--no-move"])
    section = run_worker(config, "preemption", extra)
    progress("preemption: the demo's DQN CartPole with save() after every step (bench.continuous)")
    # Many short rounds, each judged by its own pair of windows: the machine's drift is the noise here.
    section["cartpole"] = run_worker(config, "continuous", ["--reps", "12", "--window", "2"])
    return section


def run_incremental(config: BenchConfig) -> dict[str, Any]:
    """The incremental case in a worker process (bench.incremental), on S3 too where section 8 runs."""
    extra = (["--large"] if config.incremental == "large" else []) + (["--s3"] if config.s3 == "on" else [])
    return run_worker(config, "incremental", extra)


def run_worker(config: BenchConfig, name: str, extra: list[str]) -> dict[str, Any]:
    """`python -m bench.NAME --reps 3 --workdir W --out F EXTRA` in a worker process; its JSON."""
    out, log = config.workdir / f"{name}.json", config.workdir / f"{name}-worker.log"
    cmd = [sys.executable, "-m", f"bench.{name}", "--reps", "3", "--workdir", str(config.workdir), "--out", str(out)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    with open(log, "wb") as err:
        proc = subprocess.run(cmd + extra, cwd=ROOT, env=env, stdout=sys.stderr, stderr=err, timeout=2400, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"the {name} worker exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}"
        )
    return json.loads(out.read_text())


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    config = config_from_args(argv)
    progress(f"workdir {config.workdir}")
    busy0, own0 = busy_cpu_seconds(), own_cpu_seconds()
    try:
        results = run(config, argv)
    except BaseException:
        progress(f"failed; logs are kept in {config.workdir}")
        raise
    if not config.keep_workdir:
        shutil.rmtree(config.workdir, ignore_errors=True)
    results["meta"]["duration_seconds"] = time.monotonic() - _START
    results["meta"]["load_average_at_end"] = os.getloadavg()
    # Noise from outside the benchmark: CPU the rest of the machine used meanwhile.
    other = max(0.0, (busy_cpu_seconds() - busy0) - (own_cpu_seconds() - own0))
    results["meta"]["other_cpu_seconds"] = other
    results["meta"]["other_cpu_share"] = other / (results["meta"]["duration_seconds"] * (os.cpu_count() or 1))
    # Every section's targets, as judged at the run (`python -m bench.report` judges a JSON anew).
    results["targets"] = report_targets.targets(results)
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(results, indent=1))
    print(report.render(results), end="")
    progress(f"wrote {config.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
