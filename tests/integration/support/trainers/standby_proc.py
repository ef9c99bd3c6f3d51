"""A continuous trainer for test_standby to SIGKILL: it hands standby snapshots over between durable saves.

Usage: python -m tests.integration.support.trainers.standby_proc MODE ADDRESS RUN REFERENCES

The trainer (`tests.integration.training.test_held_training._Trainer`'s
objects: weights, a TFUniformReplayBuffer, a step) calls a continuous
RemoteCheckpointer's save() after every step, with a budget large enough
that a few hand-overs come quickly. After each hand-over it writes what
the daemon must write if it dies now: `tf.train.Checkpoint.write` of the
same objects, with the save counter one on (as the hand-over's snapshot
holds it), at `REFERENCES/ref-<step>`. It prints one line, then waits on
stdin (the test SIGKILLs it):

- `kill`: after its third hand-over: `handed <step>`.
- `torn`: after its third hand-over, once two hand-overs came with no save
  between them (so the one before the last is newer than every durable
  save), it zeroes the magic of the slot the last one sealed, as if killed
  while copying into it: `torn <step of the hand-over before>`.
- `flushed`: after its third hand-over, flush() (a durable save of that
  step): `flushed <step>`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

BUDGET = 0.6
HAND_OVERS = 3
TIMEOUT = 120.0
STEPS = 5000  # at most, before it gives up


def main(mode: str, address: str, run: str, references: Path) -> int:
    import mmap

    from checkpointd.protocol import standby
    from checkpointd_client import RemoteCheckpointer
    from checkpointd_client.continuous import HANDED_OVER_REASON
    from tests.integration.training.test_held_training import _Trainer

    trainer = _Trainer()
    ckpt = RemoteCheckpointer(
        "train", address, run=run, timeout=TIMEOUT, save_on_notice=False, continuous=True, budget=BUDGET,
        model=trainer.model, buffer=trainer.buffer, global_step=trainer.step,
    )  # fmt: skip
    trainer.train()
    ckpt.save(trainer.step, blocking=True)  # through shared memory: the slots go in that daemon's folder
    handed: list[int] = []
    in_a_row = 0  # hand-overs since the last durable save
    for _ in range(STEPS):
        trainer.train()
        ticket = ckpt.save(trainer.step)
        if not ticket.skipped:
            in_a_row = 0
        elif ticket.reason == HANDED_OVER_REASON:
            step = int(trainer.step.numpy())
            counter = ckpt.checkpoint.save_counter
            counter.assign_add(1)
            ckpt.checkpoint.write(str(references / f"ref-{step}"))
            counter.assign_sub(1)
            handed.append(step)
            in_a_row += 1
            # torn: the hand-over before the last must be newer than every durable save
            if len(handed) >= HAND_OVERS and (mode != "torn" or in_a_row >= 2):
                break
    else:
        print(f"only {len(handed)} hand-overs in {STEPS} steps", flush=True)
        return 1
    if mode == "kill":
        print(f"handed {handed[-1]}", flush=True)
    elif mode == "torn":
        slots = sorted(Path(ckpt._saves._standby.folder).glob(f"standby-{os.getpid()}-*"))  # noqa: SLF001
        sealed = []
        for path in slots:
            with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
                record = standby.read(memoryview(m))
                sealed.append((record.generation if record is not None else -1, path))
        newest = max(sealed)[1]
        with open(newest, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            view = memoryview(m)
            standby.invalidate(view)
            view.release()
        print(f"torn {handed[-2]}", flush=True)
    elif mode == "flushed":
        ckpt.flush(TIMEOUT)
        print(f"flushed {handed[-1]}", flush=True)
    else:
        print(f"unknown mode {mode!r}", flush=True)
        return 2
    sys.stdin.readline()  # until the test kills this process
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])))
