"""Incremental training checkpoints over gRPC: what travels, and call -> durable, next to the same save in full.

`python -m bench.incremental --workdir DIR --out FILE [--large] [--reps N]`
builds, in a process of its own, the DQN agent of section 7 (Adam's slots
trained) with a TFUniformReplayBuffer of 200 MiB (--large: 1 GiB, the
1.23 GB state), starts its own `checkpointd serve`, and two
RemoteCheckpointers over gRPC (shared memory off: a trainer on another
host), one incremental (the default) and one with `incremental=False`. Per
repetition, 1 % of the buffer's rows are written as a trainer writes them
(`add_batch`, one item at a time at the buffer's write cursor, in a
tf.function) and the agent trained one step; then both save the same
state, in alternating order:

- bytes sent (SaveResult.bytes_received), against the changed bytes rounded
  up to whole 1 MiB chunks plus the agent's bytes;
- the trainer's stall (save()'s return) and call -> durable (ticket.result());
- the full-change case: every row rewritten and the agent trained, the
  incremental save against the one with incremental off. A trainer
  rewrites every row by adding `max_length` items (minutes here); the
  bench clears the buffer (its cursor back to the start, which the
  client sees, as it would see the cursor move by `max_length`) and then
  rewrites the rows in place, which is seconds.

Each incremental save's path, as the daemon chose it (SaveResult.incremental_path:
copy, clone, server_copy, receive), is counted per row; `--incremental-path
auto|copy|receive` is passed to the daemons (auto: the daemon's default, measure
and choose), and `--root DIR` puts the local daemon's root there (e.g. on a
file system that shares extents) instead of under --workdir.

With `--s3` (a radosgw of its own, as section 8 starts it), or `--s3-endpoint URL
--s3-bucket B` (credentials: the AWS_* environment), the 1 % reps run again on a daemon committing to `s3://B/<prefix>`: bytes
uploaded per save (checkpointd_store_uploaded_bytes_total, read around each
save; unchanged ranges are copied in the bucket with UploadPartCopy) and
call -> committed, incremental against the same save in full.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SAVE_TIMEOUT = 900.0
CHANGED_SHARE = 0.01
CHUNK = 1 << 20
_START = time.monotonic()


def progress(message: str) -> None:
    print(f"[{time.monotonic() - _START:6.1f}s] incremental: {message}", flush=True)


def _touched_chunks(start: int, n: int, rows: int, row_bytes: int) -> int:
    """Whole chunks of a [rows, ...] tensor that rows [start, start + n) modulo `rows` touch."""
    spans = [(start, min(start + n, rows))]
    if start + n > rows:
        spans.append((0, start + n - rows))
    return sum((b * row_bytes - 1) // CHUNK - (a * row_bytes) // CHUNK + 1 for a, b in spans if b > a)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tensorflow as tf
    from tf_agents.replay_buffers import tf_uniform_replay_buffer

    from bench import agents
    from bench.checkpointer import CASES
    from bench.config import Size
    from bench.stats import summarize
    from checkpointd_client import RemoteCheckpointer
    from checkpointd_client import tf_checkpoint as client_training
    from tests.integration.support.daemon import start_daemon

    case = CASES["large" if args.large else "medium"]
    work = args.workdir / "incremental"
    work.mkdir(parents=True, exist_ok=True)
    # --small-agent: the reporter's shape, a few MB of agent beside the buffer (the 394 MB DQN state).
    size = Size(f"{case.name}, small agent" if args.small_agent else case.name,
                CASES["small"].hidden if args.small_agent else case.hidden)  # fmt: skip
    progress(f"building a DQN agent of {size.params:,} parameters and a {case.buffer_bytes >> 20} MiB replay buffer")
    agent = agents.build_agent(size)
    trainer = agents.Trainer(agent)
    step = agent.train_step_counter
    spec = agent.collect_data_spec
    item = sum(s.dtype.size * int(s.shape.num_elements()) for s in tf.nest.flatten(spec)) + 8
    rows = case.buffer_bytes // item
    buffer = tf_uniform_replay_buffer.TFUniformReplayBuffer(spec, batch_size=1, max_length=rows)
    columns = [v for v in buffer.variables() if v.shape.rank and int(v.shape[0]) == rows]
    objects = {"agent": agent, "replay_buffer": buffer, "train_step": step}
    described = client_training.describe(tf.train.Checkpoint(**objects))
    state_bytes = described.nbytes
    buffer_bytes = sum(t.nbytes for t in described.tensors if t.checkpoint_key.startswith("replay_buffer/"))
    changed_rows = max(1, int(rows * CHANGED_SHARE))

    item_zeros = tf.nest.map_structure(lambda s: tf.zeros([1, *s.shape], s.dtype), spec)

    @tf.function
    def add_rows(n: Any, value: Any) -> None:
        for _ in tf.range(n):
            buffer.add_batch(tf.nest.map_structure(lambda t: t + tf.cast(value, t.dtype), item_zeros))

    def rewrite(n: int) -> int:
        """Adds `n` items as a trainer does; the first row they went to."""
        start = (int(buffer._last_id.numpy()) + 1) % rows  # noqa: SLF001 - the buffer's write cursor
        add_rows(tf.constant(n), tf.constant(start % 97 + 1))
        return start

    def rewrite_all() -> None:
        buffer.clear()  # see the module doc: the client copies the buffer whole after a clear
        for v in columns:
            v.assign(v + tf.ones_like(v))

    def chunks_bound(start: int, n: int) -> int:
        return sum(
            _touched_chunks(start, n, rows, v.dtype.size * int(v.shape[1:].num_elements() or 1)) * CHUNK
            for v in columns
        )

    result: dict[str, Any] = {
        "case": {"name": size.name, "params": size.params, "buffer_rows": rows, "state_bytes": state_bytes,
                 "buffer_bytes": buffer_bytes, "agent_bytes": state_bytes - buffer_bytes,
                 "changed_rows": changed_rows},
    }  # fmt: skip
    if args.s3_endpoint:
        result["s3"] = _s3_reps(args, work, objects, rewrite, trainer, step, rows, changed_rows, chunks_bound, columns)
    root = args.root / f"bench-incremental-{os.getpid()}" if args.root else work / "daemon-root"
    daemon = start_daemon(root, work / "daemon-work", "--incremental-path", args.incremental_path)
    try:
        common = {"max_to_keep": 2, "timeout": SAVE_TIMEOUT, "shared_memory": False}
        incr = RemoteCheckpointer("incr", daemon.address, run="incr", **common, **objects)
        full = RemoteCheckpointer("full", daemon.address, run="full", incremental=False, **common, **objects)
        try:

            def save(ckpt: Any) -> dict[str, float]:
                started = time.perf_counter()
                ticket = ckpt.save(step)
                stall = time.perf_counter() - started
                r = ticket.result(SAVE_TIMEOUT)
                return {"stall": stall, "durable": time.perf_counter() - started,
                        "received": r.bytes_received, "copied": r.bytes_copied, "path": r.incremental_path}  # fmt: skip

            progress("first saves (the incremental run's base)")
            save(incr), save(full)
            rows_out: list[dict[str, Any]] = []
            for rep in range(args.reps):
                start = rewrite(changed_rows)
                trainer.step()
                bound = chunks_bound(start, changed_rows)
                pair = (
                    (("incremental", incr), ("full", full)) if rep % 2 == 0 else (("full", full), ("incremental", incr))
                )
                row = {name: save(ckpt) for name, ckpt in pair}
                row["changed_chunk_bytes"] = bound
                rows_out.append(row)
                progress(
                    f"rep {rep}: incremental sent {row['incremental']['received'] / 1e6:.1f} MB in "
                    f"{row['incremental']['durable']:.2f} s; full {row['full']['received'] / 1e6:.1f} MB in "
                    f"{row['full']['durable']:.2f} s ({row['incremental']['path']})"
                )
            result["one_percent"] = {
                "reps": rows_out,
                "changed_chunk_bytes": summarize(r["changed_chunk_bytes"] for r in rows_out),
                "incremental_paths": _paths(r["incremental"] for r in rows_out),
                "durable_ratio": summarize(r["incremental"]["durable"] / r["full"]["durable"] for r in rows_out),
                **{
                    f"{name}_{what}": summarize(r[name][what] for r in rows_out)
                    for name in ("incremental", "full")
                    for what in ("stall", "durable", "received", "copied")
                },
            }
            progress("every byte changed: incremental vs incremental off")
            changes = []
            for rep in range(args.reps):
                rewrite_all()
                trainer.step()
                pair = (("incremental", incr), ("full", full)) if rep % 2 else (("full", full), ("incremental", incr))
                changes.append({name: save(ckpt) for name, ckpt in pair})
            result["full_change"] = {
                "incremental_paths": _paths(r["incremental"] for r in changes),
                **{
                    f"{name}_{what}": summarize(r[name][what] for r in changes)
                    for name in ("incremental", "full")
                    for what in ("stall", "durable", "received")
                },
            }
        finally:
            incr.close(SAVE_TIMEOUT)
            full.close(SAVE_TIMEOUT)
    finally:
        result["daemon_exit_code"] = daemon.terminate()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    progress("done")
    return result


def _s3_reps(
    args: argparse.Namespace, work: Path, objects: dict[str, Any], rewrite: Any, trainer: Any, step: Any,
    rows: int, changed_rows: int, chunks_bound: Any, columns: list[Any],
) -> dict[str, Any]:  # fmt: skip
    """The 1 % reps on a daemon committing to S3: bytes uploaded and call -> committed, incremental vs full."""
    import secrets

    from bench.stats import summarize
    from checkpointd_client import RemoteCheckpointer
    from tests.integration.support.daemon import start_daemon
    from tests.integration.support.scrape import Metrics

    url = f"s3://{args.s3_bucket}/bench-incremental-{secrets.token_hex(4)}"
    daemon = start_daemon(
        url, work / "s3-daemon", "--work-dir", str(work / "s3-state"),  # type: ignore[arg-type]
        "--s3-endpoint-url", args.s3_endpoint, "--s3-region", "us-east-1",
        "--incremental-path", args.incremental_path,
    )  # fmt: skip

    def uploaded() -> float:  # a scrape of its own each time
        return float(Metrics(daemon.metrics_url)("checkpointd_store_uploaded_bytes_total", kind="training_checkpoint"))

    out: list[dict[str, Any]] = []
    try:
        common = {"max_to_keep": 2, "timeout": SAVE_TIMEOUT, "shared_memory": False}
        incr = RemoteCheckpointer("incr", daemon.address, run="s3incr", **common, **objects)
        full = RemoteCheckpointer("full", daemon.address, run="s3full", incremental=False, **common, **objects)
        try:

            def save(ckpt: Any) -> dict[str, float]:
                before = uploaded()
                started = time.perf_counter()
                r = ckpt.save(step).result(SAVE_TIMEOUT)
                return {"committed": time.perf_counter() - started, "uploaded": uploaded() - before,
                        "received": r.bytes_received, "copied": r.bytes_copied, "path": r.incremental_path}  # fmt: skip

            progress("S3: first saves (the incremental run's base)")
            save(incr), save(full)
            for rep in range(args.reps):
                start = rewrite(changed_rows)
                trainer.step()
                pair = (
                    (("incremental", incr), ("full", full)) if rep % 2 == 0 else (("full", full), ("incremental", incr))
                )
                row: dict[str, Any] = {name: save(ckpt) for name, ckpt in pair}
                row["changed_chunk_bytes"] = chunks_bound(start, changed_rows)
                row["changed_regions"] = (2 if start + changed_rows > rows else 1) * len(columns)
                out.append(row)
                progress(
                    f"S3 rep {rep}: incremental uploaded {row['incremental']['uploaded'] / 1e6:.1f} MB, committed in "
                    f"{row['incremental']['committed']:.2f} s; full {row['full']['uploaded'] / 1e6:.1f} MB in "
                    f"{row['full']['committed']:.2f} s ({row['incremental']['path']})"
                )
        finally:
            incr.close(SAVE_TIMEOUT)
            full.close(SAVE_TIMEOUT)
    finally:
        daemon.terminate()
        from bench.s3 import delete_prefix
        from checkpointd.storage.s3 import make_client

        # radosgw's memstore holds every stored byte in RAM: the run's objects go.
        delete_prefix(make_client(args.s3_endpoint, "us-east-1"), args.s3_bucket, url.split("/", 3)[3] + "/")
    return {
        "reps": out,
        "changed_chunk_bytes": summarize(r["changed_chunk_bytes"] for r in out),
        "changed_regions": summarize(r["changed_regions"] for r in out),
        "incremental_paths": _paths(r["incremental"] for r in out),
        "committed_ratio": summarize(r["incremental"]["committed"] / r["full"]["committed"] for r in out),
        **{
            f"{name}_{what}": summarize(r[name][what] for r in out)
            for name in ("incremental", "full")
            for what in ("committed", "uploaded", "received", "copied")
        },
    }


def _paths(saves: Any) -> dict[str, int]:
    """How many of `saves` took each path (SaveResult.incremental_path)."""
    counts: dict[str, int] = {}
    for save in saves:
        counts[save["path"]] = counts.get(save["path"], 0) + 1
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.incremental", description=__doc__.split("\n\n")[0])
    parser.add_argument("--large", action="store_true", help="the 1 GiB buffer (1.23 GB state), not 200 MiB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--s3-endpoint", help="also on S3 at this endpoint (AWS_* credentials from the environment)")
    parser.add_argument("--s3-bucket", help="the bucket for --s3-endpoint")
    parser.add_argument("--s3", action="store_true", help="also on S3: a radosgw of its own (scripts/rgw.sh)")
    parser.add_argument(
        "--incremental-path", choices=("auto", "copy", "receive"), default="auto", help="the daemons' (serve's flag)"
    )
    parser.add_argument(
        "--small-agent", action="store_true", help="the small case's agent (a few MB) beside the buffer"
    )
    parser.add_argument("--root", type=Path, help="a dir to hold the local daemon's root (default: under --workdir)")
    args = parser.parse_args(argv)
    if args.s3 and args.s3_endpoint:
        parser.error("--s3 starts a radosgw of its own; give it or --s3-endpoint, not both")
    if not args.s3:
        args.out.write_text(json.dumps(run(args), indent=1))
        return 0
    from bench import rgw

    progress("S3: starting radosgw (scripts/rgw.sh)")
    with rgw.radosgw(args.workdir / "incremental-rgw") as (server, why):
        if server is None:
            result = {**run(args), "s3": {"skipped": why}}
        else:
            os.environ.update(server.daemon_env())
            args.s3_endpoint, args.s3_bucket = server.endpoint, server.bucket
            result = run(args)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())


# The report: rows and targets, from the results alone (no TensorFlow).

SENT_FACTOR = 1.1
# Incremental call -> durable against the same save in full, by the path the daemon took: never
# slower where the unchanged bytes are copied or received; a quarter where the file system shares extents
# (clone); half where the object store copies them itself (server_copy).
LATENCY_SHARE = {"clone": 0.25, "server_copy": 0.5}
LATENCY_SHARE_ELSE = 1.0
FULL_CHANGE_FACTOR = 1.05


def latency_share(paths: dict[str, int]) -> tuple[float, str]:
    """The share an incremental save's call -> durable may take of a full one's, and the path it is for (the
    path most of the measured saves took)."""
    path = max(paths, key=lambda p: paths[p]) if paths else "none"
    return LATENCY_SHARE.get(path, LATENCY_SHARE_ELSE), path


def table(r: dict[str, Any]) -> list[str]:
    """The incremental case's lines."""
    from bench.fmt import fmt_bytes, fmt_time

    c = r.get("incremental")
    if not c:
        return []
    one, every = c["one_percent"], c["full_change"]
    med = lambda d, k: d[k]["median"]  # noqa: E731
    lines = [
        "",
        f"incremental training checkpoints over gRPC ({c['case']['name']}: {fmt_bytes(c['case']['state_bytes'])}, "
        f"1 % of {c['case']['buffer_rows']:,} buffer rows rewritten + one train step between saves)",
    ]
    for label, key in (("bytes sent", "received"), ("trainer stall", "stall"), ("call -> durable", "durable")):
        fmt = fmt_bytes if key == "received" else fmt_time
        lines.append(
            f"{label:<46}incremental {fmt(med(one, f'incremental_{key}'))}   full {fmt(med(one, f'full_{key}'))}"
            + (_ratio_and_paths(one, "durable_ratio") if key == "durable" else "")
        )
    lines.append(
        f"{'every byte changed: call -> durable':<46}incremental {fmt_time(med(every, 'incremental_durable'))}   "
        f"incremental off {fmt_time(med(every, 'full_durable'))}"
    )
    s3 = c.get("s3")
    if s3 and "skipped" in s3:
        lines.append(f"{'S3':<46}not measured: {s3['skipped']}")
    elif s3:
        for label, key, fmt in (
            ("S3: bytes uploaded", "uploaded", fmt_bytes),
            ("S3: call -> committed", "committed", fmt_time),
        ):
            lines.append(
                f"{label:<46}incremental {fmt(med(s3, f'incremental_{key}'))}   full {fmt(med(s3, f'full_{key}'))}"
                + (_ratio_and_paths(s3, "committed_ratio") if key == "committed" else "")
            )
    return lines


def _ratio_and_paths(case: dict[str, Any], ratio: str) -> str:
    """ "   (0.62 x; copy 3, receive 1)": the median ratio incremental / full, and the paths taken (newer results)."""
    if ratio not in case:
        return ""
    paths = ", ".join(f"{p or 'none'} {n}" for p, n in sorted(case.get("incremental_paths", {}).items()))
    return f"   ({case[ratio]['median']:.2f} x; {paths})"


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The incremental case's targets over gRPC: bytes sent, call -> durable, and the full-change case."""
    from bench.fmt import fmt_bytes, fmt_time
    from bench.judge import INCREMENTAL, at_most, judge, median, not_measured

    names = (
        f"incremental: bytes sent <= {SENT_FACTOR:g} x changed bytes in whole chunks + the agent's bytes",
        "incremental: call -> durable over gRPC <= the path's share x the same save in full (clone 0.25, " "else 1)",
        f"incremental: every byte changed, call -> durable <= {FULL_CHANGE_FACTOR:g} x incremental off",
    )
    c = r.get("incremental")
    if not c:
        return [{"group": INCREMENTAL, **not_measured(n, None, "no incremental case in this run")} for n in names]
    one, every = c["one_percent"], c["full_change"]

    def sent() -> tuple[float, float, bool, str]:
        agent, chunks = float(c["case"]["agent_bytes"]), median(one, "changed_chunk_bytes")
        return at_most(median(one, "incremental_received"), SENT_FACTOR * chunks + agent, fmt_bytes,
                       f"changed chunks {fmt_bytes(chunks)}, agent {fmt_bytes(agent)}")  # fmt: skip

    def latency() -> tuple[float, float, bool, str]:
        whole = median(one, "full_durable")
        share, path = latency_share(one.get("incremental_paths") or {})
        return at_most(median(one, "incremental_durable"), share * whole, fmt_time,
                       f"full {fmt_time(whole)}; path {path}: {share:g} x")  # fmt: skip

    def full_change() -> tuple[float, float, bool, str]:
        off = median(every, "full_durable")
        return at_most(median(every, "incremental_durable"), FULL_CHANGE_FACTOR * off, fmt_time,
                       f"incremental off {fmt_time(off)}")  # fmt: skip

    measures = [sent, latency, full_change]
    s3 = c.get("s3")
    s3_names = (
        "incremental on S3: bytes uploaded <= changed bytes in whole chunks + 10 MiB per changed region "
        "+ the agent's bytes",
        f"incremental on S3: call -> committed <= {LATENCY_SHARE['server_copy']:g} x a full commit",
    )
    unmeasured: list[dict[str, Any]] = []
    if s3 and "skipped" in s3:  # radosgw did not start
        unmeasured = [{"group": INCREMENTAL, **not_measured(n, c["case"]["name"], s3["skipped"])} for n in s3_names]
    elif s3:  # measured only with --s3 or --s3-endpoint
        names += s3_names

        def uploaded() -> tuple[float, float, bool, str]:
            agent, chunks = float(c["case"]["agent_bytes"]), median(s3, "changed_chunk_bytes")
            regions = median(s3, "changed_regions")
            return at_most(median(s3, "incremental_uploaded"), chunks + regions * (10 << 20) + agent, fmt_bytes,
                           f"changed chunks {fmt_bytes(chunks)} in {regions:g} regions, agent {fmt_bytes(agent)}")  # fmt: skip

        def committed() -> tuple[float, float, bool, str]:
            whole = median(s3, "full_committed")
            return at_most(
                median(s3, "incremental_committed"), LATENCY_SHARE["server_copy"] * whole, fmt_time,
                f"full {fmt_time(whole)}",
            )  # fmt: skip

        measures += [uploaded, committed]
    return [judge(n, c["case"]["name"], fn, INCREMENTAL) for n, fn in zip(names, measures, strict=True)] + unmeasured
