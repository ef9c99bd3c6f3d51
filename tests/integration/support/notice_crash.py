"""Crash consistency of the save on notice: a trainer gets SIGTERM, then it or its daemon is SIGKILLed mid-save.

Each trial starts the real daemon on the same root (under
`tests.integration.support.slow_sync`, as `crash_harness` does, so a kill can land in
the group commit) and a trainer process (this module's `trainer` mode:
`tests.integration.support.dqn`'s DQN with a ballast variable of BALLAST_MB, a
`RemoteCheckpointer` of `train` with its default save on notice; one save at
step 3, waited for, then training on). Past step 5 the trainer gets SIGTERM,
so its checkpointer takes the save on notice; then the kill, at one of these
kill points (the trial's `point`):

- `daemon-staged`: the daemon, as soon as the save on notice has a temp dir
  in `train/` (being streamed, or handed over through shared memory);
- `daemon-commit`: the daemon, as soon as that temp dir holds its manifest
  (inside the group commit, before the rename);
- `daemon-published`: the daemon, as soon as the new checkpoint's manifest is
  in `train/` (committed; its reply may not have reached the trainer);
- `trainer-staged`: the trainer, as soon as the temp dir exists;
- `trainer-early`: the trainer, at a random moment in the first
  EARLY_SECONDS after its SIGTERM (snapshotting, or sending).

A killed daemon is restarted; a daemon whose trainer was killed must still
serve, and is stopped with SIGTERM (it finishes or discards what it holds)
and restarted. Then, with recovery done:

- no temp dir of the daemon is left in the run;
- every committed checkpoint (a `ckpt-N` with its manifest) verifies, files
  and CRCs: complete or absent, never partial; TensorFlow's `checkpoint`
  state file names only committed checkpoints;
- the step 3 save is committed, and a step the trainer logged as "saved,
  durable" on notice is committed;
- a trainer whose daemon was killed ends by its notice deadline (plus the
  backstop's 3 s), having logged what was lost (or what it saved);
- a new `RemoteCheckpointer` on the restarted daemon restores the newest
  committed checkpoint: its train step and ballast are that save's, as
  TensorFlow's own reader reads them from its files. (The trainer fills the
  ballast with a value of each step after the train step, so a save on
  notice between the two holds the previous step's: a point in time.)

Long mode (the pytest test runs one trial per kill point):

    python -m tests.integration.support.notice_crash --trials 20
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

POINTS = ("daemon-staged", "daemon-commit", "daemon-published", "trainer-staged", "trainer-early")
RUN = "notice-crash"
BALLAST_MB = 24  # enough that the save on notice takes a while to write, so the kill points are reachable
SAVED_AT = 3
NOTICE_AT = 5  # the trainer gets SIGTERM once it printed a step past this
NOTICE_DEADLINE = 10.0  # the trainer's notice_deadline: with its daemon killed it ends by this plus BACKSTOP
BACKSTOP = 3.0  # checkpointd_client.notice ends the process this long after the deadline at the latest
EARLY_SECONDS = 0.3
_WAIT = 120.0  # any other wait of a trial: a start, a step, a stop
SAVED = re.compile(r"preempted at step (\d+): saved, durable in \d+ ms")
NOT_SAVED = re.compile(r"preempted at step (\d+): not saved: (.+)")


def _ballast_value(step: int) -> float:
    """The value the trainer fills its ballast with at `step`: a restore shows which save it read."""
    return float(step) + 0.5


def trainer_main(address: str, run: str, ballast_mb: int) -> int:
    """The trainer process: trains until SIGTERM ends it, printing `step N` after each step."""
    import logging

    import tensorflow as tf
    from tf_agents.utils import common

    from checkpointd_client import RemoteCheckpointer
    from tests.integration.support import dqn

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    trainer = dqn.build(seed=1)
    trainer.agent.train = common.function(trainer.agent.train)
    ballast = tf.Variable(tf.zeros([ballast_mb << 18]), name="ballast")  # float32: MB * 2**18 of them
    checkpointer = RemoteCheckpointer(
        "train", address, run=run, timeout=_WAIT, notice_deadline=NOTICE_DEADLINE,
        agent=trainer.agent, train_step=trainer.train_step, ballast=ballast,
    )  # fmt: skip
    iterator = iter(trainer.dataset_fn())
    while True:
        trainer.agent.train(next(iterator)[0])
        step = int(trainer.train_step.numpy())
        ballast.assign(tf.fill(ballast.shape, _ballast_value(step)))
        if step == SAVED_AT:
            assert checkpointer.save(trainer.train_step).result(_WAIT) is not None
            print(f"saved {step}", flush=True)
        print(f"step {step}", flush=True)


@dataclass
class Figures:
    """What the trials did and found."""

    trials: int = 0
    points: collections.Counter[str] = field(default_factory=collections.Counter)
    reached: collections.Counter[str] = field(default_factory=collections.Counter)  # kill point seen before the kill
    committed_on_notice: int = 0  # trials whose save on notice was committed
    told_durable: int = 0  # trials whose trainer logged its save on notice durable
    restores: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        points = ", ".join(f"{p} {self.points[p]} ({self.reached[p]} reached)" for p in POINTS if self.points[p])
        return (
            f"{self.trials} trials in {self.seconds:.1f}s; kills: {points}; saves on notice: "
            f"{self.committed_on_notice} committed, {self.told_durable} told durable; {self.restores} restores "
            f"checked; {len(self.failures)} failures"
        )


class _Trainer:
    """The trainer subprocess, its stdout read as it comes and its stderr in a file."""

    def __init__(self, address: str, log: Path) -> None:
        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.integration.support.notice_crash", "trainer", address, RUN, str(BALLAST_MB)],
                stdout=subprocess.PIPE, stderr=err, text=True,
            )  # fmt: skip
        self.step = 0
        self._moved = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("step "):
                with self._moved:
                    self.step = int(line.split()[1])
                    self._moved.notify_all()

    def wait_step(self, step: int) -> None:
        with self._moved:
            if not self._moved.wait_for(lambda: self.step >= step or self.proc.poll() is not None, _WAIT):
                raise RuntimeError(f"the trainer did not reach step {step}; see {self.log}")
        if self.step < step:
            raise RuntimeError(f"the trainer exited ({self.proc.poll()}) before step {step}; see {self.log}")

    def said(self) -> str:
        return self.log.read_text(errors="replace")


def _staged(train: Path) -> list[Path]:
    """The daemon's temp dirs in `train` (a save being written)."""
    from checkpointd.storage import local

    try:
        return [train / n for n in os.listdir(train) if n.startswith(local.TMP_PREFIX)]
    except FileNotFoundError:
        return []


def _committed(train: Path) -> set[int]:
    """The steps of the checkpoints committed in `train` (their manifests)."""
    from checkpointd.storage.save_manifest import PREFIX_MANIFEST_SUFFIX

    return {
        int(p.name[len("ckpt-") : -len(PREFIX_MANIFEST_SUFFIX)]) for p in train.glob("ckpt-*" + PREFIX_MANIFEST_SUFFIX)
    }


def _kill_point(point: str, train: Path, before: set[int], rng: random.Random) -> bool:
    """Waits for `point`'s moment of the save on notice; whether it came (else the save was quicker)."""
    from tests.integration.support.crash_harness import until

    if point.endswith("-staged"):
        return until(lambda: bool(_staged(train)), 10.0)
    if point == "daemon-commit":
        from checkpointd.storage import save_manifest

        return until(lambda: any((t / save_manifest.MANIFEST_NAME).exists() for t in _staged(train)), 10.0)
    if point == "daemon-published":
        return until(lambda: bool(_committed(train) - before), 10.0)
    threading.Event().wait(rng.uniform(0.0, EARLY_SECONDS))
    return True


def _check(daemon: Any, trainer: _Trainer, point: str, figures: Figures) -> list[str]:
    """The invariants of the module docstring, on a restarted daemon; returns what broke."""
    import tensorflow as tf

    from checkpointd.cli.verify import verify_paths
    from checkpointd_client import RemoteCheckpointer
    from tests.integration.support import dqn

    train = daemon.root / RUN / "train"
    problems = [f"left after restart: {p.name}" for p in _staged(train)]
    committed = _committed(train)
    problems += [f"verify {r.path}: {r.reason}" for r in verify_paths([train]) if not r.ok]
    state = tf.train.get_checkpoint_state(str(train))
    listed = [] if state is None else list(state.all_model_checkpoint_paths)
    problems += [
        f"the state file lists {p}, not committed" for p in listed if int(p.rsplit("-", 1)[1]) not in committed
    ]
    if SAVED_AT not in committed:
        problems.append(f"the step {SAVED_AT} save is gone: committed {sorted(committed)}")
    figures.committed_on_notice += bool(committed - {SAVED_AT})
    said = trainer.said()
    saved = SAVED.search(said)
    if saved:
        figures.told_durable += 1
        if int(saved[1]) not in committed:
            problems.append(f"the trainer was told step {saved[1]} is durable; committed {sorted(committed)}")
    elif point.startswith("daemon") and not NOT_SAVED.search(said):
        problems.append("the trainer said neither what it saved nor what was lost")
    # The restore: the newest committed checkpoint, its train step and its ballast.
    restored = dqn.build(seed=2)
    ballast = tf.Variable(tf.zeros([BALLAST_MB << 18]), name="ballast")
    checkpointer = RemoteCheckpointer(
        "train", daemon.address, run=RUN, timeout=_WAIT, save_on_notice=False,
        agent=restored.agent, train_step=restored.train_step, ballast=ballast,
    )  # fmt: skip
    try:
        step = int(restored.train_step.numpy())
        figures.restores += 1
        if committed and step != max(committed):
            problems.append(f"restored step {step}, the newest committed is {max(committed)}")
        elif committed:
            reader = tf.train.load_checkpoint(str(train / f"ckpt-{step}"))
            saved_ballast = reader.get_tensor("ballast/.ATTRIBUTES/VARIABLE_VALUE")
            if not (ballast.numpy() == saved_ballast).all() or len(set(saved_ballast[[0, -1]])) != 1:
                problems.append(f"restored step {step} with a ballast that is not its save's (or not one step's)")
    finally:
        checkpointer.close()
    return problems


def run_trials(
    trials: int, root: Path, workdir: Path, *, seed: int = 0, log: Callable[[str], None] = lambda line: None
) -> Figures:
    """Runs `trials` trials, the kill points in turn; each on a fresh run in `root`."""
    from tests.integration.support.crash_harness import SLOW_SYNC  # imports TensorFlow: not in the trainer's process
    from tests.integration.support.daemon import start_daemon

    rng = random.Random(seed)
    figures = Figures()
    started = time.monotonic()
    for trial in range(trials):
        point = POINTS[trial % len(POINTS)]
        shutil.rmtree(root / RUN, ignore_errors=True)
        daemon = start_daemon(root, workdir, wrap=SLOW_SYNC)
        trainer = _Trainer(daemon.address, workdir / f"trainer-{trial}.log")
        problems: list[str] = []
        try:
            trainer.wait_step(NOTICE_AT + 1)
            train = daemon.root / RUN / "train"
            before = _committed(train)
            trainer.proc.send_signal(signal.SIGTERM)
            reached = _kill_point(point, train, before, rng)
            victim = daemon.proc if point.startswith("daemon") else trainer.proc
            victim.kill()
            victim.wait(_WAIT)
            try:
                status = trainer.proc.wait(NOTICE_DEADLINE + BACKSTOP + 5.0)  # a margin for a loaded machine
            except subprocess.TimeoutExpired:
                problems.append(f"the trainer did not end by its notice deadline ({NOTICE_DEADLINE:g} s + backstop)")
                trainer.proc.kill()
                status = trainer.proc.wait()
            if point.startswith("trainer"):
                if daemon.proc.poll() is not None:
                    problems.append(f"the daemon died with its trainer ({daemon.proc.returncode})")
                elif daemon.terminate() != 0:
                    problems.append("the daemon did not stop cleanly after its trainer was killed")
            daemon = start_daemon(root, workdir)
            problems += _check(daemon, trainer, point, figures)
        finally:
            for proc in (trainer.proc, daemon.proc):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        figures.trials += 1
        figures.points[point] += 1
        figures.reached[point] += reached
        figures.failures += [f"trial {trial} ({point}): {p}" for p in problems]
        log(f"trial {trial:3d} {point:16s}: {'reached' if reached else 'missed '}; trainer exit {status}; "
            f"{len(problems)} problems")  # fmt: skip
    figures.seconds = time.monotonic() - started
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["trainer"]:
        return trainer_main(argv[1], argv[2], int(argv[3]))
    from tests.integration.support.crash_harness import conclude

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=len(POINTS) * 4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="checkpointd-notice-crash-"))
    figures = run_trials(args.trials, base / "root", base / "work", seed=args.seed, log=print)
    return conclude(figures.failures, [figures.summary()], base)


if __name__ == "__main__":
    sys.exit(main())
