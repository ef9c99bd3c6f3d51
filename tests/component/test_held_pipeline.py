"""The run's busy lock in the pipeline: held saves, and the daemon's own saves against a trainer's lock.

The trainer's side is played by a file descriptor of the test's own on the
run's lock file (an flock belongs to an open file description, so it
contends with the daemon's even in this process). Every wait is bounded by LIMIT.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from checkpointd.core.config import ServeConfig
from checkpointd.core.retention import RetentionPolicy
from checkpointd.protocol.busy_lock import BusyLock
from checkpointd.protocol.codes import code_for
from checkpointd.protocol.errors import DeadlineError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.saves.budget import UploadBudget
from checkpointd.saves.pipeline import Decision, Formats, LocalSkip, Result, SavePipeline, SaveRequest, TrainerDecided
from checkpointd.saves.pool import WriterPool
from checkpointd.saves.retention import Retention
from checkpointd.saves.runs import Lanes, TrainerDecidedError
from checkpointd.transport.shm import SharedMemory
from tests.component.conftest import Rig, request
from tests.component.fakes import LIMIT, FakeFormat, FakeStore, RecordingSink

MiB = 1 << 20


@pytest.fixture
def shm_rig(tmp_path: Path) -> Iterator[tuple[Rig, SharedMemory]]:
    """A pipeline with shared memory and run "a" registered."""
    serve = ServeConfig(
        root=tmp_path / "root", port=0, metrics_port=None, fsync=False, write_nice=0, upload_timeout_seconds=LIMIT
    )
    store = FakeStore(tmp_path / "staging")
    fmt = FakeFormat(store.files)
    sink = RecordingSink()
    lanes = Lanes(sink=sink)
    budget = UploadBudget(32, 64 * MiB)
    kept = Retention(store, RetentionPolicy())
    kept.start()
    pool = WriterPool()
    (tmp_path / "shm").mkdir()
    memory = SharedMemory(tmp_path / "shm", 64 * MiB)
    pipeline = SavePipeline(
        serve, lanes, store, Formats(fmt), pool, budget=budget, retention=kept, shared_memory=memory
    )
    rig = Rig(pipeline, lanes, store, fmt, sink, budget, kept, pool, tmp_path / "templates")
    rig.register("a")
    try:
        yield rig, memory
    finally:
        rig.close()
        memory.close()


def shm_request(export_dir: str, step: int = 1, **fields: object) -> SaveRequest:
    return dataclasses.replace(request(export_dir, step=step), shared_memory=True, **fields)


def first_save(rig: Rig) -> tuple[Decision, BusyLock]:
    """An ordinary save into shared memory, which offers the segment and the lock."""
    decision, result = rig.save(shm_request("first"))
    assert isinstance(decision, Decision) and decision.accepted and decision.segment is not None
    assert decision.lock_path and isinstance(result, Result)
    return decision, BusyLock(decision.lock_path)


def held_request(decision: Decision, export_dir: str, step: int = 2, segment: str | None = None) -> SaveRequest:
    assert decision.segment is not None
    path = segment if segment is not None else str(decision.segment.path)
    return shm_request(export_dir, step, trainer_decided=TrainerDecided(path, decision.lock_path))


def test_the_daemon_holds_the_lock_for_each_save_it_accepts_and_lets_go_before_the_result(shm_rig) -> None:
    rig, _ = shm_rig
    decision, lock = first_save(rig)
    assert lock.try_take()  # the first save is over: free
    lock.release()

    held, gate = rig.hold(shm_request("second", step=2))
    assert not lock.try_take()  # the daemon holds it while its save is in flight
    gate.release()
    (_, result) = held.result(LIMIT)
    assert isinstance(result, Result)
    assert lock.try_take()  # and let go of it before the result went out
    lock.release()
    lock.close()


def test_an_ordinary_save_while_a_trainer_holds_the_lock_is_skipped_and_counted(shm_rig) -> None:
    rig, _ = shm_rig
    _, lock = first_save(rig)
    assert lock.try_take()

    (decision,) = rig.save(request("wire", step=2))  # a cross-host trainer's, even
    assert isinstance(decision, Decision) and not decision.accepted
    assert "busy lock" in decision.reason
    assert rig.stats().skipped == 1
    assert ("skipped", "a", "saved_model") in rig.sink.outcomes()
    assert "wire" not in {s.export_dir for s in rig.store.saves()}

    lock.release()
    decision, result = rig.save(request("after", step=3))
    assert decision.accepted and isinstance(result, Result)
    lock.close()


def test_a_blocking_save_waits_for_a_trainers_lock_within_its_deadline(shm_rig) -> None:
    rig, _ = shm_rig
    _, lock = first_save(rig)
    assert lock.try_take()

    with pytest.raises(DeadlineError, match="gave up waiting"):
        rig.save(request("late", step=2, blocking=True), timeout=0.05)
    waiter = rig.in_background(request("waits", step=3, blocking=True), timeout=LIMIT)
    assert not waiter.done()
    lock.release()
    (decision, result) = waiter.result(LIMIT)
    assert decision.accepted and isinstance(result, Result) and result.step == 3
    assert (rig.stats().ok, rig.stats().skipped) == (2, 0)
    lock.close()


def test_a_held_save_is_accepted_without_a_decision_into_its_segment(shm_rig) -> None:
    rig, _ = shm_rig
    first, lock = first_save(rig)
    assert lock.try_take()

    decision, result = rig.save(held_request(first, "held"))
    assert decision.accepted and decision.segment is not None
    assert decision.segment.path == first.segment.path  # the trainer wrote it: shared_memory_written next
    assert isinstance(result, Result) and result.step == 2
    assert {s.export_dir for s in rig.store.saves()} == {"first", "held"}
    assert rig.stats().ok == 2
    lock.release()
    lock.close()


def test_a_held_save_naming_a_replaced_segment_is_accepted_without_one(shm_rig) -> None:
    rig, memory = shm_rig
    first, lock = first_save(rig)
    memory.drop("a")  # as the cap's LRU or a re-registration would
    assert lock.try_take()

    decision, result = rig.save(held_request(first, "chunks"))
    assert decision.accepted and decision.segment is None  # send chunks
    assert isinstance(result, Result)
    lock.release()
    lock.close()


def test_a_held_save_on_a_busy_lane_fails_precondition_and_writes_nothing(shm_rig) -> None:
    rig, _ = shm_rig
    first, lock = first_save(rig)
    in_flight, gate = rig.hold(shm_request("in-flight", step=5))
    before = rig.stats()

    with pytest.raises(TrainerDecidedError, match="'in-flight' in flight") as refused:
        rig.save(held_request(first, "broken"))

    assert code_for(refused.value) == grpc.StatusCode.FAILED_PRECONDITION
    assert rig.stats() == before  # counted nowhere
    gate.release()
    in_flight.result(LIMIT)
    assert "broken" not in {s.export_dir for s in rig.store.saves()}
    lock.close()


@pytest.mark.parametrize("what", ["nobody holds it", "another lock"])
def test_a_held_save_without_the_current_lock_fails_precondition(shm_rig, what: str) -> None:
    rig, _ = shm_rig
    first, lock = first_save(rig)
    request_ = held_request(first, "claimed")
    if what == "another lock":
        assert lock.try_take()
        request_ = dataclasses.replace(
            request_, trainer_decided=TrainerDecided(str(first.segment.path), "/elsewhere/a.lock")
        )

    with pytest.raises(
        TrainerDecidedError, match="nobody holds it" if what == "nobody holds it" else "not this daemon's"
    ):
        rig.save(request_)

    assert "claimed" not in {s.export_dir for s in rig.store.saves()}
    assert rig.stats().ok == 1 and rig.view().in_flight is None
    lock.close()


def test_local_skips_are_counted_and_logged_even_when_the_save_is_refused(
    shm_rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig, _ = shm_rig
    skips = (LocalSkip(SaveKind.SAVED_MODEL, "x", 4), LocalSkip(SaveKind.CHECKPOINT, "y", 5))

    rig.save(dataclasses.replace(request("carrier", step=6), local_skips=skips))
    with pytest.raises(TrainerDecidedError):  # nobody holds the lock: refused, skips still counted
        rig.save(
            dataclasses.replace(request("bad", step=7), trainer_decided=TrainerDecided("s", "l"), local_skips=skips[:1])
        )
    rig.pipeline.count_local_skips("a", skips[1:])  # as Flush reports them

    assert rig.stats().skipped == 4
    outcomes = [o for o in rig.sink.outcomes() if o[0] == "skipped"]
    assert outcomes == [("skipped", "a", k) for k in ("saved_model", "checkpoint", "saved_model", "checkpoint")]
    assert "export_dir=x step=4" in caplog.text and "skipped by the trainer" in caplog.text


def test_a_trainer_lock_taken_between_two_saves_keeps_each_exact(shm_rig) -> None:
    """Many ordinary saves racing a trainer that takes and drops the lock: each is accepted or skipped, never both."""
    rig, _ = shm_rig
    first, lock = first_save(rig)
    stop = threading.Event()
    held_saves: list[bool] = []

    def trainer() -> None:
        i = 0
        while not stop.is_set():
            if lock.try_take():
                try:
                    rig.save(held_request(first, f"held{i}", step=100 + i))
                    held_saves.append(True)
                finally:
                    lock.release()
                i += 1

    thread = threading.Thread(target=trainer)
    thread.start()
    decisions = [rig.save(request(f"ord{i}", step=i))[0] for i in range(40)]
    stop.set()
    thread.join(LIMIT)
    assert not thread.is_alive()

    accepted = sum(1 for d in decisions if isinstance(d, Decision) and d.accepted)
    stats = rig.stats()
    assert stats.ok == 1 + accepted + len(held_saves) and stats.failed == 0
    assert stats.skipped == len(decisions) - accepted
    assert len(rig.store.saves()) == stats.ok
    lock.close()


def test_closing_the_run_unlinks_its_lock_and_a_reopened_run_refuses_the_old_one(shm_rig) -> None:
    rig, _ = shm_rig
    first, lock = first_save(rig)
    rig.pipeline.close_run("a", LIMIT)
    assert lock.stale()  # the trainer's staleness check
    rig.register("a")  # reopened

    assert lock.try_take()  # a trainer that missed the close
    with pytest.raises(TrainerDecidedError, match="not this daemon's"):
        rig.save(held_request(first, "stale"))
    lock.release()
    decision, result = rig.save(shm_request("fresh", step=3))
    assert decision.accepted and decision.lock_path != first.lock_path and isinstance(result, Result)
    lock.close()
