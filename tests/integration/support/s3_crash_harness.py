"""Crash consistency on S3: SIGKILL the daemon during uploads and commits, check the bucket, restart.

Each trial starts the real daemon on `--root s3://BUCKET/PREFIX` (radosgw,
tests/integration/support/rgw.py) with a one-second `--s3-grace-seconds`, and two
trainers save through it at once:

- a policy run (`crash_harness`'s driver: RemotePolicySaver SavedModels and
  checkpoints, blocking and not, into a pool of export dirs, so most saves
  replace an earlier one in place);
- a training run (RemoteCheckpointer, max_to_keep=2, `ckpt-<step>` beside
  each other and the dir's `checkpoint` state file).

The large sizes put a variables file above the daemon's 16 MiB multipart
threshold (two parts each). The daemon is SIGKILLed at a moment the trial's
seeded RNG picks by one of four aims: `random` (a uniform delay after 0-2
durable saves), `multipart` (as soon as a multipart upload is open under the
prefix, plus up to 0.1 s), `unmanifested` (as soon as every file a staged
save lists is in the bucket with its bytes' ETag and its manifest is not:
the window between the last data object and the commit), `stream` (a kill
point inside the streamed write: as soon as a staging dir holds a bundle's
data file being written as the chunks arrive, and no index yet), `parts`
(large sizes: still inside the streamed write, with parts of the data
file's multipart upload already in the bucket), `copies` (large sizes: a
training checkpoint staged and its data file's upload open: an incremental
checkpoint's commit, its unchanged parts being copied from the base
object; only w's first rows change between checkpoints). Aiming is only a
way to get there often; what the kill hit is judged afterwards, per run,
from the frozen state: the daemon's staging dir (its manifest lists the
save's files, sizes and CRC32Cs before the upload starts) against the bucket:

    idle          no save call in flight
    rpc           a call in flight, no staging dir (snapshot transfer, queue)
    write         a staging dir without a manifest (the format writes)
    upload        staged; some files not up, no multipart upload open
    multipart     staged; a multipart upload open under the save's keys
    unmanifested  every file up with its bytes, no manifest: the commit's eve
    state-file    committed, the `checkpoint` state file not yet naming it
    committed     committed, the reply not yet received (or staging not yet gone)

After the kill, with the daemon dead, the bucket is read with boto3:
- every manifest's objects are there with the listed size, the ETag it
  recorded and the listed CRC32C (each object version read back once);
- the `checkpoint` state file names committed checkpoints only, its newest
  at least the newest reported durable;
- a dir the trainer saw durable is committed at that step or newer, unless
  the cut save was replacing it (S3 overwrites in place: the old save stops
  counting first);
- the newest save of each run loads (a SavedModel's train step, every key of
  a checkpoint, the training values of its step), through the store's own
  `local_copy` (the daemon's restore path);
- leftovers are counted: objects no manifest lists, open multipart uploads.

The next trial's daemon start is the restart, no sooner than two grace
ages after the kill (recovery leaves younger objects alone: they could be a
peer's save in progress); once it reports its recovery done (its bucket tidy runs after it serves), and then: no leftover and no staging dir is left, every
committed object is as it was (same size, ETag and time; only training
checkpoints past max_to_keep may go, as the newest save's rules say), the
planted unrelated objects survive, and RemoteCheckpointer restores the
newest checkpoint. The state file: a daemon alone rewrites it in its
recovery, so it names exactly the committed checkpoints, no more than
max_to_keep; a daemon with run leases (a fleet's) leaves it to the run's
holder at its next checkpoint, so it is checked as after a kill. At
the end every committed save is loaded, the newest policy save once more
through `checkpointd fetch`, and the prefix is deleted (the memstore OSD
holds stored bytes in RAM).

What a listing says is confirmed with HEAD before it is reported (an object
listed but gone, or gone from the listing but there): radosgw completes its
bucket index asynchronously, and a listing once showed an object recovery
had just deleted.

One wait is not what the trials test and is kept short: the daemon runs
with the shortest lease ttl (`--lease-seconds 3`, where leases exist),
since the killed daemon's leases hold its runs until they expire. (The
daemon imports no TensorFlow, so a run registers as soon as it listens.)

Long mode (the pytest test runs a short subset; CHECKPOINTD_CRASH_TRIALS
changes its count; without CHECKPOINTD_TEST_S3_ENDPOINT it starts its own
radosgw through scripts/rgw.sh and stops it):

    python -m tests.integration.support.s3_crash_harness --trials 50
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import math
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from bench import rgw  # noqa: E402
from bench.rgw import Rgw  # noqa: E402
from checkpointd.core.config import ServeConfig  # noqa: E402
from checkpointd.protocol.errors import CheckpointdError  # noqa: E402
from checkpointd.storage.s3 import S3Store, error_code  # noqa: E402
from checkpointd.transport import shm  # noqa: E402
from checkpointd.transport.shm import default_shm_root  # noqa: E402
from checkpointd_client import RemoteCheckpointer, RemotePolicySaver  # noqa: E402
from tests.integration.support import crash_harness, policies, s3_bucket  # noqa: E402
from tests.integration.support.daemon import Daemon, start_daemon  # noqa: E402

MANIFEST, PREFIX_MANIFEST = s3_bucket.MANIFEST, s3_bucket.PREFIX_MANIFEST
# Hidden layers of the policy's QNetwork: ~400 parameters; ~5.3M (21 MB of variables, 2 parts).
SIZES = {"small": (16,), "large": (2304, 2304)}
# The training state's big tensor: 64 KB, or 19 MB (2 parts).
TRAIN_SHAPES = {"small": (128, 128), "large": (2048, 2304)}
PHASES = s3_bucket.PHASES
AIMS = ("random", "multipart", "unmanifested", "stream", "parts", "copies")
TRAIN_DIR, MAX_TO_KEEP = "train", 2
GRACE_SECONDS = 1.0
# The killed daemon's run leases block its successor (another holder) until
# they expire: the shortest ttl keeps that wait short (where leases exist).
_LEASE_ARGS = ("--lease-seconds", "3") if "lease_seconds" in {f.name for f in dataclasses.fields(ServeConfig)} else ()
# A daemon sharing the bucket (leases) leaves the state files of training
# dirs to each run's holder, which rewrites them at its next checkpoint; a
# daemon alone rewrites them and applies max_to_keep in its start's recovery.
_FLEET = bool(_LEASE_ARGS)
_DEADLINE = 120.0


@dataclass
class Figures:
    """What the trials did and found."""

    trials: int = 0
    kills: collections.Counter[str] = field(default_factory=collections.Counter)  # "policy multipart"
    aims: collections.Counter[str] = field(default_factory=collections.Counter)
    saves_durable: int = 0
    saves_cut: int = 0
    bytes_copied: int = 0  # by the training run's incremental checkpoints, from their base, in the bucket
    save_checks: int = 0  # committed saves checked against the bucket, summed over the checks
    objects_read_back: int = 0  # object versions read in full for their CRC32C
    loads: int = 0
    leftover_objects: int = 0  # found after the kills (every one must be gone after the restart)
    leftover_uploads: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        kills = "; ".join(
            f"{who}: " + ", ".join(f"{p} {self.kills[f'{who} {p}']}" for p in PHASES if self.kills[f"{who} {p}"])
            for who in ("policy", "training")
        )
        aims = ", ".join(f"{a} {self.aims[a]}" for a in AIMS)
        return (
            f"{self.trials} trials in {self.seconds:.1f}s (aimed {aims}); kills during {kills}; "
            f"{self.saves_durable} saves durable, {self.saves_cut} cut by a kill; "
            f"{self.bytes_copied} bytes of checkpoints copied from their base; "
            f"{self.save_checks} save checks against the bucket ({self.objects_read_back} objects read back), "
            f"{self.loads} loads; leftovers cleaned by recovery: {self.leftover_objects} objects, "
            f"{self.leftover_uploads} multipart uploads; {len(self.failures)} failures"
        )


def train_values(step: int, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """The training state at `step`: a function of the step, so any checkpoint can be checked alone.

    Only w's first rows change with the step (as a replay buffer's newest
    rows do): an incremental checkpoint copies the rest from its base.
    """
    w = np.full(shape, -1.0, np.float32)
    w[: max(1, shape[0] // 32)] = step
    return {"w": w, "b": np.arange(8, dtype=np.int64) * step}


# The trainers.


class _Trainer(threading.Thread):
    """The training run: RemoteCheckpointer saves back to back until one fails (the daemon died)."""

    def __init__(self, ckpt: RemoteCheckpointer, w: tf.Variable, b: tf.Variable, first: int, seed: int) -> None:
        super().__init__(name="trainer", daemon=True)
        self.ckpt, self.w, self.b, self.step = ckpt, w, b, first
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.pending: int | None = None  # the step of the save call in flight
        self.durable = -1  # the newest step reported durable
        self.saves = 0  # how many were
        self.copied = 0  # payload bytes the durable ones copied from their base
        self.cut = 0
        self.killed = threading.Event()
        self.first_durable = threading.Event()  # one checkpoint of this trial committed
        self.first_copied = threading.Event()  # one committed incrementally (bytes copied from its base)
        self.error: BaseException | None = None

    def run(self) -> None:
        while True:
            self.step += 1
            v = train_values(self.step, tuple(self.w.shape))
            self.w.assign(v["w"])
            self.b.assign(v["b"])
            with self.lock:
                self.pending = self.step
            try:
                ticket = self.ckpt.save(self.step, blocking=self.rng.random() < 0.5)
                if not ticket.skipped:  # one save at a time: none is skipped, but the API allows it
                    result = ticket.result(_DEADLINE)
                    self.durable, self.saves = self.step, self.saves + 1
                    self.copied += result.bytes_copied
                    self.first_durable.set()
                    if result.bytes_copied:
                        self.first_copied.set()
            except CheckpointdError as exc:
                if not self.killed.is_set():
                    self.error = exc
                self.cut += 1
                return
            except BaseException as exc:  # noqa: BLE001 - reported by the trial
                self.error = exc
                return
            with self.lock:
                self.pending = None


# The trials.


@dataclass
class _S3:
    """Where the daemons write: the server, the bucket's prefix and the daemons' local dirs."""

    rgw: Rgw
    prefix: str
    work: Path

    @property
    def url(self) -> str:
        return f"s3://{self.rgw.bucket}/{self.prefix}"

    def start(self) -> Daemon:
        return start_daemon(
            self.url,  # type: ignore[arg-type]  # passed to --root as str(root)
            self.work / "daemon",
            "--work-dir", str(self.work / "state"),
            "--s3-endpoint-url", self.rgw.endpoint,
            "--s3-region", "us-east-1",
            "--s3-grace-seconds", str(GRACE_SECONDS),
            *_LEASE_ARGS,
            env=self.rgw.daemon_env(),
        )  # fmt: skip


class _Harness:
    def __init__(self, s3: _S3, size: str, seed: int, figures: Figures, log: Callable[[str], None]) -> None:
        self.s3, self.size, self.figures, self.log = s3, size, figures, log
        self.rng = random.Random(seed)
        self.base = f"{s3.prefix}/"
        self.reader = s3_bucket.Reader(s3.rgw.client(), s3.rgw.bucket, self.base)
        self.store = S3Store(s3.url, s3.work / "harness-copies", client=self.reader.client)
        self.staging = s3_bucket.Staging(s3.work / "state", self.base)
        policy = policies.build(policies.q(SIZES[size]))
        self.run = crash_harness._Run(f"s3crash-{size}", size, policy, tf.Variable(0, dtype=tf.int64))  # noqa: SLF001
        self.train_run = f"s3train-{size}"
        shape = TRAIN_SHAPES[size]
        self.w, self.b = tf.Variable(train_values(0, shape)["w"]), tf.Variable(train_values(0, shape)["b"])
        self.train_step, self.train_durable = 0, -1
        self.planted = {
            f"{self.base}notes.txt": b"beside the runs",
            f"{self.base}{self.run.name}/notes.txt": b"in a run's folder",
            f"{self.base}{self.train_run}/{TRAIN_DIR}/notes.txt": b"in a training dir",
        }
        for key, body in self.planted.items():
            self.reader.client.put_object(Bucket=s3.rgw.bucket, Key=key, Body=body)
        self.steps = iter(range(1, 1 << 62))
        self.cycle = 0.5
        self.loaded: set[str] = set()
        self.last = ("", "", "")  # the last trial's aim and phases (policy, training)
        self.killed_at = -math.inf
        self.timing: collections.defaultdict[str, float] = collections.defaultdict(float)  # seconds per step

    @property
    def state_key(self) -> str:
        return f"{self.base}{self.train_run}/{TRAIN_DIR}/checkpoint"

    def _committed_checkpoints(self, bucket: s3_bucket.Bucket) -> list[str]:
        base = f"{self.base}{self.train_run}/{TRAIN_DIR}/"
        names = [k[len(base) : -len(PREFIX_MANIFEST)] for k in bucket.manifests if k.startswith(base)]
        return sorted(names, key=lambda n: int(n.rpartition("-")[2]))

    def trials(self, count: int) -> None:
        before: s3_bucket.Bucket | None = None
        for trial in range(count + 1):
            # Recovery deletes leftovers older than the grace age only (a
            # peer's save in progress is younger): the kill's must be older.
            threading.Event().wait(max(0.0, self.killed_at + 2 * GRACE_SECONDS - time.monotonic()))
            began = time.monotonic()
            daemon = self.s3.start()
            daemon.wait_recovered()  # the bucket's tidy runs after the daemon serves
            self.timing["start"] += time.monotonic() - began
            try:
                with self._timed("after restart"):
                    problems = self._after_restart(before) if before is not None else []
                if trial == count:
                    problems += self._final()
                    self.figures.failures += [f"after trial {trial}: {p}" for p in problems]
                    break
                before = self._trial(daemon, problems)
                self.figures.failures += [f"trial {trial}: {p}" for p in problems]
                for problem in problems:
                    self.log(f"PROBLEM trial {trial}: {problem}")
                self.figures.trials += 1
            finally:
                if daemon.proc.poll() is None:
                    daemon.proc.kill()
                    daemon.proc.wait()
                shm_root = default_shm_root()
                if shm_root is not None:
                    shm.remove_dead_folders(shm_root)
            self.log(
                f"trial {trial:3d}: aimed {self.last[0]:12s} killed the policy run during {self.last[1]:12s} "
                f"the training run during {self.last[2]:12s} {len(problems)} problems; seconds so far: "
                + ", ".join(f"{k} {v:.0f}" for k, v in self.timing.items())
            )

    def _after_restart(self, before: s3_bucket.Bucket) -> list[str]:
        """Recovery has run: no leftover, nothing committed touched, the state file agrees."""
        problems = [f"staging left after the restart: {p}" for p in self.staging.dirs()]
        self.staging.forget()
        after = self.reader.snapshot()
        for left in s3_bucket.leftovers(after, set(self.planted)):
            # A listing can show a just-deleted object for a moment (rgw
            # completes its bucket index asynchronously): read it directly.
            if left.startswith("multipart upload of ") or self.reader.head(left) is not None:
                problems.append(f"left after the restart: {left}")
        problems += [f"planted {k} is gone" for k in self.planted if k not in after.objects]
        kept = set(self._committed_checkpoints(before)[-MAX_TO_KEEP:])
        for key in before.listed():
            was, now = before.objects.get(key), after.objects.get(key)
            if was is None or was == now:
                continue  # (an object missing from the kill's listing was looked for then)
            if now is None:
                head = self.reader.head(key)  # a listing may miss it for a moment
                if head is not None and head[:2] == was[:2]:
                    continue
            name = key.rpartition("/")[2].split(".")[0]
            prefix_dir = f"{self.base}{self.train_run}/{TRAIN_DIR}/"
            if key.startswith(prefix_dir) and name not in kept and now is None:
                continue  # past max_to_keep: recovery's sweep may delete it (manifest first)
            problems.append(f"committed {key} was touched by the restart: {was} -> {now}")
        committed = self._committed_checkpoints(after)
        names = s3_bucket.state_names(self.reader, self.state_key, self.s3.work / "state-file")
        if _FLEET:  # the run's holder rewrites its state file at its next checkpoint
            problems += self._check_state_file(names, committed)
        else:  # recovery rewrote it and applied max_to_keep
            if committed and names != committed:
                problems.append(f"after recovery the state file names {names}, the committed are {committed}")
            if len(committed) > MAX_TO_KEEP:
                problems.append(f"{len(committed)} checkpoints committed past max_to_keep={MAX_TO_KEEP}")
        self.figures.save_checks += len(after.manifests)
        problems += s3_bucket.check_manifests(after, self.reader)
        return problems

    def _trial(self, daemon: Daemon, problems: list[str]) -> s3_bucket.Bucket:
        """Registers both runs, saves, kills; checks the bucket; returns it as the kill left it."""
        # Both runs at once: each may wait for the killed daemon's lease to expire.
        opened: dict[str, Any] = {}

        def open_checkpointer() -> None:
            try:
                opened["ckpt"] = RemoteCheckpointer(  # restores the newest committed checkpoint
                    TRAIN_DIR, daemon.address, run=self.train_run, max_to_keep=MAX_TO_KEEP, timeout=_DEADLINE,
                    w=self.w, b=self.b,
                )  # fmt: skip
            except BaseException as exc:  # noqa: BLE001 - raised below
                opened["error"] = exc

        with self._timed("register"):
            opening = threading.Thread(target=open_checkpointer, name="open-checkpointer", daemon=True)
            opening.start()
            try:
                saver = RemotePolicySaver(
                    self.run.policy, daemon.address, run=self.run.name, train_step=self.run.train_step,
                    timeout=_DEADLINE,
                )  # fmt: skip
                saver.register()
            finally:
                opening.join(_DEADLINE)
            if "ckpt" not in opened:
                raise RuntimeError(f"RemoteCheckpointer failed: {opened.get('error')!r}\n{daemon.log()[-3000:]}")
            ckpt = opened["ckpt"]
        # The constructor restored the newest committed checkpoint (or none).
        if self.train_durable >= 0:
            newest = int(self.w.numpy().flat[0])
            if newest < self.train_durable:
                problems.append(f"RemoteCheckpointer restored step {newest}, step {self.train_durable} was durable")
        driver = crash_harness._Driver(saver, self.run, lambda: next(self.steps), self.rng.randrange(1 << 32))  # noqa: SLF001
        trainer = _Trainer(ckpt, self.w, self.b, self.train_step, self.rng.randrange(1 << 32))
        try:
            driver.start()
            trainer.start()
            if self.figures.trials == 0:
                # The first kill comes after a checkpoint committed incrementally (a
                # base, then one copied from it; never replaced in place, unlike a policy
                # export dir), so every run has a manifest to check, a save to load and a
                # copy from a base to prove, however the load on the machine times the kills.
                # (Only the large state spans chunks to copy.)
                first = trainer.first_copied if self.size == "large" else trainer.first_durable
                until = time.monotonic() + _DEADLINE
                while trainer.is_alive() and time.monotonic() < until and not first.wait(0.05):
                    pass  # a trainer that failed ends the wait; its error is reported below
            aim = self.rng.choice(AIMS if self.size == "large" else ("random", "unmanifested", "stream"))
            self.figures.aims[aim] += 1
            self.last = (aim, "", "")
            with self._timed("saves"):
                self._aim(aim, driver)
            driver.killed.set()
            trainer.killed.set()
            os.kill(daemon.proc.pid, signal.SIGKILL)
            daemon.proc.wait(_DEADLINE)
            self.killed_at = time.monotonic()
            with driver.lock, trainer.lock:
                policy_call, train_call = driver.pending, trainer.pending
            driver.join(_DEADLINE)
            trainer.join(_DEADLINE)
            for who, thread in (("policy", driver), ("training", trainer)):
                if thread.is_alive():
                    problems.append(f"the {who} trainer's save did not end after the daemon died")
                if thread.error is not None:
                    problems.append(f"the {who} trainer failed: {thread.error!r}")
        finally:
            for client in (saver, ckpt):
                client._daemon._channel.close()  # noqa: SLF001 - close() would flush against a dead daemon
        self.figures.saves_durable += driver.durable + trainer.saves
        self.figures.saves_cut += driver.cut + trainer.cut
        self.figures.bytes_copied += trainer.copied
        if driver.cycle:
            self.cycle = sum(driver.cycle) / len(driver.cycle)
        self.train_step, self.train_durable = trainer.step, max(self.train_durable, trainer.durable)
        run_base, train_base = f"{self.base}{self.run.name}/", f"{self.base}{self.train_run}/"
        pending = (
            None
            if policy_call is None
            else s3_bucket.Pending(
                policy_call[0].rpartition("/")[2], policy_call[1], f"{run_base}{policy_call[0]}/{MANIFEST}"
            ),
            None
            if train_call is None
            else s3_bucket.Pending(
                f"ckpt-{train_call}", train_call, f"{train_base}{TRAIN_DIR}/ckpt-{train_call}{PREFIX_MANIFEST}"
            ),
        )
        with self._timed("after kill"):
            return self._after_kill(pending, problems)

    @contextlib.contextmanager
    def _timed(self, what: str) -> Iterator[None]:
        began = time.monotonic()
        try:
            yield
        finally:
            self.timing[what] += time.monotonic() - began

    def _aim(self, aim: str, driver: crash_harness._Driver) -> None:  # noqa: SLF001
        """Returns at the moment to kill."""
        if aim == "random":
            driver.wait_saves(self.rng.choice((0, 1, 2)), _DEADLINE)
            threading.Event().wait(self.rng.uniform(0.0, 1.5 * self.cycle))
            return
        driver.wait_saves(self.rng.choice((0, 1)), _DEADLINE)
        deadline = time.monotonic() + 4 * self.cycle + 5.0
        while time.monotonic() < deadline:  # polling the bucket for a moment, with a deadline
            if aim == "multipart":
                if self.reader.uploads(self.base):
                    threading.Event().wait(self.rng.uniform(0.0, 0.1))
                    return
            elif aim == "stream":
                if any(_streaming(d) for d in self.staging.dirs()):
                    return
            elif aim == "parts":
                if any(_streaming(d) for d in self.staging.dirs()) and self._parts_up():
                    return
            elif aim == "copies":  # a training checkpoint's commit: its parts copied from the base
                staged = [s for s in map(self.staging.staged, self.staging.dirs()) if s is not None]
                train = f"{self.base}{self.train_run}/"
                if any(s.manifest_key.startswith(train) for s in staged) and self.reader.uploads(train):
                    threading.Event().wait(self.rng.uniform(0.0, 0.05))
                    return
            else:
                staged = [s for s in map(self.staging.staged, self.staging.dirs()) if s is not None]
                if staged:
                    objects = {o["Key"]: (o["Size"], o["ETag"].strip('"')) for o in self.reader.keys(self.base)}
                    for s in staged:
                        if s.manifest_key not in objects and all(objects.get(k) == v for k, v in s.files.items()):
                            return
        # Not seen in time (e.g. every upload was too quick): kill now, judged as it lands.

    def _parts_up(self) -> bool:
        """Whether a multipart upload under the prefix has a part in the bucket."""
        for key, upload_id in self.reader.uploads(self.base):
            try:
                listed = self.reader.client.list_parts(Bucket=self.reader.bucket, Key=key, UploadId=upload_id)
            except Exception as e:
                if error_code(e) in ("NoSuchUpload", "NoSuchKey", "404"):  # completed or aborted since listed
                    continue
                raise
            if listed.get("Parts"):
                return True
        return False

    def _after_kill(
        self, pending: tuple[s3_bucket.Pending | None, s3_bucket.Pending | None], problems: list[str]
    ) -> s3_bucket.Bucket:
        staged_dirs = [(p, self.staging.staged(p)) for p in self.staging.dirs()]
        bucket = self.reader.snapshot()
        state = s3_bucket.state_names(self.reader, self.state_key, self.s3.work / "state-file")
        phases = (
            s3_bucket.phase(pending[0], staged_dirs, bucket, None),
            s3_bucket.phase(pending[1], staged_dirs, bucket, state or []),
        )
        self.figures.kills[f"policy {phases[0]}"] += 1
        self.figures.kills[f"training {phases[1]}"] += 1
        self.last = (self.last[0], *phases)
        self.figures.save_checks += len(bucket.manifests)
        problems += s3_bucket.check_manifests(bucket, self.reader)
        committed = self._committed_checkpoints(bucket)
        problems += self._check_state_file(state, committed)
        if self.train_durable >= 0 and (not committed or int(committed[-1].rpartition("-")[2]) < self.train_durable):
            problems.append(f"newest committed checkpoint {committed[-1:]} is older than durable {self.train_durable}")
        run_base = f"{self.base}{self.run.name}/"
        for export_dir, step in self.run.floor.items():
            key = f"{run_base}{export_dir}/{MANIFEST}"
            doc = bucket.manifests.get(key)
            if doc is None and pending[0] is not None and pending[0].manifest_key == key:
                continue  # the cut save was replacing it in place: the old one stopped counting first
            if doc is None or doc["step"] < step:
                problems.append(f"{export_dir}: durable at step {step}, now {doc and doc['step']}")
        for export_dir, _ in crash_harness.POOL:
            doc = bucket.manifests.get(f"{run_base}{export_dir}/{MANIFEST}")
            if doc is not None and doc["step"] not in self.run.sent[export_dir]:
                problems.append(f"{export_dir}: holds step {doc['step']}, never sent there")
        self.run.floor = {
            d: bucket.manifests[f"{run_base}{d}/{MANIFEST}"]["step"]
            for d, _ in crash_harness.POOL
            if f"{run_base}{d}/{MANIFEST}" in bucket.manifests
        }
        leftovers = s3_bucket.leftovers(bucket, set(self.planted))
        self.figures.leftover_uploads += len(bucket.uploads)
        self.figures.leftover_objects += len(leftovers) - len(bucket.uploads)
        problems += self._load_newest()
        return bucket

    def _check_state_file(self, names: list[str] | None, committed: list[str]) -> list[str]:
        """The state file names committed checkpoints only, its newest at least the newest reported durable."""
        if names is None:
            return [f"no state file, step {self.train_durable} was durable"] if self.train_durable >= 0 else []
        problems = []
        if not set(names) <= set(committed):
            problems.append(f"the state file names {names}, only {committed} are committed")
        if self.train_durable >= 0 and (not names or int(names[-1].rpartition("-")[2]) < self.train_durable):
            problems.append(f"the state file's newest of {names} is older than step {self.train_durable}, durable")
        return problems

    def _saves(self, run: str) -> list[Any]:
        return sorted(self.store.committed(run, None), key=lambda s: (s.step, str(s.path)))

    def _load_newest(self) -> list[str]:
        problems = []
        for run in (self.run.name, self.train_run):
            saves = self._saves(run)
            if saves and str(saves[-1].path) not in self.loaded:
                problems += self._load(saves[-1])
        return problems

    def _load(self, save: Any) -> list[str]:
        """Loads a committed save through the store's local copy; returns the problems."""
        self.figures.loads += 1
        self.loaded.add(str(save.path))
        try:
            with self.store.local_copy(save) as local:
                path = str(local.path)
                if save.kind.value == "saved_model":
                    got = int(tf.saved_model.load(path).get_train_step())
                elif save.kind.value == "checkpoint":
                    reader = tf.train.load_checkpoint(str(Path(path) / "variables" / "variables"))
                    for key in reader.get_variable_to_shape_map():
                        reader.get_tensor(key)
                    got = int(reader.get_tensor(crash_harness._TRAIN_STEP_KEY))  # noqa: SLF001
                else:
                    reader = tf.train.load_checkpoint(path)
                    want = train_values(save.step, TRAIN_SHAPES[self.size])
                    for key, value in want.items():
                        if not np.array_equal(reader.get_tensor(f"{key}/.ATTRIBUTES/VARIABLE_VALUE"), value):
                            return [f"{save.path}: {key} is not the value of step {save.step}"]
                    got = save.step
        except Exception as exc:  # noqa: BLE001 - any load error is the finding
            return [f"{save.path}: does not load: {type(exc).__name__}: {exc}"]
        return [] if got == save.step else [f"{save.path}: holds train step {got}, its manifest says {save.step}"]

    def _final(self) -> list[str]:
        """Every committed save loads; the newest policy save also through `checkpointd fetch`."""
        problems = []
        self.loaded.clear()
        for run in (self.run.name, self.train_run):
            for save in self._saves(run):
                problems += self._load(save)
        saves = [s for s in self._saves(self.run.name) if s.kind.value == "saved_model"]
        if saves:
            dest = self.s3.work / "fetched"
            shutil.rmtree(dest, ignore_errors=True)
            env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
            fetched = subprocess.run(
                [sys.executable, "-m", "checkpointd", "fetch", "--root", self.s3.url,
                 f"{self.run.name}/{saves[-1].export_dir}", str(dest), "--s3-endpoint-url", self.s3.rgw.endpoint,
                 "--s3-region", "us-east-1"],
                capture_output=True, text=True, timeout=_DEADLINE, env={**env, **self.s3.rgw.daemon_env()},
            )  # fmt: skip
            if fetched.returncode != 0:
                problems.append(f"checkpointd fetch failed: {fetched.stderr[-2000:]}")
            elif int(tf.saved_model.load(str(dest)).get_train_step()) != saves[-1].step:
                problems.append(f"fetched {saves[-1].path} does not hold step {saves[-1].step}")
            else:
                self.figures.loads += 1
        return problems

    def close(self) -> None:
        self.store.close()
        self.reader.delete_all()


def _streaming(staging: Path) -> bool:
    """Whether a staged save is inside its streamed write: a bundle's data file there, its index not yet."""
    for bundle_dir, stem in ((staging / "variables", "variables"), (staging, "ckpt")):
        try:
            names = os.listdir(bundle_dir)
        except OSError:  # a training checkpoint's staging has no variables/, or the save is over
            continue
        if any(n.startswith(f"{stem}.data-") for n in names) and f"{stem}.index" not in names:
            return True
    return False


def run_trials(
    trials: int,
    server: Rgw,
    workdir: Path,
    *,
    size: str = "small",
    seed: int = 0,
    log: Callable[[str], None] = lambda line: None,
) -> Figures:
    """Runs `trials` kill-and-restart trials on a fresh prefix of the bucket; deletes the prefix after."""
    figures = Figures()
    started = time.monotonic()
    s3 = _S3(server, f"crash-{secrets.token_hex(4)}", workdir)
    harness = _Harness(s3, size, seed, figures, log)
    try:
        harness.trials(trials)
    finally:
        figures.objects_read_back = harness.reader.read_back
        harness.close()
    figures.seconds = time.monotonic() - started
    return figures


def _start_rgw(workdir: Path) -> Rgw:
    try:
        return rgw.start(workdir)
    except rgw.Unavailable as e:
        raise SystemExit(str(e)) from e


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=int(os.environ.get("CHECKPOINTD_CRASH_TRIALS", "50")))
    parser.add_argument("--size", choices=sorted(SIZES), default="large")
    parser.add_argument("--seed", type=int, default=int(os.environ.get("CHECKPOINTD_FUZZ_SEED", "0")))
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error("--trials must be >= 1")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    base = Path(tempfile.mkdtemp(prefix="checkpointd-s3crash-"))
    endpoint = os.environ.get("CHECKPOINTD_TEST_S3_ENDPOINT")
    env = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "CHECKPOINTD_TEST_S3_"))}
    server = Rgw(base / "rgw", env, 0.0, _stopped=True) if endpoint else _start_rgw(base / "rgw")
    try:
        figures = run_trials(args.trials, server, base / "work", size=args.size, seed=args.seed, log=print)
    finally:
        server.stop()
    for failure in figures.failures:
        print("FAILURE", failure)
    print(figures.summary())
    if args.json:
        print(json.dumps({**figures.__dict__, "kills": dict(figures.kills), "aims": dict(figures.aims)}))
    if figures.failures:
        print(f"daemon logs kept in {base}")
        return 1
    shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
