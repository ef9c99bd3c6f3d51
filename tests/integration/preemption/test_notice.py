"""A preempted trainer loses nothing: SIGTERM to a real trainer process saves the step it reached.

Each test runs `tests.integration.support.trainers.notice_proc` against a real daemon, waits
until it prints the step it must pass, sends SIGTERM, and reads what is
left: how the process ended, its one "preempted at step N" line, and the
newest committed checkpoint on the daemon's disk (read by TensorFlow).
"""

from __future__ import annotations

import math
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import tensorflow as tf

import checkpointd_client
from checkpointd_client import RemoteCheckpointer, notice
from tests.integration.support import dqn
from tests.integration.support.daemon import Daemon
from tests.integration.support.scrape import Metrics

WAIT = 120.0  # seconds: a trainer's start (TensorFlow's import) and every wait here are bounded by it
SAVED = re.compile(r"run (\S+): preempted at step (\d+): saved, durable in (\d+) ms")
STEP_KEY = "train_step/.ATTRIBUTES/VARIABLE_VALUE"


class Trainer:
    """A notice_proc subprocess; its stdout and stderr lines are read as they come."""

    def __init__(self, mode: str, address: str, run: str, root_dir: Path, deadline: float = 25.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.support.trainers.notice_proc", mode, address, run, str(deadline), str(root_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.out: list[str] = []
        self.err: list[str] = []
        self._lines: queue.Queue[tuple[str, str]] = queue.Queue()
        for name, stream, into in (("out", self.proc.stdout, self.out), ("err", self.proc.stderr, self.err)):
            threading.Thread(target=self._pump, args=(name, stream, into), daemon=True).start()

    def _pump(self, name: str, stream: object, into: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            into.append(line.rstrip("\n"))
            self._lines.put((name, line.rstrip("\n")))
        self.proc.wait()
        self._lines.put((name, ""))  # the stream ended

    def wait_for(self, name: str, found: Callable[[str], bool], what: str, timeout: float = WAIT) -> str:
        """The first line on `name` ("out" or "err") for which `found` holds; fails after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                stream, line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {what} within {timeout} s; stderr:\n" + "\n".join(self.err[-40:])) from None
            if stream == name and not line and self.proc.poll() is not None:
                raise AssertionError(
                    f"the trainer ended ({self.proc.returncode}) before {what}; stderr:\n" + "\n".join(self.err[-40:])
                )
            if stream == name and found(line):
                return line

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.proc.send_signal(signum)

    def ended(self, timeout: float = WAIT) -> int:
        """Its exit status (negative: killed by that signal); fails if it runs on after `timeout`."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the trainer still runs {timeout} s on; stderr:\n" + "\n".join(self.err[-40:])
            ) from None

    def steps(self) -> list[int]:
        return [int(line.split()[1]) for line in self.out if line.startswith("step ")]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _newest(directory: Path) -> tuple[str, int]:
    """The newest committed checkpoint's prefix in `directory`, and the train step it holds."""
    newest = tf.train.latest_checkpoint(str(directory))
    assert newest is not None, f"no checkpoint in {directory}"
    return newest, int(tf.train.load_checkpoint(newest).get_tensor(STEP_KEY))


def _saved_line(trainer: Trainer) -> tuple[int, int]:
    """The step and milliseconds of the trainer's one "preempted at step N: saved" line."""
    found = [m for m in map(SAVED.search, trainer.err) if m]
    assert len(found) == 1, "\n".join(trainer.err[-40:])
    return int(found[0].group(2)), int(found[0].group(3))


def test_sigterm_in_a_plain_training_loop_saves_the_step_reached_before_the_process_ends(
    daemon: Daemon, tmp_path: Path
) -> None:
    run = "notice-loop"
    before = Metrics(daemon.metrics_url)("checkpointd_preemption_saves_total", outcome="ok")
    trainer = Trainer("loop", daemon.address, run, tmp_path)
    try:
        trainer.wait_for("out", lambda line: line == "step 6", "step 6")  # past its one save, at step 3
        trainer.signal()
        status = trainer.ended()
    finally:
        trainer.kill()
    assert status == -signal.SIGTERM  # ended as SIGTERM ends a process without a handler
    step, _ = _saved_line(trainer)
    reached = trainer.steps()[-1]
    # The handler ran between two train steps: after the last one printed, or
    # after the next one returned and before its print.
    assert step in (reached, reached + 1)
    assert _newest(daemon.root / run / "train") == (str(daemon.root / run / "train" / f"ckpt-{step}"), step)
    saved = [line for line in daemon.log().splitlines() if f"saved run={run}.train " in line]
    assert any(f"step={step} " in line and "on_notice=yes" in line for line in saved)
    metrics = Metrics(daemon.metrics_url)
    assert metrics("checkpointd_preemption_saves_total", outcome="ok") == before + 1
    assert metrics("checkpointd_preemption_notice_to_durable_seconds_count") >= 1


def test_sigterm_inside_learner_run_saves_the_step_reached(daemon: Daemon, tmp_path: Path) -> None:
    run = "notice-learner"
    trainer = Trainer("learner", daemon.address, run, tmp_path / "root_dir")
    try:
        trainer.wait_for("out", lambda line: line == "step 7", "step 7")
        trainer.signal()
        status = trainer.ended()
    finally:
        trainer.kill()
    assert status == -signal.SIGTERM
    step, _ = _saved_line(trainer)
    reached = trainer.steps()[-1]
    assert step in (reached, reached + 1)
    directory = daemon.root / run / "train" / "checkpoints"
    assert _newest(directory) == (str(directory / f"ckpt-{step}"), step)


def test_a_users_own_sigterm_handler_still_runs_after_the_save_on_notice(daemon: Daemon, tmp_path: Path) -> None:
    run = "notice-own-handler"
    trainer = Trainer("own-handler", daemon.address, run, tmp_path)
    try:
        trainer.wait_for("out", lambda line: line == "step 5", "step 5")
        trainer.signal()
        status = trainer.ended()
    finally:
        trainer.kill()
    assert status == 7  # the script's handler's sys.exit(7): its behaviour, not the default's
    step, _ = _saved_line(trainer)
    assert f"own handler ran at step {step}" in trainer.out  # after the save, at the same step
    assert _newest(daemon.root / run / "train") == (str(daemon.root / run / "train" / f"ckpt-{step}"), step)


def test_sigterm_during_a_save_call_is_saved_when_the_call_returns_waiting_for_the_save_in_flight(
    daemon: Daemon, tmp_path: Path
) -> None:
    run = "notice-in-flight"
    trainer = Trainer("in-flight", daemon.address, run, tmp_path)
    try:
        status = trainer.ended()  # the trainer sends itself SIGTERM inside its save at step 3
    finally:
        trainer.kill()
    assert status == -signal.SIGTERM
    assert any("SIGTERM inside a checkpointd_client call" in line for line in trainer.err)
    assert _saved_line(trainer)[0] == 3
    assert "save call returned" not in trainer.out  # the process ended as the call returned
    assert _newest(daemon.root / run / "train") == (str(daemon.root / run / "train" / "ckpt-3"), 3)
    # The save in flight was the step reached: waited for, not sent again.
    assert not any("on_notice=yes" in line and f"run={run}." in line for line in daemon.log().splitlines())


def test_with_the_daemon_down_the_trainer_exits_within_its_deadline_and_says_what_was_lost(
    fresh_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = fresh_daemon()
    deadline = 5.0
    trainer = Trainer("loop", daemon.address, "notice-down", tmp_path, deadline=deadline)
    try:
        trainer.wait_for("out", lambda line: line == "step 5", "step 5")
        daemon.proc.kill()
        daemon.proc.wait()
        trainer.signal()
        noticed = time.monotonic()
        status = trainer.ended()
        took = time.monotonic() - noticed
    finally:
        trainer.kill()
    assert status == -signal.SIGTERM
    assert took < deadline + 3.0  # the deadline, and the stream's own grace past it
    [line] = [line for line in trainer.err if "preempted at step" in line]
    step = int(re.search(r"preempted at step (\d+): not saved: ", line).group(1))  # type: ignore[union-attr]
    assert f"lost: the {step - 3} step(s) after step 3, the newest durable checkpoint" in line
    assert "UnavailableError" in line


def test_a_second_sigterm_during_the_save_on_notice_ends_the_trainer_at_once(
    fresh_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = fresh_daemon()
    trainer = Trainer("loop", daemon.address, "notice-twice", tmp_path, deadline=60.0)
    try:
        trainer.wait_for("out", lambda line: line == "step 5", "step 5")
        daemon.proc.send_signal(signal.SIGSTOP)  # the save on notice then waits for an answer
        trainer.signal()
        trainer.wait_for("err", lambda line: "SIGTERM: saving" in line, "the save on notice's start")
        trainer.signal()
        second = time.monotonic()
        status = trainer.ended(timeout=10.0)  # not the 60 s deadline
        took = time.monotonic() - second
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
        trainer.kill()
    assert status == -signal.SIGTERM
    assert took < 5.0
    assert any("a second SIGTERM during the save on notice" in line for line in trainer.err)
    assert not any(SAVED.search(line) for line in trainer.err)


def test_a_notice_during_a_flush_to_a_daemon_that_does_not_answer_ends_the_trainer_by_its_deadline(
    fresh_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    # The notice lands inside flush(), a client call: the save on notice waits
    # for it to return, and the backstop ends the process if it does not
    # (unit-tested in test_notice); either way the trainer is gone by then.
    daemon = fresh_daemon()
    deadline = 3.0
    trainer = Trainer("flush", daemon.address, "notice-stuck", tmp_path, deadline=deadline)
    try:
        trainer.wait_for("out", lambda line: line == "flushing", "the flush at step 5")
        daemon.proc.send_signal(signal.SIGSTOP)  # the flush (120 s timeout) then waits for an answer
        trainer.proc.stdin.write("go\n")  # type: ignore[union-attr]
        trainer.proc.stdin.flush()  # type: ignore[union-attr]
        trainer.wait_for("out", lambda line: line == "flush called", "the flush call")
        trainer.signal()
        noticed = time.monotonic()
        status = trainer.ended(timeout=60.0)
        took = time.monotonic() - noticed
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
        trainer.kill()
    assert status == -signal.SIGTERM
    assert took < deadline + notice.BACKSTOP_GRACE + 3.0  # not the flush's 120 s
    assert "flushed" not in trainer.out
    assert any("has not ended" in line or "not saved" in line for line in trainer.err), "\n".join(trainer.err[-20:])


def test_preempted_saves_the_step_reached_returns_the_outcome_and_the_process_goes_on(
    daemon: Daemon, tmp_path: Path
) -> None:
    run = "notice-call"
    original = signal.getsignal(signal.SIGTERM)
    trainer = dqn.build(seed=2)
    checkpointer = RemoteCheckpointer("train", daemon.address, run=run, timeout=WAIT, agent=trainer.agent,
                                      train_step=trainer.train_step)  # fmt: skip
    try:
        assert signal.getsignal(signal.SIGTERM) is not original  # SIGTERM saves on notice now
        iterator = iter(trainer.dataset_fn())
        for _ in range(3):
            experience, _ = next(iterator)
            trainer.agent.train(experience)

        [outcome] = checkpointd_client.preempted()
        [again] = checkpointd_client.preempted()  # nothing trained since: that save is not sent again
    finally:
        checkpointer.close(WAIT)
    assert (outcome.run, outcome.step, outcome.saved, outcome.lost) == (f"{run}.train", 3, True, "")
    assert again.saved and again.step == 3
    directory = daemon.root / run / "train"
    assert _newest(directory) == (str(directory / "ckpt-3"), 3)
    saved = [line for line in daemon.log().splitlines() if f"saved run={run}.train " in line]
    assert len(saved) == 1 and "on_notice=yes" in saved[0]
    assert signal.getsignal(signal.SIGTERM) is original  # closed: the handler before it is back


@pytest.mark.parametrize(
    ("argument", "value"),
    [("save_on_notice", "yes"), ("save_on_notice", None), ("notice_deadline", 0), ("notice_deadline", math.inf),
     ("notice_deadline", "25")],
)  # fmt: skip
def test_a_bad_notice_argument_is_refused_at_construction_naming_it(argument: str, value: object) -> None:
    step = tf.Variable(0, dtype=tf.int64)
    with pytest.raises(ValueError, match=f"^{argument} must be"):  # before any call to the (absent) daemon
        RemoteCheckpointer("train", "127.0.0.1:1", run="bad-notice", train_step=step, **{argument: value})
