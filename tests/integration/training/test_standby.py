"""Standby snapshots: a continuous trainer on the daemon's host is SIGKILLed, and its last hand-over is written.

A real daemon; a real trainer process (TensorFlow weights, a TF-Agents
TFUniformReplayBuffer) calling a continuous RemoteCheckpointer's save()
after every step (`tests.integration.support.trainers.standby_proc`). Once
it is killed, the daemon writes its newest whole standby slot as the run's
next checkpoint: byte for byte what `tf.train.Checkpoint.write` made of the
same objects at that hand-over. A slot torn by the kill is not trusted (the
hand-over before is written); a run flushed after its hand-over gets no
older checkpoint on top of its newest.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.support.daemon import Daemon, wait_until
from tests.integration.support.replay_state import committed_files
from tests.integration.support.scrape import Metrics

TIMEOUT = 120.0
_PROC = "tests.integration.support.trainers.standby_proc"


def _trainer(mode: str, daemon: Daemon, run: str, references: Path) -> tuple[subprocess.Popen[str], list[str]]:
    """Starts the trainer; returns it and the words of the line it printed once it got there."""
    references.mkdir()
    line_word = {"kill": "handed"}.get(mode, mode)
    proc = subprocess.Popen(
        [sys.executable, "-m", _PROC, mode, daemon.address, run, str(references)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().split()  # the trainer's own deadline: it prints why, or ends
    if line[:1] != [line_word]:
        proc.kill()
        pytest.fail(f"the trainer did not get to its hand-overs: {' '.join(line)!r}, exit {proc.wait(TIMEOUT)}")
    return proc, line


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(TIMEOUT)


def _outcome(daemon: Daemon, outcome: str) -> float:
    return Metrics(daemon.metrics_url).samples.get(
        ("checkpointd_standby_saves_total", frozenset({("outcome", outcome)})), 0.0
    )


def _steps(train: Path) -> list[int]:
    return sorted(int(p.name[len("ckpt-") : -len(".index")]) for p in train.glob("ckpt-*.index"))


@pytest.mark.parametrize(("mode", "written"), [("kill", "newest"), ("torn", "the one before")])
def test_a_sigkilled_trainers_newest_whole_hand_over_is_written_as_tensorflow_would(
    fresh_daemon: Callable[..., Daemon], tmp_path: Path, mode: str, written: str
) -> None:
    (tmp_path / "shm").mkdir()
    daemon = fresh_daemon("--shm-dir", str(tmp_path / "shm"))
    run = f"standby-{mode}"
    proc, line = _trainer(mode, daemon, run, tmp_path / "refs")
    try:
        step = int(line[1])
        train = tmp_path / "root" / run / "train"
        assert step not in _steps(train), "the hand-over's step has no durable checkpoint while the trainer lives"
    finally:
        _kill(proc)
    wait_until(lambda: _outcome(daemon, "written") == 1, "the daemon writes the standby snapshot", TIMEOUT)
    assert _steps(train)[-1] == step, f"the {written} hand-over is the run's newest checkpoint"
    assert committed_files(train / f"ckpt-{step}") == committed_files(tmp_path / "refs" / f"ref-{step}")
    assert f"standby snapshot of step {step} is durable" in daemon.log()
    assert not list((tmp_path / "shm").glob("checkpointd-*/standby-[0-9]*")), "the slots are removed"


def test_a_trainer_that_flushed_its_hand_over_gets_no_checkpoint_more(
    fresh_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    (tmp_path / "shm").mkdir()
    daemon = fresh_daemon("--shm-dir", str(tmp_path / "shm"))
    run = "standby-flushed"
    proc, line = _trainer("flushed", daemon, run, tmp_path / "refs")
    train = tmp_path / "root" / run / "train"
    try:
        step = int(line[1])
        before = _steps(train)
        assert before[-1] == step, "flush() saved the last call, the hand-over's step"
    finally:
        _kill(proc)
    wait_until(lambda: _outcome(daemon, "not_newer") == 1, "the daemon sees the trainer gone", TIMEOUT)
    assert _steps(train) == before
    assert _outcome(daemon, "written") == 0
