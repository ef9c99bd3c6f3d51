"""Lanes: the waiting around the core lanes, with real threads and deadlines.

Every call that can block gets a timeout, so a failing test ends instead of
hanging, and the executor's teardown can always join its threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from checkpointd.core.lane import LaneState, SaveSpec, Skipped, Ticket, TicketState, Written
from checkpointd.core.variable_manifest import Manifest, VariableSpec
from checkpointd.protocol.errors import (
    AlreadyExistsError,
    DeadlineError,
    RunClosedError,
    RunNotFoundError,
    UnavailableError,
)
from checkpointd.protocol.kinds import SaveKind
from checkpointd.saves.runs import Lanes

# Upper bound on any wait in this file; reached only when a test fails.
LIMIT = 5.0
# How long "still blocked" is watched for; a blocked call shows it at once.
STILL_BLOCKED = 0.05

MANIFEST = Manifest((VariableSpec("w", "w/.ATTRIBUTES/VARIABLE_VALUE", "float32", (2, 3)),))


def spec(export_dir: str = "policy", *, blocking: bool = False) -> SaveSpec:
    return SaveSpec(SaveKind.SAVED_MODEL, export_dir, blocking=blocking, step=1)


@pytest.fixture
def lanes() -> Lanes:
    lanes = Lanes()
    lanes.register("a", MANIFEST)
    return lanes


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=4)
    yield pool
    # Every blocking call submitted has a timeout <= LIMIT, so this join ends.
    pool.shutdown(wait=True, cancel_futures=True)


def start(lanes: Lanes, run: str = "a", export_dir: str = "first") -> Ticket:
    ticket = lanes.begin(run, spec(export_dir))
    assert isinstance(ticket, Ticket) and ticket.state is TicketState.ACTIVE
    return ticket


def still_running(future: Future) -> bool:
    try:
        future.result(timeout=STILL_BLOCKED)
    except TimeoutError:
        return True
    return False


def eventually(predicate: Callable[[], bool]) -> bool:
    """True once `predicate` holds; False if it still does not after LIMIT seconds.

    For state another thread sets with no hook to wait on (close() marking a
    lane CLOSING); a passing test returns on the first or second check.
    """
    deadline = time.monotonic() + LIMIT
    pause = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            return False
        pause.wait(0.001)
    return True


def queued_signal() -> tuple[threading.Event, Callable[[], bool]]:
    """An `is_active` that also reports the waiter is queued.

    `Lanes.begin` asks `is_active` only once its ticket is WAITING, holding the
    lock, right before it waits; so once the event is set the waiter is queued.
    """
    queued = threading.Event()

    def is_active() -> bool:
        queued.set()
        return True

    return queued, is_active


# --- unknown runs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda lanes: lanes.begin("nope", spec()),
        lambda lanes: lanes.flush("nope", timeout=LIMIT),
        lambda lanes: lanes.close("nope", timeout=LIMIT),
        lambda lanes: lanes.manifest("nope"),
        lambda lanes: lanes.views("nope"),
    ],
    ids=["begin", "flush", "close", "manifest", "views"],
)
def test_unknown_run_is_run_not_found(lanes: Lanes, call: Callable[[Lanes], object]) -> None:
    with pytest.raises(RunNotFoundError, match="'nope'"):
        call(lanes)


def test_manifest_of_a_registered_run(lanes: Lanes) -> None:
    assert lanes.manifest("a") is MANIFEST


# --- blocking saves wait their turn -------------------------------------------------------


def test_blocking_begin_waits_for_the_in_flight_save(lanes: Lanes, pool: ThreadPoolExecutor) -> None:
    first = start(lanes)
    queued, is_active = queued_signal()

    waiter = pool.submit(lanes.begin, "a", spec("second", blocking=True), timeout=LIMIT, is_active=is_active)

    assert queued.wait(LIMIT)
    assert still_running(waiter)
    assert lanes.views("a")[0].waiting == 1
    lanes.finish("a", first, Written("/r/a/first", 1))
    second = waiter.result(timeout=LIMIT)
    assert isinstance(second, Ticket)
    assert second.state is TicketState.ACTIVE
    assert second.spec.export_dir == "second"
    lanes.finish("a", second, Written("/r/a/second", 1))
    assert lanes.views("a")[0].stats.ok == 2


def test_non_blocking_begin_while_busy_is_skipped_without_waiting(lanes: Lanes) -> None:
    start(lanes)

    decision = lanes.begin("a", spec("second"), timeout=LIMIT)

    assert isinstance(decision, Skipped)
    assert lanes.views("a")[0].stats.skipped == 1


def test_blocking_begin_past_its_timeout_is_withdrawn(lanes: Lanes) -> None:
    first = start(lanes)

    with pytest.raises(DeadlineError, match="'a'"):
        lanes.begin("a", spec("second", blocking=True), timeout=0.05)

    view = lanes.views("a")[0]
    assert view.waiting == 0
    assert view.in_flight is not None and view.in_flight.id == first.id
    lanes.finish("a", first, Written("/r/a/first", 1))
    view = lanes.views("a")[0]
    # The withdrawn save was not started after the first one ended.
    assert view.in_flight is None and view.waiting == 0
    assert view.stats.ok == 1


@pytest.mark.parametrize("timeout", [threading.TIMEOUT_MAX, 2 * threading.TIMEOUT_MAX, float("inf")])
def test_a_waiter_without_a_real_deadline_waits_for_its_turn(
    lanes: Lanes, pool: ThreadPoolExecutor, timeout: float
) -> None:
    # gRPC reports a call without a deadline as ~292 years left: more than a
    # lock can wait. The waiter must treat it as no deadline, not overflow.
    first = start(lanes)
    queued, is_active = queued_signal()
    waiter = pool.submit(lanes.begin, "a", spec("second", blocking=True), timeout=timeout, is_active=is_active)
    assert queued.wait(LIMIT)
    lanes.finish("a", first, Written("/r/a/first", 1))
    ticket = waiter.result(timeout=LIMIT)
    assert ticket.state is TicketState.ACTIVE and ticket.spec.export_dir == "second"


def test_waiter_whose_caller_went_away_gives_up(lanes: Lanes, pool: ThreadPoolExecutor) -> None:
    first = start(lanes)
    queued, gone = threading.Event(), threading.Event()

    def is_active() -> bool:
        queued.set()
        return not gone.is_set()

    waiter = pool.submit(lanes.begin, "a", spec("second", blocking=True), timeout=LIMIT, is_active=is_active)
    assert queued.wait(LIMIT)
    gone.set()
    lanes.wake()  # what the RPC's termination callback does

    # Well before its own timeout (LIMIT): the wake makes the waiter ask its caller.
    started = time.monotonic()
    with pytest.raises(DeadlineError):
        waiter.result(timeout=LIMIT)
    assert time.monotonic() - started < LIMIT / 2
    assert lanes.views("a")[0].waiting == 0
    lanes.finish("a", first, Written("/r/a/first", 1))
    assert lanes.views("a")[0].in_flight is None


# --- flush and close ----------------------------------------------------------------------


def test_flush_times_out_naming_the_busy_run_then_returns_once_finished(lanes: Lanes, pool: ThreadPoolExecutor) -> None:
    first = start(lanes)

    with pytest.raises(DeadlineError, match=r"runs: a\b"):
        lanes.flush("a", timeout=0.05)

    flushing = pool.submit(lanes.flush, "a", timeout=LIMIT)
    assert still_running(flushing)
    pool.submit(lanes.finish, "a", first, Written("/r/a/first", 1)).result(timeout=LIMIT)
    assert flushing.result(timeout=LIMIT) == ["a"]


def test_flush_of_all_runs_names_only_the_busy_ones(lanes: Lanes, pool: ThreadPoolExecutor) -> None:
    lanes.register("b", MANIFEST)
    lanes.register("c", MANIFEST)
    first_a = start(lanes, "a")
    first_c = start(lanes, "c")

    with pytest.raises(DeadlineError) as raised:
        lanes.flush(timeout=0.05)
    assert "a, c" in str(raised.value)
    assert "b" not in str(raised.value).split("runs:")[1]

    flushing = pool.submit(lanes.flush, timeout=LIMIT)
    lanes.finish("a", first_a, Written("/r/a/first", 1))
    assert still_running(flushing)  # c is still in flight
    lanes.finish("c", first_c, Written("/r/c/first", 1))
    assert flushing.result(timeout=LIMIT) == ["a", "b", "c"]


def test_flush_when_idle_returns_at_once(lanes: Lanes) -> None:
    assert lanes.flush(timeout=0.0) == ["a"]


def test_close_refuses_saves_and_waits_for_the_in_flight_one(lanes: Lanes, pool: ThreadPoolExecutor) -> None:
    first = start(lanes)

    closing = pool.submit(lanes.close, "a", timeout=LIMIT)

    assert eventually(lambda: lanes.views("a")[0].state is LaneState.CLOSING)
    assert still_running(closing)
    with pytest.raises(RunClosedError):
        lanes.begin("a", spec("late"))
    lanes.finish("a", first, Written("/r/a/first", 1))
    assert closing.result(timeout=LIMIT) is None
    view = lanes.views("a")[0]
    assert view.state is LaneState.CLOSED
    assert view.stats.ok == 1


def test_close_past_its_timeout_raises_and_closes_later(lanes: Lanes) -> None:
    first = start(lanes)

    with pytest.raises(DeadlineError, match="'a'"):
        lanes.close("a", timeout=0.05)

    assert lanes.views("a")[0].state is LaneState.CLOSING
    lanes.finish("a", first, Written("/r/a/first", 1))
    assert lanes.views("a")[0].state is LaneState.CLOSED


def test_register_again_reopens_a_closed_run(lanes: Lanes) -> None:
    lanes.close("a", timeout=LIMIT)
    new = Manifest((VariableSpec("v", "v/x", "int64", ()),))

    lanes.register("a", new)

    assert lanes.views("a")[0].state is LaneState.OPEN
    assert lanes.manifest("a") is new
    start(lanes)


# --- drain and views ------------------------------------------------------------------------


def test_drain_refuses_new_saves_but_lets_the_in_flight_one_finish(lanes: Lanes) -> None:
    first = start(lanes)

    lanes.drain()

    assert lanes.draining
    with pytest.raises(UnavailableError):
        lanes.begin("a", spec("late"))
    with pytest.raises(UnavailableError):
        lanes.begin("a", spec("late", blocking=True), timeout=LIMIT)
    lanes.finish("a", first, Written("/r/a/first", 1))
    assert lanes.flush(timeout=LIMIT) == ["a"]
    assert lanes.views("a")[0].stats.ok == 1


def test_views_are_copies(lanes: Lanes) -> None:
    first = start(lanes)
    lanes.register("b", MANIFEST)

    views = lanes.views()
    assert [v.run for v in views] == ["a", "b"]
    view = views[0]
    assert view.in_flight is not None and view.in_flight is not first
    view.in_flight.state = TicketState.FAILED
    view.stats.ok = 99

    lanes.finish("a", first, Written("/r/a/first", 1))  # still the lane's own ticket
    fresh = lanes.views("a")[0]
    assert fresh.stats.ok == 1
    assert first.state is TicketState.WRITTEN
    # The old copy did not follow the lane.
    assert view.in_flight.state is TicketState.FAILED
    assert view.state is LaneState.OPEN and fresh.in_flight is None


def test_an_operator_naming_an_unknown_run_is_told_which_runs_are_open(lanes: Lanes) -> None:
    lanes.register("b", MANIFEST)
    lanes.register("done", MANIFEST)
    lanes.close("done")
    for call in (lambda: lanes.flush("nope"), lambda: lanes.close("nope"), lambda: lanes.views("nope")):
        with pytest.raises(RunNotFoundError) as caught:
            call()
        message = str(caught.value)
        assert message.startswith("no run named 'nope' is open on this daemon; open runs: a, b; closed runs: done")
        assert "register it first" not in message  # an operator cannot; the trainer does


def test_the_open_runs_listed_are_capped() -> None:
    lanes = Lanes()
    for i in range(25):
        lanes.register(f"r{i:02d}", MANIFEST)
    with pytest.raises(RunNotFoundError, match=r"open runs: r00, .*, r19 and 5 more \("):
        lanes.flush("nope")
    with pytest.raises(RunNotFoundError, match=r"open runs: none \("):
        Lanes().views("nope")


# Claims: one open run per checkpoint dir of a folder.


def test_a_second_run_claiming_an_open_runs_dir_is_refused_naming_the_holder(lanes: Lanes) -> None:
    lanes.register("job.train", MANIFEST, "job", claim="train")
    with pytest.raises(AlreadyExistsError, match=r"'train' of folder 'job' is written by run 'job.train'"):
        lanes.register("old-name.train", MANIFEST, "job", claim="train")
    with pytest.raises(RunNotFoundError):
        lanes.claim("old-name.train")  # nothing registered
    assert lanes.claim("job.train") == "train"


def test_claims_of_other_dirs_or_folders_and_the_same_runs_again_are_taken(lanes: Lanes) -> None:
    lanes.register("job.train", MANIFEST, "job", claim="train")
    lanes.register("job.train.policy", MANIFEST, "job", claim="train/policy")
    lanes.register("other.train", MANIFEST, "other", claim="train")
    lanes.register("job.train", MANIFEST, "job", claim="train")  # a restarted trainer
    assert [lanes.claim(r) for r in ("job.train", "job.train.policy", "other.train")] == [
        "train",
        "train/policy",
        "train",
    ]


def test_a_closed_runs_claim_is_free_again(lanes: Lanes) -> None:
    lanes.register("job.train", MANIFEST, "job", claim="train")
    lanes.close("job.train", timeout=LIMIT)
    lanes.register("renamed.train", MANIFEST, "job", claim="train")
    assert lanes.claim("renamed.train") == "train"
    with pytest.raises(AlreadyExistsError):
        lanes.register("job.train", MANIFEST, "job", claim="train")  # reopening it now meets the new holder


# One stream per run name: an open run is registered again only by its own stream.

TRAINING = (SaveKind.TRAINING_CHECKPOINT,)
POLICY = (SaveKind.SAVED_MODEL, SaveKind.CHECKPOINT)


@pytest.mark.parametrize(
    ("folder", "claim", "kinds", "difference"),
    [
        ("seed2", "train", TRAINING, r"folder 'seed1', not 'seed2'"),
        ("seed1", None, POLICY, r"training_checkpoint saves, not saved_model, checkpoint"),
        ("seed1", "train/policy", TRAINING, r"checkpoint dir 'train', not 'train/policy'"),
    ],
)
def test_an_open_run_registered_by_another_stream_is_refused_and_keeps_its_place(
    folder: str, claim: str | None, kinds: tuple[SaveKind, ...], difference: str
) -> None:
    lanes = Lanes()
    lanes.register("exp.train", MANIFEST, "seed1", claim="train", kinds=TRAINING)
    with pytest.raises(AlreadyExistsError, match=rf"run 'exp.train' is open on this daemon for {difference}.*run="):
        lanes.check_registration("exp.train", folder, claim, kinds)
    with pytest.raises(AlreadyExistsError):
        lanes.register("exp.train", MANIFEST, folder, claim=claim, kinds=kinds)
    assert (lanes.folder("exp.train"), lanes.claim("exp.train")) == ("seed1", "train")


def test_its_own_stream_registers_an_open_run_again_and_a_closed_run_takes_any_place() -> None:
    lanes = Lanes()
    lanes.register("exp.train", MANIFEST, "seed1", claim="train", kinds=TRAINING)
    lanes.register("exp.train", MANIFEST, "seed1", claim="train", kinds=TRAINING)  # restarted without close()
    lanes.close("exp.train", timeout=LIMIT)
    lanes.register("exp.train", MANIFEST, "seed2", claim="train", kinds=TRAINING)  # the name taken up again
    assert (lanes.folder("exp.train"), lanes.claim("exp.train")) == ("seed2", "train")


def test_a_registration_in_progress_names_its_folder_until_it_ends() -> None:
    """A lease taken while a run registers (a fleet's takeover) finds the run's folder, not its name."""
    lanes = Lanes()
    assert lanes.registering_folder("job.train") is None
    with lanes.registering("job.train", "job"):
        assert lanes.registering_folder("job.train") == "job"
    assert lanes.registering_folder("job.train") is None
