"""The soak: trainers saving through three daemons while faults come at random, then an invariant checker.

Not in the default suite. Run it with

    CHECKPOINTD_SOAK=1 CHECKPOINTD_SOAK_MINUTES=30 pytest tests/integration/faults/test_soak.py -s
    python -m tests.integration.support.soak --minutes 30      # the same, starting its own radosgw

The world: a radosgw (scripts/rgw.sh) behind `fault_proxy.FaultProxy`; daemons
S1 and S2 on one prefix of its bucket (through the proxy, leases of
LEASE_SECONDS), daemon L on a local root (a tmpfs of LOCAL_MB, so it can be
filled); each daemon keeps its gRPC port across restarts. Four trainer
processes (this module's `trainer` mode), each a run of its own: training
checkpoints over shared memory on S1, over gRPC on S2, policy checkpoints
(`RemotePolicySaver.save_checkpoint`, three export dirs in turn) over gRPC on
S1, training checkpoints over shared memory on L. A trainer saves every
PERIOD s; a save's values are a function of its step (`values`), so any
committed save can be checked bit for bit. It prints each save's outcome as
it learns it: offered, committed (told durable) or failed (and the error's
type); it never lets a save raise out of its loop.

Faults come in rounds (`Schedule`): each round injects every kind once, in
a random order, at random times (FAULT_EVERY s apart on average, less in a
run too short for MIN_EACH rounds at that pace), so a 30-minute run injects
every kind at least MIN_EACH times. The kinds: `daemon_kill` (S1, S2 or L:
SIGKILL, restarted after 1-3 s), `s3_outage:MODE` for each of the proxy's
modes (it refuses, resets, answers 503 or 500, or stalls for 3-6 s),
`trainer_kill` (SIGKILL, started again: it restores and goes on),
`disk_full` (L's tmpfs filled for 3-5 s).

Each run writes under an S3 prefix of its own, random (printed at the
start), whatever its seed: the seed picks the faults, never what an earlier
run left.

At the end the trainers are killed, the daemons stopped (SIGTERM: what they
accepted finishes), and the checker reads every root (S3: the objects
themselves, with boto3):

- every save a trainer was told committed is there and loads bit-identically
  (a policy dir may hold a later step of the same dir: never an older one);
- every save a trainer was told failed is absent or complete, never partial,
  and `verify` passes for every save of every run, once the S3 prefix has
  had the tidy a daemon's start gives it (with no grace age: what a save cut
  off at its manifest's PUT uploaded is not a save, and recovery deletes it);
- no run had two writers: on S3 every manifest's writer is an incarnation
  of the run's own daemon, in the order they ran;
- nothing was written outside the roots: the local root's parent and the
  bucket outside the prefix hold what they held before.
"""

from __future__ import annotations

import argparse
import collections
import errno
import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

PERIOD = 0.5
FAULT_EVERY = 10.0
MIN_EACH = 5  # every kind of fault at least this often in a 30-minute run
LEASE_SECONDS = 5.0
READ_TIMEOUT = 2.0
SAVE_TIMEOUT = 30.0
LOCAL_MB = 256
WEIGHTS = 4096
POLICY_DIRS = 3
S3_FAULTS = ("refuse", "reset", "slowdown", "internal", "stall")
# (name, daemon, kind, shared memory)
TRAINERS = (("t-s1-shm", "S1", "train", True), ("t-s2-grpc", "S2", "train", False),
            ("p-s1-grpc", "S1", "policy", False), ("t-l-shm", "L", "train", True))  # fmt: skip
MANIFEST = ".checkpointd.manifest.json"
DIR_MANIFEST = "checkpointd.manifest.json"


def values(step: int) -> np.ndarray:
    """A training save's weights at `step`."""
    return np.random.default_rng(step).standard_normal(WEIGHTS).astype(np.float32)


def policy_value(step: int) -> np.float32:
    """Every float of a policy save at `step`."""
    return np.float32(step + 0.25)


def _say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def trainer_main(address: str, run: str, kind: str, shm: bool, first: int = 0) -> int:
    """A trainer: saves every PERIOD s, saying each outcome; runs until killed.

    A training run goes on from the step it restores; a policy run (nothing
    to restore) from `first`, past every step an earlier incarnation offered,
    so a policy dir's newer save always has the larger step.
    """
    import tensorflow as tf

    from checkpointd_client import RemoteCheckpointer, RemotePolicySaver
    from tests.integration.support import policies

    step = tf.Variable(0, dtype=tf.int64, name="train_step")
    save: Callable[[int], Any]
    if kind == "train":
        weights = tf.Variable(values(0))
        checkpointer = RemoteCheckpointer(
            "train", address, run=run, max_to_keep=None, timeout=SAVE_TIMEOUT, shared_memory=shm,
            save_on_notice=False, weights=weights, global_step=step,
        )  # fmt: skip

        def save(s: int) -> Any:
            weights.assign(values(s))
            step.assign(s)
            return checkpointer.save(step)
    else:
        policy = policies.build(policies.q((16,)))
        saver = RemotePolicySaver(policy, address, run=run, train_step=step, timeout=SAVE_TIMEOUT, shared_memory=shm)
        saver.register()
        step.assign(first)

        def save(s: int) -> Any:
            for v in policy.variables():
                v.assign(tf.fill(v.shape, policy_value(s)))
            step.assign(s)
            return saver.save_checkpoint(f"policy-{s % POLICY_DIRS}")

    s = int(step.numpy())
    _say(event="restored", step=s)
    pending: list[Any] = []
    while True:
        began = time.monotonic()
        for ticket in [t for t in pending if t.done()]:
            pending.remove(ticket)
            error = ticket.exception(0)
            if ticket.skipped:
                _say(event="skipped", step=ticket.step, dir=ticket.export_dir)
            elif error is None:
                _say(event="committed", step=ticket.step, dir=ticket.export_dir)
            else:
                _say(event="failed", step=ticket.step, dir=ticket.export_dir, why=type(error).__name__)
        s += 1
        try:
            ticket = save(s)
        except Exception as e:  # noqa: BLE001 - said, never raised: the loop goes on
            _say(event="failed", step=s, dir="", why=type(e).__name__)
        else:
            _say(event="offered", step=s, dir=ticket.export_dir)
            pending.append(ticket)
        time.sleep(max(0.0, PERIOD - (time.monotonic() - began)))  # the trainer's own pace


@dataclass
class Figures:
    """What the soak did and found."""

    seconds: float = 0.0
    saves: collections.Counter[str] = field(default_factory=collections.Counter)  # offered, committed, ...
    failed_why: collections.Counter[str] = field(default_factory=collections.Counter)
    faults: collections.Counter[str] = field(default_factory=collections.Counter)  # by Schedule kind
    targets: collections.Counter[str] = field(default_factory=collections.Counter)  # which daemon, which trainer
    checked: collections.Counter[str] = field(default_factory=collections.Counter)
    restarts: collections.Counter[str] = field(default_factory=collections.Counter)  # trainers that ended themselves
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"soak of {self.seconds / 60:.1f} min: saves {dict(self.saves)}; failed by error {dict(self.failed_why)}; "
            f"faults {dict(self.faults)} (on {dict(self.targets)}); trainers restarted after ending by themselves {dict(self.restarts)}; "
            f"checked {dict(self.checked)}; {len(self.violations)} violations"
            + "".join(f"\n  note: {n}" for n in self.notes)
        )


class _Trainer:
    """A trainer process and the events it said."""

    def __init__(self, name: str, address: str, kind: str, shm: bool, log: Path, events: list[dict[str, Any]]):
        self.name, self.address, self.kind, self.shm, self.log, self.events = name, address, kind, shm, log, events
        self.proc: subprocess.Popen[str] | None = None
        self.start()

    def start(self) -> None:
        with open(self.log, "a") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.integration.support.soak", "trainer", self.address, self.name, self.kind,
                 str(int(self.shm)), str(self._first())],
                stdout=subprocess.PIPE, stderr=err, text=True,
            )  # fmt: skip
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

    def _first(self) -> int:
        """Past every step this trainer's earlier incarnations offered."""
        return max((int(e.get("step", 0)) for e in list(self.events) if e.get("run") == self.name), default=0) + 1

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("{"):
                self.events.append({"run": self.name, **json.loads(line)})

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class _Daemons:
    """S1, S2 (S3 through the proxy) and L (local), each on a port of its own kept across restarts."""

    def __init__(self, rgw: Any, proxy: Any, url: str, local: Path, work: Path) -> None:
        self.rgw, self.proxy, self.url, self.local, self.work = rgw, proxy, url, local, work
        self.ports = {name: _free_port() for name in ("S1", "S2", "L")}
        self.pids: dict[str, list[int]] = collections.defaultdict(list)  # every incarnation, in order
        self.running: dict[str, Any] = {}
        for name in self.ports:
            self.start(name)

    def start(self, name: str, figures: Figures | None = None) -> None:
        """Starts `name`; a start that times out (tests.integration.support.daemon's 60 s) is noted and tried again."""
        try:
            self._start(name)
        except TimeoutError as e:
            if figures is None:
                raise
            figures.notes.append(f"{name} did not serve within 60 s of a restart; started again: {str(e)[:200]}")
            self._start(name)

    def _start(self, name: str) -> None:
        from tests.integration.support.daemon import start_daemon

        port = ["--port", str(self.ports[name])]
        if name == "L":
            daemon = start_daemon(self.local, self.work / name, *port)
        else:
            daemon = start_daemon(
                self.url, self.work / name, "--work-dir", str(self.work / f"{name}-state"),  # type: ignore[arg-type]
                "--s3-endpoint-url", self.proxy.endpoint, "--s3-region", "us-east-1",
                "--lease-seconds", f"{LEASE_SECONDS:g}", "--s3-read-timeout", f"{READ_TIMEOUT:g}", *port,
                env=self.rgw.daemon_env(),
            )  # fmt: skip
        self.running[name] = daemon
        self.pids[name].append(daemon.proc.pid)

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def kill(self, name: str) -> None:
        self.running[name].proc.kill()
        self.running[name].proc.wait()

    def stop_all(self) -> None:
        for daemon in self.running.values():
            if daemon.proc.poll() is None:
                daemon.terminate()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _mount_tmpfs(where: Path) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={LOCAL_MB}m", "tmpfs", str(where)], check=False,
                          capture_output=True)  # fmt: skip
    return done.returncode == 0


def _fill(where: Path) -> Path:
    """Fills the filesystem of `where` with one file; returns it."""
    ballast = where / "soak-ballast"
    with open(ballast, "wb") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, shutil.disk_usage(where).free)
        except OSError as e:  # the daemon took some meanwhile: full either way
            if e.errno != errno.ENOSPC:
                raise
    return ballast


class Schedule:
    """The faults, in rounds: every kind once per round in a random order, at random times.

    The mean spacing is FAULT_EVERY s, or less in a run too short for
    2 * MIN_EACH rounds at that pace (a fault itself lasts seconds), so every
    kind is injected at least MIN_EACH times.
    """

    def __init__(self, kinds: Sequence[str], minutes: float, rng: random.Random) -> None:
        self.kinds, self.rng = list(kinds), rng
        self.spacing = min(FAULT_EVERY, minutes * 60 / (2 * MIN_EACH * len(self.kinds)))
        self._round: list[str] = []

    def next(self) -> tuple[float, str]:
        """(seconds to wait, the kind of the next fault)."""
        if not self._round:
            self._round = self.rng.sample(self.kinds, len(self.kinds))
        return self.rng.uniform(0.5, 1.5) * self.spacing, self._round.pop()


def fault_kinds(disk: bool) -> list[str]:
    """Every kind the schedule injects; `disk`: the local root can be filled."""
    kinds = ["daemon_kill", *(f"s3_outage:{how}" for how in S3_FAULTS), "trainer_kill"]
    return [*kinds, "disk_full"] if disk else kinds


def _fault(kind: str, rng: random.Random, daemons: _Daemons, trainers: list[_Trainer], figures: Figures) -> None:
    """Injects one fault of `kind` (one of `fault_kinds`) and ends it."""
    pause = threading.Event().wait
    if kind == "daemon_kill":
        name = rng.choice(("S1", "S2", "L"))
        daemons.kill(name)
        pause(rng.uniform(1.0, 3.0))
        daemons.start(name, figures)
        figures.targets[name] += 1
    elif kind.startswith("s3_outage:"):
        daemons.proxy.fault(kind.partition(":")[2])
        pause(rng.uniform(3.0, 6.0))
        daemons.proxy.clear()
    elif kind == "trainer_kill":
        trainer = rng.choice(trainers)
        trainer.kill()
        trainer.start()
        figures.targets[trainer.name] += 1
    else:
        ballast = _fill(daemons.local)
        pause(rng.uniform(3.0, 5.0))
        ballast.unlink()
    figures.faults[kind] += 1


def run_soak(rgw: Any, minutes: float, work: Path, *, seed: int = 0, log: Callable[[str], None] = print) -> Figures:
    """Runs the soak for `minutes` against `rgw` (a tests.integration.support.rgw.Rgw); returns what it found."""
    from tests.integration.support.fault_proxy import FaultProxy
    from tests.integration.support.soak_check import check

    rng = random.Random(seed)
    figures = Figures()
    client = rgw.client()
    prefix = f"soak-{secrets.token_hex(4)}"  # each run its own, whatever the seed
    log(f"soak: seed {seed}, s3 prefix {prefix}, work {work}")
    local = work / "local" / "root"
    disk = _mount_tmpfs(local)
    if not disk:
        figures.notes.append("no tmpfs could be mounted (not root?): the disk_full fault was not injected")
    schedule = Schedule(fault_kinds(disk), minutes, rng)
    outside_before = _outside(client, rgw.bucket, prefix), sorted(os.listdir(local.parent))
    events: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        with FaultProxy(rgw.endpoint) as proxy:
            daemons = _Daemons(rgw, proxy, f"s3://{rgw.bucket}/{prefix}", local, work)
            trainers: list[_Trainer] = []
            try:
                trainers += [
                    _Trainer(name, daemons.address(on), kind, shm, work / f"{name}.log", events)
                    for name, on, kind, shm in TRAINERS
                ]
                end = started + minutes * 60
                while (now := time.monotonic()) < end:
                    wait, kind = schedule.next()
                    threading.Event().wait(min(end - now, wait))
                    if time.monotonic() >= end:
                        break
                    _fault(kind, rng, daemons, trainers, figures)
                    for trainer in trainers:  # one that ended by itself (its start found no daemon) starts again
                        if trainer.proc is not None and trainer.proc.poll() is not None:
                            figures.restarts[f"{trainer.name} exit {trainer.proc.returncode}"] += 1
                            trainer.start()
                    log(f"[{(time.monotonic() - started) / 60:5.1f} min] {kind}; faults {sum(figures.faults.values())}; "
                        f"events {len(events)}")  # fmt: skip
                for trainer in trainers:
                    trainer.kill()
            finally:
                for trainer in trainers:  # however the soak ends
                    trainer.kill()
                proxy.clear()
                daemons.stop_all()
        figures.seconds = time.monotonic() - started
        # What a failed save uploaded before its manifest (the store cut off
        # at the manifest's PUT) stays under its final names until a daemon's
        # tidy deletes it past the grace age: run that tidy now, as a restart
        # an hour later would, so the checker sees what readers and recovery do.
        figures.checked["S3 leftovers of uncommitted saves tidied"] = _tidy(client, rgw.bucket, prefix, work)
        check(events, daemons.pids, client, rgw.bucket, prefix, local, work / "check", figures)
        outside_after = _outside(client, rgw.bucket, prefix), sorted(os.listdir(local.parent))
        if outside_after != outside_before:
            figures.violations.append(f"written outside the roots: before {outside_before}, after {outside_after}")
    finally:
        subprocess.run(["umount", str(local)], check=False, capture_output=True)
    return figures


def _tidy(client: Any, bucket: str, prefix: str, work: Path) -> int:
    """The daemons' tidy of the bucket with no grace age (they are stopped); how many objects it deleted."""
    from checkpointd.storage.s3 import S3Store

    store = S3Store(f"s3://{bucket}/{prefix}", work / "tidy-staging", grace_seconds=0, client=client)
    try:
        return store.tidy(lambda: False)
    finally:
        store.close()


def _outside(client: Any, bucket: str, prefix: str) -> list[tuple[str, str]]:
    """Every object of the bucket outside `prefix`/, with its ETag."""
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys.extend((o["Key"], o["ETag"]) for o in page.get("Contents", []) if not o["Key"].startswith(prefix + "/"))
    return sorted(keys)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["trainer"]:
        return trainer_main(argv[1], argv[2], argv[3], argv[4] == "1", int(argv[5]) if len(argv) > 5 else 0)
    from tests.integration.support.s3_crash_harness import _start_rgw

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=float(os.environ.get("CHECKPOINTD_SOAK_MINUTES", "30")))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="checkpointd-soak-"))
    rgw = _start_rgw(base / "rgw")
    try:
        figures = run_soak(rgw, args.minutes, base / "work", seed=args.seed)
    finally:
        rgw.stop()
    for violation in figures.violations:
        print("VIOLATION", violation)
    print(figures.summary())
    print(f"logs in {base}")
    return 1 if figures.violations else 0


if __name__ == "__main__":
    sys.exit(main())
