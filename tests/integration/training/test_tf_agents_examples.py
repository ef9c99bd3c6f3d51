"""TF-Agents' own example scripts, unmodified, swapped as the README says: every checkpoint (and SavedModel)
each writes in process it writes through the daemon too, in the same dirs at the same steps, and a second
run resumes from them.

The classic v2 examples of DQN (CartPole), SAC and PPO (both on gym's
Pendulum-v1: their default environments need MuJoCo, which does not install
here), and the Learner-based DQN example with Reverb. Each run is a process
of its own (`tests.integration.support.trainers.example_proc`), as a user's two runs are.
"""

from __future__ import annotations

from pathlib import Path

from tests.integration.support.daemon import Daemon, wait_until
from tests.integration.support.examples import checkpoints_of, run_example


def test_the_dqn_v2_example_keeps_every_checkpoint_and_resumes_through_the_daemon(
    daemon: Daemon, tmp_path: Path
) -> None:
    local = tmp_path / "in-process"
    run_example(local, 60)
    run_example(local, 60)
    expected = checkpoints_of(local / "train")
    # What the run lost: the policy checkpoints (train/policy), skipped behind train's.
    assert set(expected) == {".", "policy", "replay_buffer"}, expected

    job = "dqn-v2-example"
    first = run_example(tmp_path / "remote", 60, daemon, job)
    second = run_example(tmp_path / "remote", 60, daemon, job)
    assert first == {"mismatched": [], "newest_steps": [60], "restored": {}}
    # Resumed at 60, not from 0, each restored checkpointer holding its dir's newest checkpoint bit for bit.
    assert second == {
        "mismatched": [],
        "newest_steps": [120],
        "restored": {"train": True, "train/replay_buffer": True},
    }
    # Retention (max_to_keep=1 for the replay buffer) runs off the save path: its deletions follow the commit.
    remote = daemon.root / job / "train"
    wait_until(lambda: checkpoints_of(remote) == expected, f"the same checkpoints as in process: {expected}")


def test_the_sac_v2_example_on_pendulum_keeps_every_checkpoint_and_resumes_through_the_daemon(
    daemon: Daemon, tmp_path: Path
) -> None:
    """SAC's example with its env_load_fn and env_name arguments set to gym's Pendulum-v1 (no MuJoCo here)."""
    local = tmp_path / "in-process"
    run_example(local, 60, example="sac")
    run_example(local, 120, example="sac")  # its num_iterations counts from step 0
    expected = checkpoints_of(local / "train")
    assert set(expected) == {".", "policy", "replay_buffer"}, expected

    job = "sac-v2-example"
    first = run_example(tmp_path / "remote", 60, daemon, job, example="sac")
    second = run_example(tmp_path / "remote", 120, daemon, job, example="sac")
    assert first == {"mismatched": [], "newest_steps": [60], "restored": {}}
    assert second == {
        "mismatched": [],
        "newest_steps": [120],
        "restored": {"train": True, "train/replay_buffer": True},
    }
    remote = daemon.root / job / "train"
    wait_until(lambda: checkpoints_of(remote) == expected, f"the same checkpoints as in process: {expected}")
