"""TF-Agents' own example scripts, unmodified, swapped as the README says: every checkpoint (and SavedModel)
each writes in process it writes through the daemon too, in the same dirs at the same steps, and a second
run resumes from them.

The classic v2 examples of DQN (CartPole), SAC and PPO (both on gym's
Pendulum-v1: their default environments need MuJoCo, which does not install
here), and the Learner-based DQN example with Reverb. Each run is a process
of its own (`tests.integration.support.trainers.example_proc`), as a user's two runs are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.integration.support.daemon import Daemon, wait_until

RUN_SECONDS = 600  # one example run, on a loaded 2-core machine; a hang fails the test here


def _run(
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
    assert first == {"mismatched": [], "newest_steps": [60], "restored": {}}
    # Resumed at 60, not from 0, each restored checkpointer holding its dir's newest checkpoint bit for bit.
    assert second == {
        "mismatched": [],
        "newest_steps": [120],
        "restored": {"train": True, "train/replay_buffer": True},
    }
    # Retention (max_to_keep=1 for the replay buffer) runs off the save path: its deletions follow the commit.
    remote = daemon.root / job / "train"
    wait_until(lambda: _checkpoints(remote) == expected, f"the same checkpoints as in process: {expected}")


def test_the_sac_v2_example_on_pendulum_keeps_every_checkpoint_and_resumes_through_the_daemon(
    daemon: Daemon, tmp_path: Path
) -> None:
    """SAC's example with its env_load_fn and env_name arguments set to gym's Pendulum-v1 (no MuJoCo here)."""
    local = tmp_path / "in-process"
    _run(local, 60, example="sac")
    _run(local, 120, example="sac")  # its num_iterations counts from step 0
    expected = _checkpoints(local / "train")
    assert set(expected) == {".", "policy", "replay_buffer"}, expected

    job = "sac-v2-example"
    first = _run(tmp_path / "remote", 60, daemon, job, example="sac")
    second = _run(tmp_path / "remote", 120, daemon, job, example="sac")
    assert first == {"mismatched": [], "newest_steps": [60], "restored": {}}
    assert second == {
        "mismatched": [],
        "newest_steps": [120],
        "restored": {"train": True, "train/replay_buffer": True},
    }
    remote = daemon.root / job / "train"
    wait_until(lambda: _checkpoints(remote) == expected, f"the same checkpoints as in process: {expected}")


def test_the_ppo_v2_example_on_pendulum_keeps_every_checkpoint_and_saved_model_through_the_daemon(
    daemon: Daemon, tmp_path: Path
) -> None:
    """PPO's clip-agent example on Pendulum-v1, its PolicySaver swapped too (policy_saver_module).

    7 iterations, then up to 13: its loop runs until the restored
    environment steps reach the total; each run ends on a save of both.
    """
    local = tmp_path / "in-process"
    _run(local, 7, example="ppo")
    _run(local, 13, example="ppo")
    expected = _checkpoints(local / "train")
    expected_models = _saves(local / "policy_saved_model")
    assert set(expected) == {".", "policy"} and "policy_000000012/saved_model.pb" in expected_models, expected

    job = "ppo-v2-example"
    first = _run(tmp_path / "remote", 7, daemon, job, example="ppo")
    second = _run(tmp_path / "remote", 13, daemon, job, example="ppo")
    assert first == {"mismatched": [], "newest_steps": [6], "restored": {}}
    assert second == {"mismatched": [], "newest_steps": [12], "restored": {"train": True}}
    remote = daemon.root / job
    wait_until(
        lambda: (_checkpoints(remote / "train"), _saves(remote / "policy_saved_model")) == (expected, expected_models),
        f"the same checkpoints and SavedModels as in process: {expected}, {expected_models}",
    )
    assert not (tmp_path / "remote" / "policy_saved_model").exists()  # none written in the process


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
