"""Save semantics against the real daemon: skip, never drop, block, flush, close, fail, cancel.

A save "in flight" is made deterministic with `HeldSave`: a raw Save call
that sends a valid header, receives the daemon's accept, and then sends
nothing until the test releases it (the right chunks) or cancels it. While
it is held, the run's lane is busy for as long as the test wants, with no
timing involved.

TF-Agents' async_policy_saver_test.py, re-expressed against RemotePolicySaver
and the real daemon (upstream mocks PolicySaver; here the files are real):
- testSave                   -> test_upstream_save
- testCheckpointSave         -> test_upstream_checkpoint_save
- testBlockingSave           -> test_upstream_blocking_save
- testBlockingCheckpointSave -> test_upstream_blocking_checkpoint_save
- testClose                  -> test_upstream_close (RunClosedError, not ValueError)
- testRegisterFunction       -> test_save_path.py (test_register_function_shows_up_in_...)
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tensorflow as tf

from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc
from checkpointd_client import (
    CheckpointdError,
    DeadlineError,
    RemotePolicySaver,
    RunClosedError,
    SaveFailedError,
)
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon, wait_until
from tests.integration.support.disk import (
    CHECKPOINT_FILES,
    checkpointd_entries,
    files_under,
    saved_step,
)
from tests.integration.support.raw import TIMEOUT, HeldSave, run_status


class Env:
    """Makes savers and held saves for one test; closes them all, bounded, at teardown."""

    def __init__(self, daemon: Daemon, policy: object) -> None:
        self.daemon = daemon
        self.policy = policy
        self._savers: list[RemotePolicySaver] = []
        self._held: list[HeldSave] = []
        self._channel = grpc.insecure_channel(daemon.address)
        self._stub = checkpointd_pb2_grpc.CheckpointServiceStub(self._channel)

    def saver(self, run: str, policy: object | None = None, step: int = 0) -> tuple[RemotePolicySaver, tf.Variable]:
        train_step = tf.Variable(step, dtype=tf.int64)
        saver = RemotePolicySaver(
            policy or self.policy, self.daemon.address, run=run, train_step=train_step,
            timeout=TIMEOUT,
        )  # fmt: skip
        self._savers.append(saver)
        return saver, train_step

    def die(self, saver: RemotePolicySaver) -> None:
        """Lets go of a saver unclosed, as a trainer killed mid-run does: its run stays open on the daemon."""
        self._savers.remove(saver)

    def hold(self, saver: RemotePolicySaver, train_step: tf.Variable, export_dir: str) -> HeldSave:
        held = HeldSave(self.daemon, saver, train_step, export_dir)
        self._held.append(held)
        return held

    def status(self, run: str) -> pb.RunStatus:
        return run_status(self._stub, run)

    def run_dir(self, run: str) -> Path:
        return self.daemon.root / run

    def close(self) -> None:
        for held in self._held:
            held.close()
        for saver in self._savers:
            try:
                saver.close(timeout=10)
            except CheckpointdError:
                pass  # closed runs, failed saves: the test has judged them
        self._channel.close()


@pytest.fixture(scope="module")
def policy() -> object:
    return policies.build(policies.q(hidden=(8,)))


@pytest.fixture
def env(daemon: Daemon, policy: object) -> Iterator[Env]:
    e = Env(daemon, policy)
    try:
        yield e
    finally:
        e.close()


def _in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, dict[str, object]]:
    """Runs `fn` in a thread; its return value or exception lands in the dict."""
    out: dict[str, object] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def _joined(thread: threading.Thread, out: dict[str, object]) -> object:
    thread.join(TIMEOUT)
    assert not thread.is_alive(), "the call did not return in time"
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out.get("value")


# Skip, never drop, block.


def test_non_blocking_save_while_one_is_in_flight_is_skipped(env: Env) -> None:
    saver, step = env.saver("sem-skip", step=7)
    held = env.hold(saver, step, "held")

    ticket = saver.save("skipped")
    ck_ticket = saver.save_checkpoint("skipped-ck")

    for t in (ticket, ck_ticket):
        assert t.skipped and t.done()  # known when save() returned
        assert "in flight" in t.reason and "'held'" in t.reason, t.reason
        assert t.result(timeout=0) is None
    assert env.status("sem-skip").saves_skipped == 2
    result = held.release()
    assert result.path == str(held.path)
    assert saved_step(held.path) == 7
    saver.flush(timeout=TIMEOUT)
    assert sorted(os.listdir(env.run_dir("sem-skip"))) == ["held"]


def test_an_accepted_save_is_never_replaced_or_dropped(env: Env) -> None:
    # Upstream AsyncPolicySaver keeps only the latest request: of two back-to-back
    # saves the first is dropped silently (20 of 20 trials). Here the first is
    # accepted and written; the second is written or visibly skipped.
    saver, step = env.saver("sem-never-dropped")
    saver.register()
    run_dir = env.run_dir("sem-never-dropped")
    for i in range(10):
        step.assign(i)
        first = saver.save(f"round{i}/first")
        second = saver.save(f"round{i}/second")
        assert not first.skipped, f"round {i}: {first.reason}"
        result = first.result(timeout=TIMEOUT)
        assert result is not None and result.step == i
        assert saved_step(run_dir / f"round{i}" / "first") == i
        if second.result(timeout=TIMEOUT) is None:
            assert second.skipped and "in flight" in second.reason
            assert not (run_dir / f"round{i}" / "second").exists()
        else:
            assert saved_step(run_dir / f"round{i}" / "second") == i


def test_blocking_save_waits_for_the_save_in_flight_then_returns_durable(env: Env) -> None:
    saver, step = env.saver("sem-blocking", step=3)
    held = env.hold(saver, step, "held")
    target = env.run_dir("sem-blocking") / "blocking"

    def blocking_save() -> tuple[object, bool, bool]:
        ticket = saver.save("blocking", blocking=True)
        return ticket, target.is_dir(), held.path.is_dir()

    thread, out = _in_thread(blocking_save)
    wait_until(lambda: env.status("sem-blocking").in_flight.waiting == 1, "it is queued", TIMEOUT)
    assert thread.is_alive()  # it cannot finish while the lane is held
    assert not target.exists()
    held.release()
    ticket, durable_at_return, held_durable = _joined(thread, out)  # type: ignore[misc]
    assert not ticket.skipped and ticket.done()
    assert durable_at_return and held_durable
    assert ticket.result(timeout=0).step == 3
    assert saved_step(target) == 3


# Flush and close.


def test_flush_waits_until_no_save_is_in_flight(env: Env) -> None:
    saver, step = env.saver("sem-flush")
    held = env.hold(saver, step, "held")
    with pytest.raises(DeadlineError):
        saver.flush(timeout=0.3)

    thread, out = _in_thread(lambda: (saver.flush(timeout=TIMEOUT), held.path.is_dir()))
    held.release()
    _, durable_when_flushed = _joined(thread, out)  # type: ignore[misc]
    assert durable_when_flushed

    ticket = saver.save("own")  # this saver's own background upload
    saver.flush(timeout=TIMEOUT)
    assert ticket.done() and ticket.result(timeout=0) is not None


def test_close_flushes_then_every_saver_of_the_run_is_refused(env: Env) -> None:
    saver, step = env.saver("sem-close")
    other, _ = env.saver("sem-close")  # a second trainer process on the same run
    other.register()
    held = env.hold(saver, step, "held")

    with pytest.raises(DeadlineError):
        saver.close(timeout=0.3)  # it cannot flush while the lane is held
    held.release()
    saver.close(timeout=TIMEOUT)  # calling it again finishes the close
    assert held.path.is_dir()
    assert env.status("sem-close").state == "closed"

    with pytest.raises(RunClosedError, match="closed"):
        saver.save("mine")  # refused by the saver itself
    with pytest.raises(RunClosedError, match="closed") as refused:
        other.save("theirs")  # refused by the daemon
    cause = refused.value.__cause__
    assert isinstance(cause, grpc.Call) and cause.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert sorted(os.listdir(env.run_dir("sem-close"))) == ["held"]


# Failure, cancellation, lanes per run.


@pytest.mark.parametrize("export_dir", ["blocked", "blocked/policy"], ids=["file_at_export_dir", "file_as_parent"])
def test_a_failed_save_reaches_the_caller_and_the_lane_keeps_serving(env: Env, export_dir: str) -> None:
    run = f"sem-fail-{export_dir.replace('/', '-')}"
    saver, _ = env.saver(run)
    run_dir = env.run_dir(run)
    run_dir.mkdir(parents=True)
    (run_dir / "blocked").write_text("not a directory")

    ticket = saver.save(export_dir)
    assert not ticket.skipped
    with pytest.raises(SaveFailedError, match="blocked"):
        ticket.result(timeout=TIMEOUT)
    with pytest.raises(SaveFailedError, match="blocked"):
        saver.save(export_dir, blocking=True)

    assert saver.save("next").result(timeout=TIMEOUT) is not None
    saver.flush(timeout=TIMEOUT)
    saver.close(timeout=TIMEOUT)
    assert (run_dir / "blocked").read_text() == "not a directory"
    assert sorted(os.listdir(run_dir)) == ["blocked", "next"]
    assert checkpointd_entries(run_dir) == []
    status = env.status(run)
    assert (status.saves_failed, status.saves_ok) == (2, 1)


def test_a_client_cancelling_mid_upload_frees_the_lane(env: Env) -> None:
    saver, step = env.saver("sem-cancel")
    env.hold(saver, step, "cancelled").send_half_then_cancel()
    saver.flush(timeout=TIMEOUT)  # the daemon ends the cancelled save

    ticket = saver.save("next")
    assert not ticket.skipped, ticket.reason
    assert ticket.result(timeout=TIMEOUT) is not None
    run_dir = env.run_dir("sem-cancel")
    assert sorted(os.listdir(run_dir)) == ["next"]
    assert checkpointd_entries(run_dir) == []
    status = env.status("sem-cancel")
    # A caller that went away is no disk failure: counted as cancelled, so CheckpointdSaveFailed stays quiet.
    assert (status.saves_cancelled, status.saves_failed, status.last_error) == (1, 0, "")
    # ...and logged once, at INFO, as cancelled: no write failure or error status said before or after it.
    said = [line for line in env.daemon.log().splitlines() if "sem-cancel" in line and "registered" not in line]
    said = [line for line in said if "saved run=" not in line and "closed run=" not in line]
    assert len(said) == 1 and " INFO " in said[0] and "cancelled run=sem-cancel" in said[0], said


def test_each_run_has_its_own_lane(env: Env) -> None:
    saver_a, step_a = env.saver("sem-lane-a")
    saver_b, _ = env.saver("sem-lane-b")
    held = env.hold(saver_a, step_a, "held")

    ticket = saver_b.save("b")
    assert not ticket.skipped, ticket.reason
    assert ticket.result(timeout=TIMEOUT) is not None
    assert saver_b.save("b-blocking", blocking=True).done()
    assert env.status("sem-lane-a").HasField("in_flight")  # A was held all along
    held.release()
    assert sorted(os.listdir(env.run_dir("sem-lane-b"))) == ["b", "b-blocking"]


# Registering again.


def test_a_restarted_trainer_registers_the_run_again_and_saves(env: Env) -> None:
    first, _ = env.saver("sem-restart", step=5)
    first.save("before", blocking=True)
    env.die(first)  # the trainer's process is gone: nothing of it holds the run's name in this one
    del first
    gc.collect()

    restarted = policies.build(policies.q(hidden=(8,)))  # new process: new variables
    policies.perturb(restarted, seed=21)
    second, _ = env.saver("sem-restart", policy=restarted, step=6)
    assert second.run == "sem-restart"  # the restarted trainer's saver is the same stream again
    second.save("after", blocking=True)

    after = env.run_dir("sem-restart") / "after"
    assert saved_step(after) == 6
    reader = tf.train.load_checkpoint(str(after / "variables" / "variables"))
    for i, value in enumerate(policies.values(restarted)):
        saved = reader.get_tensor(f"model_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE")
        np.testing.assert_array_equal(saved, value)
    assert saved_step(env.run_dir("sem-restart") / "before") == 5


def test_registering_a_closed_run_reopens_it(env: Env) -> None:
    closed, _ = env.saver("sem-reopen")
    closed.save("before", blocking=True)
    closed.close(timeout=TIMEOUT)
    assert env.status("sem-reopen").state == "closed"

    reopened, _ = env.saver("sem-reopen", step=9)
    ticket = reopened.save("after", blocking=True)
    assert ticket.result(timeout=0).step == 9
    assert env.status("sem-reopen").state == "open"
    with pytest.raises(RunClosedError):
        closed.save("again")  # the closed saver stays closed


# async_policy_saver_test.py, re-expressed.


def test_upstream_save(env: Env) -> None:
    saver, _ = env.saver("sem-up-save", step=1)
    ticket = saver.save("policy")
    saver.flush()
    assert ticket.done() and not ticket.skipped
    assert saved_step(env.run_dir("sem-up-save") / "policy") == 1
    assert (env.run_dir("sem-up-save") / "policy" / "saved_model.pb").is_file()


def test_upstream_checkpoint_save(env: Env) -> None:
    saver, step = env.saver("sem-up-ck", step=1)
    saver.save("save_model")
    saver.flush()
    step.assign(2)
    ticket = saver.save_checkpoint("checkpoint")
    saver.flush()
    assert ticket.done() and ticket.result(timeout=0) is not None
    checkpoint = env.run_dir("sem-up-ck") / "checkpoint"
    assert CHECKPOINT_FILES <= files_under(checkpoint)
    assert not (checkpoint / "saved_model.pb").exists()
    assert saved_step(checkpoint) == 2
    assert saved_step(env.run_dir("sem-up-ck") / "save_model") == 1


@pytest.mark.parametrize("kind", ["save", "save_checkpoint"])
def test_upstream_blocking_save(env: Env, kind: str) -> None:
    # testBlockingSave and testBlockingCheckpointSave: both saves are made,
    # and the first is durable too once the blocking one returns.
    run = f"sem-up-blocking-{kind.replace('_', '-')}"
    saver, step = env.saver(run, step=1)
    saver.register()
    first = getattr(saver, kind)("save_model")
    step.assign(2)
    second = getattr(saver, kind)("save_model2", blocking=True)
    assert (env.run_dir(run) / "save_model").is_dir()  # before any wait of ours
    assert not second.skipped and second.done()
    assert not first.skipped and first.result(timeout=TIMEOUT) is not None
    assert saved_step(env.run_dir(run) / "save_model") == 1
    assert saved_step(env.run_dir(run) / "save_model2") == 2


def test_upstream_close(env: Env) -> None:
    saver, _ = env.saver("sem-up-close")
    ticket = saver.save("save_model")
    saver.close()
    assert ticket.done() and ticket.result(timeout=0) is not None
    assert (env.run_dir("sem-up-close") / "save_model" / "saved_model.pb").is_file()
    assert env.status("sem-up-close").state == "closed"  # upstream: the thread is gone
    with pytest.raises(RunClosedError):  # upstream: ValueError
        saver.save("save_model")
