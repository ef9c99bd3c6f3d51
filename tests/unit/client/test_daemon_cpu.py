"""The CPU meter of a same-host daemon, found by its shared-memory folder's name, and of a request stream."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from checkpointd_client.daemon_cpu import DaemonCpu, ThreadCpu, idle_seconds


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_segment_of_a_running_daemon_gives_its_cpu_which_grows_as_it_works() -> None:
    cpu = DaemonCpu.of_segment(f"/dev/shm/checkpointd-{os.getpid()}-0123456789abcdef/run.train-3")
    assert cpu is not None
    before = cpu.seconds()
    _burn(0.05)
    after = cpu.seconds()
    assert before is not None and after is not None
    assert after - before >= 0.02  # clock ticks: at least a few of the 50 ms burnt


def test_no_meter_for_a_segment_not_in_a_daemons_folder_or_of_a_process_gone() -> None:
    assert DaemonCpu.of_segment("/dev/shm/elsewhere/run.train-3") is None
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    gone = int(done.stdout)
    assert DaemonCpu.of_segment(f"/dev/shm/checkpointd-{gone}-0123456789abcdef/run.train-3") is None


def test_the_cpu_of_producing_a_streams_items_is_counted_on_the_thread_that_consumes_it() -> None:
    def items() -> object:
        for _ in range(3):
            _burn(0.01)
            yield b"chunk"

    produced = ThreadCpu()
    assert list(produced.timed(items())) == [b"chunk"] * 3  # type: ignore[arg-type]
    assert 0.03 <= produced.seconds < 1.0


def test_the_machines_idle_cpu_only_grows() -> None:
    before = idle_seconds()
    _burn(0.02)
    after = idle_seconds()
    assert before is not None and after is not None and after >= before > 0
