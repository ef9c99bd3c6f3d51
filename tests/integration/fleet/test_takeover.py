"""A run taken over by another daemon of the fleet gets its retention before its first save there.

Two real daemons on one bucket prefix (radosgw, tests/integration/support/rgw.py)
with 3-second leases. Daemon A writes a run and is SIGKILLed; the trainer
moves to daemon B, whose registration waits out A's lease and takes the run.
Saves past the run's rules that A left in the bucket are gone when that
registration returns, before B writes anything of the run:

- policy saves past B's --keep-last (A ran without one: a fleet whose
  retention was turned on, daemon by daemon);
- a training checkpoint dir past its max_to_keep: the state A leaves when
  it dies between committing a checkpoint and its sweep. That instant is
  made here by copying the newest checkpoint's objects to the next step's
  names with its manifest, as A would have committed it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import tensorflow as tf

from checkpointd.protocol.names import LEASE_WAIT_METADATA
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client import CheckpointdError, RemoteCheckpointer, RemotePolicySaver
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon, start_daemon
from tests.integration.support.raw import Stub, export_template, register_requests
from tests.integration.support.rgw import Rgw

TIMEOUT = 60.0
TTL = "3"


class Pair:
    """Daemons A and B on one fresh prefix of the bucket; stopped at teardown."""

    def __init__(self, rgw: Rgw, tmp: Path) -> None:
        self.rgw = rgw
        self.tmp = tmp
        self.prefix = f"takeover-{secrets.token_hex(4)}"
        self.client: Any = rgw.client()
        self.daemons: list[Daemon] = []
        self.closers: list[Any] = []

    def daemon(self, *extra: str) -> Daemon:
        n = len(self.daemons)
        d = start_daemon(
            f"s3://{self.rgw.bucket}/{self.prefix}",  # type: ignore[arg-type]  # passed to --root as str(root)
            self.tmp / f"log{n}",
            "--work-dir", str(self.tmp / f"work{n}"),
            "--s3-endpoint-url", self.rgw.endpoint, "--s3-region", "us-east-1",
            "--lease-seconds", TTL, "--lease-idle-seconds", "60", "--no-shm", *extra,
            env=self.rgw.daemon_env(),
        )  # fmt: skip
        self.daemons.append(d)
        return d

    def keys(self, under: str) -> set[str]:
        base = f"{self.prefix}/{under}"
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.rgw.bucket, Prefix=base)
        return {o["Key"][len(base) :] for page in pages for o in page.get("Contents", [])}

    def stored_saves(self, d: Daemon, run: str) -> int:
        with d.channel() as channel:
            reply = Stub(channel).GetStatus(pb.StatusRequest(run=run, stored=True), timeout=TIMEOUT)
        (row,) = [r for r in reply.stored_runs if r.run == run]
        return row.saves

    def close(self) -> None:
        for closer in self.closers:
            with contextlib.suppress(CheckpointdError):
                closer.close()
        for d in self.daemons:
            if d.proc.poll() is None:
                d.terminate()


@pytest.fixture
def pair(rgw: Rgw, tmp_path: Path) -> Iterator[Pair]:
    up = Pair(rgw, tmp_path)
    try:
        yield up
    finally:
        up.close()


def _kill(d: Daemon) -> None:
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(TIMEOUT)


def test_policy_saves_past_the_new_holders_keep_last_are_deleted_when_it_takes_the_run(pair: Pair) -> None:
    a = pair.daemon()  # keeps every save
    b = pair.daemon("--keep-last", "3")
    policy = policies.build(policies.q(hidden=(4,)))
    step = tf.Variable(0, dtype=tf.int64)
    on_a = RemotePolicySaver(policy, a.address, run="moved", train_step=step, timeout=TIMEOUT)
    for n in range(1, 5):
        step.assign(n)
        on_a.save(f"policy-{n}", blocking=True).result(TIMEOUT)
    assert pair.stored_saves(a, "moved") == 4
    _kill(a)

    on_b = RemotePolicySaver(policy, b.address, run="moved", train_step=step, timeout=TIMEOUT)
    pair.closers.append(on_b)
    on_b.register()  # waits out A's lease, takes the run, applies its retention

    assert pair.stored_saves(b, "moved") == 3  # before any save of B's
    manifests = {k for k in pair.keys("moved/") if k.endswith("checkpointd.manifest.json")}
    assert manifests == {f"policy-{n}/checkpointd.manifest.json" for n in (2, 3, 4)}
    assert "taken over: retention deleted 1 saves" in b.log()


def _commit_copy_as_next_step(pair: Pair, directory: str, step: int) -> None:
    """Commits ckpt-<step+1> in the bucket as a copy of ckpt-<step>, manifest last, as a daemon would."""
    old, new = f"ckpt-{step}", f"ckpt-{step + 1}"
    base = f"{pair.prefix}/{directory}/"
    bucket = pair.rgw.bucket
    for suffix in (".data-00000-of-00001", ".index"):
        pair.client.copy_object(
            Bucket=bucket, Key=base + new + suffix, CopySource={"Bucket": bucket, "Key": base + old + suffix}
        )
    manifest = json.loads(
        pair.client.get_object(Bucket=bucket, Key=f"{base}{old}.checkpointd.manifest.json")["Body"].read()
    )
    text = json.dumps(manifest).replace(f'"{old}.', f'"{new}.').replace(f'/{old}"', f'/{new}"')
    manifest = json.loads(text)
    manifest["step"] = step + 1
    manifest["created_unix_seconds"] += 1.0
    assert manifest["export_dir"].endswith(new) and all(f["path"].startswith(new) for f in manifest["files"])
    pair.client.put_object(
        Bucket=bucket, Key=f"{base}{new}.checkpointd.manifest.json", Body=json.dumps(manifest).encode()
    )


def test_a_training_dir_past_max_to_keep_is_swept_when_the_new_holder_takes_the_run(pair: Pair) -> None:
    a = pair.daemon()
    b = pair.daemon()
    step = tf.Variable(0, dtype=tf.int64)
    on_a = RemoteCheckpointer("train", a.address, run="trainer", max_to_keep=3, global_step=step, timeout=TIMEOUT)
    for n in (1, 2, 3):
        step.assign(n)
        on_a.save(n, blocking=True).result(TIMEOUT)
    _kill(a)
    # A died after committing ckpt-4, before its sweep: four committed checkpoints of a max_to_keep=3 dir.
    _commit_copy_as_next_step(pair, "trainer/train", 3)

    step.assign(0)
    on_b = RemoteCheckpointer("train", b.address, run="trainer", max_to_keep=3, global_step=step, timeout=TIMEOUT)
    pair.closers.append(on_b)

    assert pair.stored_saves(b, on_b.run) == 3  # before any save of B's
    assert int(step.numpy()) == 3  # restored from ckpt-4, the copy of ckpt-3
    files = pair.keys("trainer/train/")
    assert {k.split(".")[0] for k in files if k.startswith("ckpt-")} == {"ckpt-2", "ckpt-3", "ckpt-4"}
    state = pair.client.get_object(Bucket=pair.rgw.bucket, Key=f"{pair.prefix}/trainer/train/checkpoint")["Body"].read()
    assert b'model_checkpoint_path: "ckpt-4"' in state and b'"ckpt-1"' not in state
    assert os.path.basename(on_b.manager.latest_checkpoint or "") == "ckpt-4"


def test_a_registration_that_waits_for_the_lease_says_so_first_in_its_metadata_and_the_log(
    pair: Pair, tmp_path: Path
) -> None:
    a, b = pair.daemon(), pair.daemon()
    template = export_template(policies.build(policies.q(hidden=(4,))), tmp_path / "template")

    def requests() -> Iterator[pb.RegisterRunRequest]:
        return register_requests("waited", template.dir, template.bindings.protos(), template.bindings.object_graph)

    with a.channel() as channel:
        Stub(channel).RegisterRun(requests(), timeout=TIMEOUT)  # A holds the run and stays alive
    with b.channel() as channel:
        call = Stub(channel).RegisterRun.future(requests(), timeout=8.0)
        metadata = dict(call.initial_metadata())  # before the wait ends: B sends it as it starts waiting
        assert not call.done()
        with pytest.raises(grpc.RpcError) as refused:
            call.result()
    text = metadata[LEASE_WAIT_METADATA]
    assert re.fullmatch(
        rf"waiting up to \d+ s for the lease of run waited held by host {re.escape(socket.gethostname())}, "
        rf"pid {a.proc.pid}, renewed \d+ s ago",
        text,
    ), text
    assert refused.value.code() == grpc.StatusCode.ABORTED  # A still holds it at the deadline
    assert f"lease: {text}" in b.log()
