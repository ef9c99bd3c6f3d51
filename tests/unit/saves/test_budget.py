"""UploadBudget: admission by count and by staged bytes, released on exit."""

from __future__ import annotations

import threading
import time

import pytest

from checkpointd.protocol.errors import LimitExceededError
from checkpointd.saves.budget import UploadBudget, default_staging_bytes

DEADLINE = 10.0


def test_uploads_past_the_count_are_refused_until_one_ends() -> None:
    budget = UploadBudget(max_uploads=2, max_bytes=1000)
    with budget.reserve(10, "a"), budget.reserve(10, "b"):
        assert budget.in_use == (2, 20)
        with pytest.raises(LimitExceededError, match="limit of 2 saves at once"):
            with budget.reserve(10, "c"):
                pass
        assert budget.in_use == (2, 20)  # the refusal reserved nothing
    with budget.reserve(10, "c"):
        assert budget.in_use == (1, 10)
    assert budget.in_use == (0, 0)


def test_bytes_past_the_budget_are_refused_and_name_the_flag() -> None:
    budget = UploadBudget(max_uploads=10, max_bytes=100)
    with budget.reserve(60, "a"):
        with pytest.raises(LimitExceededError, match=r"--max-staging-bytes") as info:
            with budget.reserve(41, "b"):
                pass
        assert "'b'" in str(info.value) and "40 of 100" in str(info.value)
        with budget.reserve(40, "b"):
            assert budget.in_use == (2, 100)


def test_a_failure_inside_the_block_releases_the_reservation() -> None:
    budget = UploadBudget(max_uploads=1, max_bytes=100)
    with pytest.raises(RuntimeError):
        with budget.reserve(100, "a"):
            raise RuntimeError("the save failed")
    assert budget.in_use == (0, 0)
    with budget.reserve(100, "a"):
        pass


def test_default_staging_is_half_the_machine() -> None:
    import os

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert default_staging_bytes() == total // 2


def test_release_inside_the_block_frees_the_slot_once() -> None:
    budget = UploadBudget(max_uploads=1, max_bytes=100)
    with budget.reserve(50, "a") as release:
        release()
        assert budget.in_use == (0, 0)
        with budget.reserve(100, "b"):  # fits already: the caller heard its result
            assert budget.in_use == (1, 100)
        release()  # idempotent
    assert budget.in_use == (0, 0)


def test_a_save_at_the_limit_waits_for_a_slot_and_is_admitted_when_one_ends() -> None:
    budget = UploadBudget(max_uploads=1, max_bytes=100, wait=30.0)
    waiting = threading.Event()
    admitted: list[tuple[int, int]] = []

    def second() -> None:
        waiting.set()
        with budget.reserve(10, "b"):
            admitted.append(budget.in_use)

    with budget.reserve(10, "a"):
        thread = threading.Thread(target=second)
        thread.start()
        assert waiting.wait(DEADLINE)
        assert not admitted  # held: the slot is "a"'s until its block ends
    thread.join(DEADLINE)
    assert admitted == [(1, 10)]  # "a" ended, "b" took its slot instead of being refused


def test_a_save_still_at_the_limit_after_the_wait_is_refused_and_one_that_never_fits_at_once() -> None:
    budget = UploadBudget(max_uploads=1, max_bytes=100, wait=0.05)
    with budget.reserve(10, "a"):
        with pytest.raises(LimitExceededError, match="limit of 1 saves at once"):
            with budget.reserve(10, "b"):
                pass
    patient = UploadBudget(max_uploads=1, max_bytes=100, wait=3600.0)
    refused: list[BaseException] = []

    def too_big() -> None:
        try:
            with patient.reserve(101, "c"):
                pass
        except LimitExceededError as e:
            refused.append(e)

    thread = threading.Thread(target=too_big, daemon=True)
    thread.start()
    thread.join(DEADLINE)
    assert refused and "--max-staging-bytes" in str(refused[0])  # no hour's wait for what cannot fit


def _reserve_in_background(
    budget: UploadBudget, nbytes: int, run: str, admitted: list[str], **options: float
) -> threading.Thread:
    """Starts a thread that reserves, and records `run` once admitted (and releases at once), or its refusal."""

    def work() -> None:
        try:
            with budget.reserve(nbytes, run, **options):
                admitted.append(run)
        except LimitExceededError as e:
            admitted.append(f"refused {run}: {e}")

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def test_waiters_are_admitted_first_come_first_served_as_slots_free() -> None:
    budget = UploadBudget(max_uploads=1, max_bytes=100, wait=3600.0)
    admitted: list[str] = []
    with budget.reserve(10, "a"):
        first = _reserve_in_background(budget, 10, "b", admitted)
        assert budget.wait_for_waiters(1, DEADLINE)
        second = _reserve_in_background(budget, 10, "c", admitted)
        assert budget.wait_for_waiters(2, DEADLINE)
        assert admitted == [] and budget.in_use == (1, 10)
    first.join(DEADLINE)
    second.join(DEADLINE)
    assert admitted == ["b", "c"]  # in the order they came, each once a slot freed
    assert budget.in_use == (0, 0) and budget.waiting == 0


def test_a_release_hands_the_slot_to_the_waiter_before_a_newcomer() -> None:
    budget = UploadBudget(max_uploads=1, max_bytes=100, wait=3600.0)
    admitted: list[str] = []
    gate = threading.Event()

    def waiter() -> None:
        with budget.reserve(10, "b"):
            admitted.append("b")
            gate.wait(DEADLINE)

    with budget.reserve(10, "a") as release:
        thread = threading.Thread(target=waiter, daemon=True)
        thread.start()
        assert budget.wait_for_waiters(1, DEADLINE)
        release()
        # The slot went to "b" at the release: a newcomer finds the daemon full, and may not jump the line.
        assert budget.in_use == (1, 10)
        with pytest.raises(LimitExceededError, match="limit of 1 saves at once"):
            with budget.reserve(10, "c", deadline=0.0):
                pass
    gate.set()
    thread.join(DEADLINE)
    assert admitted == ["b"] and budget.in_use == (0, 0)


def test_a_waiter_past_its_calls_deadline_is_refused_with_what_to_do() -> None:
    budget = UploadBudget(max_uploads=1, max_bytes=100, wait=3600.0)
    with budget.reserve(10, "a"):
        with pytest.raises(LimitExceededError) as info:
            with budget.reserve(10, "b", deadline=0.0):  # monotonic 0: passed long ago
                pass
    message = str(info.value)
    assert "'b'" in message and "limit of 1 saves at once (--max-concurrent-uploads)" in message
    assert "--admission-wait" in message and "retry later" in message
    assert budget.in_use == (0, 0) and budget.waiting == 0  # nothing reserved, nobody left in line


def test_a_waiter_for_bytes_holds_the_line_until_they_free_and_then_those_behind_it_fit() -> None:
    budget = UploadBudget(max_uploads=10, max_bytes=100, wait=3600.0)
    admitted: list[str] = []
    with budget.reserve(60, "a"):
        big = _reserve_in_background(budget, 50, "big", admitted)
        assert budget.wait_for_waiters(1, DEADLINE)
        small = _reserve_in_background(budget, 10, "small", admitted)
        assert budget.wait_for_waiters(2, DEADLINE)
        assert admitted == []  # "small" would fit, but waits its turn behind "big"
    big.join(DEADLINE)
    small.join(DEADLINE)
    # Both fit once "a" frees: both are admitted by that release, in whichever order their threads run.
    assert sorted(admitted) == ["big", "small"]


def test_a_waiter_that_gives_up_lets_those_behind_it_in() -> None:
    budget = UploadBudget(max_uploads=10, max_bytes=100, wait=3600.0)
    admitted: list[str] = []
    with budget.reserve(60, "a"):
        # "big" heads the line, waiting for bytes that "a" holds past big's call deadline.
        big = _reserve_in_background(budget, 50, "big", admitted, deadline=time.monotonic() + 1.0)
        assert budget.wait_for_waiters(1, DEADLINE)
        small = _reserve_in_background(budget, 10, "small", admitted)
        big.join(DEADLINE)
        small.join(DEADLINE)  # admitted as "big" left the line, while "a" still holds its bytes
        assert admitted[-1] == "small" and budget.in_use == (1, 60)
    assert admitted[0].startswith("refused big: run 'big': a 50-byte snapshot does not fit")
    assert "--max-staging-bytes" in admitted[0] and "--admission-wait" in admitted[0]
    assert budget.in_use == (0, 0) and budget.waiting == 0
