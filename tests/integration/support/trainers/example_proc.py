"""Runs one of TF-Agents' own examples, unmodified, in this process.

    python -m tests.integration.support.trainers.example_proc EXAMPLE ROOT_DIR ITERATIONS [ADDRESS JOB]

EXAMPLE is `v2` (`agents/dqn/examples/v2/train_eval.py`, three
`common.Checkpointer`s), `sac` (`agents/sac/examples/v2/train_eval.py`, the
same three), `ppo` (`agents/ppo/examples/v2/train_eval_clip_agent.py`, two
and a `PolicySaver`) or `learner` (`examples/dqn/dqn_train_eval.py`: a
`Learner`, a `PolicySavedModelTrigger` and a Reverb replay buffer). SAC and
PPO run on gym's Pendulum-v1 through their `env_name` and `env_load_fn`
arguments: their default environments need MuJoCo, which does not install
here. Without ADDRESS an example runs as installed (in process). With
ADDRESS the README's one-line swaps are applied to the installed module: a
classic example's `common` is `checkpointd_client.common_module(ADDRESS,
run=JOB, root_dir=ROOT_DIR)` (and PPO's `policy_saver` is
`policy_saver_module(...)`), the Learner example's `learner, triggers` are
`checkpointd_client.train_modules(...)`, as those import lines become in a
user's copy. For the classic examples, each checkpointer the script
restores is checked as its `initialize_or_restore()` returns (its objects'
values against the daemon's newest checkpoint of the dir, bit for bit), and
once `train_eval` returns every checkpointer is flushed and each one's
objects, written by TensorFlow's own saver here, are compared tensor by
tensor with the daemon's newest checkpoint of its dir (the daemon's root is
the ROOT env var's). It prints one JSON line: what did not match, the
newest steps, and what was restored.

The intervals are small and coincide at some steps, as the issue that made
this test saw: train 20, policy 30, replay buffer 60 (PPO: 2 and 3).

    python -m tests.integration.support.trainers.example_proc serve

runs the same runs, each in a process of its own forked from this one once
it has imported TensorFlow and TF-Agents (~5 s of each run's ~12 s of CPU):
see `serve`. Nothing runs in it before a fork but imports: no TensorFlow op,
no gRPC channel, no example module (each defines absl flags).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from typing import Any

import gin
import numpy as np
import tensorflow as tf

import checkpointd_client

_OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"
INTERVALS = {"train_checkpoint_interval": 20, "policy_checkpoint_interval": 30, "rb_checkpoint_interval": 60}


def learner_example(root_dir: str, iterations: int, address: str | None, job: str | None) -> None:
    """The Learner-based example; it saves policies every 50 steps."""
    from tf_agents.examples.dqn import dqn_train_eval as dqn_learner  # each example defines absl flags: one only

    # As a user's --gin_bindings would: the Learner checkpoints every 50 steps (its default is 100,000).
    gin.parse_config("Learner.checkpoint_interval = 50")
    if address is not None:
        dqn_learner.learner, dqn_learner.triggers = checkpointd_client.train_modules(
            address, run=job, root_dir=root_dir, timeout=120.0
        )
    dqn_learner.train_eval(
        root_dir, num_iterations=iterations, initial_collect_steps=64, replay_capacity=400, batch_size=16,
        policy_save_interval=50, eval_interval=10**9, eval_episodes=1,
    )  # fmt: skip


def main(root_dir: str, iterations: int, address: str | None, job: str | None) -> None:
    """The classic v2 example; see the module docstring."""
    from tf_agents.agents.dqn.examples.v2 import train_eval as dqn_v2  # each example defines absl flags: one only

    _classic(dqn_v2, address, job, root_dir, num_iterations=iterations, initial_collect_steps=64,
             replay_buffer_capacity=400, batch_size=16, eval_interval=10**9, num_eval_episodes=1,
             log_interval=10**9, summary_interval=10**9, **INTERVALS)  # fmt: skip


def sac_example(root_dir: str, iterations: int, address: str | None, job: str | None) -> None:
    """SAC's v2 example on Pendulum-v1 (gym's classic control: its default HalfCheetah needs MuJoCo).

    Its num_iterations is the total from step 0 (it counts the restored global
    step), so a second run of 2N goes on from where a first of N stopped.
    """
    from tf_agents.agents.sac.examples.v2 import train_eval as sac_v2
    from tf_agents.environments import suite_gym

    _classic(sac_v2, address, job, root_dir, env_name="Pendulum-v1", env_load_fn=suite_gym.load,
             num_iterations=iterations, actor_fc_layers=(16,), critic_joint_fc_layers=(16,),
             initial_collect_steps=64, replay_buffer_capacity=400, batch_size=16, eval_interval=10**9,
             num_eval_episodes=1, log_interval=10**9, summary_interval=10**9, **INTERVALS)  # fmt: skip


def ppo_example(root_dir: str, iterations: int, address: str | None, job: str | None) -> None:
    """PPO's v2 clip-agent example on Pendulum-v1, one environment process, one epoch per iteration.

    Its loop runs until the environment steps (restored with its train
    metrics) reach `num_environment_steps`, so ITERATIONS counts from the
    first run: a second run of 2N goes on from where a first of N stopped.
    It saves (train, policy and a SavedModel) only at its log steps, after
    training at the step it read before (ckpt-6 holds the state after the
    7th iteration), so ITERATIONS of 6k + 1 end on a save of both.
    """
    from tf_agents.agents.ppo.examples.v2 import train_eval_clip_agent as ppo_v2
    from tf_agents.environments import suite_gym
    from tf_agents.system import system_multiprocessing

    system_multiprocessing.enable_interactive_mode()  # its ParallelPyEnvironment, outside absl's main
    _classic(ppo_v2, address, job, root_dir, env_name="Pendulum-v1", env_load_fn=suite_gym.load,
             random_seed=0, actor_fc_layers=(16,), value_fc_layers=(16,), num_environment_steps=200 * iterations,
             collect_episodes_per_iteration=1, num_parallel_environments=1, num_epochs=1, num_eval_episodes=1,
             eval_interval=10**9, train_checkpoint_interval=2, policy_checkpoint_interval=3, log_interval=1,
             summary_interval=10**9)  # fmt: skip


def _classic(example: Any, address: str | None, job: str | None, root_dir: str, **arguments: Any) -> None:
    """Runs a classic example's train_eval; through the daemon, checks what it restored and wrote."""
    if address is None:
        example.train_eval(root_dir, **arguments)
        return
    common = checkpointd_client.common_module(address, run=job, root_dir=root_dir, timeout=120.0)
    restores = _checking_restores(common, os.environ["ROOT"])
    example.common = common
    if hasattr(example, "policy_saver"):  # PPO's SavedModel export
        example.policy_saver = checkpointd_client.policy_saver_module(
            address, run=job, root_dir=root_dir, timeout=120.0
        )
    example.train_eval(root_dir, **arguments)
    common.flush()
    mismatched = [c.ckpt_dir for c in common.checkpointers if not _same_as_newest(c)]
    steps = sorted({int(c.manager.latest_checkpoint.rsplit("-", 1)[1]) for c in common.checkpointers})
    common.close()
    print(json.dumps({"mismatched": mismatched, "newest_steps": steps, "restored": restores}))


def _checking_restores(common: Any, daemon_root: str) -> dict[str, bool]:
    """{ckpt_dir: restored bit-identically} for each checkpointer the script restores from a checkpoint.

    Checked as `initialize_or_restore()` returns, before the script runs on:
    every value the objects hold then equals the daemon's newest checkpoint
    of the dir, bit for bit (values of objects not built yet, such as
    optimizer slots, are restored by TensorFlow when they are).
    """
    found: dict[str, bool] = {}
    make = common.Checkpointer

    def checking(*args: Any, **kwargs: Any) -> checkpointd_client.RemoteCheckpointer:
        checkpointer = make(*args, **kwargs)
        restore = checkpointer.initialize_or_restore

        def initialize_or_restore(session: Any = None) -> Any:
            status = restore(session)
            if checkpointer.checkpoint_exists:
                found[checkpointer.ckpt_dir] = _same_as_newest(checkpointer, restored=True)
            return status

        checkpointer.initialize_or_restore = initialize_or_restore  # type: ignore[method-assign]
        return checkpointer

    common.Checkpointer = checking
    return found


def _same_as_newest(checkpointer: checkpointd_client.RemoteCheckpointer, restored: bool = False) -> bool:
    """Whether TF's saver, writing the checkpointer's objects now, writes what the daemon's newest checkpoint holds.

    After a save every key must match; just after a restore, the keys of
    objects the script has not built yet may be missing here (no others),
    and every value here must match.
    """
    with tempfile.TemporaryDirectory() as tmp:
        local = tf.train.load_checkpoint(checkpointer.checkpoint.write(os.path.join(tmp, "now")))
        theirs = tf.train.load_checkpoint(checkpointer.manager.latest_checkpoint)
        keys, saved = set(local.get_variable_to_shape_map()), set(theirs.get_variable_to_shape_map())
        if not (keys <= saved if restored else keys == saved):
            return False
        if restored:  # the object graph lists the objects, so not yet the slots the first train step builds
            keys.discard(_OBJECT_GRAPH)
        return all(_equal(local.get_tensor(k), theirs.get_tensor(k)) for k in keys)


def _equal(a: object, b: object) -> bool:
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


def _run(example: str, *args: str) -> None:
    run = {"v2": main, "learner": learner_example, "sac": sac_example, "ppo": ppo_example}[example]
    run(args[0], int(args[1]), args[2] if len(args) > 2 else None, args[3] if len(args) > 3 else None)


def serve() -> None:
    """Runs each request read from stdin in a child forked from this process; stdout says how each ended.

    A request is one JSON line: {"args": [EXAMPLE, ROOT_DIR, ITERATIONS,
    (ADDRESS, JOB)], "env": {...}, "stdout": path, "stderr": path}; the
    child sets `env` in its environment, writes its stdout and stderr to the
    two files and runs the example as the command line would. This process
    answers {"pid": ...} as the child starts and {"returncode": ...} when it
    ended (negative: killed by that signal). Ends at the end of stdin.
    """
    # What every example imports, here once: the examples' own modules are imported in each child.
    import reverb  # noqa: F401
    import tf_agents.agents  # noqa: F401
    import tf_agents.train  # noqa: F401
    from tf_agents.environments import suite_gym  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child ends as a run's own process does: atexit handlers (PPO's env workers), then exit
            sys.exit(_child(request))
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


def _child(request: dict[str, Any]) -> int:
    """In the forked child: the request's run; its exit code."""
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
        os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
        os.environ.update(request["env"])
        _run(*request["args"])
        return 0
    except Exception:  # noqa: BLE001 - reported as a run's would be: its traceback, exit code 1
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        _run(*sys.argv[1:])
