"""The suite's scheduling on pytest-xdist's workers (scripts/test.sh: `-n 2 --dist loadfile`).

With --dist loadfile each test file runs whole on one worker, and xdist hands
the files out in the order of their test counts (most tests first), as
workers free up. The longest files have few tests (the TF-Agents examples: 4
tests, ~4 min; the demo: 3; the move bench: 1), so they started last, and
one worker went on with one of them while the other had nothing left. Here
the longest files go out first, longest first, and the many short files
after them fill in around them; the rest keep xdist's order.
"""

from __future__ import annotations

from typing import Any

import pytest

# The files that take longest on CI's 2-core machine, longest first (seconds of
# --durations, fresh-clone run of 14 min 56 s). A file missing here only runs
# in xdist's order; a file named here and renamed is simply not found.
LONGEST_FIRST = (
    "tests/integration/training/test_tf_agents_examples.py",  # ~240 s
    "tests/integration/tools/test_demo.py",  # ~105 s
    "tests/integration/faults/test_crash.py",  # ~75 s
    "tests/integration/fleet/test_s3_lease_fencing.py",  # ~65 s
    "tests/integration/tools/test_bench_quick.py",  # ~55 s
    "tests/integration/fleet/test_fleet.py",  # ~50 s
    "tests/integration/preemption/test_training_resume.py",  # ~50 s
    "tests/integration/tools/test_bench_move.py",  # ~45 s
    "tests/integration/faults/test_s3_faults.py",  # ~45 s
)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's, called only when it runs
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With --dist loadfile, xdist's own file scheduling, the longest files first; else xdist's choice."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFilesFirst(LoadFileScheduling):
        def _assign_work_unit(self, node: Any) -> None:
            # The queue is complete by the first assignment (schedule() fills it, then assigns).
            for path in reversed(LONGEST_FIRST):
                if path in self.workqueue:
                    self.workqueue.move_to_end(path, last=False)
            super()._assign_work_unit(node)

    return LongestFilesFirst(config, log)
