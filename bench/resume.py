"""The "resume" section: how fast a restarted trainer gets its training state back.

`python -m bench.resume [--case medium|large] [--reps 3] [--no-s3] [--no-move] --workdir DIR --out FILE`
builds, in a process of its own, a DQN agent with Adam (slots trained) and a
TFUniformReplayBuffer (bench.checkpointer's cases: medium ~370 MB of state,
large ~1.23 GB behind --case large), saves it once in process and once
through a daemon, and times restoring it into the live objects:

- in process: `tf.train.Checkpoint.restore` of the local checkpoint
  (page cache warm), the anchor;
- same host: RemoteCheckpointer's restore reading the committed files in place;
- over gRPC: the files fetched into memory (tmpfs), then restored;
- from S3: a fresh daemon on a radosgw bucket that never saw the run streams
  the files with parallel ranged GETs; beside it a raw boto3 parallel
  ranged GET of the same objects into memory, the anchor;
- partial: `tf.train.Checkpoint(policy=agent.policy)` from the training
  checkpoint (the buffer stays behind), against the same policy restored
  from a checkpoint holding the policy alone;
- bench/move.py's rows: in process and same host again with a cold page
  cache, and (with S3, unless --no-move) the whole move of a trainer to
  another node, the lease wait shown apart.

Targets (the issue's, one run): same host <= 1.2x in process; from S3 >= 0.7x
the raw GET's bandwidth; partial <= 1.2x the policy alone.
"""

from __future__ import annotations

import argparse
import concurrent.futures
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

from bench import move

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parents[1]
RGW_SCRIPT = ROOT / "scripts" / "rgw.sh"
REGION = "us-east-1"
TIMEOUT = 900.0
RAW_GET_BYTES = 16 << 20
RAW_GETS = 8
SAME_HOST_VS_INPROCESS = 1.2
S3_VS_RAW_GET = 0.7
PARTIAL_VS_ALONE = 1.2
_START = time.monotonic()


def progress(message: str) -> None:
    print(f"[resume {time.monotonic() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


def _best(reps: int, fn: Callable[[], Any], before: Callable[[], Any] | None = None) -> dict[str, Any]:
    from bench.stats import summarize

    samples = []
    for _ in range(reps):
        if before is not None:
            before()
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return summarize(samples)


def _files_bytes(directory: Path, prefix: str) -> int:
    return sum(p.stat().st_size for p in directory.glob(prefix + ".*") if "manifest" not in p.name)


def _raw_get(client: Any, bucket: str, keys: Sequence[str]) -> int:
    """Every key into memory with RAW_GETS ranged GETs of RAW_GET_BYTES in flight; returns the bytes."""
    sizes = {k: client.head_object(Bucket=bucket, Key=k)["ContentLength"] for k in keys}
    ranges = [
        (k, at, min(RAW_GET_BYTES, size - at)) for k, size in sizes.items() for at in range(0, size, RAW_GET_BYTES)
    ]

    def get(key: str, at: int, n: int) -> int:
        return len(client.get_object(Bucket=bucket, Key=key, Range=f"bytes={at}-{at + n - 1}")["Body"].read())

    with concurrent.futures.ThreadPoolExecutor(RAW_GETS) as pool:
        return sum(pool.map(lambda r: get(*r), ranges))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import tensorflow as tf
    from tf_agents.replay_buffers import tf_uniform_replay_buffer
    from tf_agents.utils import common

    from bench import agents
    from bench.checkpointer import CASES
    from bench.config import Size
    from checkpointd_client import RemoteCheckpointer, checkpoint_restore
    from checkpointd_client.connection import ConnectionOptions
    from checkpointd_client.session import DaemonSession
    from tests.integration.daemon import start_daemon

    case = CASES[args.case]
    work = args.workdir / f"resume-{case.name}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    size = Size(case.name, case.hidden)
    progress(f"building a DQN agent of {size.params:,} parameters and a {case.buffer_bytes >> 20} MiB buffer")
    agent = agents.build_agent(size)
    agents.Trainer(agent)  # one train step: Adam's slots exist and hold values
    step = agent.train_step_counter
    spec = agent.collect_data_spec
    item = sum(s.dtype.size * int(np.prod(s.shape)) for s in tf.nest.flatten(spec)) + 8
    buffer = tf_uniform_replay_buffer.TFUniformReplayBuffer(spec, batch_size=1, max_length=case.buffer_bytes // item)
    # As the tutorial checkpoints them: the policy too, so an evaluation job can take it alone.
    objects = {"agent": agent, "policy": agent.policy, "replay_buffer": buffer, "train_step": step}
    children = {*objects, "save_counter"}
    checkpoint = tf.train.Checkpoint(**objects)
    policy_checkpoint = tf.train.Checkpoint(policy=agent.policy)

    local_dir = work / "inprocess"
    local = common.Checkpointer(str(local_dir), max_to_keep=1, **objects)
    local.save(step)
    prefix = tf.train.latest_checkpoint(str(local_dir))
    state_bytes = _files_bytes(local_dir, Path(prefix).name)
    alone_prefix = policy_checkpoint.write(str(work / "policy-alone" / "ckpt"))
    policy_bytes = _files_bytes(work / "policy-alone", "ckpt")
    result: dict[str, Any] = {
        "case": {"name": case.name, "params": size.params, "state_bytes": state_bytes, "policy_bytes": policy_bytes}
    }
    progress(f"state {state_bytes / 1e6:.0f} MB, policy {policy_bytes / 1e6:.1f} MB; in-process restore (warm)")
    checkpoint.restore(prefix).assert_consumed()  # warms the page cache and TF's restore path
    result["inprocess"] = _best(args.reps, lambda: checkpoint.restore(prefix))
    result["inprocess_policy"] = _best(args.reps, lambda: policy_checkpoint.restore(prefix))

    daemon = start_daemon(work / "daemon-root", work / "daemon-work")
    try:
        with RemoteCheckpointer("train", daemon.address, run="bench", timeout=TIMEOUT, **objects) as remote:
            remote.save(step, blocking=True).result()
        with RemoteCheckpointer("alone", daemon.address, run="alone", timeout=TIMEOUT, policy=agent.policy) as alone:
            alone.save(step, blocking=True).result()
        export_dir = f"train/ckpt-{int(step.numpy())}"
        session = DaemonSession(
            daemon.address, "bench", ConnectionOptions(timeout=TIMEOUT), owner="bench", upload_threads=1
        )
        alone_session = DaemonSession(
            daemon.address, "alone", ConnectionOptions(timeout=TIMEOUT), owner="bench", upload_threads=1
        )
        try:

            def restore(ckpt: Any, names: Any, in_place: bool, on: Any = session, where: str = export_dir) -> int:
                restored = checkpoint_restore.restore(on, ckpt, names, where, "", in_place=in_place)
                if restored.copy is not None:
                    restored.copy.close()
                return restored.received

            progress("same host: in place")
            restore(checkpoint, children, True)
            result["same_host"] = _best(args.reps, lambda: restore(checkpoint, children, True))
            progress("cold page cache: in process and same host")
            daemon_dir = work / "daemon-root" / "bench" / "train"
            result.update(move.cold(args.reps, lambda: checkpoint.restore(prefix), move.bundle(local_dir, Path(prefix).name),
                                    lambda: restore(checkpoint, children, True), move.bundle(daemon_dir, Path(export_dir).name)))  # fmt: skip
            progress("over gRPC: fetched into memory")
            result["grpc_received_bytes"] = restore(checkpoint, children, False)
            result["grpc"] = _best(args.reps, lambda: restore(checkpoint, children, False))
            progress("partial: the policy out of the training checkpoint, and the policy alone")
            result["partial_received_bytes"] = restore(policy_checkpoint, {"policy", "save_counter"}, False)
            result["partial"] = _best(args.reps, lambda: restore(policy_checkpoint, {"policy", "save_counter"}, False))
            alone_dir = f"alone/ckpt-{int(step.numpy())}"
            result["alone_received_bytes"] = restore(
                policy_checkpoint, {"policy", "save_counter"}, False, alone_session, alone_dir
            )
            result["policy_alone"] = _best(
                args.reps,
                lambda: restore(policy_checkpoint, {"policy", "save_counter"}, False, alone_session, alone_dir),
            )
        finally:
            session.shutdown()
            alone_session.shutdown()
    finally:
        result["daemon_exit_code"] = daemon.terminate()
    del alone_prefix

    if args.s3:
        result["s3"] = _s3(args, work, objects, children, step, progress)
    if args.s3 and args.move:
        result["move"] = move.whole_move(work, objects, step, progress)
    result["targets"] = targets(result)
    shutil.rmtree(work, ignore_errors=True)
    return result


def _s3(args: argparse.Namespace, work: Path, objects: dict[str, Any], children: set[str], step: Any, say: Any) -> Any:
    import tensorflow as tf

    from checkpointd.storage.s3_client import make_client
    from checkpointd_client import RemoteCheckpointer, checkpoint_restore
    from checkpointd_client.connection import ConnectionOptions
    from checkpointd_client.session import DaemonSession
    from tests.integration.daemon import start_daemon

    rgw_dir = work / "rgw"
    say("S3: starting radosgw (scripts/rgw.sh)")
    proc = subprocess.run([str(RGW_SCRIPT), "start", str(rgw_dir)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return {"skipped": f"radosgw did not start (exit {proc.returncode})"}
    try:
        env = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
        endpoint, bucket = env["CHECKPOINTD_TEST_S3_ENDPOINT"], env["CHECKPOINTD_TEST_S3_BUCKET"]
        aws = {k: v for k, v in env.items() if k.startswith("AWS_")}
        os.environ.update(aws)
        prefix = f"resume-{secrets.token_hex(4)}"
        url = f"s3://{bucket}/{prefix}"

        def daemon(n: int) -> Any:
            return start_daemon(
                url, work / f"s3-daemon{n}", "--work-dir", str(work / f"s3-state{n}"),
                "--s3-endpoint-url", endpoint, "--s3-region", REGION, env=aws,
            )  # type: ignore[arg-type]  # fmt: skip

        first = daemon(0)
        try:
            with RemoteCheckpointer("train", first.address, run="bench", timeout=TIMEOUT, **objects) as remote:
                remote.save(step, blocking=True).result()
        finally:
            first.terminate()
        export_dir = f"train/ckpt-{int(step.numpy())}"
        client = make_client(endpoint, REGION)
        keys = [f"{prefix}/bench/{export_dir}.index", f"{prefix}/bench/{export_dir}.data-00000-of-00001"]
        out: dict[str, Any] = {}
        say("S3: raw parallel ranged GETs of the same objects")
        out["raw_bytes"] = _raw_get(client, bucket, keys)
        out["raw_get"] = _best(args.reps, lambda: _raw_get(client, bucket, keys))
        fresh = daemon(1)  # never saw the run
        try:
            session = DaemonSession(
                fresh.address, "bench", ConnectionOptions(timeout=TIMEOUT), owner="bench", upload_threads=1
            )
            checkpoint = tf.train.Checkpoint(**objects)

            def restore() -> None:
                restored = checkpoint_restore.restore(session, checkpoint, children, export_dir, "")
                if restored.copy is not None:
                    restored.copy.close()

            say("S3: restore through the fresh daemon")
            out["fresh_daemon"] = _best(args.reps, restore)
            session.shutdown()
        finally:
            fresh.terminate()
        return out
    finally:
        subprocess.run([str(RGW_SCRIPT), "stop", str(rgw_dir)], timeout=120, check=False)
        shutil.rmtree(rgw_dir, ignore_errors=True)


def _median(r: dict[str, Any], *path: str) -> float | None:
    node: Any = r
    for p in path:
        if not isinstance(node, dict) or p not in node:
            return None
        node = node[p]
    return float(node["median"])


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, judged on this run's medians."""
    out = []

    def judge(name: str, value: float | None, limit: float, at_most: bool) -> None:
        if value is None:
            out.append({"name": name, "ok": None, "detail": "not measured"})
            return
        ok = value <= limit if at_most else value >= limit
        out.append({"name": name, "ok": ok, "value": round(value, 3), "limit": limit})

    inproc, same = _median(r, "inprocess"), _median(r, "same_host")
    judge(
        "same host <= 1.2x in-process restore", same / inproc if same and inproc else None, SAME_HOST_VS_INPROCESS, True
    )
    partial, alone = _median(r, "partial"), _median(r, "policy_alone")
    judge("partial <= 1.2x the policy alone", partial / alone if partial and alone else None, PARTIAL_VS_ALONE, True)
    raw, fresh = _median(r, "s3", "raw_get"), _median(r, "s3", "fresh_daemon")
    judge(
        "S3 through a fresh daemon >= 0.7x raw GET bandwidth",
        raw / fresh if raw and fresh else None,
        S3_VS_RAW_GET,
        False,
    )
    return out


def table(r: dict[str, Any]) -> list[str]:
    """The section's rows: seconds (median of the reps), MB/s and seconds per GB of state."""
    state = r["case"]["state_bytes"]
    rows = [
        f"resume ({r['case']['name']}: {state / 1e6:.0f} MB of state, policy {r['case']['policy_bytes'] / 1e6:.1f} MB)"
    ]

    def row(label: str, seconds: float | None, nbytes: int) -> None:
        if seconds is not None:
            rows.append(
                f"  {label:<44} {seconds:7.3f} s  {nbytes / seconds / 1e6:8.0f} MB/s  {seconds / nbytes * 1e9:6.2f} s/GB"
            )

    row("in-process restore (warm)", _median(r, "inprocess"), state)
    row("same host, in place", _median(r, "same_host"), state)
    row("over gRPC, into memory", _median(r, "grpc"), state)
    row("S3, raw parallel ranged GET", _median(r, "s3", "raw_get"), state)
    row("S3, through a fresh daemon", _median(r, "s3", "fresh_daemon"), state)
    policy = r["case"]["policy_bytes"]
    row("in-process restore, policy only", _median(r, "inprocess_policy"), policy)
    row("partial: the policy from the training ckpt", _median(r, "partial"), policy)
    row("the policy alone (its own checkpoint)", _median(r, "policy_alone"), policy)
    if "partial_received_bytes" in r:
        rows.append(f"  partial received {r['partial_received_bytes'] / 1e6:.1f} MB of {state / 1e6:.0f} MB")
    move.rows(r, row, rows.append)
    for t in r.get("targets", []):
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["ok"]]
        rows.append(f"  target {t['name']}: {verdict} ({t.get('value', '-')} vs {t.get('limit', '-')})")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.resume", description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=("small", "medium", "large"), default="medium")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-s3", dest="s3", action="store_false", help="skip the S3 rows (no radosgw)")
    p.add_argument("--no-move", dest="move", action="store_false", help="skip the whole move (an S3 row)")
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    result = run(args)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(table(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
