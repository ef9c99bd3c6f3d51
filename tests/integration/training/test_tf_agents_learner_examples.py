"""TF-Agents' PPO v2 example and its Learner-based DQN example with Reverb, unmodified, swapped as the
README says: every checkpoint (and SavedModel) each writes in process it writes through the daemon too, and
a second run resumes from them. The classic DQN and SAC examples are in test_tf_agents_examples.py.
"""

from __future__ import annotations

from pathlib import Path

from tests.integration.support.daemon import Daemon, wait_until
from tests.integration.support.examples import checkpoints_of, run_example


def test_the_ppo_v2_example_on_pendulum_keeps_every_checkpoint_and_saved_model_through_the_daemon(
    daemon: Daemon, tmp_path: Path
) -> None:
    """PPO's clip-agent example on Pendulum-v1, its PolicySaver swapped too (policy_saver_module).

    7 iterations, then up to 13: its loop runs until the restored
    environment steps reach the total; each run ends on a save of both.
    """
    local = tmp_path / "in-process"
    run_example(local, 7, example="ppo")
    run_example(local, 13, example="ppo")
    expected = checkpoints_of(local / "train")
    expected_models = _saves(local / "policy_saved_model")
    assert set(expected) == {".", "policy"} and "policy_000000012/saved_model.pb" in expected_models, expected

    job = "ppo-v2-example"
    first = run_example(tmp_path / "remote", 7, daemon, job, example="ppo")
    second = run_example(tmp_path / "remote", 13, daemon, job, example="ppo")
    assert first == {"mismatched": [], "newest_steps": [6], "restored": {}}
    assert second == {"mismatched": [], "newest_steps": [12], "restored": {"train": True}}
    remote = daemon.root / job
    wait_until(
        lambda: (checkpoints_of(remote / "train"), _saves(remote / "policy_saved_model"))
        == (expected, expected_models),
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
    run_example(local, 100, example="learner")
    run_example(local, 100, example="learner")
    expected = _saves(local / "policies") + [f"train/{p}" for p in _saves(local / "train")]
    assert "greedy_policy/saved_model.pb" in expected and "train/checkpoints/ckpt-200.index" in expected, expected

    job = "dqn-learner-example"
    run_example(tmp_path / "remote", 100, daemon, job, example="learner")
    run_example(tmp_path / "remote", 100, daemon, job, example="learner")
    ours = daemon.root / job
    wait_until(
        lambda: _saves(ours / "policies") + [f"train/{p}" for p in _saves(ours / "train")] == expected,
        f"the same saves as in process: {expected}",
    )
