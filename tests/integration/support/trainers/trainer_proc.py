"""A trainer for test_trigger to kill: DQN in a Learner, saving through the daemon.

Usage: python -m tests.integration.support.trainers.trainer_proc ADDRESS RUN ROUNDS INTERVAL LEARNER_DIR

Runs ROUNDS Learner rounds of INTERVAL steps; the trigger saves a checkpoint
after each, with a NumpyState that records the round. Once every checkpoint
is durable it prints `durable <step>` and waits on stdin until it is killed:
it never closes its runs, as a trainer killed by SIGKILL would not.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def episodes(round_: int) -> list[int]:
    """The NumpyState's value after round `round_` (1-based), for the test to check."""
    return [round_, 10 * round_]


def main(argv: list[str]) -> int:
    import numpy as np
    from tf_agents.utils import numpy_storage

    from checkpointd_client.trigger import RemotePolicySavedModelTrigger
    from tests.integration.support import dqn

    address, run, rounds, interval, learner_dir = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4]
    trainer = dqn.build(seed=1)
    state = numpy_storage.NumpyState()
    state.episodes = np.zeros(2, np.int64)
    trigger = RemotePolicySavedModelTrigger(
        "policies", trainer.agent, trainer.train_step, interval,
        address=address, run=run, numpy_state=state, timeout=120,
    )  # fmt: skip
    learner = trainer.learner(learner_dir, [trigger])
    for round_ in range(1, rounds + 1):
        state.episodes = np.array(episodes(round_), np.int64)
        learner.run(iterations=interval)
        ticket = trigger.last_ticket
        assert ticket is not None and ticket.result() is not None, "a checkpoint was skipped"
    print(f"durable {int(trainer.train_step.numpy())}", flush=True)
    sys.stdin.read()  # parked until the test kills the process
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
