"""TF-Agents' example scripts run as a user runs them: one process each (`trainers.example_proc`).

For tests/integration/training/test_tf_agents_examples.py and test_tf_agents_learner_examples.py,
two files so that the suite's two workers can take them at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.integration.support.daemon import Daemon

RUN_SECONDS = 600  # one example run, on a loaded 2-core machine; a hang fails the test here


def run_example(
    root_dir: Path, iterations: int, daemon: Daemon | None = None, job: str = "", example: str = "v2"
) -> dict[str, object]:
    args = [
        sys.executable,
        "-m",
        "tests.integration.support.trainers.example_proc",
        example,
        str(root_dir),
        str(iterations),
    ]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if daemon is not None:
        args += [daemon.address, job]
        env["ROOT"] = str(daemon.root)
    proc = subprocess.run(args, capture_output=True, text=True, timeout=RUN_SECONDS, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def checkpoints_of(train_dir: Path) -> dict[str, list[str]]:
    """Each checkpoint dir under train/ (relative), with its ckpt-* files and state file, as TF writes them."""
    found: dict[str, list[str]] = {}
    for directory in sorted({p.parent for p in train_dir.rglob("ckpt-*.index")}):
        names = sorted(
            p.name
            for p in directory.iterdir()
            if p.name == "checkpoint" or (p.name.startswith("ckpt-") and p.suffix in (".index", ".data-00000-of-00001"))
        )
        found[directory.relative_to(train_dir).as_posix()] = names
    return found
