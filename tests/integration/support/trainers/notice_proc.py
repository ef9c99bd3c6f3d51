"""A trainer for test_notice to send SIGTERM to: DQN saving through the daemon, training until it is stopped.

Usage: python -m tests.integration.support.trainers.notice_proc MODE ADDRESS RUN DEADLINE ROOT_DIR

Every mode builds `dqn.build(seed=1)` with its train step in a
`tf.function` (as TF-Agents' examples wrap it), logs at INFO to stderr, and
prints `step N` after each train step. It never closes its run: it ends the
way the SIGTERM it is sent ends it.

- `loop`: a plain training loop with a RemoteCheckpointer of `train`; one
  save at step 3, waited for (`saved 3`), then no more.
- `learner`: `tf_agents.train.Learner` from `train_modules`, `run(iterations=1)`
  over and over, its interval checkpoint every 3 steps.
- `own-handler`: `loop`, with a SIGTERM handler of the script's own
  installed first: it prints `own handler ran at step N` and exits with 7.
- `in-flight`: `loop` whose save at step 3 is not waited for, and whose
  checkpoint holds a Python state that sends this process SIGTERM while that
  save describes it: the notice lands inside the client's save call.
- `flush`: `loop` that at step 5 prints `flushing`, waits for a line on
  stdin, prints `flush called` and calls `flush()` (the test stops the
  daemon first, so the call does not return).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

OWN_HANDLER_EXIT = 7
SAVED_AT = 3
FLUSH_AT = 5
TIMEOUT = 120.0


def _tripwire() -> Any:
    import tensorflow as tf

    class Tripwire(tf.train.experimental.PythonState):
        """Python state that sends this process SIGTERM the first time it is serialized while armed."""

        armed = False

        def serialize(self) -> bytes:
            if self.armed:
                self.armed = False
                os.kill(os.getpid(), signal.SIGTERM)
            return b"tripwire"

        def deserialize(self, string_value: bytes) -> None:
            del string_value

    return Tripwire()


def loop(mode: str, address: str, run: str, deadline: float) -> int:
    from tf_agents.utils import common

    from checkpointd_client import RemoteCheckpointer
    from tests.integration.support import dqn

    trainer = dqn.build(seed=1)
    trainer.agent.train = common.function(trainer.agent.train)
    objects: dict[str, Any] = {"agent": trainer.agent, "train_step": trainer.train_step}
    if mode == "in-flight":
        objects["tripwire"] = tripwire = _tripwire()
    if mode == "own-handler":

        def own(signum: int, frame: Any) -> None:
            # os.write, not print: the signal may have interrupted a print to stdout,
            # and the buffered writer refuses a reentrant call.
            os.write(1, f"own handler ran at step {int(trainer.train_step.numpy())}\n".encode())
            # os._exit, not sys.exit: a SystemExit raised where the signal landed is
            # swallowed if that was inside a __del__ (TensorFlow runs many), and the
            # loop would go on; this handler's behaviour must not depend on that.
            os._exit(OWN_HANDLER_EXIT)

        signal.signal(signal.SIGTERM, own)
    checkpointer = RemoteCheckpointer(
        "train", address, run=run, timeout=TIMEOUT, notice_deadline=deadline, **objects
    )  # fmt: skip
    iterator = iter(trainer.dataset_fn())
    while True:
        experience, _ = next(iterator)
        trainer.agent.train(experience)
        step = int(trainer.train_step.numpy())
        print(f"step {step}", flush=True)
        if step == FLUSH_AT and mode == "flush":
            print("flushing", flush=True)
            sys.stdin.readline()
            print("flush called", flush=True)
            checkpointer.flush()
            print("flushed", flush=True)
        if step == SAVED_AT:
            if mode == "in-flight":
                tripwire.armed = True
                checkpointer.save(trainer.train_step)  # SIGTERM arrives inside; the process ends after it returns
                print("save call returned", flush=True)
            else:
                assert checkpointer.save(trainer.train_step).result(TIMEOUT) is not None
                print(f"saved {step}", flush=True)


def learner(address: str, run: str, deadline: float, root_dir: str) -> int:
    from checkpointd_client import train_modules
    from tests.integration.support import dqn

    learner_module, _ = train_modules(address, run=run, root_dir=root_dir, timeout=TIMEOUT, notice_deadline=deadline)
    trainer = dqn.build(seed=1)
    job = learner_module.Learner(
        root_dir, trainer.train_step, trainer.agent, trainer.dataset_fn,
        checkpoint_interval=SAVED_AT, summary_interval=0,
    )  # fmt: skip
    while True:
        job.run(iterations=1)
        print(f"step {int(trainer.train_step.numpy())}", flush=True)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    mode, address, run, deadline, root_dir = argv[0], argv[1], argv[2], float(argv[3]), argv[4]
    if mode == "learner":
        return learner(address, run, deadline, root_dir)
    return loop(mode, address, run, deadline)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
