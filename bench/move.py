"""The resume section's rows beyond the warm restore paths: a cold page cache, and the whole move.

bench/resume.py calls these (one hook each) with its live objects:

- `cold`: the in-process restore and the same-host in-place restore again,
  each rep after the files it reads were fsynced and dropped from the page
  cache (`bench.page_cache.drop`: posix_fadvise DONTNEED, per file, no
  root), and mincore(2) checked that none of their pages stayed;
- `whole_move`: a trainer moved to another node. Two daemons on one
  machine, separate dirs and one S3 prefix, model two nodes: the trainer
  saves through daemon A, then A is SIGKILLed while it holds the run's lease
  (its node died; so did the trainer there). On node B, whose daemon is
  already up (a DaemonSet), the trainer's checkpointer registers the run:
  B waits for A's lease to lapse, which takes the lease ttl
  (`--lease-seconds`; B counts it from its own first sight of the lease, as
  it cannot tell a dead holder from a slow one), then restores the newest
  checkpoint from the bucket, and the trainer makes its first training
  step (a new `tf.function` of `agent.train`, traced as in a new process).
  Shown apart: register -> wait starts, the lease wait, the restore, the
  first step; their sum is the move.
- `graceful_move`: the same two nodes, but node A is drained, not lost:
  daemon A gets SIGTERM while the trainer holds the run on it (its
  --notice-window of NOTICE_WINDOW s for final saves, then it drains and
  releases its leases as it exits), and the trainer registers the run on B,
  which takes it at once. Timed from A's exit to the trainer restored on B
  (the target: the restore's own time + 1 s, not a lease ttl).
  `moves` runs both on one radosgw (bench/preemption.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from bench import page_cache, rgw

REGION = "us-east-1"
TIMEOUT = 900.0
# The move's lease ttl (daemon --lease-seconds; its default is 30 s): the lease wait is about this long.
LEASE_SECONDS = 10.0
# The client's log lines the move's phases are read from (their record times).
_WAIT_LOG = ("checkpointd_client.transport.session", "waits for the run's lease")
_FOUND_LOG = ("checkpointd_client.checkpointer", "checkpoint available")
NOTICE_WINDOW = 1.0  # daemon A's --notice-window in the graceful move (its default is 5 s)


def _timed(reps: int, fn: Callable[[], Any], before: Callable[[], Any]) -> dict[str, Any]:
    from bench.stats import summarize

    samples = []
    for _ in range(reps):
        before()
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return summarize(samples)


def bundle(directory: Path, name: str) -> list[Path]:
    """The files of checkpoint `name` in `directory` a restore reads (its index and data), not its manifest."""
    return sorted(p for p in directory.glob(name + ".*") if "manifest" not in p.name)


def cold(
    reps: int,
    inprocess: Callable[[], Any],
    inprocess_files: Sequence[Path],
    same_host: Callable[[], Any],
    daemon_files: Sequence[Path],
) -> dict[str, Any]:
    """The in-process and same-host restores with their files' pages dropped before each rep.

    Args:
        reps: repetitions of each.
        inprocess, same_host: one restore each (as resume.py times them warm).
        inprocess_files, daemon_files: the files each reads (the local
            checkpoint's; the daemon's committed ones).

    Returns:
        {"inprocess_cold": summary, "same_host_cold": summary, "cold_resident":
        the most pages of each set found cached after a drop, and their count}.
    """
    worst: dict[str, list[int]] = {"inprocess": [0, 0], "same_host": [0, 0]}

    def dropper(name: str, files: Sequence[Path]) -> Callable[[], None]:
        def before() -> None:
            page_cache.drop(files)
            cached, total = page_cache.resident(files)
            worst[name] = [max(worst[name][0], cached), total]

        return before

    return {
        "inprocess_cold": _timed(reps, inprocess, dropper("inprocess", inprocess_files)),
        "same_host_cold": _timed(reps, same_host, dropper("same_host", daemon_files)),
        "cold_resident": worst,
    }


class _LogTimes(logging.Handler):
    """The wall time of the first record of each (logger, text) watched."""

    def __init__(self, *watched: tuple[str, str]) -> None:
        super().__init__(logging.INFO)
        self.watched = watched
        self.times: dict[tuple[str, str], float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        for name, text in self.watched:
            if record.name == name and text in record.getMessage():
                self.times.setdefault((name, text), record.created)

    @contextlib.contextmanager
    def installed(self) -> Iterator[_LogTimes]:
        loggers = [logging.getLogger(name) for name, _ in self.watched]
        levels = [lg.level for lg in loggers]
        for lg in loggers:
            lg.addHandler(self)
            lg.setLevel(logging.INFO)
        try:
            yield self
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.removeHandler(self)
                lg.setLevel(level)


def whole_move(
    work: Path,
    objects: dict[str, Any],
    step: Any,
    say: Callable[[str], None],
    lease_seconds: float = LEASE_SECONDS,
) -> dict[str, Any]:
    """A trainer's move to another node, from its first RegisterRun there to its first training step.

    Args:
        work: a scratch dir (removed by the caller).
        objects: the trainer's objects (an "agent" among them), as for
            tf.train.Checkpoint; restored into on node B.
        step: the train step variable.
        say: progress lines.
        lease_seconds: both daemons' --lease-seconds.

    Returns:
        The phases in seconds (register_to_wait, lease_wait, restore,
        first_step, total), the ttl, the bytes restored, or {"skipped": why}.
    """
    with rgw.radosgw(work / "move-rgw") as (s3, why):
        if s3 is None:
            return {"skipped": why}
        return _node_loss(s3, work, objects, step, say, lease_seconds)


def moves(
    work: Path, objects: dict[str, Any], step: Any, say: Callable[[str], None], lease_seconds: float = LEASE_SECONDS
) -> dict[str, Any]:
    """`graceful_move`, then the node loss of `whole_move`, on one radosgw: {"graceful": ..., "node_loss": ...}."""
    with rgw.radosgw(work / "move-rgw") as (s3, why):
        if s3 is None:
            return {"skipped": why}
        graceful = graceful_move(s3, work, objects, step, say, lease_seconds)
        return {"graceful": graceful, "node_loss": _node_loss(s3, work, objects, step, say, lease_seconds)}


def _nodes(s3: rgw.S3, work: Path, lease_seconds: float, *extra: str) -> tuple[Any, Any]:
    """Daemons A and B on one new prefix of the bucket (two nodes), gRPC only, each `extra` flags."""
    from tests.integration.support.daemon import start_daemon

    url = f"s3://{s3.bucket}/move-{secrets.token_hex(4)}"

    def node(name: str) -> Any:
        return start_daemon(
            url, work / f"move-{name}", "--work-dir", str(work / f"move-{name}-state-{secrets.token_hex(2)}"),
            "--s3-endpoint-url", s3.endpoint, "--s3-region", REGION,
            "--lease-seconds", f"{lease_seconds:g}", "--no-shm", *extra, env=s3.env,
        )  # type: ignore[arg-type]  # fmt: skip

    return node("a"), node("b")


def graceful_move(
    s3: rgw.S3, work: Path, objects: dict[str, Any], step: Any, say: Callable[[str], None], lease_seconds: float
) -> dict[str, Any]:
    """Node A drained (daemon A SIGTERMed while the trainer holds the run), the trainer restored on B.

    Returns:
        Seconds: A's SIGTERM -> exit (`drain`), A's exit -> restored on B
        (`after_exit`), of which the restore itself (`restore`, from the
        client's "checkpoint available" line); whether B waited for a lease.
    """
    from checkpointd.protocol.errors import CheckpointdError
    from checkpointd_client import RemoteCheckpointer

    a, b = _nodes(s3, work, lease_seconds, "--notice-window", f"{NOTICE_WINDOW:g}")
    try:
        say(
            f"graceful move: a checkpoint through daemon A, then A drained (SIGTERM, --notice-window {NOTICE_WINDOW:g})"
        )
        old = RemoteCheckpointer("train", a.address, run="graceful", timeout=TIMEOUT, save_on_notice=False, **objects)
        old.save(step, blocking=True).result()
        told = time.time()
        a.proc.terminate()  # the trainer still holds the run on A
        code = a.proc.wait(TIMEOUT)
        exited = time.time()
        with contextlib.suppress(CheckpointdError):
            old.close(timeout=1.0)
        del old
        with _LogTimes(_WAIT_LOG, _FOUND_LOG).installed() as log:
            new = RemoteCheckpointer("train", b.address, run="graceful", timeout=TIMEOUT, **objects)
            restored = time.time()
        new.close()
        found = log.times.get(_FOUND_LOG, exited)
        return {
            "notice_window": NOTICE_WINDOW,
            "daemon_a_exit_code": code,
            "drain": exited - told,
            "waited": _WAIT_LOG in log.times,
            "after_exit": restored - exited,
            "restore": restored - found,
        }
    finally:
        for d in (a, b):
            if d.proc.poll() is None:
                d.terminate()


def _node_loss(
    s3: rgw.S3, work: Path, objects: dict[str, Any], step: Any, say: Callable[[str], None], lease_seconds: float
) -> dict[str, Any]:
    from bench import agents
    from checkpointd.protocol.errors import CheckpointdError
    from checkpointd_client import RemoteCheckpointer

    a, b = _nodes(s3, work, lease_seconds)
    try:
        say(f"move: a checkpoint through daemon A (node A), its lease ttl {lease_seconds:g} s")
        old = RemoteCheckpointer("train", a.address, run="move", timeout=TIMEOUT, **objects)
        old.save(step, blocking=True).result()
        a.proc.kill()  # node A dies with its daemon, which holds the run's lease
        a.proc.wait()
        with contextlib.suppress(CheckpointdError):
            old.close(timeout=1.0)  # the trainer of node A died too: nothing of it is waited for
        del old  # its snapshot buffers (as many bytes as the state) go with it
        say("move: the trainer registers on node B (daemon B waits out A's lease), restores, trains a step")
        with _LogTimes(_WAIT_LOG, _FOUND_LOG).installed() as log:
            started = time.time()
            new = RemoteCheckpointer("train", b.address, run="move", timeout=TIMEOUT, **objects)
            restored = time.time()
        try:
            agents.Trainer(objects["agent"])  # the first training step, traced as in a new process
            stepped = time.time()
        finally:
            new.close()
        waited = log.times.get(_WAIT_LOG, started)
        found = log.times.get(_FOUND_LOG, waited)
        return {
            "lease_seconds": lease_seconds,
            "waited": _WAIT_LOG in log.times,
            "register_to_wait": waited - started,
            "lease_wait": found - waited,
            "restore": restored - found,
            "first_step": stepped - restored,
            "total": stepped - started,
            "trainer_peak_rss_bytes": _peak_rss(),
        }
    finally:
        for d in (a, b):
            if d.proc.poll() is None:
                d.terminate()


def _peak_rss() -> int:
    """This process's peak resident set (VmHWM), in bytes; 0 if unknown."""
    try:
        with open(f"/proc/{os.getpid()}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _median(summary: Any) -> float | None:
    return float(summary["median"]) if isinstance(summary, dict) and "median" in summary else None


def rows(r: dict[str, Any], row: Callable[[str, float | None, int], None], note: Callable[[str], None]) -> None:
    """The cold and move rows, through resume.table's `row` (label, seconds, bytes) and `note` (a line)."""
    state = r["case"]["state_bytes"]
    row("in-process restore (cold page cache)", _median(r.get("inprocess_cold")), state)
    row("same host, in place (cold page cache)", _median(r.get("same_host_cold")), state)
    resident = r.get("cold_resident")
    if resident:
        most = max(resident.values(), key=lambda v: v[0])
        note(
            "  cold: before each rep the files read were fsynced and dropped (posix_fadvise DONTNEED); "
            f"mincore then found at most {most[0]} of {most[1]} pages cached"
        )
    move = r.get("move")
    if not move:
        return
    if "total" not in move:
        note(f"  the whole move: not measured ({move.get('skipped', 'no result')})")
        return
    note(
        f"  the whole move, RegisterRun on node B -> 1st training step: {move['total']:.2f} s = "
        f"register {move['register_to_wait']:.3f} + lease wait {move['lease_wait']:.2f} "
        f"(A's lease lapsing; ttl --lease-seconds {move['lease_seconds']:g}) + restore from S3 "
        f"{move['restore']:.2f} ({move['restore'] / state * 1e9:.2f} s/GB) + 1st step {move['first_step']:.2f}"
    )
    if move.get("trainer_peak_rss_bytes"):
        note(f"  trainer peak RSS {move['trainer_peak_rss_bytes'] / 1e9:.2f} GB for {state / 1e9:.2f} GB of state")


def report_targets(r: dict[str, Any] | None, same_host_limit: float, partial_limit: float) -> list[dict[str, Any]]:
    """The resume section's restore-time targets as bench.report lists them (group "resume").

    Same host and partial are judged here, at bench.resume's limits (passed
    in: resume imports this module); the S3, gRPC and memory targets of the
    section are the RestoreFiles path's own.
    """
    from bench.fmt import fmt_time
    from bench.judge import RESUME, at_most, judge, median, not_measured

    names = (
        f"resume: same host, in place <= {same_host_limit:g} x in-process Checkpointer restore (warm)",
        f"resume: partial (the policy of a training checkpoint) <= {partial_limit:g} x the policy's own",
    )
    if not r:
        return [{"group": RESUME, **not_measured(n, None, "no resume section in this run")} for n in names]

    def same_host() -> tuple[float, float, bool, str]:
        inprocess = median(r, "inprocess")
        return at_most(median(r, "same_host"), same_host_limit * inprocess, fmt_time,
                       f"in process {fmt_time(inprocess)}")  # fmt: skip

    def partial() -> tuple[float, float, bool, str]:
        alone = median(r, "policy_alone")
        return at_most(median(r, "partial"), partial_limit * alone, fmt_time, f"the policy alone {fmt_time(alone)}")

    size = r["case"]["name"]
    return [judge(n, size, fn, RESUME) for n, fn in zip(names, (same_host, partial), strict=True)]
