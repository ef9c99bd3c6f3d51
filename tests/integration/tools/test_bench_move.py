"""The resume section's cold-cache rows and the whole move run end to end on the small case.

Nothing about speed is asserted (a shared machine is too noisy). What is
exact: the cold rows' files had no page cached when each rep began (mincore),
and the move's lease wait lasted the lease ttl, as the lease rule demands of
a daemon that cannot tell a dead holder from a slow one: B counts the ttl
from its own first sight of A's lease, just before it tells the client it
waits (load only lengthens the wait).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT = 900
CANNOT_INSTALL = "exit 3"  # scripts/rgw.sh: Ceph cannot be installed here


def test_the_cold_rows_and_the_whole_move_run_and_show_the_lease_wait_apart(tmp_path: Path) -> None:
    out = tmp_path / "resume.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.resume", "--case", "small", "--reps", "1",
         "--workdir", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())

    for path in ("inprocess_cold", "same_host_cold"):
        assert result[path]["median"] > 0, path
    for name, (cached, pages) in result["cold_resident"].items():
        assert pages > 0 and cached == 0, name
    assert "in-process restore (cold page cache)" in proc.stdout

    move = result["move"]
    if CANNOT_INSTALL in move.get("skipped", ""):
        pytest.skip(f"no S3 server for the move: {move['skipped']}")
    assert move["waited"], "daemon B took the run without waiting for A's lease"
    assert move["lease_wait"] >= 0.9 * move["lease_seconds"]  # less the wait's notice on its way to the client
    phases = ("register_to_wait", "lease_wait", "restore", "first_step")
    assert all(move[p] > 0 for p in phases)
    assert abs(sum(move[p] for p in phases) - move["total"]) < 1e-6
    assert "the whole move, RegisterRun on node B -> 1st training step" in proc.stdout
    assert not (tmp_path / "work" / "resume-small").exists()  # the section cleans up after itself
