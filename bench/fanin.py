"""Section 5: fan-in: N trainer processes, each saving a small policy 5 times a second.

Every trainer is a real process (multiprocessing, spawn) with its own
TensorFlow, policy and RemotePolicySaver on its own run, all on one daemon.
They register first, wait at a barrier, then save on a fixed clock for the
same window. A save is counted accepted when the daemon accepted it and
written when its ticket says durable; the published directories and the
daemon's own counters are checked against both.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from bench.scrape import saves_by_outcome
from bench.stats import percentile, summarize

SAVE_TIMEOUT = 60.0
READY_TIMEOUT = 600.0  # N processes importing TensorFlow on 2 cores


def trainer(address: str, run: str, rate: float, seconds: float, barrier: Any, results: Any, log: str) -> None:
    """One fan-in trainer; puts a dict of its outcomes (or its error) on `results`.

    Its stderr (TensorFlow's and TF-Agents' start-up noise) goes to `log`.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        from bench import agents
        from bench.config import SIZES
        from checkpointd_client import RemotePolicySaver

        agent = agents.build_agent(SIZES["small"], seed=int(run.rsplit("-", 1)[1]))
        saver = RemotePolicySaver(
            agent.policy,
            address,
            run=run,
            train_step=agent.train_step_counter,
            timeout=SAVE_TIMEOUT,
        )
        saver.save("registered", blocking=True)
    except BaseException:
        results.put({"run": run, "error": traceback.format_exc()})
        barrier.abort()
        return
    try:
        barrier.wait(READY_TIMEOUT)
        results.put(_save_on_a_clock(saver, run, rate, seconds))
    except BaseException:
        results.put({"run": run, "error": traceback.format_exc()})
    finally:
        saver.close(SAVE_TIMEOUT)


def _save_on_a_clock(saver: Any, run: str, rate: float, seconds: float) -> dict[str, Any]:
    pending: queue.SimpleQueue = queue.SimpleQueue()
    latencies: list[float] = []
    failures: list[str] = []

    def collect() -> None:
        # A run has one save in flight at a time, so tickets end in call order:
        # waiting on them one by one stamps each end as it happens.
        while (item := pending.get()) is not None:
            start, ticket = item
            error = ticket.exception(SAVE_TIMEOUT)
            if error is None:
                latencies.append(time.perf_counter() - start)
            else:
                failures.append(f"{type(error).__name__}: {error}")

    collector = threading.Thread(target=collect, name=f"collect-{run}")
    collector.start()
    stalls: list[float] = []
    skipped = requested = 0
    begin = time.perf_counter()
    try:
        while (due := begin + requested / rate) < begin + seconds:
            time.sleep(max(0.0, due - time.perf_counter()))
            start = time.perf_counter()
            ticket = saver.save(f"s{requested}")
            stalls.append(time.perf_counter() - start)
            requested += 1
            if ticket.skipped:
                skipped += 1
            else:
                pending.put((start, ticket))
    finally:
        pending.put(None)
        collector.join()
    elapsed = time.perf_counter() - begin
    return {
        "run": run,
        "requested": requested,
        "accepted": requested - skipped,
        "skipped": skipped,
        "written": len(latencies),
        "failed": len(failures),
        "failures": failures[:5],
        "seconds": elapsed,
        "latencies": latencies,
        "stalls": stalls,
    }


def run_fanin(daemon: Any, procs: int, seconds: float, rate: float, progress: Any = print) -> dict[str, Any]:
    """Runs `procs` trainers against `daemon` (a tests.integration.support.daemon.Daemon).

    The daemon must be fresh: its counters then hold the fan-in's saves plus
    one registering save per trainer, which are subtracted.
    """
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(procs + 1)
    results = ctx.Queue()
    runs = [f"fanin-{i}" for i in range(procs)]
    logs = daemon.log_path.parent
    workers = [
        ctx.Process(
            target=trainer,
            args=(daemon.address, run, rate, seconds, barrier, results, str(logs / f"{run}.log")),
        )
        for run in runs
    ]
    for w in workers:
        w.start()
    outcomes: list[dict[str, Any]] = []
    try:
        try:
            barrier.wait(READY_TIMEOUT)
        except threading.BrokenBarrierError:
            pass  # a trainer failed to start: its error is on the queue
        progress(f"fan-in: {procs} trainers registered; saving for {seconds:g} s at {rate:g}/s each")
        deadline = time.monotonic() + seconds + SAVE_TIMEOUT + 60
        while len(outcomes) < procs:
            outcomes.append(results.get(timeout=max(1.0, deadline - time.monotonic())))
        for w in workers:
            w.join(SAVE_TIMEOUT)
        after = saves_by_outcome(daemon.metrics_url)
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
                w.join()
    errors = [o["error"] for o in outcomes if "error" in o]
    if errors:
        raise RuntimeError("fan-in trainers failed:\n" + "\n".join(errors))
    latencies = [x for o in outcomes for x in o["latencies"]]
    stalls = [x for o in outcomes for x in o["stalls"]]
    on_disk = sum(1 for run in runs for d in (daemon.root / run).glob("s*") if (d / "saved_model.pb").exists())
    total = {k: sum(o[k] for o in outcomes) for k in ("requested", "accepted", "skipped", "written", "failed")}
    return {
        "procs": procs,
        "rate_per_proc": rate,
        "seconds": seconds,
        **total,
        "offered_per_second": procs * rate,
        "written_per_second": total["written"] / seconds,
        "on_disk": on_disk,
        "daemon_ok": after.get("ok", 0) - procs,
        "daemon_skipped": after.get("skipped", 0),
        "daemon_failed": after.get("failed", 0),
        "latency": summarize(latencies) if latencies else None,
        "latency_p50": percentile(latencies, 50) if latencies else None,
        "latency_p99": percentile(latencies, 99) if latencies else None,
        "stall_p50": percentile(stalls, 50),
        "stall_p99": percentile(stalls, 99),
        "failures": [f for o in outcomes for f in o["failures"]][:5],
        "per_proc": [{k: v for k, v in o.items() if k not in ("latencies", "stalls")} for o in outcomes],
    }


def fanin_daemon(workdir: Path) -> Any:
    """A fresh daemon for the fan-in (its counters then belong to the fan-in alone)."""
    from tests.integration.support.daemon import start_daemon

    return start_daemon(workdir / "fanin-root", workdir / "fanin-work")
