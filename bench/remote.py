"""Section 3: checkpointd seen from the trainer: the stall of a call and the wait for durable.

The daemon is a real `checkpointd serve` subprocess on this machine; the
trainer side is `RemotePolicySaver`, exactly as a trainer would use it.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

from bench.scrape import phase_means, phase_totals, transport_totals
from bench.stats import summarize
from checkpointd_client import RemotePolicySaver


def first_save(saver: RemotePolicySaver) -> float:
    """The first save: exports and uploads the template, then saves. Seconds, call to durable."""
    start = time.perf_counter()
    ticket = saver.save("first", blocking=True)
    seconds = time.perf_counter() - start
    if ticket.skipped:
        raise RuntimeError(f"the first save of run {saver.run} was skipped: {ticket.reason}")
    return seconds


class _Registered(logging.Handler):
    """Keeps the export and register seconds of the client's "registered" log record (checkpointd_client.template)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seconds: tuple[float, float] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if str(record.msg).startswith("run %s: registered") and isinstance(args, tuple) and len(args) == 6:
            export, register = args[4], args[5]
            if isinstance(export, float | int) and isinstance(register, float | int):
                self.seconds = (float(export), float(register))


def first_save_parts(saver: RemotePolicySaver) -> dict[str, float | None]:
    """`first_save`, and its parts as the client timed them: the template's export (PolicySaver.save
    into a temp dir, binding, dropping the values) and RegisterRun; None if the client did not say."""
    logger = logging.getLogger("checkpointd_client.template")
    handler, level = _Registered(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        seconds = first_save(saver)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    export, register = handler.seconds or (None, None)
    return {"first_save_seconds": seconds, "first_save_export_seconds": export, "first_save_register_seconds": register}


def checkpointd_times(
    saver: RemotePolicySaver, run_root: Path, metrics_url: str, reps: int, timeout: float
) -> dict[str, Any]:
    """Non-blocking save()/save_checkpoint(): stall, call->durable, and the daemon's own time.

    Each call waits for the previous one to be durable, so none is skipped.
    `run_root` is `<daemon root>/<run>`; published saves are deleted there.
    The daemon's phase histograms (from `metrics_url`) split its time into
    transfer (accept to last chunk, or to the trainer's word that the
    snapshot is in shared memory) and write (files, fsync, rename).

    Raises:
        RuntimeError: if a save is skipped or fails.
    """
    result: dict[str, Any] = {}
    phases_before = phase_totals(metrics_url)
    transports_before = transport_totals(metrics_url)
    for kind in ("save", "save_checkpoint"):
        stall, latency, daemon, throughput = [], [], [], []
        for i in range(reps):
            export_dir = f"{kind}-{i}"
            start = time.perf_counter()
            ticket = getattr(saver, kind)(export_dir)
            returned = time.perf_counter()
            if ticket.skipped:
                raise RuntimeError(f"{kind} {export_dir} was skipped: {ticket.reason}")
            done = ticket.result(timeout)
            durable = time.perf_counter()
            stall.append(returned - start)
            latency.append(durable - start)
            daemon.append(done.duration_seconds)
            throughput.append(done.bytes_written / (durable - start))
            shutil.rmtree(run_root / export_dir, ignore_errors=True)
        result[f"{kind}_stall"] = summarize(stall)
        result[f"{kind}_latency"] = summarize(latency)
        result[f"{kind}_daemon"] = summarize(daemon)
        result[f"{kind}_throughput"] = summarize(throughput)
        result[f"{kind}_bytes_written"] = done.bytes_written
    result["daemon_phase_mean_seconds"] = phase_means(phases_before, phase_totals(metrics_url))
    # How the snapshots travelled: shared memory or gRPC chunks (the daemon's count).
    result["transports"] = {k: v - transports_before.get(k, 0.0) for k, v in transport_totals(metrics_url).items()}
    return result


# The small stall against TF async's: both are well under a millisecond, and the first few
# calls of either after a pause run slower (its code and data not yet in the caches), so a handful of
# reps measured minutes apart compares the two warm-ups more than the two calls. Here they alternate,
# each call's save made durable before the other's, after WARM_ROUNDS of both not counted.
PAIRED_ROUNDS = 40
WARM_ROUNDS = 5


def paired_stalls(
    saver: RemotePolicySaver, checkpoint: Any, run_root: Path, out: Path, timeout: float,
    rounds: int = PAIRED_ROUNDS,
) -> dict[str, Any]:  # fmt: skip
    """`save()`'s stall and TF async `Checkpoint.write`'s, alternating round by round.

    `checkpoint` is section 2's `tf.train.Checkpoint` of the same policy
    (`bench.inprocess.tf_checkpoint`); each write is followed by `sync()`,
    each save by its ticket's result. Published saves and TF's files are
    deleted as they come.

    Raises:
        RuntimeError: if a save is skipped or fails.
    """
    from bench import inprocess

    ours, theirs = [], []
    for i in range(WARM_ROUNDS + rounds):
        export_dir = f"paired-{i}"
        start = time.perf_counter()
        ticket = saver.save(export_dir)
        stall = time.perf_counter() - start
        if ticket.skipped:
            raise RuntimeError(f"save {export_dir} was skipped: {ticket.reason}")
        ticket.result(timeout)
        shutil.rmtree(run_root / export_dir, ignore_errors=True)
        prefix = out / f"paired-tf-{i}" / "ckpt"
        start = time.perf_counter()
        checkpoint.write(str(prefix), options=inprocess.ASYNC)
        blocked = time.perf_counter() - start
        checkpoint.sync()
        shutil.rmtree(prefix.parent, ignore_errors=True)
        if i >= WARM_ROUNDS:
            ours.append(stall)
            theirs.append(blocked)
    return {"checkpointd": summarize(ours), "tf_async": summarize(theirs), "warm_rounds": WARM_ROUNDS}


# Over gRPC against the in-process saver: checkpointd_times' reps come minutes after section
# 1's in-process saves, and its first rep has the run's first save as a base, so with the weights unchanged
# the daemon copies instead of receiving. Here every save sends the whole policy (no base: each published
# save is deleted, the first one too), alternating with PolicySaver.save + fsync round by round.
WIRE_ROUNDS = 8
WIRE_WARM_ROUNDS = 1


def paired_wire(
    saver: RemotePolicySaver, policy_saver: Any, run_root: Path, out: Path, timeout: float,
    rounds: int = WIRE_ROUNDS,
) -> dict[str, Any]:  # fmt: skip
    """call -> durable over gRPC (shared memory off) and in-process `PolicySaver.save` + fsync, alternating.

    `saver` is a RemotePolicySaver with shared memory off whose run lives at
    `run_root`; every save of it there is deleted before the rounds and after
    each one, so each sends every byte. Which of the two goes first
    alternates by round. Also the bytes per second over gRPC (SaveResult's
    bytes written / call -> durable).

    Raises:
        RuntimeError: if a save is skipped, or the daemon did not receive it whole.
    """
    from bench import inprocess

    for published in run_root.iterdir() if run_root.exists() else []:
        if published.is_dir():
            shutil.rmtree(published, ignore_errors=True)
    ours, theirs, rates = [], [], []
    for i in range(WIRE_WARM_ROUNDS + rounds):

        def remote(i: int = i) -> None:
            export_dir = f"wire-{i}"
            start = time.perf_counter()
            ticket = saver.save(export_dir)
            if ticket.skipped:
                raise RuntimeError(f"save {export_dir} was skipped: {ticket.reason}")
            done = ticket.result(timeout)
            seconds = time.perf_counter() - start
            shutil.rmtree(run_root / export_dir, ignore_errors=True)
            if done.bytes_copied:
                raise RuntimeError(f"save {export_dir} copied {done.bytes_copied} bytes from a base: not a full send")
            if i >= WIRE_WARM_ROUNDS:
                ours.append(seconds)
                rates.append(done.bytes_written / seconds)

        def local(i: int = i) -> None:
            target = out / f"wire-inprocess-{i}"
            start = time.perf_counter()
            policy_saver.save(str(target))
            inprocess.fsync_tree(target)
            seconds = time.perf_counter() - start
            shutil.rmtree(target, ignore_errors=True)
            if i >= WIRE_WARM_ROUNDS:
                theirs.append(seconds)

        for step in (remote, local) if i % 2 == 0 else (local, remote):
            step()
    return {
        "grpc": summarize(ours),
        "inprocess_fsync": summarize(theirs),
        "grpc_throughput": summarize(rates),
        "warm_rounds": WIRE_WARM_ROUNDS,
    }
