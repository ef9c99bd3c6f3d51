"""S3Leases under many leases: renewals side by side, and a held run's save never waits for its renewal."""

from __future__ import annotations

import threading
from typing import Any

from checkpointd.storage.s3 import LEASES_DIR
from tests.unit.s3.test_lease import FakeBucket, FakeClock, _leases

WAIT = 10.0  # any single wait here; reached only on failure
RUNS = 4


class _TogetherBucket(FakeBucket):
    """Lets a renewal's write through only once `together` writes are in flight at once."""

    def __init__(self) -> None:
        super().__init__()
        self.together: threading.Barrier | None = None
        self._lock = threading.Lock()

    def put_object(self, **kwargs: Any) -> dict[str, str]:  # type: ignore[override]
        if self.together is not None:
            self.together.wait()  # BrokenBarrierError (a failed renewal) unless they run side by side
        with self._lock:
            return super().put_object(**kwargs)


def test_leases_due_together_are_renewed_side_by_side() -> None:
    bucket, clock = _TogetherBucket(), FakeClock()
    leases = _leases(bucket, clock, "a")
    try:
        for i in range(RUNS):
            leases.hold(f"r{i}", None)
        before = {i: bucket.doc(f"pre/{LEASES_DIR}/r{i}.json").seq for i in range(RUNS)}
        clock.now += 3.5  # past every lease's renewal time (ttl 9: every 3 s)
        bucket.together = threading.Barrier(RUNS, timeout=WAIT)
        leases.tick()
        after = {i: bucket.doc(f"pre/{LEASES_DIR}/r{i}.json").seq for i in range(RUNS)}
        assert all(after[i] == before[i] + 1 for i in range(RUNS)), (before, after)
        assert not bucket.together.broken
        leases.check("r0")  # still valid
    finally:
        bucket.together = None
        leases.close()


def test_a_held_runs_hold_does_not_wait_for_the_runs_lock() -> None:
    bucket, clock = FakeBucket(), FakeClock()
    leases = _leases(bucket, clock, "a")
    try:
        leases.hold("r", None)
        returned = threading.Event()
        with leases._run_lock("r"):  # as a renewal of the run holds it during its request
            threading.Thread(target=lambda: (leases.hold("r", None), returned.set()), daemon=True).start()
            assert returned.wait(WAIT)
    finally:
        leases.close()


def test_a_run_due_for_its_idle_release_takes_the_locked_path() -> None:
    bucket, clock = FakeBucket(), FakeClock()
    leases = _leases(bucket, clock, "a", busy=lambda run: True)  # renewed, never released while busy
    try:
        leases.hold("r", None)
        assert leases._touch_if_valid("r")
        for _ in range(11):  # 33 s unused (idle is 30), the lease renewed every 3 s
            clock.now += 3
            leases.tick()
        assert not leases._touch_if_valid("r")  # an idle release may be under way: hold() takes the run's lock
        leases.hold("r", None)  # the locked path: still held, marked used again
        assert leases._touch_if_valid("r")
    finally:
        leases.close()
