"""Fixtures for the real-daemon tier: a `checkpointd serve` subprocess."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from checkpointd.transport import shm  # noqa: E402
from checkpointd.transport.shm import default_shm_root  # noqa: E402
from tests.integration.support.daemon import Daemon, start_daemon  # noqa: E402
from tests.integration.support.rgw import rgw  # noqa: E402, F401  (here once: imported per module, one server each)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon shared by a test module; tests use their own run names."""
    base = tmp_path_factory.mktemp("daemon")
    proc = start_daemon(base / "root", base / "work")
    try:
        yield proc
    finally:
        proc.terminate()


@pytest.fixture
def fresh_daemon(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Starts daemons of the test's own (exact counts, shutdown); stops them all."""
    started: list[Daemon] = []

    def start(*extra: str) -> Daemon:
        d = start_daemon(tmp_path / "root", tmp_path / f"work{len(started)}", *extra)
        started.append(d)
        return d

    try:
        yield start
    finally:
        for d in started:
            if d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()


@pytest.fixture(scope="session", autouse=True)
def _free_killed_daemons_shared_memory() -> Iterator[None]:
    """Removes the /dev/shm folders of daemons the tests killed, as a next daemon would."""
    yield
    root = default_shm_root()
    if root is not None:
        shm.remove_dead_folders(root)
