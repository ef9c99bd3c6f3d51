"""TF-Agents' own DQN v2 example, unmodified, swapped as the README says: every checkpoint it writes in process
it writes through the daemon too, in the same dirs at the same steps, and a second run resumes from them.

Each run is a process of its own (`tests.integration.example_proc`), as a
user's two runs are: 60 iterations, then 60 more from the restored step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.integration.daemon import Daemon, wait_until

RUN_SECONDS = 600  # one example run, on a loaded 2-core machine; a hang fails the test here


def _run(
    root_dir: Path, iterations: int, daemon: Daemon | None = None, job: str = "", example: str = "v2"
) -> dict[str, object]:
    args = [sys.executable, "-m", "tests.integration.example_proc", example, str(root_dir), str(iterations)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if daemon is not None:
        args += [daemon.address, job]
        env["ROOT"] = str(daemon.root)
    proc = subprocess.run(args, capture_output=True, text=True, timeout=RUN_SECONDS, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def _checkpoints(train_dir: Path) -> dict[str, list[str]]:
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


def test_the_dqn_v2_example_keeps_every_checkpoint_and_resumes_through_the_daemon(
    daemon: Daemon, tmp_path: Path
) -> None:
    local = tmp_path / "in-process"
    _run(local, 60)
    _run(local, 60)
    expected = _checkpoints(local / "train")
    # What the run lost: the policy checkpoints (train/policy), skipped behind train's.
    assert set(expected) == {".", "policy", "replay_buffer"}, expected

    job = "dqn-v2-example"
    first = _run(tmp_path / "remote", 60, daemon, job)
    second = _run(tmp_path / "remote", 60, daemon, job)
    assert first == {"mismatched": [], "newest_steps": [60]}
    assert second == {"mismatched": [], "newest_steps": [120]}  # resumed at 60, not from 0
    # Retention (max_to_keep=1 for the replay buffer) runs off the save path: its deletions follow the commit.
    remote = daemon.root / job / "train"
    wait_until(lambda: _checkpoints(remote) == expected, f"the same checkpoints as in process: {expected}")


def _saves(top: Path) -> list[str]:
    """Every save under `top` TF-Agents writes (SavedModels, checkpoints, state files), relative, sorted."""
    return sorted(
        p.relative_to(top).as_posix()
        for p in top.rglob("*")
        if p.is_file() and (p.name in ("saved_model.pb", "checkpoint") or p.suffix == ".index")
    )


def test_the_learner_example_with_reverb_writes_its_policies_and_checkpoints_through_the_daemon(
    daemon: Daemon, tmp_path: Path
) -> None:
    local = tmp_path / "in-process"
    _run(local, 100, example="learner")
    _run(local, 100, example="learner")
    expected = _saves(local / "policies") + [f"train/{p}" for p in _saves(local / "train")]
    assert "greedy_policy/saved_model.pb" in expected and "train/checkpoints/ckpt-200.index" in expected, expected

    job = "dqn-learner-example"
    _run(tmp_path / "remote", 100, daemon, job, example="learner")
    _run(tmp_path / "remote", 100, daemon, job, example="learner")
    ours = daemon.root / job
    wait_until(
        lambda: _saves(ours / "policies") + [f"train/{p}" for p in _saves(ours / "train")] == expected,
        f"the same saves as in process: {expected}",
    )
