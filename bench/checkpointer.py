"""Section 7: the whole training state: Checkpointer.save, TF's async checkpoint, RemoteCheckpointer.

`python -m bench.checkpointer --case medium --reps 3 --window 4 --workdir DIR --out FILE`
builds, in a process of its own, a DQN agent with Adam (slots trained) and a
TFUniformReplayBuffer sized to the case, starts its own `checkpointd serve`,
and measures side by side what `common.Checkpointer(agent=, replay_buffer=,
train_step=)` costs the trainer:

- the in-process `common.Checkpointer.save` (the stall is the whole write;
  TensorFlow does not fsync it);
- TensorFlow's asynchronous checkpoint of the same `tf.train.Checkpoint`
  (`CheckpointOptions(experimental_enable_async_checkpoint=True)`): the
  stall is `write()`'s return, durable is after `sync()`;
- checkpointd's `RemoteCheckpointer.save` (shared memory on this host): the
  stall is `save()`'s return, durable is `ticket.result()` (fsynced, state
  file written);
- the memcpy of the state's bytes on this machine, the anchor of the stall
  target;
- DQN training steps/s with no checkpoints, then with each saver requested at
  the same cadence, interleaved;
- the daemon's resident memory when idle and at its peak during a save.

Cases (bytes of the state): small, for --quick; medium, a ~10M-parameter
agent (Q-network, target network, Adam's two slots) plus a ~200 MB buffer;
large, the same agent with a ~1 GB buffer, when the machine has the memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SAVE_TIMEOUT = 900.0
MIN_CADENCE = 0.5
_START = time.monotonic()


@dataclass(frozen=True)
class Case:
    name: str
    hidden: tuple[int, ...]
    buffer_bytes: int


CASES = {
    "small": Case("small", (64, 64), 2 << 20),
    "medium": Case("medium", (3162, 3162), 200 << 20),
    "large": Case("large", (3162, 3162), 1 << 30),
}
# Free memory a case needs: its state about five times over (the agent, TF's
# copies while saving, the daemon's shared segment and write, page cache).
NEEDS = {name: 6 * (case.buffer_bytes + (200 << 20)) for name, case in CASES.items()}


def progress(case: str, message: str) -> None:
    print(f"[{time.monotonic() - _START:6.1f}s] training {case}: {message}", flush=True)


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable"):
            return int(line.split()[1]) * 1024
    return 0


class _CheckpointerDriver:
    """common.Checkpointer.save at a cadence: each request is the whole write."""

    name = "checkpointer"

    def __init__(self, checkpointer: Any, step: Any) -> None:
        self._checkpointer, self._step, self._n = checkpointer, step, 0

    def request(self, index: int) -> None:
        self._checkpointer.save(self._step)
        self._n += 1

    def finish(self) -> dict[str, int]:
        n, self._n = self._n, 0
        return {"requested": n, "written": n}


class _TfAsyncDriver:
    """tf.train.Checkpoint.write with async checkpointing at a cadence."""

    name = "tf_async_checkpoint"

    def __init__(self, checkpoint: Any, options: Any, out: Path) -> None:
        self._checkpoint, self._options, self._out, self._n = checkpoint, options, out, 0

    def request(self, index: int) -> None:
        self._checkpoint.write(str(self._out / f"w{self._n % 2}" / "ckpt"), options=self._options)
        self._n += 1

    def finish(self) -> dict[str, int]:
        self._checkpoint.sync()
        n, self._n = self._n, 0
        return {"requested": n, "written": n}


class _RemoteDriver:
    """RemoteCheckpointer.save at a cadence; outcomes from the tickets."""

    name = "checkpointd"

    def __init__(self, checkpointer: Any, step: Any) -> None:
        self._checkpointer, self._step = checkpointer, step
        self._tickets: list[Any] = []

    def request(self, index: int) -> None:
        self._tickets.append(self._checkpointer.save(self._step))

    def finish(self) -> dict[str, int]:
        self._checkpointer.flush(SAVE_TIMEOUT)
        skipped = sum(t.skipped for t in self._tickets)
        failed = sum(1 for t in self._tickets if not t.skipped and t.exception(SAVE_TIMEOUT) is not None)
        counts = {
            "requested": len(self._tickets),
            "skipped": skipped,
            "written": len(self._tickets) - skipped - failed,
            "failed": failed,
        }
        self._tickets = []
        return counts


def _fsynced(checkpointer: Any, step: Any, directory: Path) -> None:
    checkpointer.save(step)
    for path in [*directory.iterdir(), directory]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import tensorflow as tf
    from tf_agents.replay_buffers import tf_uniform_replay_buffer
    from tf_agents.utils import common

    from bench import agents, inprocess, limits, memory, training_speed
    from bench.config import Size
    from bench.stats import summarize, timed
    from checkpointd_client import RemoteCheckpointer
    from checkpointd_client import tf_checkpoint as client_training
    from tests.integration.support.daemon import start_daemon

    case = CASES[args.case]
    say = lambda message: progress(case.name, message)  # noqa: E731
    work = args.workdir / f"training-{case.name}"
    out = work / "inprocess"
    out.mkdir(parents=True, exist_ok=True)
    size = Size(case.name, case.hidden)
    say(f"building a DQN agent of {size.params:,} parameters and a {case.buffer_bytes >> 20} MiB replay buffer")
    agent = agents.build_agent(size)
    trainer = agents.Trainer(agent)  # one train step: Adam's slots exist and hold values
    step = agent.train_step_counter
    spec = agent.collect_data_spec
    item = sum(s.dtype.size * int(np.prod(s.shape)) for s in tf.nest.flatten(spec)) + 8  # + the id table's int64
    buffer = tf_uniform_replay_buffer.TFUniformReplayBuffer(spec, batch_size=1, max_length=case.buffer_bytes // item)
    objects = {"agent": agent, "replay_buffer": buffer, "train_step": step}
    state_bytes = client_training.describe(tf.train.Checkpoint(**objects)).nbytes  # what a save carries
    result: dict[str, Any] = {
        "case": {
            "name": case.name,
            "params": size.params,
            "hidden": list(case.hidden),
            "buffer_items": case.buffer_bytes // item,
            "state_bytes": state_bytes,
        },
        "memcpy": limits.memcpy(state_bytes, args.reps),
    }

    say("in-process common.Checkpointer.save")
    local = common.Checkpointer(str(out / "checkpointer"), max_to_keep=1, **objects)
    local.save(step)  # the first save builds TF's saver
    result["inprocess"] = {
        "save": summarize(timed(lambda: local.save(step))[0] for _ in range(args.reps)),
        # What durable costs it: the same save, then its files and dir fsynced.
        "save_fsync": summarize(
            timed(lambda: _fsynced(local, step, out / "checkpointer"))[0] for _ in range(args.reps)
        ),
    }

    say("TF async checkpoint of the same objects")
    tf_checkpoint = tf.train.Checkpoint(**objects)
    result["tf_async"] = inprocess.tf_async_checkpoint_times(tf_checkpoint, out, args.reps)

    daemon = start_daemon(work / "daemon-root", work / "daemon-work")
    try:
        say("daemon memory: idle after a tiny checkpoint")
        with RemoteCheckpointer("warmup", daemon.address, run="warmup", w=tf.Variable(1.0)) as warm:
            warm.save(0, blocking=True)
        idle = memory.status(daemon.proc.pid)["VmRSS"]

        say("RemoteCheckpointer.save: stall and call -> durable")
        remote = RemoteCheckpointer(
            "train", daemon.address, run="bench", max_to_keep=1, timeout=SAVE_TIMEOUT, **objects
        )
        try:
            started = time.perf_counter()
            remote.save(step, blocking=True)  # the first maps the shared segment
            first = time.perf_counter() - started
            stalls, durable, peaks = [], [], []
            resettable = True
            for _ in range(args.reps):
                resettable = memory.reset_peak(daemon.proc.pid) and resettable
                started = time.perf_counter()
                ticket = remote.save(step)
                stalls.append(time.perf_counter() - started)
                ticket.result(SAVE_TIMEOUT)
                durable.append(time.perf_counter() - started)
                peaks.append(memory.status(daemon.proc.pid)["VmHWM"])
            result["remote"] = {
                "first_save_seconds": first,
                "save_stall": summarize(stalls),
                "save_latency": summarize(durable),
            }
            result["memory"] = {
                "idle_rss_bytes": idle,
                "peak_rss_bytes": summarize(peaks),
                "peak_reset_per_save": resettable,
                "payload_bytes": state_bytes,
            }

            cadence = max(MIN_CADENCE, result["inprocess"]["save"]["median"])
            say(f"DQN training windows, a checkpoint requested every {cadence:.2f} s")
            drivers = [
                _CheckpointerDriver(local, step),
                _TfAsyncDriver(tf_checkpoint, inprocess.ASYNC, out / "windows"),
                _RemoteDriver(remote, step),
            ]
            windows = training_speed.interleaved_windows(
                trainer, drivers, args.reps, args.window, args.min_steps, cadence, say
            )
        finally:
            remote.close(SAVE_TIMEOUT)
        result["training"] = {
            "cadence_seconds": cadence,
            "window_seconds": args.window,
            "steps_per_second": {k: summarize(w.steps_per_second for w in ws) for k, ws in windows.items()},
            "request_share": {
                k: summarize(w.request_seconds / w.seconds for w in ws) for k, ws in windows.items() if k != "baseline"
            },
            "saves": {
                k: {c: sum(w.counts[c] for w in ws) for c in ws[0].counts}
                for k, ws in windows.items()
                if k != "baseline"
            },
        }
    finally:
        result["daemon_exit_code"] = daemon.terminate()
        shutil.rmtree(work, ignore_errors=True)
    say("done")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpointer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=list(CASES), required=True)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--window", type=float, default=4.0, help="seconds per training window")
    parser.add_argument("--min-steps", type=int, default=5)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.write_text(json.dumps(run(args), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())


# The report: rows and targets, from the results alone (no TensorFlow).

STALL_MEMCPY_FACTOR, STALL_MEMCPY_SLACK = 1.2, 0.001
# call -> durable against the disk: the state's bytes at the fsync'd bandwidth
# section 4 measured in the same run, times this, plus a fixed allowance.
# (Not against Checkpointer.save: that one is not fsynced, so the two times
# do not measure the same thing.)
LATENCY_VS_DISK, LATENCY_SLACK = 1.2, 0.050
TRAINING_SLOWDOWN = 0.10
MEMORY_FACTOR = 1.5
# The run's first checkpoint (its shared-memory segment made, mapped) against a later one's call -> durable.
FIRST_SAVE_FACTOR = 1.5


def table(r: dict[str, Any]) -> list[str]:
    """Section 7's lines: one column per case."""
    from bench.fmt import cells, columns, fmt_bytes, fmt_sps, fmt_time

    cases = r.get("training_checkpoint") or {}
    if not cases:
        return []
    names = list(cases)
    lines = ["", "7. whole training state (agent + Adam + replay buffer): common.Checkpointer vs checkpointd"]

    def row(label: str, fn: Any) -> None:
        lines.append(columns(label, cells(fn, [cases[name] for name in names])))

    row("", lambda c: c["case"]["name"])
    row("agent parameters / state bytes", lambda c: f"{c['case']['params']:,} / {fmt_bytes(c['case']['state_bytes'])}")
    row("memcpy of the state", lambda c: fmt_time(c["memcpy"]["seconds"]))
    row("Checkpointer.save (stall = write; no fsync)", lambda c: fmt_time(c["inprocess"]["save"]))
    row("Checkpointer.save, then fsync the files", lambda c: fmt_time(c["inprocess"]["save_fsync"]))
    row("TF async checkpoint: write() stall", lambda c: fmt_time(c["tf_async"]["write_blocked"]))
    row("TF async checkpoint: until sync()", lambda c: fmt_time(c["tf_async"]["write_done"]))
    row("RemoteCheckpointer.save: trainer stall", lambda c: fmt_time(c["remote"]["save_stall"]))
    row("RemoteCheckpointer.save: call -> durable", lambda c: fmt_time(c["remote"]["save_latency"]))
    row("RemoteCheckpointer 1st save", lambda c: fmt_time(c["remote"]["first_save_seconds"]))
    row("training cadence (a checkpoint every)", lambda c: f"{c['training']['cadence_seconds']:.2f} s")
    base = lambda c: c["training"]["steps_per_second"]["baseline"]["median"]  # noqa: E731
    row("train steps/s, no checkpoints", lambda c: fmt_sps(c["training"]["steps_per_second"]["baseline"]))
    for key, label in (
        ("checkpointer", "Checkpointer"),
        ("tf_async_checkpoint", "TF async"),
        ("checkpointd", "checkpointd"),
    ):
        row(f"train steps/s, {label}", lambda c, key=key: fmt_sps(c["training"]["steps_per_second"][key], base(c)))
    row("checkpointd saves written / requested", lambda c: _saves(c["training"]["saves"]["checkpointd"]))
    row(
        "daemon RSS idle / peak during a save",
        lambda c: f"{fmt_bytes(c['memory']['idle_rss_bytes'])} / {fmt_bytes(c['memory']['peak_rss_bytes']['median'])}",
    )
    row(
        "(peak - idle) / state bytes",
        lambda c: f"{(c['memory']['peak_rss_bytes']['median'] - c['memory']['idle_rss_bytes']) / c['memory']['payload_bytes']:.2f}",
    )
    return lines


def _saves(c: dict[str, int]) -> str:
    return f"{c['written']}/{c['requested']} ({c['skipped']} skipped, told)"


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The training-state targets for every measured case, and its training slowdown, each with its group.

    Not measured (one row per target) when the run has no section 7.
    """
    from bench.fmt import fmt_bytes, fmt_time
    from bench.judge import TRAINING_SPEED, TRAINING_STATE, at, at_most, judge, median, not_measured

    group = TRAINING_STATE
    stall_name = (
        f"training checkpoints: save() stall <= {STALL_MEMCPY_FACTOR:g} x memcpy of the state "
        f"+ {STALL_MEMCPY_SLACK * 1e3:g} ms"
    )
    latency_name = (
        f"training checkpoints: call -> durable <= {LATENCY_VS_DISK:g} x state bytes / fsync'd disk bandwidth "
        f"+ {LATENCY_SLACK * 1e3:g} ms"
    )
    slowed_name = (
        f"training slowed <= {100 * TRAINING_SLOWDOWN:g}%: DQN steps/s with training checkpoints " "(section 7)"
    )
    memory_name = f"training checkpoints: daemon peak <= idle + {MEMORY_FACTOR:g} x state"
    first_name = f"training checkpoints: the run's 1st save <= {FIRST_SAVE_FACTOR:g} x a later call -> durable"
    cases = r.get("training_checkpoint") or {}
    if not cases:
        return [
            {"group": g, **not_measured(name, None, "no section 7 in this run")}
            for g, name in (
                (TRAINING_SPEED, slowed_name),
                (group, stall_name),
                (group, latency_name),
                (group, memory_name),
                (group, first_name),
            )
        ]
    out = []
    for name, c in cases.items():

        def stall(c: dict[str, Any] = c) -> tuple[float, float, bool, str]:
            value, copy = median(c, "remote", "save_stall"), median(c, "memcpy", "seconds")
            limit = STALL_MEMCPY_FACTOR * copy + STALL_MEMCPY_SLACK
            return at_most(value, limit, fmt_time, f"memcpy {fmt_time(copy)}")

        def latency(c: dict[str, Any] = c) -> tuple[float, float, bool, str]:
            value, state = median(c, "remote", "save_latency"), float(at(c, "case", "state_bytes"))
            disk = median(r, "limits", "disk_fsync", "bytes_per_second")
            synced = median(c, "inprocess", "save_fsync")
            anchor = (
                f"{fmt_bytes(state)} at the disk's {disk / 1e6:,.0f} MB/s = {fmt_time(state / disk)}; "
                f"Checkpointer.save then fsync {fmt_time(synced)}"
            )
            return at_most(value, LATENCY_VS_DISK * state / disk + LATENCY_SLACK, fmt_time, anchor)

        def slowed(c: dict[str, Any] = c) -> tuple[float, float, bool, str]:
            sps = at(c, "training", "steps_per_second")
            base = median(sps, "baseline")
            slowdown = 1 - median(sps, "checkpointd") / base
            local = 1 - median(sps, "checkpointer") / base
            detail = (
                f"{100 * slowdown:.1f}% vs limit {100 * TRAINING_SLOWDOWN:g}% "
                f"(Checkpointer.save in process: {100 * local:.1f}%)"
            )
            return slowdown, TRAINING_SLOWDOWN, slowdown <= TRAINING_SLOWDOWN, detail

        def peak(c: dict[str, Any] = c) -> tuple[float, float, bool, str]:
            value = median(c, "memory", "peak_rss_bytes")
            idle, state = float(at(c, "memory", "idle_rss_bytes")), float(at(c, "memory", "payload_bytes"))
            anchor = f"idle {fmt_bytes(idle)}, state {fmt_bytes(state)}: idle + {(value - idle) / state:.2f} x"
            return at_most(value, idle + MEMORY_FACTOR * state, fmt_bytes, anchor)

        def first(c: dict[str, Any] = c) -> tuple[float, float, bool, str]:
            value, later = float(at(c, "remote", "first_save_seconds")), median(c, "remote", "save_latency")
            return at_most(value, FIRST_SAVE_FACTOR * later, fmt_time, f"a later save {fmt_time(later)}")

        out += [
            judge(slowed_name, name, slowed, TRAINING_SPEED),
            judge(stall_name, name, stall, group),
            judge(latency_name, name, latency, group),
            judge(memory_name, name, peak, group),
            judge(first_name, name, first, group),
        ]
    return out
