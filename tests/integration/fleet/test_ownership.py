"""One daemon per dir, with real daemons: a second on the same root (or S3 work dir) refuses to start.

A daemon's recovery at start deletes the temp dirs it finds, which on a dir
another live daemon writes to are that daemon's saves in flight. The first
daemon here is paused with SIGSTOP in the middle of a save (accepted, half
its snapshot received, a temp dir of its own under the root), so nothing
of it can move while the second one tries to start; the second must exit 2
naming it, touch nothing, and the first's save must commit once it runs on.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tensorflow as tf

from checkpointd_client import CheckpointdError, RemotePolicySaver
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon, start_daemon, wait_until
from tests.integration.support.raw import HeldSave
from tests.integration.support.rgw import Rgw

TIMEOUT = 60.0
HEX16 = "0123456789abcdef"


def refused_start(root: str, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`checkpointd serve` that must refuse to start; bounded."""
    return subprocess.run(
        [sys.executable, "-m", "checkpointd", "serve", "--root", root, "--port", "0", "--metrics-port", "-1",
         "--no-shm", *extra],
        capture_output=True, text=True, timeout=TIMEOUT, check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})},
    )  # fmt: skip


def cannot_start_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "cannot start:" in line]
    assert "listening" not in done.stderr and "recover" not in done.stderr
    return line


def tree(root: Path) -> set[str]:
    """Every path under `root` (dirs and files), relative."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    """Daemons a test starts; each resumed (if paused) and stopped at teardown."""
    started: list[Daemon] = []
    yield started
    for d in started:
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGCONT)
            d.proc.kill()
            d.proc.wait()


@pytest.fixture
def savers() -> Iterator[list[object]]:
    made: list[object] = []
    yield made
    for s in made:
        with contextlib.suppress(CheckpointdError):  # its daemon may be gone: the test stopped it
            s.close()  # type: ignore[attr-defined]


def _state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _held_half_way(daemon: Daemon, savers: list[object], run: str) -> tuple[HeldSave, list]:
    """A save of `run` accepted by `daemon` with half its snapshot sent: in flight, going nowhere."""
    step = tf.Variable(5, dtype=tf.int64)
    remote = RemotePolicySaver(policies.build(policies.q()), daemon.address, run=run, train_step=step, timeout=TIMEOUT)
    savers.append(remote)
    held = HeldSave(daemon, remote, step, "in-flight", chunk_bytes=1 << 10)
    savers.append(held)
    chunks = held.chunks()
    held.send_chunks(chunks[: len(chunks) // 2])
    return held, chunks[len(chunks) // 2 :]


def test_a_second_daemon_on_a_root_refuses_to_start_and_the_first_daemons_save_in_flight_commits(
    tmp_path: Path, daemons: list[Daemon], savers: list[object]
) -> None:
    root = tmp_path / "root"
    first = start_daemon(root, tmp_path / "a")
    daemons.append(first)
    held, rest = _held_half_way(first, savers, "owned")
    # A temp dir of the first daemon's, as its writes leave them while they run:
    # the second daemon's recovery would delete it.
    in_progress = root / "owned" / f".checkpointd-tmp-other-{HEX16}"
    (in_progress / "variables").mkdir(parents=True)

    first.proc.send_signal(signal.SIGSTOP)  # nothing of the first daemon moves now
    wait_until(lambda: _state(first.proc.pid) == "T", "the first daemon stopped", TIMEOUT)
    before = tree(root)  # taken once it is stopped: its own staging of the save is in it too
    done = refused_start(str(root))
    line = cannot_start_line(done)
    assert f"the root {root} is in use by another checkpointd" in line, line
    assert f"pid {first.proc.pid} on host {socket.gethostname()}" in line, line
    assert "stop that daemon, or give this one another --root" in line, line
    assert tree(root) == before  # recovery never ran: the first daemon's temp dirs are whole

    first.proc.send_signal(signal.SIGCONT)
    result = held.finish(rest)
    assert result.path == str(root / "owned" / "in-flight")
    assert int(tf.saved_model.load(result.path).get_train_step().numpy()) == 5
    assert in_progress.is_dir()
    assert first.terminate() == 0


def test_the_lock_of_a_sigkilled_daemon_frees_at_once_and_the_next_one_recovers_its_root(
    tmp_path: Path, daemons: list[Daemon], savers: list[object]
) -> None:
    root = tmp_path / "root"
    first = start_daemon(root, tmp_path / "a")
    daemons.append(first)
    _held_half_way(first, savers, "killed")
    left = root / "killed" / f".checkpointd-tmp-left-{HEX16}"
    left.mkdir(parents=True)
    first.proc.kill()
    first.proc.wait()

    second = start_daemon(root, tmp_path / "b")  # at once: the kernel dropped the flock with the process
    daemons.append(second)
    assert not left.exists()  # its recovery owns the root now, and cleaned what the dead one left
    # The dead daemon's own staging of its save in flight is there too once the accept made it.
    assert not [p for p in (root / "killed").iterdir() if p.name.startswith(".checkpointd-tmp-")]
    recovered = re.search(r"recovered (\d+) interrupted save dirs", second.log())
    assert recovered is not None and int(recovered.group(1)) >= 1, second.log()
    assert second.terminate() == 0


def test_two_s3_daemons_with_one_work_dir_the_second_refuses_naming_work_dir(
    rgw: Rgw, tmp_path: Path, daemons: list[Daemon]
) -> None:
    url = f"s3://{rgw.bucket}/own-{os.getpid()}"
    s3_args = ("--s3-endpoint-url", rgw.endpoint, "--s3-region", "us-east-1")
    work = tmp_path / "work"
    first = start_daemon(url, tmp_path / "a", "--work-dir", str(work), *s3_args, env=rgw.daemon_env())  # type: ignore[arg-type]
    daemons.append(first)
    staged = work / ".checkpointd" / "s3-staging" / f".checkpointd-tmp-part-{HEX16}"
    staged.mkdir(parents=True)  # a save of the first daemon's being staged
    done = refused_start(url, "--work-dir", str(work), *s3_args, env=rgw.daemon_env())
    line = cannot_start_line(done)
    assert f"the work dir {work}" in line and "is in use by another checkpointd" in line, line
    assert f"pid {first.proc.pid} on host {socket.gethostname()}" in line, line
    assert "another --work-dir" in line and "./checkpointd-work" in line, line
    assert staged.is_dir()

    # Its own work dir: the same bucket and prefix are fine (the fleet's leases share those).
    second = start_daemon(url, tmp_path / "b", "--work-dir", str(tmp_path / "work-b"), *s3_args, env=rgw.daemon_env())  # type: ignore[arg-type]
    daemons.append(second)
    assert second.terminate() == 0
    assert first.terminate() == 0
