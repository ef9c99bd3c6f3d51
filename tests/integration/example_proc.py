"""Runs TF-Agents' own DQN v2 example (`agents/dqn/examples/v2/train_eval.py`), unmodified, in this process.

    python -m tests.integration.example_proc ROOT_DIR ITERATIONS [ADDRESS JOB]

Without ADDRESS it runs as installed (in-process `common.Checkpointer`s).
With ADDRESS the README's one-line swap is applied to the installed module:
its `common` is `checkpointd_client.common_module(ADDRESS, run=JOB,
root_dir=ROOT_DIR)`, as the line `from tf_agents.utils import common`
becomes in a user's copy. Then, once `train_eval` returns, every
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

import numpy as np
import tensorflow as tf
from tf_agents.agents.dqn.examples.v2 import train_eval as dqn_v2

import checkpointd_client

INTERVALS = {"train_checkpoint_interval": 20, "policy_checkpoint_interval": 30, "rb_checkpoint_interval": 60}


def main(root_dir: str, iterations: int, address: str | None, job: str | None) -> None:
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
    args = sys.argv[1:]
    main(args[0], int(args[1]), args[2] if len(args) > 2 else None, args[3] if len(args) > 3 else None)
