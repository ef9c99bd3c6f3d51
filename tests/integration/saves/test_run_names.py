"""A run name never loses work: a job's savers and checkpointers, its evaluators and its renames.

Each saver or checkpointer of a job is a run of its own on the daemon
(`checkpointd_client.transport.streams`), so none skips, refuses or shadows another
whatever names they share; restores go by where the checkpoints are. Real
TF-Agents objects (a DQN agent with Adam, its replay buffer) against a real
daemon.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import checkpointd_client
from checkpointd_client import AlreadyExistsError, RemoteCheckpointer, RemotePolicySaver, RunClosedError, SaveTicket
from tests.integration.support import policies, training_state
from tests.integration.support.daemon import Daemon
from tests.integration.support.raw import counts

LIMIT = 60.0


def _objects(state: training_state.State) -> list[dict[str, Any]]:
    """What the DQN example's three checkpointers hold: train, train/policy, train/replay_buffer."""
    return [
        {"agent": state.agent, "global_step": state.global_step},
        {"policy": state.agent.policy, "global_step": state.global_step},
        {"replay_buffer": state.replay_buffer},
    ]


def _three(daemon: Daemon, job: str, state: training_state.State) -> list[RemoteCheckpointer]:
    """The DQN example's three checkpointers, named by one job as the README says."""
    dirs = ("train", "train/policy", "train/replay_buffer")
    return [
        RemoteCheckpointer(d, daemon.address, run=job, timeout=LIMIT, max_to_keep=1 if "replay" in d else 20, **o)
        for d, o in zip(dirs, _objects(state), strict=True)
    ]


def test_a_jobs_checkpointers_never_skip_one_another_and_each_restores_its_own(daemon: Daemon) -> None:
    state = training_state.build(seed=1)
    state.collect(40)
    trainers = _three(daemon, "rn-dqn", state)
    assert [c.run for c in trainers] == ["rn-dqn.train", "rn-dqn.train.policy", "rn-dqn.train.replay_buffer"]
    assert {c.folder for c in trainers} == {"rn-dqn"}
    for step in (500, 1000):
        state.global_step.assign(step)
        # The intervals coincide: three non-blocking saves at once, as the example's loop makes them.
        tickets: list[SaveTicket] = [c.save(step) for c in trainers]
        assert [t.skipped for t in tickets] == [False, False, False], [t.reason for t in tickets]
        assert all(t.result() is not None for t in tickets)
    saved = [training_state.values(o) for o in _objects(state)]
    for c in trainers:
        c.close()
    for name in ("train", "train/policy", "train/replay_buffer"):
        assert (daemon.root / "rn-dqn" / name / "ckpt-1000.index").is_file(), name
    assert counts(daemon, "rn-dqn.train.policy") == (2, 0, 0)

    fresh = training_state.build(seed=2)  # other initial values, restored over
    restarted = _three(daemon, "rn-dqn", fresh)
    try:
        assert all(c.checkpoint_exists for c in restarted)
        for c in restarted:
            c.initialize_or_restore()
        assert [training_state.values(o) for o in _objects(fresh)] == saved
        assert int(fresh.global_step.numpy()) == 1000
    finally:
        for c in restarted:
            c.close()


def test_a_policy_saver_and_checkpointers_of_one_job_all_save(daemon: Daemon) -> None:
    state = training_state.build(seed=3)
    saver = RemotePolicySaver(state.agent.policy, daemon.address, run="rn-snip", train_step=state.global_step)
    checkpointer = RemoteCheckpointer(
        "train", daemon.address, run="rn-snip", timeout=LIMIT, agent=state.agent, global_step=state.global_step
    )
    try:
        assert (saver.run, checkpointer.run) == ("rn-snip", "rn-snip.train")
        for step in (1, 2):
            state.global_step.assign(step)
            policy_ticket = saver.save(f"policies/policy_{step}")
            checkpoint_ticket = checkpointer.save(step)
            assert policy_ticket.result() is not None and checkpoint_ticket.result() is not None
        assert (daemon.root / "rn-snip" / "policies" / "policy_2" / "saved_model.pb").is_file()
        assert (daemon.root / "rn-snip" / "train" / "ckpt-2.index").is_file()
    finally:
        saver.close()
        checkpointer.close()


def test_two_policies_savers_of_one_job_have_runs_of_their_own(daemon: Daemon) -> None:
    state = training_state.build(seed=4)
    greedy = RemotePolicySaver(state.agent.policy, daemon.address, run="rn-pol", train_step=state.global_step)
    collect = RemotePolicySaver(state.agent.collect_policy, daemon.address, run="rn-pol", train_step=state.global_step)
    try:
        assert greedy.run == "rn-pol" and collect.run.startswith("rn-pol.") and collect.run != greedy.run
        assert greedy.folder == collect.folder == "rn-pol"
        both = [greedy.save("greedy"), collect.save("collect")]
        assert [t.skipped for t in both] == [False, False]
        assert all(t.result() is not None for t in both)
    finally:
        greedy.close()
        collect.close()
    # Both in the job's folder, as the README's table says: not in a folder named after the second's run.
    assert (daemon.root / "rn-pol" / "greedy" / "saved_model.pb").is_file()
    assert (daemon.root / "rn-pol" / "collect" / "saved_model.pb").is_file()
    assert not (daemon.root / collect.run).exists()


def test_an_evaluator_restores_without_registering_or_closing_the_trainers_run(daemon: Daemon) -> None:
    state = training_state.build(seed=5)
    trainer = RemoteCheckpointer(
        "train", daemon.address, run="rn-eval", timeout=LIMIT, agent=state.agent, global_step=state.global_step
    )
    try:
        state.global_step.assign(7)
        assert trainer.save(7).result() is not None
        evaluation = training_state.build(seed=6)
        # The README's evaluation job: the policy alone, partially restored, read-only.
        evaluator = RemoteCheckpointer(
            "train", daemon.address, run="rn-eval", read_only=True, timeout=LIMIT, agent=evaluation.agent
        )
        assert evaluator.checkpoint_exists and evaluator.read_only
        evaluator.initialize_or_restore().expect_partial()
        for mine, theirs in zip(evaluation.agent.policy.variables(), state.agent.policy.variables(), strict=True):
            np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
        with pytest.raises(RunClosedError, match="read-only"):
            evaluator.save(8)
        evaluator.close()
        state.global_step.assign(8)
        ticket = trainer.save(8)  # not blocking: a closed run would fail it
        assert not ticket.skipped and ticket.result() is not None
        assert counts(daemon, trainer.run) == (2, 0, 0)
    finally:
        trainer.close()


def test_a_renamed_job_resumes_from_its_dir_and_a_second_writer_is_refused(daemon: Daemon) -> None:
    step = tf.Variable(0, dtype=tf.int64)
    weights = tf.Variable(np.arange(6, dtype=np.float32))
    with RemoteCheckpointer(
        "train", daemon.address, run="rn-old", folder="rn-moved", timeout=LIMIT, global_step=step, w=weights
    ) as old:
        for s in (500, 1000):
            step.assign(s)
            assert old.save(s, blocking=True).result() is not None
    directory = daemon.root / "rn-moved" / "train"
    before = {p.name: (p.stat().st_ino, p.read_bytes()) for p in directory.glob("ckpt-*")}

    step2, weights2 = tf.Variable(0, dtype=tf.int64), tf.Variable(np.zeros(6, dtype=np.float32))
    with RemoteCheckpointer(
        "train", daemon.address, run="rn-new", folder="rn-moved", timeout=LIMIT, global_step=step2, w=weights2
    ) as new:
        new.initialize_or_restore()
        assert int(step2.numpy()) == 1000  # resumed from the dir, not from step 0
        np.testing.assert_array_equal(weights2.numpy(), weights.numpy())
        # While it is open, a third name over the same dir is refused at once, saying what to change.
        with pytest.raises(AlreadyExistsError, match=r"written by run 'rn-new\.train'.*another ckpt_dir.*read_only"):
            RemoteCheckpointer("train", daemon.address, run="rn-third", folder="rn-moved", timeout=LIMIT, s=step)
        step2.assign(1500)
        assert new.save(1500, blocking=True).result() is not None
        assert [Path(p).name for p in new.manager.checkpoints] == ["ckpt-500", "ckpt-1000", "ckpt-1500"]
    after = {p.name: (p.stat().st_ino, p.read_bytes()) for p in directory.glob("ckpt-*") if p.name in before}
    assert after == before  # the old name's checkpoints are untouched


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"max_to_keep": "3"}, "max_to_keep"),
        ({"max_to_keep": 0}, "max_to_keep"),
        ({"keep_checkpoint_every_n_hours": -1}, "keep_checkpoint_every_n_hours"),
        ({"keep_checkpoint_every_n_hours": float("nan")}, "keep_checkpoint_every_n_hours"),
        ({"incremental": "yes"}, "incremental"),
        ({"read_only": 1}, "read_only"),
        ({"skip_if_busy": None}, "skip_if_busy"),
        ({"ckpt_dir": "/abs/train"}, "ckpt_dir"),
        ({"ckpt_dir": "../train"}, "ckpt_dir"),
        ({"run": None}, "name the training job"),
        ({"run": "a/b"}, "run="),
        ({"folder": "../x"}, "folder="),
        ({"timeout": "5"}, "timeout"),
        ({"timeout": float("inf")}, "timeout"),
        ({"chunk_bytes": 8 << 20}, "chunk_bytes"),
        ({"shared_memory": "no"}, "shared_memory"),
        ({"channel_credentials": "tls"}, "channel_credentials"),
        ({"token": 5}, "token"),
        ({"token": "t", "token_file": "f"}, "token or token_file"),
        ({"root_dir": "/data/job", "ckpt_dir": "/elsewhere/train"}, "ckpt_dir"),
    ],
)
def test_a_bad_constructor_argument_fails_at_construction_naming_it(arguments: dict[str, Any], message: str) -> None:
    kwargs: dict[str, Any] = {"ckpt_dir": "train", "run": "rn-args", "timeout": 1.0, **arguments}
    ckpt_dir = kwargs.pop("ckpt_dir")
    # No daemon listens there: a check that passed would fail on the connection instead.
    with pytest.raises(ValueError, match=message):
        RemoteCheckpointer(ckpt_dir, "127.0.0.1:1", step=tf.Variable(0), **kwargs)


def test_a_huge_max_to_keep_is_taken_as_checkpoint_manager_takes_it(daemon: Daemon) -> None:
    step = tf.Variable(3, dtype=tf.int64)
    with RemoteCheckpointer("train", daemon.address, run="rn-huge", max_to_keep=10**12, timeout=LIMIT, s=step) as c:
        assert c.save(3, blocking=True).result() is not None
    assert os.path.isfile(daemon.root / "rn-huge" / "train" / "ckpt-3.index")


def test_a_renamed_job_that_does_not_resume_never_replaces_the_old_names_checkpoints(daemon: Daemon) -> None:
    step = tf.Variable(0, dtype=tf.int64)
    with RemoteCheckpointer(
        "train", daemon.address, run="rn-was", folder="rn-dir", timeout=LIMIT, global_step=step
    ) as old:
        for s in (500, 1000):
            step.assign(s)
            assert old.save(s, blocking=True).result() is not None
        assert old.save(1000, blocking=True).result() is not None  # its own stream may save a step again
    directory = daemon.root / "rn-dir" / "train"
    before = {p.name: p.read_bytes() for p in directory.glob("ckpt-*")}

    # A job renamed over the dir restores from it, then starts its step again (a script that sets it):
    # at a step the old name committed, its save is refused, loudly, blocking or not; the old one stays.
    step2 = tf.Variable(0, dtype=tf.int64)
    with RemoteCheckpointer(
        "train", daemon.address, run="rn-is", folder="rn-dir", timeout=LIMIT, global_step=step2
    ) as new:
        assert int(step2.numpy()) == 1000
        step2.assign(500)
        for blocking in (False, True):
            with pytest.raises(AlreadyExistsError, match=r"run 'rn-was\.train' committed.*initialize_or_restore"):
                new.save(500, blocking=blocking)
        step2.assign(1500)
        assert new.save(1500, blocking=True).result() is not None  # past the dir's newest: its own
    after = {p.name: p.read_bytes() for p in directory.glob("ckpt-*") if p.name in before}
    assert after == before
    assert counts(daemon, "rn-is.train") == (1, 0, 0)


def test_a_job_of_the_same_name_in_another_folder_is_refused_and_the_first_keeps_its_folder(daemon: Daemon) -> None:
    step = tf.Variable(1, dtype=tf.int64)
    first = RemoteCheckpointer("train", daemon.address, run="rn-exp", folder="rn-seed1", timeout=LIMIT, s=step)
    try:
        # A second seed of the experiment, same run=, its own folder: both would be run 'rn-exp.train'.
        with pytest.raises(
            AlreadyExistsError, match=r"'rn-exp\.train' is open .* folder 'rn-seed1', not 'rn-seed2'.*run="
        ):
            RemoteCheckpointer("train", daemon.address, run="rn-exp", folder="rn-seed2", timeout=LIMIT, s=step)
        ticket = first.save(1)  # not blocking: a run taken over would fail or move it
        assert not ticket.skipped and ticket.result() is not None
    finally:
        first.close()
    assert (daemon.root / "rn-seed1" / "train" / "ckpt-1.index").is_file()
    assert not (daemon.root / "rn-seed2").exists()


def test_a_policy_saver_named_like_a_checkpointers_run_is_refused_at_registration(daemon: Daemon) -> None:
    state = training_state.build(seed=7)
    checkpointer = RemoteCheckpointer(
        "train", daemon.address, run="rn-like", timeout=LIMIT, agent=state.agent, global_step=state.global_step
    )
    saver = RemotePolicySaver(state.agent.policy, daemon.address, run="rn-like.train", timeout=LIMIT)
    try:
        assert saver.run == checkpointer.run == "rn-like.train"
        with pytest.raises(AlreadyExistsError, match=r"training_checkpoint saves, not saved_model.*run="):
            saver.register()
        state.global_step.assign(3)
        assert checkpointer.save(3).result() is not None  # its run is still its own
    finally:
        saver.close()
        checkpointer.close()


def test_savers_of_a_job_named_by_folder_alone_or_by_run_never_skip_one_another(daemon: Daemon) -> None:
    """Omitting run= (the folder names the job) gives the same runs as naming it: none shared."""
    state = training_state.build(seed=8)
    state.collect(40)
    by_folder = [
        RemoteCheckpointer(d, daemon.address, folder="rn-omit", timeout=LIMIT, **o)
        for d, o in zip(("train", "train/policy"), _objects(state)[:2], strict=True)
    ]
    by_run = RemoteCheckpointer(
        "train/replay_buffer", daemon.address, run="rn-omit", timeout=LIMIT, rb=state.replay_buffer
    )
    greedy = RemotePolicySaver(state.agent.policy, daemon.address, folder="rn-omit", timeout=LIMIT)
    collect = RemotePolicySaver(state.agent.collect_policy, daemon.address, timeout=LIMIT, folder="rn-omit")
    everything = [*by_folder, by_run]
    try:
        runs = [c.run for c in everything] + [greedy.run, collect.run]
        assert len(set(runs)) == len(runs), runs
        state.global_step.assign(20)
        tickets = [c.save(20) for c in everything] + [greedy.save("policies/greedy"), collect.save("policies/collect")]
        assert [t.skipped for t in tickets] == [False] * len(tickets), [t.reason for t in tickets]
        assert all(t.result() is not None for t in tickets)
    finally:
        for closing in (*everything, greedy, collect):
            closing.close()
    folder = daemon.root / "rn-omit"
    for name in ("train", "train/policy", "train/replay_buffer"):
        assert (folder / name / "ckpt-20.index").is_file(), name
    assert (folder / "policies" / "greedy" / "saved_model.pb").is_file()
    assert (folder / "policies" / "collect" / "saved_model.pb").is_file()


SAVER_ARGUMENTS = [
    ({"run": None}, "name the training job"),
    ({"run": "a/b"}, "run="),
    ({"folder": ".."}, "folder="),
    ({"timeout": 0}, "timeout"),
    ({"chunk_bytes": 0}, "chunk_bytes"),
    ({"shared_memory": 1}, "shared_memory"),
    ({"incremental": "yes"}, "incremental"),
    ({"numpy_state": {"x": 1}}, "numpy_state"),
    ({"session": "s"}, "session"),
    ({"token": ""}, "token"),
    ({"address": "http://127.0.0.1:1"}, "HOST:PORT"),
    ({"address": None}, "address"),
]


@pytest.mark.parametrize(("arguments", "message"), SAVER_ARGUMENTS)
def test_a_bad_policy_saver_argument_fails_at_construction_naming_it(arguments: dict[str, Any], message: str) -> None:
    kwargs: dict[str, Any] = {"address": "127.0.0.1:1", "run": "rn-args", "timeout": 1.0, **arguments}
    address = kwargs.pop("address")
    with pytest.raises(ValueError, match=message):
        RemotePolicySaver(policies.build(policies.q(hidden=(4,))), address, **kwargs)


@pytest.mark.parametrize(
    ("make", "arguments", "error", "message"),
    [
        ("common_module", {"run": "a/b"}, ValueError, "run="),
        ("common_module", {"timeout": -1}, ValueError, "timeout"),
        ("common_module", {"max_to_keep": 3}, TypeError, "max_to_keep"),  # a Checkpointer's own argument
        ("common_module", {"incremental": 1}, ValueError, "incremental"),
        ("common_module", {"keep_checkpoint_every_n_hours": 0}, ValueError, "keep_checkpoint_every_n_hours"),
        ("common_module", {"root_dir": 5}, ValueError, "root_dir"),
        ("train_modules", {"run": ""}, ValueError, "run="),
        ("train_modules", {"tokn": "t"}, TypeError, "tokn"),
        ("train_modules", {"shared_memory": "yes"}, ValueError, "shared_memory"),
        ("train_modules", {"address": "grpc://h:1"}, ValueError, "HOST:PORT"),
        ("ppo_learner_module", {"run": "a b"}, ValueError, "run="),
        ("ppo_learner_module", {"chunk_bytes": 1 << 30}, ValueError, "chunk_bytes"),
    ],
)
def test_a_bad_swap_argument_fails_when_the_module_is_made_naming_it(
    make: str, arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    """The one-line swaps check what they are given then, not when the script builds its first saver."""
    kwargs: dict[str, Any] = {"address": "127.0.0.1:1", "run": "rn-swap", **arguments}
    address = kwargs.pop("address")
    with pytest.raises(error, match=message):
        getattr(checkpointd_client, make)(address, **kwargs)
