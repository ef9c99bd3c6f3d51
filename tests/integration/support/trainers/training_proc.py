"""Trainer processes for the kill-and-resume test: one to SIGKILL, one that resumes.

Usage:
    python -m tests.integration.support.trainers.training_proc train ADDRESS RUN ROUNDS STEPS CONTINUE OUT
    python -m tests.integration.support.trainers.training_proc resume ADDRESS RUN CONTINUE OUT

`train` builds `training_state.build(seed=0)` with TensorFlow's op
determinism, collects, and runs ROUNDS rounds of STEPS DQN updates, each
ending in a non-blocking RemoteCheckpointer save it waits to be durable.
It writes what the last checkpoint holds (`OUT/saved.pickle`), then, from
that state, an uninterrupted continuation of CONTINUE updates with a fixed
seed (`OUT/uninterrupted.pickle`), prints `ready <step>`, and trains on
without saving until it is killed: it never closes its run.

`resume` builds the same objects from another seed (as a restarted job with
fresh weights would), creates the optimizer's slots as Learner does,
restores from the daemon, writes what it restored (`OUT/restored.pickle`),
runs the same CONTINUE updates with the same seed (`OUT/resumed.pickle`)
and prints `resumed <step>`.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

CONTINUATION_SEED = 99
TIMEOUT = 120.0


def _dump(path: Path, values: dict[str, bytes]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(values))
    tmp.replace(path)


def _continue(state: object, steps: int) -> None:
    import tensorflow as tf

    tf.random.set_seed(CONTINUATION_SEED)  # the same sampling in both processes
    state.train(steps)  # type: ignore[attr-defined]


def train(address: str, run: str, rounds: int, steps: int, continuation: int, out: Path) -> int:
    import tensorflow as tf

    from checkpointd_client import RemoteCheckpointer
    from tests.integration.support import training_state

    tf.config.experimental.enable_op_determinism()
    state = training_state.build(seed=0)
    state.collect(64)
    checkpointer = RemoteCheckpointer("train", address, run=run, max_to_keep=2, timeout=TIMEOUT, **state.objects)
    for _ in range(rounds):
        state.train(steps)
        ticket = checkpointer.save(state.global_step)
        assert ticket.result(TIMEOUT) is not None, "a checkpoint was skipped"
    _dump(out / "saved.pickle", training_state.values(state.objects))
    _continue(state, continuation)
    _dump(out / "uninterrupted.pickle", training_state.values(state.objects))
    print(f"ready {ticket.step}", flush=True)
    while True:  # mid-training when the test kills it
        state.train(1)


def resume(address: str, run: str, continuation: int, out: Path) -> int:
    import tensorflow as tf

    from checkpointd_client import RemoteCheckpointer
    from tests.integration.support import training_state

    tf.config.experimental.enable_op_determinism()
    state = training_state.build(seed=7)
    state.create_optimizer_variables()
    with RemoteCheckpointer("train", address, run=run, max_to_keep=2, timeout=TIMEOUT, **state.objects) as checkpointer:
        assert checkpointer.checkpoint_exists
        checkpointer.initialize_or_restore()
        _dump(out / "restored.pickle", training_state.values(state.objects))
        _continue(state, continuation)
        _dump(out / "resumed.pickle", training_state.values(state.objects))
    print(f"resumed {int(state.global_step.numpy())}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    mode, rest = argv[0], argv[1:]
    if mode == "train":
        address, run, rounds, steps, continuation, out = rest
        return train(address, run, int(rounds), int(steps), int(continuation), Path(out))
    address, run, continuation, out = rest
    return resume(address, run, int(continuation), Path(out))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
