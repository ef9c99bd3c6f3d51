"""TF-Agents' own example scripts, unmodified, swapped as the README says: every checkpoint (and SavedModel)
each writes in process it writes through the daemon too, in the same dirs at the same steps, and a second
run resumes from them.

The classic v2 examples of DQN (CartPole), SAC and PPO (both on gym's
Pendulum-v1: their default environments need MuJoCo, which does not install
here), and the Learner-based DQN example with Reverb. Each run is a process
of its own, as a user's two runs are: a child forked by
`tests.integration.support.trainers.example_proc serve`, which imported
TensorFlow and TF-Agents once for all of them (those imports are ~5 s of
each run's ~12 s of CPU; nothing runs in it before a fork but imports).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.support.daemon import Daemon, wait_until

RUN_SECONDS = 600  # one example run, on a loaded 2-core machine; a hang fails the test here

Run = Callable[..., dict[str, object]]


@pytest.fixture(scope="module")
def example_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """`run(root_dir, iterations, daemon=None, job="", example="v2")`: one example run, in a process of its own."""
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.support.trainers.example_proc", "serve"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )  # fmt: skip
    requests, replies = server.stdin, server.stdout
    assert requests is not None and replies is not None
    answers: queue.Queue[str] = queue.Queue()  # its stdout's lines as they come, "" at its end

    def read() -> None:
        for line in replies:
            answers.put(line)
        answers.put("")

    threading.Thread(target=read, daemon=True).start()
    logs = tmp_path_factory.mktemp("example-runs")

    def answer(deadline: float) -> dict[str, int] | None:
        """The server's next line, or None at the deadline."""
        try:
            line = answers.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        assert line, f"the example server ended (exit code {server.poll()})"
        return json.loads(line)

    def run(
        root_dir: Path, iterations: int, daemon: Daemon | None = None, job: str = "", example: str = "v2"
    ) -> dict[str, object]:
        args = [example, str(root_dir), str(iterations)]
        env = {}
        if daemon is not None:
            args += [daemon.address, job]
            env["ROOT"] = str(daemon.root)
        n = len(list(logs.iterdir())) // 2
        out, err = logs / f"{n}.out", logs / f"{n}.err"
        request = {"args": args, "env": env, "stdout": str(out), "stderr": str(err)}
        requests.write(json.dumps(request) + "\n")
        requests.flush()
        deadline = time.monotonic() + RUN_SECONDS
        started = answer(deadline)
        assert started is not None, "the example server forked no run"
        ended = answer(deadline)
        if ended is None:  # a hang fails the test here
            os.kill(started["pid"], signal.SIGKILL)
            answer(time.monotonic() + 60)
        assert ended is not None and ended["returncode"] == 0, (ended, err.read_text()[-4000:])
        lines = [line for line in out.read_text().splitlines() if line.startswith("{")]
        return json.loads(lines[-1]) if lines else {}

    try:
        yield run
    finally:
        requests.close()
        try:
            server.wait(60)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()


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
    daemon: Daemon, tmp_path: Path, example_run: Run
) -> None:
    local = tmp_path / "in-process"
    example_run(local, 60)
    example_run(local, 60)
    expected = _checkpoints(local / "train")
    # What the run lost: the policy checkpoints (train/policy), skipped behind train's.
    assert set(expected) == {".", "policy", "replay_buffer"}, expected

    job = "dqn-v2-example"
    first = example_run(tmp_path / "remote", 60, daemon, job)
    second = example_run(tmp_path / "remote", 60, daemon, job)
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
    daemon: Daemon, tmp_path: Path, example_run: Run
) -> None:
    """SAC's example with its env_load_fn and env_name arguments set to gym's Pendulum-v1 (no MuJoCo here)."""
    local = tmp_path / "in-process"
    example_run(local, 60, example="sac")
    example_run(local, 120, example="sac")  # its num_iterations counts from step 0
    expected = _checkpoints(local / "train")
    assert set(expected) == {".", "policy", "replay_buffer"}, expected

    job = "sac-v2-example"
    first = example_run(tmp_path / "remote", 60, daemon, job, example="sac")
    second = example_run(tmp_path / "remote", 120, daemon, job, example="sac")
    assert first == {"mismatched": [], "newest_steps": [60], "restored": {}}
    assert second == {
        "mismatched": [],
        "newest_steps": [120],
        "restored": {"train": True, "train/replay_buffer": True},
    }
    remote = daemon.root / job / "train"
    wait_until(lambda: _checkpoints(remote) == expected, f"the same checkpoints as in process: {expected}")


def test_the_ppo_v2_example_on_pendulum_keeps_every_checkpoint_and_saved_model_through_the_daemon(
    daemon: Daemon, tmp_path: Path, example_run: Run
) -> None:
    """PPO's clip-agent example on Pendulum-v1, its PolicySaver swapped too (policy_saver_module).

    7 iterations, then up to 13: its loop runs until the restored
    environment steps reach the total; each run ends on a save of both.
    """
    local = tmp_path / "in-process"
    example_run(local, 7, example="ppo")
    example_run(local, 13, example="ppo")
    expected = _checkpoints(local / "train")
    expected_models = _saves(local / "policy_saved_model")
    assert set(expected) == {".", "policy"} and "policy_000000012/saved_model.pb" in expected_models, expected

    job = "ppo-v2-example"
    first = example_run(tmp_path / "remote", 7, daemon, job, example="ppo")
    second = example_run(tmp_path / "remote", 13, daemon, job, example="ppo")
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
    daemon: Daemon, tmp_path: Path, example_run: Run
) -> None:
    local = tmp_path / "in-process"
    example_run(local, 100, example="learner")
    example_run(local, 100, example="learner")
    expected = _saves(local / "policies") + [f"train/{p}" for p in _saves(local / "train")]
    assert "greedy_policy/saved_model.pb" in expected and "train/checkpoints/ckpt-200.index" in expected, expected

    job = "dqn-learner-example"
    example_run(tmp_path / "remote", 100, daemon, job, example="learner")
    example_run(tmp_path / "remote", 100, daemon, job, example="learner")
    ours = daemon.root / job
    wait_until(
        lambda: _saves(ours / "policies") + [f"train/{p}" for p in _saves(ours / "train")] == expected,
        f"the same saves as in process: {expected}",
    )
