"""Trainer processes of the fleet tests, run on one host (`ip netns exec`) and talking to that host's daemon.

Usage:
    python -m tests.integration.support.trainers.fleet_trainer train ADDRESS RUN ROUNDS OUT
    python -m tests.integration.support.trainers.fleet_trainer resume ADDRESS RUN ROUNDS OUT
    python -m tests.integration.support.trainers.fleet_trainer save ADDRESS RUN SAVES SEED
    python -m tests.integration.support.trainers.fleet_trainer race ADDRESS RUN HOST SAVES HOLD_SECONDS

Every process reports on stdout, one JSON object a line, and connects over
TCP with shared memory off (the daemon is "another machine's" as far as the
transport goes, even where /dev/shm is shared).

- `train`: a real DQN (tests/integration/support/dqn.py) trained with its own
  replay data; each of ROUNDS rounds ends in a policy checkpoint
  (RemotePolicySaver.save_checkpoint, run RUN) and a training checkpoint
  (RemoteCheckpointer, run RUN-train), both waited durable
  (`{"durable": step}`). It then writes the last saved weights and step to
  OUT/saved.pickle, says `{"ready": step}` and trains on without saving
  until it is SIGKILLed: it never closes its runs.
- `resume`: the same DQN from another seed (a rescheduled job's fresh
  weights) restores RUN-train through RemoteCheckpointer
  (OUT/checkpointer.pickle), scrambles the weights, restores RUN's newest
  policy save through RemotePolicySaver.restore() (OUT/policy.pickle), then
  saves ROUNDS more rounds as `train` does and closes both runs (`{"done": step}`).
- `save`: one trainer of the zero-lost test: SAVES policy checkpoints
  between training steps, two of three non-blocking (skip-if-busy skips
  some), one of three blocking; a flush,
  then `{"durable": [...], "skipped": n, "failed": [...]}` from the tickets.
- `race`: one side of a race for one run: a template exported once, then
  on each `go R` line of stdin RegisterRun (raw gRPC, so nothing but the
  call stands between the line and the daemon) with a deadline of
  HOLD_SECONDS, and SAVES raw saves if it won; `{"round": R, "won": ...}`
  or `{"round": R, "refused": CODE, "message": ...}`. `close R` closes the
  run (its daemon lets go of the lease); `quit` ends the process.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

TIMEOUT = 120.0  # every RPC's deadline (a registration on B may wait out A's lease)
STEPS = 3  # DQN updates between two saves


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _dump(path: Path, values: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(values))
    tmp.replace(path)


def _weights(trainer: Any) -> dict[str, Any]:
    return {"step": int(trainer.train_step.numpy()), "policy": trainer.q_values()}


class _Dqn:
    """A DQN, its savers (shared memory off) and a training loop over its replay data."""

    def __init__(self, address: str, run: str, seed: int, *, training: bool = True, restore: bool = False) -> None:
        from tf_agents.utils import common

        from checkpointd_client import RemoteCheckpointer, RemotePolicySaver
        from tests.integration.support import dqn

        self.trainer = dqn.build(seed=seed)
        self._experience = iter(self.trainer.dataset_fn())
        self._train = common.function(self.trainer.agent.train)
        if restore:
            self.train(1)  # creates the optimizer's slots, so the checkpoint restores them too
        self.checkpointer = (
            RemoteCheckpointer(
                "train",
                address,
                run=f"{run}-train",
                max_to_keep=2,
                timeout=TIMEOUT,
                shared_memory=False,
                agent=self.trainer.agent,
                train_step=self.trainer.train_step,
            )  # fmt: skip
            if training
            else None
        )
        self.saver = RemotePolicySaver(
            self.trainer.agent.policy, address, run=run, train_step=self.trainer.train_step,
            timeout=TIMEOUT, shared_memory=False,
        )  # fmt: skip

    def train(self, steps: int) -> None:
        for _ in range(steps):
            experience, _ = next(self._experience)
            self._train(experience)

    def save_round(self) -> int:
        self.train(STEPS)
        step = int(self.trainer.train_step.numpy())
        policy = self.saver.save_checkpoint(f"policies/ckpt_{step:06d}")
        assert self.checkpointer is not None
        training = self.checkpointer.save(self.trainer.train_step)
        assert policy.result(TIMEOUT) is not None and training.result(TIMEOUT) is not None, "a save was skipped"
        emit(durable=step, export_dir=policy.export_dir)
        return step


def train(address: str, run: str, rounds: int, out: Path) -> int:
    dqn = _Dqn(address, run, seed=1)
    for _ in range(rounds):
        step = dqn.save_round()
    _dump(out / "saved.pickle", _weights(dqn.trainer))
    emit(ready=step)
    while True:  # mid-training when the test kills it
        dqn.train(1)


def resume(address: str, run: str, rounds: int, out: Path) -> int:
    from tests.integration.support import policies

    dqn = _Dqn(address, run, seed=7, restore=True)
    assert (
        dqn.checkpointer is not None and dqn.checkpointer.checkpoint_exists
    ), "no training checkpoint found through this host's daemon"
    dqn.checkpointer.initialize_or_restore()
    _dump(out / "checkpointer.pickle", _weights(dqn.trainer))
    policies.perturb(dqn.trainer.agent.policy, seed=11)
    dqn.trainer.train_step.assign(0)
    latest = dqn.saver.latest()
    restored = dqn.saver.restore()
    _dump(out / "policy.pickle", {**_weights(dqn.trainer), "latest": latest.export_dir if latest else None})
    emit(restored=restored.step, export_dir=restored.export_dir)
    for _ in range(rounds):
        step = dqn.save_round()
    dqn.saver.close(timeout=TIMEOUT)
    dqn.checkpointer.close()
    emit(done=step)
    return 0


def save(address: str, run: str, saves: int, seed: int) -> int:
    from checkpointd.protocol.errors import CheckpointdError

    dqn = _Dqn(address, run, seed=seed, training=False)
    tickets, failed = [], []
    for i in range(saves):
        dqn.train(1)
        # Mostly non-blocking (the next one often finds the lane busy and is
        # skipped); every third blocking, waiting its turn, so many are accepted.
        try:
            tickets.append(dqn.saver.save_checkpoint(f"ckpt_{i:04d}", blocking=i % 3 == 2))
        except CheckpointdError as e:  # a blocking save raises its own error
            failed.append(f"ckpt_{i:04d}: {e}")
    dqn.saver.flush(timeout=TIMEOUT)
    durable, skipped = [], 0
    for ticket in tickets:
        if ticket.skipped:
            skipped += 1
            continue
        error = ticket.exception(TIMEOUT)
        if error is None:
            durable.append(ticket.export_dir)
        else:
            failed.append(f"{ticket.export_dir}: {error}")
    dqn.saver.close(timeout=TIMEOUT)
    emit(durable=durable, skipped=skipped, failed=failed)
    return 0


def race(address: str, run: str, host: str, saves: int, hold_seconds: float) -> int:
    import grpc

    from checkpointd.v1 import checkpointd_pb2 as pb
    from tests.integration.support import policies, raw

    template = raw.export_template(policies.build(policies.q(hidden=(4,))), Path(tempfile.mkdtemp()) / "template")
    requests = list(
        raw.register_requests(run, template.dir, template.bindings.protos(), template.bindings.object_graph)
    )
    channel = grpc.insecure_channel(address)
    stub = raw.Stub(channel)
    grpc.channel_ready_future(channel).result(timeout=TIMEOUT)  # connected before the first race
    emit(ready=host)
    for line in sys.stdin:
        word, _, arg = line.strip().partition(" ")
        if word == "quit":
            break
        round_ = int(arg)
        if word == "close":
            stub.CloseRun(pb.CloseRunRequest(run=run, timeout_seconds=TIMEOUT), timeout=TIMEOUT)
            emit(round=round_, closed=True)
            continue
        started = time.time()
        try:
            stub.RegisterRun(iter(requests), timeout=hold_seconds)
        except grpc.RpcError as e:
            emit(round=round_, refused=e.code().name, message=e.details(), seconds=time.time() - started)
            continue
        registered = time.time()
        saved = []
        for i in range(saves):
            export_dir = f"r{round_:02d}-{host}-{i}"
            template.train_step.assign(100 * round_ + i)
            run_ = raw.Run(run, template)
            with raw.RawSave(stub, pb.SaveRequest(header=run_.header(export_dir))) as call:
                decision = call.decision()
                assert decision.accepted, decision.reason
                call.finish(run_.chunks())
            saved.append(export_dir)
        emit(round=round_, won=True, registered=registered, saved=saved, seconds=registered - started)
    channel.close()
    return 0


def main(argv: list[str]) -> int:
    mode, rest = argv[0], argv[1:]
    if mode == "train":
        return train(rest[0], rest[1], int(rest[2]), Path(rest[3]))
    if mode == "resume":
        return resume(rest[0], rest[1], int(rest[2]), Path(rest[3]))
    if mode == "save":
        return save(rest[0], rest[1], int(rest[2]), int(rest[3]))
    if mode == "race":
        return race(rest[0], rest[1], rest[2], int(rest[3]), float(rest[4]))
    raise SystemExit(f"unknown mode {mode!r}: train, resume, save or race")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
