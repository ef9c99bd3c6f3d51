"""Crash consistency of training checkpoints: SIGKILL the daemon while a trainer saves, restart, check.

Each trial starts the real daemon on the same root, and a RemoteCheckpointer
(max_to_keep=2) saves a 4 MB state back to back, blocking or not, until the
daemon is killed at a random moment: during an upload, a write, a commit, a
state-file rewrite or a sweep. After the restart (whose recovery has run
once the port is up), the dir must agree with itself:

- no `.checkpointd-tmp-*` dir or file is left;
- the `checkpoint` file, as TensorFlow parses it, names exactly the
  committed checkpoints (those with a manifest), newest last, and no more
  than max_to_keep of them (recovery applied the rules the newest recorded);
- the newest committed step is at least the last one reported durable;
- every committed checkpoint verifies against its manifest, and TensorFlow
  reads from it the values of its step;
- a new RemoteCheckpointer restores the newest.

The incremental variant saves over gRPC (no shared memory) a state whose
64 MiB "frozen" tensor never changes, so each save copies most of its bytes
from the previous checkpoint (its base) while the kill comes: the base and
every committed checkpoint must come through whole.

CHECKPOINTD_CRASH_TRIALS sets the number of trials (default 3).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from checkpointd.cli.verify import verify_paths
from checkpointd.protocol.errors import CheckpointdError
from checkpointd.transport import shm
from checkpointd.transport.shm import default_shm_root
from checkpointd_client import RemoteCheckpointer
from tests.integration.support.daemon import start_daemon

TRIALS = int(os.environ.get("CHECKPOINTD_CRASH_TRIALS", "3"))
RUN, DIR, MAX_TO_KEEP = "crash-train", "train", 2
LIMIT = 60.0


FROZEN = np.arange(16 << 20, dtype=np.float32)  # 64 MiB, the same in every checkpoint


def values(step: int) -> dict[str, np.ndarray]:
    """The state saved at `step`: a function of the step, so any checkpoint can be checked alone."""
    return {"w": np.full((1024, 1024), step, np.float32), "b": np.arange(8, dtype=np.int64) * step}


def _stored(step: int, incremental: bool) -> dict[str, np.ndarray]:
    return {**values(step), "frozen": FROZEN} if incremental else values(step)


class _Trainer(threading.Thread):
    def __init__(self, ckpt: RemoteCheckpointer, w: tf.Variable, b: tf.Variable, first: int, seed: int) -> None:
        super().__init__(daemon=True)
        self.ckpt, self.w, self.b, self.step = ckpt, w, b, first
        self.rng = random.Random(seed)
        self.durable = -1
        self.copied = 0  # payload bytes the daemon copied from a base
        self.killed = threading.Event()
        self.error: BaseException | None = None
        self.progress = threading.Semaphore(0)

    def run(self) -> None:
        while True:
            self.step += 1
            v = values(self.step)
            self.w.assign(v["w"])
            self.b.assign(v["b"])
            try:
                ticket = self.ckpt.save(self.step, blocking=self.rng.random() < 0.5)
                if not ticket.skipped:
                    self.copied += ticket.result(LIMIT).bytes_copied
                    self.durable = self.step
                    self.progress.release()
            except CheckpointdError as e:
                if not self.killed.is_set():
                    self.error = e
                return
            except BaseException as e:  # noqa: BLE001 - reported by the test
                self.error = e
                return


def _leftovers(root: Path) -> list[str]:
    return [
        os.path.join(d, n)
        for d, dirs, names in os.walk(root)
        for n in dirs + names
        if n.startswith(".checkpointd-tmp-")
    ]


def _writing(directory: Path) -> bool:
    """A save's data file is being written in its staging dir (received, or copied from its base), its index not yet."""
    for tmp in directory.glob(".checkpointd-tmp-*"):
        try:
            names = os.listdir(tmp)
        except OSError:
            continue
        if any(n.endswith(".data-00000-of-00001") for n in names) and not any(n.endswith(".index") for n in names):
            return True
    return False


def _wait_writing(directory: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _writing(directory):
            return True
        threading.Event().wait(0.002)
    return False


def _check(root: Path, durable: int, incremental: bool) -> list[str]:
    problems = [f"left behind: {p}" for p in _leftovers(root / RUN)]
    directory = root / RUN / DIR
    committed = sorted(
        (p.name.split(".")[0] for p in directory.glob("*.checkpointd.manifest.json")),
        key=lambda n: int(n.split("-")[1]),
    )
    parsed = tf.train.get_checkpoint_state(str(directory))
    listed = [Path(p).name for p in parsed.all_model_checkpoint_paths] if parsed else []
    if listed != committed:
        problems.append(f"state file lists {listed}, committed are {committed}")
    if parsed and Path(parsed.model_checkpoint_path).name != committed[-1]:
        problems.append(f"state file's newest is {parsed.model_checkpoint_path}, not {committed[-1]}")
    if len(committed) > MAX_TO_KEEP:
        problems.append(f"{len(committed)} checkpoints committed past max_to_keep={MAX_TO_KEEP}")
    if durable >= 0 and (not committed or int(committed[-1].split("-")[1]) < durable):
        problems.append(f"newest committed {committed[-1:]} is older than step {durable}, reported durable")
    for report in verify_paths([directory]):
        if not report.ok and Path(report.path).name in committed:
            problems.append(f"verify {report.path}: {report.reason}")
    for name in committed:
        reader = tf.train.load_checkpoint(str(directory / name))
        step = int(name.split("-")[1])
        for key, want in _stored(step, incremental).items():
            got = reader.get_tensor(f"{key}/.ATTRIBUTES/VARIABLE_VALUE")
            if not np.array_equal(got, want):
                problems.append(f"{name}: {key} is not the value of step {step}")
    return problems


@pytest.mark.parametrize("incremental", [False, True], ids=["shared-memory", "incremental-grpc"])
def test_killing_the_daemon_during_training_checkpoints_leaves_a_dir_that_agrees_with_itself(
    tmp_path: Path, incremental: bool
) -> None:
    root, rng = tmp_path / "root", random.Random(0)
    durable, step, problems = -1, 0, []
    w, b = tf.Variable(values(0)["w"]), tf.Variable(values(0)["b"])
    objects = {"w": w, "b": b, **({"frozen": tf.Variable(FROZEN)} if incremental else {})}
    copied = in_write = 0
    for trial in range(TRIALS + 1):
        daemon = start_daemon(root, tmp_path / "work")
        try:
            if trial:
                problems += [f"trial {trial}: {p}" for p in _check(root, durable, incremental)]
            ckpt = RemoteCheckpointer(
                DIR, daemon.address, run=RUN, max_to_keep=MAX_TO_KEEP, timeout=LIMIT,
                shared_memory=not incremental, **objects,
            )  # fmt: skip
            if trial == TRIALS:
                ckpt.initialize_or_restore()
                newest = int(ckpt.manager.latest_checkpoint.rsplit("-", 1)[1])
                assert np.array_equal(w.numpy(), values(newest)["w"]) and newest >= durable
                ckpt.close()
                break
            trainer = _Trainer(ckpt, w, b, step, rng.randrange(1 << 30))
            trainer.start()
            for _ in range(rng.choice((1, 2, 3))):
                assert trainer.progress.acquire(timeout=LIMIT), f"no durable save: {trainer.error}"
            if incremental and trial % 2:  # inside the write, where the copies from the base run
                in_write += _wait_writing(root / RUN / DIR, LIMIT)
            else:
                threading.Event().wait(rng.uniform(0.0, 0.15))
            trainer.killed.set()
            os.kill(daemon.proc.pid, signal.SIGKILL)
            daemon.proc.wait(LIMIT)
            trainer.join(LIMIT)
            assert not trainer.is_alive(), "the trainer's save did not end after the daemon died"
            assert trainer.error is None, repr(trainer.error)
            durable, step = trainer.durable, trainer.step
            copied += trainer.copied
            ckpt._daemon._channel.close()  # noqa: SLF001 - close() would flush against a dead daemon
        finally:
            if daemon.proc.poll() is None:
                daemon.proc.kill()
                daemon.proc.wait()
            shm_root = default_shm_root()
            if shm_root is not None:
                shm.remove_dead_folders(shm_root)
    if problems:
        pytest.fail("\n".join(problems))
    if incremental:  # the saves the kills interrupted were incremental ones, some killed inside the write
        assert copied >= FROZEN.nbytes and in_write >= 1
