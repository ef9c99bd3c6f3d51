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
- from S3: a fresh daemon on a radosgw bucket that never saw the run, on
  the trainer's host (the trainer moved there): it lands parallel ranged
  GETs in files on its tmpfs for the trainer to take; beside it the same
  daemon's byte stream over gRPC (a trainer on another host) and a raw
  boto3 parallel ranged GET of the same objects into memory, the anchor,
  one rep of each in turn;
- partial: `tf.train.Checkpoint(policy=agent.policy)` from the training
  checkpoint (the buffer stays behind), against the same policy restored
  from a checkpoint holding the policy alone;
- bench/move.py's rows: in process and same host again with a cold page
  cache, and (with S3, unless --no-move) the whole move of a trainer to
  another node, the lease wait shown apart.

Targets (the issue's, one run): same host <= 1.2x in process; over gRPC >=
0.6x min(gRPC loopback, disk read) bandwidth, both measured in the run
(bench.limits' loopback; a sequential read of the committed files); from S3
>= 0.7x the raw GET's bandwidth; partial <= 1.2x the policy alone; memory
during one restore over gRPC and from S3 (bench.restore_memory: peak RSS
over what each process held just before, tmpfs apart): the daemon and the
trainer each <= 0.25x the payload.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import move, rgw

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parents[1]
REGION = "us-east-1"
TIMEOUT = 900.0
RAW_GET_BYTES = 16 << 20
RAW_GETS = 8
READ_BLOCK = 8 << 20
MEMORY_VS_PAYLOAD = 0.25  # peak RSS over what the process held before, per byte of state restored
GRPC_VS_LIMIT = 0.6  # over gRPC: state bytes / restore time, against min(gRPC loopback, disk read)
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


def _interleaved(reps: int, fns: dict[str, Callable[[], Any]]) -> dict[str, dict[str, Any]]:
    """Each fn timed `reps` times, one rep of each in turn, so the machine's load moves them alike."""
    from bench.stats import summarize

    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - started)
    return {name: summarize(values) for name, values in samples.items()}


def _files_bytes(directory: Path, prefix: str) -> int:
    return sum(p.stat().st_size for p in directory.glob(prefix + ".*") if "manifest" not in p.name)


def _disk_read(paths: Sequence[Path]) -> int:
    """Every file read once, sequentially in 8 MiB blocks into one buffer (page cache as it is); returns the bytes."""
    block = bytearray(READ_BLOCK)
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while n := os.readv(fd, [block]):
                total += n
        finally:
            os.close(fd)
    return total


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

    from bench import agents, limits, restore_memory
    from bench.checkpointer import CASES
    from bench.config import Size
    from checkpointd_client import RemoteCheckpointer
    from checkpointd_client.restore import checkpoints as checkpoint_restore
    from checkpointd_client.transport.connection import ConnectionOptions
    from checkpointd_client.transport.session import DaemonSession
    from tests.integration.support.daemon import start_daemon

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
            progress("over gRPC: fetched into memory; the machine's gRPC loopback and disk read")
            result["grpc_received_bytes"] = restore(checkpoint, children, False)
            result["grpc"] = _best(args.reps, lambda: restore(checkpoint, children, False))
            result["memory_grpc"] = restore_memory.measure(
                daemon.proc.pid, lambda: restore(checkpoint, children, False)
            )
            committed = sorted((work / "daemon-root" / "bench" / "train").glob(f"ckpt-{int(step.numpy())}.*"))
            committed = [p for p in committed if "manifest" not in p.name]
            result["limits"] = {
                "grpc_loopback": limits.grpc_loopback(work / "grpc-loopback", state_bytes, args.reps),
                "disk_read": {
                    "bytes": _disk_read(committed),
                    "seconds": _best(args.reps, lambda: _disk_read(committed)),
                },
            }
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

    from bench import restore_memory
    from checkpointd.storage.s3 import make_client
    from checkpointd_client import RemoteCheckpointer
    from checkpointd_client.restore import checkpoints as checkpoint_restore
    from checkpointd_client.transport.connection import ConnectionOptions
    from checkpointd_client.transport.session import DaemonSession
    from tests.integration.support.daemon import start_daemon

    rgw_dir = work / "rgw"
    say("S3: starting radosgw (scripts/rgw.sh)")
    try:
        server = rgw.start(rgw_dir)
    except rgw.Unavailable as e:
        return {"skipped": rgw.unavailable(e, work / "rgw-start.log")}
    try:
        endpoint, bucket, aws = server.endpoint, server.bucket, server.daemon_env()
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
        out["raw_bytes"] = _raw_get(client, bucket, keys)
        fresh = daemon(1)  # never saw the run
        try:
            session = DaemonSession(
                fresh.address, "bench", ConnectionOptions(timeout=TIMEOUT), owner="bench", upload_threads=1
            )
            checkpoint = tf.train.Checkpoint(**objects)

            def restore(same_host: bool) -> None:
                restored = checkpoint_restore.restore(session, checkpoint, children, export_dir, "", in_place=same_host)
                if restored.copy is not None:
                    restored.copy.close()

            # The trainer moved to the fresh daemon's node: the daemon stages the GETs on
            # that host. A trainer on another host gets the bytes over gRPC instead.
            say("S3: raw parallel ranged GETs; the fresh daemon staging on its host; its byte stream (interleaved)")
            out.update(
                _interleaved(
                    args.reps,
                    {
                        "raw_get": lambda: _raw_get(client, bucket, keys),
                        "fresh_daemon": lambda: restore(True),
                        "fresh_daemon_stream": lambda: restore(False),
                    },
                )
            )
            out["memory_staged"] = restore_memory.measure(fresh.proc.pid, lambda: restore(True))
            out["memory_stream"] = restore_memory.measure(fresh.proc.pid, lambda: restore(False))
            session.shutdown()
        finally:
            fresh.terminate()
        return out
    finally:
        server.stop()


def _median(r: dict[str, Any], *path: str) -> float | None:
    node: Any = r
    for p in path:
        if not isinstance(node, dict) or p not in node:
            return None
        node = node[p]
    return float(node["median"])


def _rate(r: dict[str, Any], nbytes: int, *path: str) -> float | None:
    seconds = _median(r, *path)
    return nbytes / seconds if seconds and nbytes else None


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
    grpc_rate = _rate(r, r["case"]["state_bytes"], "grpc") if "case" in r else None
    loopback = _median(r, "limits", "grpc_loopback", "bytes_per_second")
    disk = _rate(r, r.get("limits", {}).get("disk_read", {}).get("bytes", 0), "limits", "disk_read", "seconds")
    judge(
        "over gRPC >= 0.6x min(gRPC loopback, disk read) bandwidth",
        grpc_rate / min(loopback, disk) if grpc_rate and loopback and disk else None,
        GRPC_VS_LIMIT,
        False,
    )
    payload = r.get("case", {}).get("state_bytes", 0)
    for name, memory in (
        ("over gRPC", r.get("memory_grpc")),
        ("from S3, staged", r.get("s3", {}).get("memory_staged")),
        ("from S3, over gRPC", r.get("s3", {}).get("memory_stream")),
    ):
        for side in ("daemon", "trainer"):
            over = memory[f"{side}_over_bytes"] / payload if memory and payload else None
            judge(f"memory {name}: the {side} <= its own before + 0.25x payload", over, MEMORY_VS_PAYLOAD, True)
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
    row("S3, through a fresh daemon (same host, staged)", _median(r, "s3", "fresh_daemon"), state)
    row("S3, through a fresh daemon (bytes over gRPC)", _median(r, "s3", "fresh_daemon_stream"), state)
    lim = r.get("limits", {})
    if "grpc_loopback" in lim:
        row("gRPC loopback (1 MiB messages, bare server)", float(lim["grpc_loopback"]["seconds"]["median"]),
            int(lim["grpc_loopback"]["bytes"]))  # fmt: skip
    if "disk_read" in lim:
        row("disk read of the committed files", _median(r, "limits", "disk_read", "seconds"), lim["disk_read"]["bytes"])
    for label, memory in (
        ("over gRPC", r.get("memory_grpc")),
        ("S3 staged", r.get("s3", {}).get("memory_staged")),
        ("S3 over gRPC", r.get("s3", {}).get("memory_stream")),
    ):
        if memory:
            rows.append(
                f"  memory {label:<13} daemon +{memory['daemon_over_bytes'] / 1e6:5.0f} MB over "
                f"{memory['daemon_before_bytes'] / 1e6:.0f}, trainer +{memory['trainer_over_bytes'] / 1e6:5.0f} MB "
                f"over {memory['trainer_before_bytes'] / 1e6:.0f}, tmpfs +{memory['tmpfs_over_bytes'] / 1e6:.0f} MB"
            )
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
