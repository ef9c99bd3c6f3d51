"""Runs one of TF-Agents' own DQN examples, unmodified, in this process.

    python -m tests.integration.example_proc EXAMPLE ROOT_DIR ITERATIONS [ADDRESS JOB]

EXAMPLE is `v2` (`agents/dqn/examples/v2/train_eval.py`, three
`common.Checkpointer`s) or `learner` (`examples/dqn/dqn_train_eval.py`: a
`Learner`, a `PolicySavedModelTrigger` and a Reverb replay buffer). Without
ADDRESS it runs as installed (in process). With ADDRESS the README's
one-line swap is applied to the installed module: for `v2` its `common` is
`checkpointd_client.common_module(ADDRESS, run=JOB, root_dir=ROOT_DIR)`,
for `learner` its `learner, triggers` are `checkpointd_client.train_modules(
...)`, as those import lines become in a user's copy. For `v2`, once
`train_eval` returns, every
checkpointer is flushed and each one's objects, written by TensorFlow's own
saver here, are compared tensor by tensor with the daemon's newest
checkpoint of its dir (the daemon's root is the ROOT env var's). It prints
one JSON line: the restored step at the start and the final step.

The intervals are small and coincide at some steps, as the issue that made
this test saw: train 20, policy 30, replay buffer 60.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import gin
import numpy as np
import tensorflow as tf

import checkpointd_client

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

    if address is not None:
        dqn_v2.common = checkpointd_client.common_module(address, run=job, root_dir=root_dir, timeout=120.0)
    dqn_v2.train_eval(
        root_dir, num_iterations=iterations, initial_collect_steps=64, replay_buffer_capacity=400, batch_size=16,
        eval_interval=10**9, num_eval_episodes=1, log_interval=10**9, summary_interval=10**9, **INTERVALS,
    )  # fmt: skip
    if address is None:
        return
    common = dqn_v2.common
    common.flush()
    mismatched = [c.ckpt_dir for c in common.checkpointers if not _same_as_newest(c, os.environ["ROOT"])]
    steps = sorted({int(c.manager.latest_checkpoint.rsplit("-", 1)[1]) for c in common.checkpointers})
    common.close()
    print(json.dumps({"mismatched": mismatched, "newest_steps": steps}))


def _same_as_newest(checkpointer: checkpointd_client.RemoteCheckpointer, daemon_root: str) -> bool:
    """Whether TF's saver, writing the checkpointer's objects now, writes what the daemon's newest checkpoint holds."""
    with tempfile.TemporaryDirectory() as tmp:
        local = tf.train.load_checkpoint(checkpointer.checkpoint.write(os.path.join(tmp, "now")))
        theirs = tf.train.load_checkpoint(checkpointer.manager.latest_checkpoint)
        keys = set(local.get_variable_to_shape_map())
        if keys != set(theirs.get_variable_to_shape_map()):
            return False
        return all(_equal(local.get_tensor(k), theirs.get_tensor(k)) for k in keys)


def _equal(a: object, b: object) -> bool:
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


if __name__ == "__main__":
    example, *args = sys.argv[1:]
    run = {"v2": main, "learner": learner_example}[example]
    run(args[0], int(args[1]), args[2] if len(args) > 2 else None, args[3] if len(args) > 3 else None)
