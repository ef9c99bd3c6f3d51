"""Load: many trainers saving through one real daemon at once, for a bounded time.

16 trainers with a job each and 4 more sharing one job (one folder, and a
daemon run per saver, as the client names them), each a thread with its
own TF-Agents policy and its own RemotePolicySaver, save in a loop: give the
policy new values and a distinct train step, save (non-blocking; every 10th
blocking), alternating SavedModels and checkpoints. For `CHECKPOINTD_LOAD_SECONDS`
(default 6). Then:
- every accepted save is on disk where its result says, and holds exactly the
  values the trainer had at the call: `tf.train.load_checkpoint` reads every
  key of every save and each bound variable equals the trainer's copy taken
  before the call; a sample of SavedModels loads with `tf.saved_model.load`
  and has the right train step and model variables;
- every skip reached its caller: per run, the daemon's skipped count equals
  the number of tickets that say skipped, its ok count equals the accepted
  tickets, and no save failed;
- the daemon's resident memory, sampled from /proc during the run, peaked
  under its idle figure plus 1.5 GiB.
It prints throughput, p50/p99 accept-to-durable latency (SaveResult's
duration_seconds), how long save() calls held the trainers, skips and RSS.

Long mode: `CHECKPOINTD_LOAD_SECONDS=300 pytest tests/integration/saves/test_load.py -s`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
import tensorflow as tf

from checkpointd.protocol.kinds import SaveKind
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc
from checkpointd_client import CheckpointdError, RemotePolicySaver, SaveTicket
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon, start_daemon

LOAD_SECONDS = float(os.environ.get("CHECKPOINTD_LOAD_SECONDS") or 6)
OWN_RUNS = 16
SHARED = 4
SHARED_RUN = "shared"
TIMEOUT = 180.0  # per RPC and per wait; generous for a loaded 2-core box
RSS_BOUND = 3 << 29  # 1.5 GiB over idle
SAVED_MODEL_SAMPLE = 6
RSS_EVERY = 0.1  # seconds between /proc samples


@dataclass
class Record:
    """One save call: what the trainer asked for and the values it had at the call."""

    run: str  # the saver's run on the daemon
    folder: str  # where its saves are, under the daemon's root
    kind: SaveKind
    export_dir: str
    step: int
    expected: dict[str, np.ndarray]  # SavedModel key -> value
    checkpoint_keys: dict[str, str]  # SavedModel key -> save_checkpoint key
    ticket: SaveTicket
    call_seconds: float


@dataclass
class Trainer:
    """A training loop of its own: a policy, a train step and a RemotePolicySaver."""

    name: str
    run: str  # the saver's daemon run
    folder: str
    index: int
    saver: RemotePolicySaver
    policy: object
    train_step: tf.Variable
    records: list[Record] = field(default_factory=list)
    error: BaseException | None = None

    def loop(self, start: threading.Barrier, stop: threading.Event) -> None:
        try:
            bindings = self.saver._bindings  # noqa: SLF001 - the keys the daemon writes
            assert bindings is not None, "register() first"
            checkpoint_keys = {b.key: b.checkpoint_key for b in bindings.variables}
            observations = policies.time_steps(32, seed=self.index)
            start.wait(TIMEOUT)
            n = 0
            while not stop.is_set():
                n += 1
                step = self.index * 1_000_000 + n  # distinct across every trainer
                # A "training step": some inference, then new values for every variable.
                self.policy.action(observations)
                policies.perturb(self.policy, seed=step)
                self.train_step.assign(step)
                expected = {b.key: b.variable.numpy().copy() for b in bindings.variables}
                kind = SaveKind.SAVED_MODEL if n % 3 == 0 else SaveKind.CHECKPOINT
                export_dir = f"{self.name}/{kind.value}-{step:09d}"
                blocking = n % 10 == 0
                started = time.perf_counter()
                if kind is SaveKind.SAVED_MODEL:
                    ticket = self.saver.save(export_dir, blocking=blocking)
                else:
                    ticket = self.saver.save_checkpoint(export_dir, blocking=blocking)
                seconds = time.perf_counter() - started
                if ticket.skipped:
                    expected = {}  # nothing to check on disk; keep memory flat
                self.records.append(
                    Record(
                        self.saver.run,
                        self.saver.folder,
                        kind,
                        export_dir,
                        step,
                        expected,
                        checkpoint_keys,
                        ticket,
                        seconds,
                    )
                )
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
            start.abort()


class RssSampler:
    """Samples a process's VmRSS from /proc in a thread until stopped."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(RSS_EVERY):
            self.samples.append(rss_bytes(self.pid))

    def __enter__(self) -> RssSampler:
        self.samples.append(rss_bytes(self.pid))
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(TIMEOUT)
        self.samples.append(rss_bytes(self.pid))


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.fixture(scope="module")
def load_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    base = tmp_path_factory.mktemp("load")
    daemon = start_daemon(base / "root", base / "work", "--upload-timeout", "60")
    try:
        yield daemon
    finally:
        daemon.terminate()


@pytest.fixture(scope="module")
def trainers(load_daemon: Daemon) -> Iterator[list[Trainer]]:
    made: list[Trainer] = []
    try:
        for i in range(OWN_RUNS + SHARED):
            run = f"own-{i:02d}" if i < OWN_RUNS else SHARED_RUN
            policy = policies.build(policies.q(hidden=(8,)))
            train_step = tf.Variable(0, dtype=tf.int64)
            saver = RemotePolicySaver(policy, load_daemon.address, run=run, train_step=train_step, timeout=TIMEOUT)
            made.append(Trainer(f"t{i:02d}", saver.run, saver.folder, i + 1, saver, policy, train_step))
            saver.register()  # the template export stays out of the timed loop
        yield made
    finally:
        for t in made:  # closes the runs
            with contextlib.suppress(CheckpointdError):
                t.saver.close(timeout=60)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def test_many_trainers_every_accepted_save_is_written_every_skip_is_reported_memory_bounded(
    load_daemon: Daemon, trainers: list[Trainer]
) -> None:
    daemon = load_daemon
    stop = threading.Event()
    start = threading.Barrier(len(trainers) + 1)
    threads = [threading.Thread(target=t.loop, args=(start, stop), name=t.name, daemon=True) for t in trainers]
    idle_rss = rss_bytes(daemon.proc.pid)
    with RssSampler(daemon.proc.pid) as rss:
        for thread in threads:
            thread.start()
        with contextlib.suppress(threading.BrokenBarrierError):  # a trainer failed: reported below
            start.wait(TIMEOUT)
        began = time.monotonic()
        stop.wait(LOAD_SECONDS)  # the load's duration, not a wait for completion
        stop.set()
        for thread in threads:
            thread.join(TIMEOUT)
        assert not any(thread.is_alive() for thread in threads), "a trainer hung"
        loaded_seconds = time.monotonic() - began
        errors = {t.name: repr(t.error) for t in trainers if t.error is not None}
        assert not errors, errors
        for t in trainers:
            t.saver.flush(timeout=TIMEOUT)
        drained_seconds = time.monotonic() - began
    assert daemon.proc.poll() is None

    records = [r for t in trainers for r in t.records]
    accepted = [r for r in records if not r.ticket.skipped]
    assert accepted, "no save was accepted"

    # Every skip reached its caller, and the daemon counted exactly what the callers saw.
    with grpc.insecure_channel(daemon.address) as channel:
        stub = checkpointd_pb2_grpc.CheckpointServiceStub(channel)
        statuses = {s.run: s for s in stub.GetStatus(pb.StatusRequest(), timeout=TIMEOUT).runs}
    # The shared job's savers are runs of their own (one per policy: streams.PolicyRuns), in its folder.
    for run in sorted({t.saver.run for t in trainers}):
        mine = [r for r in records if r.run == run]
        skipped = sum(r.ticket.skipped for r in mine)
        status = statuses[run]
        assert status.saves_skipped == skipped, (run, status)
        assert status.saves_ok == len(mine) - skipped, (run, status)
        assert status.saves_failed == 0, (run, status.last_error)
        assert not status.HasField("in_flight"), (run, status)
    for r in records:
        assert r.ticket.done(), r.ticket
        assert not r.ticket.skipped or r.ticket.reason  # a skip says why

    # Every accepted save is written and holds the values of its call.
    results = []
    for r in accepted:
        result = r.ticket.result(timeout=0)
        results.append(result)
        assert result.step == r.step and result.kind is r.kind, (r.export_dir, result)
        path = daemon.root / r.folder / r.export_dir
        assert result.path == str(path)
        reader = tf.train.load_checkpoint(str(path / "variables" / "variables"))
        stored = {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}
        for key, value in r.expected.items():
            name = key if r.kind is SaveKind.SAVED_MODEL else r.checkpoint_keys[key]
            np.testing.assert_array_equal(stored[name], value, err_msg=f"{path}: {name}")
    saved_models = [r for r in accepted if r.kind is SaveKind.SAVED_MODEL]
    for r in random.Random(0).sample(saved_models, min(SAVED_MODEL_SAMPLE, len(saved_models))):
        loaded = tf.saved_model.load(str(daemon.root / r.folder / r.export_dir))
        assert int(loaded.get_train_step()) == r.step
        for i, variable in enumerate(loaded.model_variables):
            key = f"model_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE"
            np.testing.assert_array_equal(variable.numpy(), r.expected[key])

    peak = max(rss.samples)
    durations = [res.duration_seconds for res in results]
    calls = [r.call_seconds for r in records if not r.ticket.skipped]
    summary = {
        "trainers": len(trainers),
        "runs": len({t.saver.run for t in trainers}),
        "load_seconds": round(loaded_seconds, 1),
        "drained_seconds": round(drained_seconds, 1),
        "save_calls": len(records),
        "accepted": len(accepted),
        "skipped": len(records) - len(accepted),
        "skipped_in_shared_job": sum(r.ticket.skipped for r in records if r.folder == SHARED_RUN),
        "saved_models": len(saved_models),
        "checkpoints": len(accepted) - len(saved_models),
        "throughput_saves_per_s": round(len(accepted) / drained_seconds, 2),
        "accept_to_durable_p50_s": round(percentile(durations, 50), 4),
        "accept_to_durable_p99_s": round(percentile(durations, 99), 4),
        "save_call_p50_s": round(percentile(calls, 50), 4),
        "save_call_p99_s": round(percentile(calls, 99), 4),
        "rss_idle_mib": idle_rss >> 20,
        "rss_peak_mib": peak >> 20,
        "rss_samples": len(rss.samples),
    }
    print("\nload summary:", json.dumps(summary, indent=1))
    assert peak < idle_rss + RSS_BOUND, summary
