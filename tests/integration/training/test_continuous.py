"""Continuous saves: a real DQN trainer calls save() after every step against a real daemon.

The checkpointer decides each call itself; these tests measure, around each
call, the time the training thread spent in save() and the training time
between calls, and hold the budget to it: time in save() is at most
`budget` of training time, plus the newest save (not yet paid for by the
training after it). Then the run is closed, which saves the last call if the
budget skipped it, and a fresh trainer restores the last step's state.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tensorflow as tf
from tf_agents.utils import common

import checkpointd_client
from checkpointd_client import CheckpointdError, RemoteCheckpointer, RunClosedError
from tests.integration.support import training_state
from tests.integration.support.daemon import Daemon, start_daemon

TIMEOUT = 120.0
BUDGET = 0.05
SYNC_DELAY = 0.1  # seconds each fsync of the slowed daemon waits first (tests.integration.support.slow_sync --fsync)
SLOW_DISK_BUDGET = 0.2
TRAINING_DEADLINE = 90.0  # seconds a loop trains on for the saves it needs
PER_CALL_SLACK = 50e-6  # seconds: what the test's own timing of a call adds around the checkpointer's


@dataclass
class Loop:
    """What a training loop saw of its save() calls."""

    steps: int = 0
    trained: float = 0.0  # seconds between calls
    in_save: float = 0.0  # seconds inside save()
    saved_stalls: list[float] = field(default_factory=list)
    elapsed: float = 0.0
    flushed: str | None = None  # the newest checkpoint once flush() returned


def _train_saving_every_step(
    state: training_state.State, checkpointer: RemoteCheckpointer, steps: int, least_saves: int
) -> Loop:
    """`steps` train steps, each followed by save(), and more until `least_saves` saves (by TRAINING_DEADLINE)."""
    train = common.function(state.agent.train)
    iterator = iter(state.replay_buffer.as_dataset(sample_batch_size=training_state.BATCH, num_steps=2))
    loop = Loop()
    start = last = time.perf_counter()
    deadline = start + TRAINING_DEADLINE
    while loop.steps < steps or (len(loop.saved_stalls) < least_saves and time.perf_counter() < deadline):
        train(next(iterator)[0])
        entered = time.perf_counter()
        loop.trained += entered - last
        ticket = checkpointer.save(state.global_step)
        last = time.perf_counter()
        loop.in_save += last - entered
        if not ticket.skipped:
            loop.saved_stalls.append(last - entered)
        loop.steps += 1
    loop.elapsed = time.perf_counter() - start
    return loop


def _restored(daemon: Daemon, run: str) -> dict[str, bytes]:
    """What a fresh trainer (other initial weights) restores from the run's newest checkpoint."""
    fresh = training_state.build(seed=1)
    fresh.create_optimizer_variables()
    reader = RemoteCheckpointer("train", daemon.address, run=run, read_only=True, timeout=TIMEOUT, **fresh.objects)
    try:
        reader.initialize_or_restore()
        return training_state.values(fresh.objects)
    finally:
        reader.close()


def _run(
    daemon: Daemon, run: str, steps: int, budget: float = BUDGET, least_saves: int = 0
) -> tuple[Loop, RemoteCheckpointer, dict[str, bytes]]:
    state = training_state.build(seed=0)
    state.collect(64)
    checkpointer = RemoteCheckpointer(
        "train", daemon.address, run=run, timeout=TIMEOUT, continuous=True, budget=budget, save_on_notice=False,
        **state.objects,
    )  # fmt: skip
    try:
        loop = _train_saving_every_step(state, checkpointer, steps, least_saves)
        want = training_state.values(state.objects)
        checkpointer.flush()  # saves the last call if it was not saved
        loop.flushed = tf.train.latest_checkpoint(str(daemon.root / run / "train"))
        checkpointer.close()
    except BaseException:
        checkpointer.close(timeout=TIMEOUT)
        raise
    return loop, checkpointer, want


def _assert_within_budget(loop: Loop, budget: float = BUDGET) -> None:
    # Every interval from one save to the next kept within the budget; the newest
    # save's is still open: its stall, and the calls after it, are not paid for yet.
    # The first save is not charged (its one-time costs).
    first, newest = loop.saved_stalls[0], loop.saved_stalls[-1]
    assert loop.in_save <= budget * loop.trained + first + newest + PER_CALL_SLACK * loop.steps, (
        f"{loop.in_save:.3f} s in save() over {loop.trained:.3f} s of training ({loop.steps} calls, "
        f"{len(loop.saved_stalls)} saves, the newest {newest * 1000:.1f} ms)"
    )


def test_a_save_after_every_step_stays_within_the_budget_and_the_last_step_is_restorable(
    daemon: Daemon, tmp_path: Path
) -> None:
    run = "continuous"
    loop, checkpointer, want = _run(daemon, run, steps=1500, least_saves=3)
    decisions = checkpointer.decisions
    assert decisions is not None

    assert decisions.calls == loop.steps
    assert decisions.saved == len(loop.saved_stalls)
    assert 3 <= decisions.saved <= loop.steps // 4  # it saves repeatedly, and far from every step
    _assert_within_budget(loop)
    # Budget skips are the checkpointer's own: the daemon saw the saves only, plus flush()'s save of the last call.
    counts = checkpointer.counts
    assert counts.failed == 0
    assert counts.durable in (decisions.saved, decisions.saved + 1)
    directory = daemon.root / run / "train"
    assert loop.flushed == str(directory / f"ckpt-{loop.steps}")
    assert tf.train.latest_checkpoint(str(directory)) == str(directory / f"ckpt-{loop.steps}")
    assert _restored(daemon, run) == want
    # What the saves cost off the training thread (the daemon's CPU on this host) was charged too.
    assert decisions.charged_seconds > 0


def test_the_daemon_on_this_host_is_metered_by_its_pid(daemon: Daemon) -> None:
    state = training_state.build(seed=0)
    with RemoteCheckpointer(
        "train", daemon.address, run="continuous-meter", timeout=TIMEOUT, continuous=True, save_on_notice=False,
        **state.objects,
    ) as checkpointer:  # fmt: skip
        checkpointer.save(state.global_step, blocking=True).result(TIMEOUT)
        meter = checkpointer._saves._daemon_cpu  # noqa: SLF001 - what the test is about
        assert meter is not None and meter[1] is not None
        assert meter[1]._stat == f"/proc/{daemon.proc.pid}/stat"  # noqa: SLF001


def test_against_a_slowed_disk_saves_get_rarer_and_the_budget_holds(tmp_path: Path) -> None:
    # Each save stays in flight for at least one slowed fsync (a checkpoint has about
    # ten): never two at once, so at most one save per SYNC_DELAY of training, and
    # training does not wait for them. A budget of 20 % would allow one every few
    # hundred milliseconds: the disk, not the budget, makes them rare.
    slow_sync = (sys.executable, "-m", "tests.integration.support.slow_sync", str(SYNC_DELAY), "--fsync", "--")
    daemon = start_daemon(tmp_path / "root", tmp_path / "work", wrap=slow_sync)
    try:
        run = "continuous-slow-disk"
        # The first save on a slowed disk may stall long (the run's first dirs are
        # fsynced before the accept); it is not charged.
        loop, checkpointer, want = _run(daemon, run, steps=1500, budget=SLOW_DISK_BUDGET, least_saves=4)
        decisions = checkpointer.decisions
        assert decisions is not None
        assert decisions.skipped_busy > 0  # the budget allowed a save the disk did not
        assert 4 <= decisions.saved <= loop.elapsed / SYNC_DELAY + 1
        _assert_within_budget(loop, SLOW_DISK_BUDGET)
        assert checkpointer.counts.failed == 0
        directory = daemon.root / run / "train"
        assert tf.train.latest_checkpoint(str(directory)) == str(directory / f"ckpt-{loop.steps}")
        assert _restored(daemon, run) == want
    finally:
        daemon.terminate()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"continuous": True, "budget": 0.0}, r"^budget must be"),
        ({"continuous": True, "budget": 1.0}, r"^budget must be"),
        ({"continuous": True, "budget": "5%"}, r"^budget must be"),
        ({"budget": 0.1}, r"^budget=0.1 applies to continuous saves: pass continuous=True too"),
        ({"continuous": 1}, r"^continuous must be True or False"),
    ],
)
def test_a_bad_budget_or_continuous_is_refused_naming_it_before_any_call(options: dict, message: str) -> None:
    # Port 1 answers nothing: a refusal that dialled first would be an UnavailableError.
    with pytest.raises(ValueError, match=message):
        RemoteCheckpointer("train", "127.0.0.1:1", run="bad-budget", w=tf.Variable(1.0), **options)


def test_a_notice_after_calls_the_budget_skipped_saves_the_step_reached(daemon: Daemon) -> None:
    run = "continuous-notice"
    state = training_state.build(seed=0)
    state.collect(64)
    checkpointer = RemoteCheckpointer(
        "train", daemon.address, run=run, timeout=TIMEOUT, continuous=True, **state.objects
    )  # saves on notice by default
    try:
        # The first call saves; the next ones are skipped until training pays for it.
        _train_saving_every_step(state, checkpointer, steps=5, least_saves=0)
        decisions = checkpointer.decisions
        assert decisions is not None and decisions.saved < 5
        [outcome] = checkpointd_client.preempted()
    finally:
        checkpointer.close(TIMEOUT)
    assert (outcome.step, outcome.saved) == (5, True)
    directory = daemon.root / run / "train"
    assert tf.train.latest_checkpoint(str(directory)) == str(directory / "ckpt-5")


def test_close_with_the_daemon_gone_raises_and_still_closes_with_the_last_call_unsaved(
    fresh_daemon: Callable[..., Daemon],
) -> None:
    daemon = fresh_daemon()
    state = training_state.build(seed=0)
    state.collect(64)
    checkpointer = RemoteCheckpointer(
        "train", daemon.address, run="continuous-gone", timeout=10.0, continuous=True, save_on_notice=False,
        budget=0.001, **state.objects,  # after the first save (not charged), the next stays paid for a while
    )  # fmt: skip
    try:
        _train_saving_every_step(state, checkpointer, steps=5, least_saves=0)
        decisions = checkpointer.decisions
        assert decisions is not None and decisions.saved < 5  # the last call is not saved yet
        checkpointer.flush()  # saves it: the daemon has step 5
        _train_saving_every_step(state, checkpointer, steps=1, least_saves=0)
        daemon.proc.kill()
        daemon.proc.wait()
        with pytest.raises(CheckpointdError):
            checkpointer.close()  # step 6 cannot be saved, nor the run closed
        with pytest.raises(RunClosedError):
            checkpointer.save(state.global_step)  # closed all the same
    finally:
        with contextlib.suppress(CheckpointdError):  # a close that failed tries its flush again: it fails again
            checkpointer.close(timeout=1.0)
    directory = daemon.root / "continuous-gone" / "train"
    assert tf.train.latest_checkpoint(str(directory)) == str(directory / "ckpt-5")
