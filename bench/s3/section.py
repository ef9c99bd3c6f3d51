"""Section 8: saves committed to an S3 object store, against a raw multipart PUT of the same bytes.

`python -m bench` runs it (`--s3-only` alone, `--no-s3` skips it; `--quick`
skips it unless `--s3`). The section starts its own Ceph radosgw on loopback
(`scripts/rgw.sh start` in the bench workdir, stopped however the section
ends); if Ceph cannot be started it is skipped with the reason printed. Then,
per policy size (medium and large; small only when it is the one size asked
for), a worker process (`python -m bench.s3 --size large --reps 3 --endpoint
URL --bucket B --workdir DIR --out FILE`, AWS credentials from the
environment) builds the DQN agent, starts two `checkpointd serve` daemons,
one on a local `--root` and one on `--root s3://BUCKET/PREFIX`, and a
`RemotePolicySaver` on each (shared memory, as in section 3). Each
repetition, side by side:

- the local daemon: the trainer's stall (`save()` returns) and call ->
  durable (`ticket.result()`: fsynced and renamed);
- the S3 daemon: the stall and call -> committed (`ticket.result()`: every
  object uploaded and the manifest created in the bucket);
- raw PUTs of the same files (the save the local daemon just wrote) to the
  same server, all files of a save at once, at the S3 store's own part size
  and concurrency (read from `S3Store`'s defaults, so a tuning there is
  followed here): boto3's s3transfer TransferManager alone, the anchor of
  the target; the same with the store's Content-MD5 on every request; the
  same plus a `head_object` per file (the store's whole upload step); and
  obstore's `put_async` (Rust object_store) if obstore is installed.

The order of the five S3 measurements rotates each repetition, so none
always follows another's deletes (radosgw's garbage collection runs behind
them). Objects are deleted after each measurement, outside the timing: the
memstore OSD holds every stored byte in RAM.

An A/B of the S3 store itself: with CHECKPOINTD_BENCH_S3_BASE_TREE=DIR (a
`git worktree` of an older commit), the worker starts a third daemon on its
own prefix from DIR's `service/` and saves to it in the same rotation; its
stall and call -> committed are in the JSON under "s3_base" (not in the
table, and not a target).

bench.s3.s3_report judges the targets (S3 commit throughput against the raw
boto3 PUT, the stall on S3 against the local root's, the bytes uploaded per
save) and prints the section's table.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import rgw
from bench.rgw import unavailable as rgw_unavailable
from bench.s3 import s3_raw
from bench.s3.s3_report import targets

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parents[2]
REGION = s3_raw.REGION
SAVE_TIMEOUT = 900.0
_START = time.monotonic()


# The section, in `python -m bench`.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--s3", dest="s3", action="store_const", const="on", help="run section 8 (also with --quick)")
    group.add_argument("--no-s3", dest="s3", action="store_const", const="off", help="skip section 8 (S3)")
    group.add_argument(
        "--s3-only", dest="s3", action="store_const", const="only", help="run section 8 (S3) and nothing else"
    )


def mode(args: argparse.Namespace) -> str:
    """on, off or only; by default on, except in --quick mode."""
    return args.s3 or ("off" if args.quick else "on")


def section_sizes(sizes: Sequence[str]) -> list[str]:
    """Medium and large; small only when it is all that was asked for (--quick)."""
    return [s for s in sizes if s != "small"] or list(sizes)


def store_defaults() -> dict[str, int]:
    """S3Store's own part size and concurrency: the raw PUTs use the same."""
    from checkpointd.storage.s3 import S3Store

    params = inspect.signature(S3Store.__init__).parameters
    return {"part_bytes": params["part_bytes"].default, "max_concurrency": params["max_concurrency"].default}


def run_section(config: Any, progress: Callable[[str], None]) -> dict[str, Any]:
    """Starts radosgw, runs a worker per size, stops radosgw. {"skipped": reason} if Ceph cannot start."""
    rgw_dir = config.workdir / "rgw"
    shutil.rmtree(rgw_dir, ignore_errors=True)  # rgw.sh makes a new cluster in an empty dir only
    progress("8. S3: starting Ceph radosgw on loopback (scripts/rgw.sh)")
    try:
        server = rgw.start(rgw_dir)
    except rgw.Unavailable as e:
        reason = rgw_unavailable(e, config.workdir / "rgw-start.log")
        progress(f"8. S3 section skipped: {reason}")
        return {"skipped": reason}
    try:
        env = server.env
        result: dict[str, Any] = {
            "server": _server_version(),
            "rgw_start_seconds": server.cold_start_seconds,
            "obstore": _obstore_version(),
            **store_defaults(),
            "sizes": {},
        }
        for size in section_sizes(config.sizes):
            progress(f"8. S3, {size}: local root vs s3:// root vs raw PUTs, in a worker process")
            result["sizes"][size] = _run_worker(config, size, env)
        result["targets"] = targets(result)
        return result
    finally:
        server.stop()


def _server_version() -> str:
    try:
        out = subprocess.run(["radosgw", "--version"], capture_output=True, text=True, timeout=30).stdout
    except OSError:
        return "radosgw"
    words = out.split()  # "ceph version 16.2.15 (...) pacific (stable)"
    return f"Ceph radosgw {words[2]}" if len(words) > 2 else "radosgw"


def _obstore_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("obstore")
    except metadata.PackageNotFoundError:
        return None


def _run_worker(config: Any, size: str, rgw_env: dict[str, str]) -> dict[str, Any]:
    out = config.workdir / f"s3-{size}.json"
    log = config.workdir / f"s3-{size}-worker.log"
    cmd = [sys.executable, "-m", "bench.s3", "--size", size, "--reps", str(config.reps_for(size))]
    cmd += ["--endpoint", rgw_env["CHECKPOINTD_TEST_S3_ENDPOINT"], "--bucket", rgw_env["CHECKPOINTD_TEST_S3_BUCKET"]]
    cmd += ["--workdir", str(config.workdir), "--out", str(out)]
    aws = {k: v for k, v in rgw_env.items() if k.startswith("AWS_")}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", **aws)
    with open(log, "wb") as err:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=sys.stderr, stderr=err, timeout=600 if config.quick else 2400, check=False
        )
    if proc.returncode != 0:
        raise RuntimeError(
            f"the S3 {size} worker exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}"
        )
    return json.loads(out.read_text())


# The worker: one size.


def _progress(size: str, message: str) -> None:
    print(f"[{time.monotonic() - _START:6.1f}s] S3 {size}: {message}", flush=True)


def delete_prefix(client: Any, bucket: str, key_prefix: str) -> int:
    """Deletes every object under `key_prefix`; how many there were."""
    keys = [
        obj["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key_prefix)
        for obj in page.get("Contents", [])
    ]
    for key in keys:  # one by one: a handful per save, and DeleteObjects' checksum differs by botocore version
        client.delete_object(Bucket=bucket, Key=key)
    return len(keys)


def _uploaded(totals_by: Callable[[str, str, str], dict[str, float]], url: str) -> float:
    return totals_by(url, "checkpointd_store_uploaded_bytes_total", "kind").get("saved_model", 0.0)


def _files(save_dir: Path) -> s3_raw.Files:
    return [(p, p.relative_to(save_dir).as_posix()) for p in sorted(save_dir.rglob("*")) if p.is_file()]


def _timed_save(saver: Any, export_dir: str) -> dict[str, float]:
    """One non-blocking save(): stall, call -> durable/committed, the daemon's time and bytes."""
    start = time.perf_counter()
    ticket = saver.save(export_dir)
    returned = time.perf_counter()
    if ticket.skipped:
        raise RuntimeError(f"save {export_dir} was skipped: {ticket.reason}")
    done = ticket.result(SAVE_TIMEOUT)
    durable = time.perf_counter()
    return {
        "stall": returned - start,
        "latency": durable - start,
        "daemon": done.duration_seconds,
        "bytes": float(done.bytes_written),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.s3", description=__doc__)
    p.add_argument("--size", required=True)
    p.add_argument("--reps", type=int, required=True)
    p.add_argument("--endpoint", required=True, help="the S3 server's URL (credentials: the AWS_* environment)")
    p.add_argument("--bucket", required=True)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error(f"--reps must be >= 1, saw {args.reps}")
    return args


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    from bench import agents, remote
    from bench.config import SIZES
    from bench.scrape import phase_means, phase_totals, totals_by
    from bench.stats import summarize
    from checkpointd.storage.s3 import make_client
    from checkpointd.storage.save_manifest import MANIFEST_NAME
    from checkpointd_client import RemotePolicySaver
    from tests.integration.support.daemon import start_daemon

    size = SIZES[args.size]
    say = lambda message: _progress(size.name, message)  # noqa: E731
    work = args.workdir / f"s3-{size.name}"
    prefix = f"bench-{size.name}-{secrets.token_hex(4)}"
    defaults = store_defaults()
    client = make_client(args.endpoint, REGION)
    raws = s3_raw.boto3_puts(args.endpoint, args.bucket, defaults["part_bytes"], defaults["max_concurrency"])
    result: dict[str, Any] = {"prefix": prefix}
    if _obstore_version() is not None:
        raws["obstore"] = s3_raw.obstore_put(
            args.endpoint, args.bucket, defaults["part_bytes"], defaults["max_concurrency"]
        )
    else:
        result["obstore_skipped"] = "obstore is not installed (.venv/bin/pip install obstore)"

    say(f"building a DQN agent of {size.params:,} parameters")
    agent = agents.build_agent(size)
    policy, counter = agent.policy, agent.train_step_counter
    local = start_daemon(work / "local-root", work / "local-daemon")
    try:
        s3 = start_daemon(
            f"s3://{args.bucket}/{prefix}",  # type: ignore[arg-type]  # passed to --root as str(root)
            work / "s3-daemon",
            "--work-dir",
            str(work / "s3-work"),
            "--s3-endpoint-url",
            args.endpoint,
            "--s3-region",
            REGION,
        )
    except BaseException:
        local.terminate()
        raise
    base_tree = os.environ.get("CHECKPOINTD_BENCH_S3_BASE_TREE")
    s3_base = None
    try:
        if base_tree:  # the A/B's old code: the same daemon, from the other tree's service/
            s3_base = start_daemon(
                f"s3://{args.bucket}/{prefix}-base",  # type: ignore[arg-type]
                work / "s3-base-daemon",
                "--work-dir",
                str(work / "s3-base-work"),
                "--s3-endpoint-url",
                args.endpoint,
                "--s3-region",
                REGION,
                env={"PYTHONPATH": str(Path(base_tree) / "service")},
            )
            result["s3_base_tree"] = base_tree
    except BaseException:
        local.terminate()
        s3.terminate()
        raise
    result["daemon_logs"] = [str(local.log_path), str(s3.log_path)]
    samples: dict[str, list[dict[str, float]]] = {"local": [], "s3": []}
    if s3_base is not None:
        samples["s3_base"] = []
    raw_seconds: dict[str, list[float]] = {name: [] for name in raws}
    try:
        with contextlib.ExitStack() as savers:
            ls, ss = (
                savers.enter_context(
                    RemotePolicySaver(policy, d.address, run="trainer", train_step=counter, timeout=SAVE_TIMEOUT)
                )
                for d in (local, s3)
            )
            say("1st saves (export, register, save) on each daemon")
            result["first_save_seconds"] = {"local": remote.first_save(ls), "s3": remote.first_save(ss)}
            bs = None
            if s3_base is not None:
                bs = savers.enter_context(
                    RemotePolicySaver(policy, s3_base.address, run="trainer", train_step=counter, timeout=SAVE_TIMEOUT)
                )
                result["first_save_seconds"]["s3_base"] = remote.first_save(bs)
            warm = _files(local.root / "trainer" / "first")
            for key, raw in raws.items():  # connections up, as the daemon's are after its 1st save
                raw(warm, f"{prefix}/raw-warmup/{key}/")
            delete_prefix(client, args.bucket, f"{prefix}/raw-warmup/")
            phases_before = phase_totals(s3.metrics_url)
            daemons = {"s3": s3, **({"s3_base": s3_base} if s3_base is not None else {})}
            uploaded_before = {k: _uploaded(totals_by, d.metrics_url) for k, d in daemons.items()}
            order = ["s3", *(["s3_base"] if bs is not None else []), *raws]
            for i in range(args.reps):
                name = f"save-{i}"
                samples["local"].append(_timed_save(ls, name))  # its files are the raw PUTs' bytes
                files = _files(local.root / "trainer" / name)
                sizes = [path.stat().st_size for path, _ in files]
                must_send = (
                    sum(p.stat().st_size for p, rel in files if rel.startswith("variables/")),
                    sum(p.stat().st_size for p, rel in files if rel.endswith(MANIFEST_NAME)),
                )
                shift = i % len(order)
                for key in order[shift:] + order[:shift]:
                    if key == "s3":
                        samples["s3"].append(_timed_save(ss, name))
                        gone = f"{prefix}/trainer/{name}/"
                    elif key == "s3_base":
                        samples["s3_base"].append(_timed_save(bs, name))
                        gone = f"{prefix}-base/trainer/{name}/"
                    else:
                        gone = f"{prefix}/raw/{key}-{i}/"
                        raw_seconds[key].append(s3_raw.timed(raws[key], files, gone))
                    if not delete_prefix(client, args.bucket, gone):
                        raise RuntimeError(f"nothing under {gone} in the bucket after the {key} upload")
                shutil.rmtree(local.root / "trainer" / name)
                say(
                    f"rep {i + 1}/{args.reps}: S3 commit {samples['s3'][-1]['latency']:.2f} s, "
                    + (f"base {samples['s3_base'][-1]['latency']:.2f} s, " if bs is not None else "")
                    + "raw "
                    + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in raw_seconds.items())
                )
            result["s3_phase_mean_seconds"] = phase_means(phases_before, phase_totals(s3.metrics_url))
            # Bytes each daemon sent per save (server-side copies are not sent), against what must be sent.
            result["uploaded_per_save"] = {
                k: (_uploaded(totals_by, d.metrics_url) - uploaded_before[k]) / args.reps for k, d in daemons.items()
            }
            result["variables_bytes"], result["manifest_bytes"] = must_send
    finally:
        codes = {"local": local.terminate(), "s3": s3.terminate()}
        if s3_base is not None:
            codes["s3_base"] = s3_base.terminate()
    result["daemon_exit_codes"] = codes
    raw_bytes = sum(sizes)
    result.update(
        {
            "size": {"params": size.params, "save_bytes": samples["s3"][0]["bytes"], "raw_bytes": raw_bytes},
            "files": len(sizes),
            "largest_file_bytes": max(sizes),
        }
    )
    for where, runs in samples.items():
        result[where] = {
            "save_stall": summarize(s["stall"] for s in runs),
            "save_latency": summarize(s["latency"] for s in runs),
            "save_daemon": summarize(s["daemon"] for s in runs),
            "save_throughput": summarize(s["bytes"] / s["latency"] for s in runs),
        }
    result["raw"] = {
        name: {"seconds": summarize(seconds), "throughput": summarize(raw_bytes / s for s in seconds)}
        for name, seconds in raw_seconds.items()
    }
    say("done")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run_worker(args)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
