"""A fleet on one machine, as several hosts: 3 daemons on 3 network namespaces, one S3 server, trainers on each host.

The hosts (tests/integration/support/netns.py) are network namespaces on a bridge;
the S3 server is a radosgw of this module's own whose gateway listens on
the bridge (scripts/rgw.sh with RGW_BIND), since a namespace cannot reach
the root namespace's 127.0.0.1. Each host runs `checkpointd serve` on its
own address (plaintext with --insecure: the bridge is private to the
test), all on one bucket prefix, with 3 s run leases; its trainers
(tests/integration/support/trainers/fleet_trainer.py) dial that host's daemon over TCP with
shared memory off (`shared_memory=False`; the daemons' logs prove every
snapshot came by gRPC). Where namespaces cannot be made (not root, no `ip`) the
same tests run on loopback addresses 127.0.0.11-13 with a shared-memory dir
per host; every test's id ends in the mode that ran: `[netns]` or
`[loopback]` (CHECKPOINTD_FLEET_HOSTS=loopback forces the fallback).

What it shows:
- a trainer SIGKILLed on host A, with A's daemon SIGKILLed too, resumes on
  host B: RemoteCheckpointer and RemotePolicySaver.restore() find, through
  B's daemon, the newest saves A committed, with A's last weights; B takes
  the runs' leases once A's expired and goes on saving;
- zero lost: DQN trainers on every host, each its own run, saving
  non-blocking (skip-if-busy skips some) and blocking in turn; every save a
  ticket said durable has its manifest in the bucket, no other save does,
  none failed, and `checkpointd verify s3://...` passes over all of them;
- the race: over several rounds two hosts' trainers register the same run
  at the same instant (both parked on stdin, released by one write each);
  each round one daemon takes the lease and writes, the other, whose call
  has a 2 s deadline the winner outlasts, is refused ABORTED naming the
  holder's pid, and every manifest's "writer" is that round's holder (the
  lease object's owner, read while it held the run).

The default suite runs a lean version: 1 trainer per host with 4 saves,
2 race rounds (about 70 s of CPU in all, TensorFlow's import in 3 daemons
and 7 trainers most of it). CHECKPOINTD_FLEET=1 runs the full one: 3
trainers per host with 30 saves each, and 10 race rounds.
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.integration.support import netns
from tests.integration.support.fleet_cluster import Fleet, start_rgw
from tests.integration.support.netns import Hosts
from tests.integration.support.rgw import Rgw

FULL = os.environ.get("CHECKPOINTD_FLEET") == "1"
TRAINERS_PER_HOST = 3 if FULL else 1
SAVES_PER_TRAINER = 30 if FULL else 4
RACE_ROUNDS = 10 if FULL else 2
LEASE_SECONDS = 3.0


@pytest.fixture(scope="module", params=[netns.mode()])
def hosts(request: pytest.FixtureRequest) -> Iterator[Hosts]:
    """3 hosts; the param (and so every test's id) is the mode: netns or loopback."""
    made = netns.make_hosts(3)
    try:
        if made.why:  # in the warnings summary of every run, beside the [loopback] ids
            warnings.warn(
                f"the fleet tests ran on loopback addresses, not network namespaces: {made.why}", stacklevel=1
            )
        yield made
    finally:
        made.remove()


@pytest.fixture(scope="module")
def fleet_rgw(hosts: Hosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rgw]:
    server = start_rgw(tmp_path_factory.mktemp("fleet-rgw"), hosts.gateway)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def fleet(hosts: Hosts, fleet_rgw: Rgw, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    made = Fleet(hosts, fleet_rgw, tmp_path_factory.mktemp("fleet"), lease_seconds=LEASE_SECONDS)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(hosts)) as pool:
            list(pool.map(made.start, range(len(hosts))))
        yield made
    finally:
        made.close()


@pytest.fixture
def live(fleet: Fleet) -> Fleet:
    """The fleet with a daemon on every host (an earlier test may have killed one)."""
    fleet.ensure_all()
    return fleet


def _writers(fleet: Fleet, run: str) -> dict[str, str]:
    return {rel: doc.get("writer", "") for rel, doc in fleet.manifests(run).items()}


def _same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.tobytes() == w.tobytes()


def test_every_save_accepted_across_the_fleet_is_committed(live: Fleet) -> None:
    trainers = {
        f"zl-{host.name}-{j}": live.trainer(i, "save", f"zl-{host.name}-{j}", str(SAVES_PER_TRAINER), str(10 * i + j))
        for i, host in enumerate(live.hosts.hosts)
        for j in range(TRAINERS_PER_HOST)
    }
    reports = {run: t.expect("durable") for run, t in trainers.items()}
    for run, report in reports.items():
        assert report["failed"] == [], (run, report)
        assert report["durable"], f"{run}: every save was skipped"
        assert len(report["durable"]) + report["skipped"] == SAVES_PER_TRAINER
        assert set(live.manifests(run)) == set(report["durable"]), run
    for i in range(len(live.hosts)):  # the trainers' snapshots came over TCP, none through shared memory
        log = live.daemon(i).log()
        assert "transport=grpc" in log and "transport=shm" not in log, live.hosts[i].name
    checked = live.verify(*(f"{live.url}/{run}" for run in reports))
    committed = sum(len(r["durable"]) for r in reports.values())
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{committed} OK, 0 FAILED" in checked.stdout, checked.stdout


def test_two_hosts_racing_for_one_run_never_both_write_it(live: Fleet) -> None:
    run, saves, hold = "contested", 2, 2.0
    racers = {i: live.trainer(i, "race", run, live.hosts[i].name, str(saves), str(hold), stdin=True) for i in (1, 2)}
    for r in racers.values():
        r.expect("ready")
    wins = {i: 0 for i in racers}
    for round_ in range(1, RACE_ROUNDS + 1):
        for r in racers.values():  # both parked on stdin: released together
            r.send(f"go {round_}")
        answers = {i: r.next(timeout=120) for i, r in racers.items()}
        won = [i for i, m in answers.items() if m.get("won")]
        assert len(won) == 1, answers
        (winner,) = won
        (loser,) = set(racers) - {winner}
        wins[winner] += 1
        refused = answers[loser]
        assert refused["refused"] == "ABORTED", refused
        holder = live.lease(run)
        assert holder is not None
        racers[winner].send(f"close {round_}")
        assert racers[winner].expect("closed")["round"] == round_

        written = {rel: w for rel, w in _writers(live, run).items() if rel.startswith(f"r{round_:02d}-")}
        assert set(written) == {f"r{round_:02d}-{live.hosts[winner].name}-{n}" for n in range(saves)}, written
        assert len(set(written.values())) == 1, written
        owner = next(iter(written.values()))
        assert owner == holder["owner"] and f"-{live.daemon(winner).proc.pid}-" in owner, (owner, holder)
        assert refused["message"] and _names_holder(refused["message"], holder), refused
    for r in racers.values():
        r.send("quit")
        assert r.wait() == 0
    print(f"\nrace wins by host: { {live.hosts[i].name: n for i, n in wins.items()} }")


def test_a_trainer_killed_with_its_daemon_resumes_on_another_host(live: Fleet, tmp_path: Path) -> None:
    run, rounds = "mover", 3
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = live.trainer(0, "train", run, str(rounds), str(tmp_path / "a"))
    durable_on_a = [a.expect("durable")["durable"] for _ in range(rounds)]
    ready = a.expect("ready")["ready"]
    assert ready == durable_on_a[-1]
    a.kill()  # mid-training, runs never closed
    pid_a = live.daemon(0).proc.pid
    live.kill_daemon(0)
    saved = pickle.loads((tmp_path / "a" / "saved.pickle").read_bytes())
    assert saved["step"] == ready

    b = live.trainer(1, "resume", run, "2", str(tmp_path / "b"))
    restored = b.expect("restored")
    assert (restored["restored"], restored["export_dir"]) == (ready, f"policies/ckpt_{ready:06d}")
    durable_on_b = [b.expect("durable")["durable"] for _ in range(2)]
    assert b.expect("done")["done"] == durable_on_b[-1] > ready
    assert b.wait() == 0

    through_checkpointer = pickle.loads((tmp_path / "b" / "checkpointer.pickle").read_bytes())
    through_saver = pickle.loads((tmp_path / "b" / "policy.pickle").read_bytes())
    assert through_checkpointer["step"] == through_saver["step"] == ready
    assert through_saver["latest"] == f"policies/ckpt_{ready:06d}"
    _same(through_checkpointer["policy"], saved["policy"])
    _same(through_saver["policy"], saved["policy"])

    policy_saves = {rel: w for rel, w in _writers(live, run).items()}
    assert set(policy_saves) == {f"policies/ckpt_{s:06d}" for s in durable_on_a + durable_on_b}
    by_a = {policy_saves[f"policies/ckpt_{s:06d}"] for s in durable_on_a}
    by_b = {policy_saves[f"policies/ckpt_{s:06d}"] for s in durable_on_b}
    assert len(by_a) == len(by_b) == 1 and by_a != by_b and "" not in by_a | by_b, policy_saves
    assert f"-{pid_a}-" in next(iter(by_a)), (by_a, pid_a)  # owner ids are host-pid-token
    training = _writers(live, f"{run}-train")
    assert set(training.values()) <= by_a | by_b and by_b <= set(training.values()), training
    lease = live.lease(run)  # B closed the run: its lease is B's, released
    assert lease is not None and {lease["owner"]} == by_b and lease["released"], lease
    assert f"-{live.daemon(1).proc.pid}-" in lease["owner"], (lease, live.daemon(1).proc.pid)
    checked = live.verify(f"{live.url}/{run}", f"{live.url}/{run}-train")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def _names_holder(message: str, lease: dict[str, object]) -> bool:
    """Whether a refusal names the lease's holder (its owner id, or its host and pid)."""
    owner = str(lease.get("owner", ""))
    return (bool(owner) and owner in message) or f"pid {lease.get('pid')}" in message
