"""Saves PolicySaver makes that RemotePolicySaver must make too, against the real daemon.

- TF1 graph mode: a policy and saver built inside `tf.compat.v1.Graph().as_default()`
  with a Session, as half of upstream policy_saver_test's testSaveAction* cases
  run. The daemon's output is compared with in-process PolicySaver's in the
  same graph, and skip, block, flush and close behave as in eager mode.
- Policies without variables (RandomTFPolicy, one without distribution()):
  save() works, save_checkpoint() raises what PolicySaver raises and sends nothing.
- `options=`: SaveOptions apply at template export, CheckpointOptions' write
  callbacks run once durable, and what cannot apply remotely is refused.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2
from tf_agents.policies import policy_saver, random_tf_policy, tf_policy
from tf_agents.trajectories import policy_step
from tf_agents.trajectories import time_step as ts

from checkpointd.storage.save_manifest import MANIFEST_NAME
from checkpointd_client import CheckpointdError, DeadlineError, RemotePolicySaver, RunClosedError, SaveResult
from tests.integration.saves.test_save_path import decide, make_policy, read_checkpoint
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon, wait_until
from tests.integration.support.disk import TRAIN_STEP_KEY, files_under, saved_step
from tests.integration.support.raw import TIMEOUT, HeldSave, run_status

STEP = 4242  # the train step at the save call
LATER_STEP = 9999  # assigned right after it
SEED = 98723
KINDS = ("q", "actor", "recurrent")
ALL = [(kind, nest) for kind in KINDS for nest in (True, False)]
IDS = [f"{kind}-{'nest_paths' if nest else 'spec_names'}" for kind, nest in ALL]


def _unknown_to_daemon(daemon: Daemon, run: str) -> bool:
    """The daemon never heard of `run`: no registration, no save."""
    with pytest.raises(grpc.RpcError) as caught:
        run_status(daemon, run)
    return caught.value.code() == grpc.StatusCode.NOT_FOUND and f"run={run} " not in daemon.log()


# TF1 graph mode: output byte-identical to PolicySaver's in the same graph mode.


@dataclass
class GraphCase:
    run: str
    kind: str
    expected: list[np.ndarray]  # the policy's values at the call
    later: list[np.ndarray]  # assigned right after it
    results: dict[str, SaveResult]
    out_sm: Path
    out_ck: Path
    ref_sm: Path
    ref_ck: Path


def _assign(session: tf.compat.v1.Session, variables: Any, values: Any) -> None:
    session.run([v.assign(x) for v, x in zip(variables, values, strict=True)])


def _random_values(variables: Any, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=v.shape).astype(v.dtype.as_numpy_dtype) for v in variables]


def _graph_case(daemon: Daemon, tmp: Path, kind: str, nest: bool) -> GraphCase:
    run = f"fid-graph-{kind}-{'nest' if nest else 'names'}"
    graph = tf.compat.v1.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph).as_default() as session:
        step = tf.Variable(0, dtype=tf.int64)
        meta = {"env_steps": tf.Variable(0, dtype=tf.int64)}
        policy = make_policy(kind)
        session.run(tf.compat.v1.global_variables_initializer())
        variables = policy.variables()
        args: dict[str, Any] = dict(use_nest_path_signatures=nest, seed=SEED, train_step=step, metadata=meta)
        # As in test_save_path: nest_paths through shared memory, spec_names
        # streamed in 256-byte chunks, so both snapshot paths read the graph.
        saver = RemotePolicySaver(
            policy, daemon.address, run=run, chunk_bytes=256, timeout=TIMEOUT, shared_memory=nest, **args
        )
        reference = policy_saver.PolicySaver(policy, **args)
        saver.register()

        expected, later = _random_values(variables, 1), _random_values(variables, 2)

        def at_call() -> None:
            _assign(session, [*variables, step, meta["env_steps"]], [*expected, STEP, 1000])

        def after_call() -> None:
            _assign(session, [*variables, step, meta["env_steps"]], [*later, LATER_STEP, 2000])

        at_call()
        reference.save(str(tmp / "ref_sm"))
        reference.save_checkpoint(str(tmp / "ref_ck"))
        results = {}
        for name, save in (("ck", saver.save_checkpoint), ("sm", saver.save)):
            at_call()
            ticket = save(name)
            after_call()
            assert not ticket.skipped, ticket.reason
            result = ticket.result(timeout=TIMEOUT)
            assert result is not None
            results[name] = result
        assert saver.get_train_step() is not None
        saver.close(timeout=TIMEOUT)  # its log line once raised TypeError in graph mode
    run_dir = daemon.root / run
    return GraphCase(
        run, kind, expected, later, results, run_dir / "sm", run_dir / "ck", tmp / "ref_sm", tmp / "ref_ck"
    )


@pytest.fixture(scope="module")
def graph_cases(daemon: Daemon, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, bool], GraphCase]:
    built: dict[tuple[str, bool], GraphCase] = {}

    def get(kind: str, nest: bool) -> GraphCase:
        if (kind, nest) not in built:
            built[(kind, nest)] = _graph_case(daemon, tmp_path_factory.mktemp(f"graph-{kind}-{nest}"), kind, nest)
        return built[(kind, nest)]

    return get


@pytest.mark.parametrize("kind, nest", ALL, ids=IDS)
def test_graph_mode_saves_are_byte_identical_to_policy_saver_at_the_step_of_the_call(
    graph_cases: Callable[[str, bool], GraphCase], kind: str, nest: bool
) -> None:
    case = graph_cases(kind, nest)
    for ours, theirs in ((case.out_sm, case.ref_sm), (case.out_ck, case.ref_ck)):
        assert files_under(ours) == files_under(theirs) | {MANIFEST_NAME}
        got, want = read_checkpoint(ours), read_checkpoint(theirs)
        assert set(got) == set(want)
        for key, value in want.items():
            assert got[key].dtype == value.dtype, key
            assert got[key].tobytes() == value.tobytes(), key
        assert int(got[TRAIN_STEP_KEY]) == STEP
        for i, (value, live) in enumerate(zip(case.expected, case.later, strict=True)):
            saved = got[f"model_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE"]
            assert saved.tobytes() == value.tobytes() != live.tobytes()
    assert case.results["sm"].step == case.results["ck"].step == STEP


@pytest.mark.parametrize("kind, nest", ALL, ids=IDS)
def test_graph_mode_output_acts_like_policy_saver_output(
    graph_cases: Callable[[str, bool], GraphCase], kind: str, nest: bool
) -> None:
    case = graph_cases(kind, nest)
    loaded, ref = tf.saved_model.load(str(case.out_sm)), tf.saved_model.load(str(case.ref_sm))
    policies.assert_policy_functions(loaded)
    assert int(loaded.get_train_step()) == STEP
    assert int(loaded.get_metadata()["env_steps"]) == 1000
    steps = policies.mid_steps(8, seed=3)
    state = loaded.get_initial_state(batch_size=8)
    ours = decide(loaded, kind, steps, state)
    np.testing.assert_array_equal(ours, decide(ref, kind, steps, state))
    assert np.ptp(ours[0] if kind == "actor" else ours) > 0  # not a constant


# TF1 graph mode: skip, block, flush, close and restore as in eager mode.


class GraphEnv:
    """One small QPolicy in its own graph and session; savers and held saves of it, closed at teardown."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.graph = tf.compat.v1.Graph()
        self.session = tf.compat.v1.Session(graph=self.graph)
        with self.active():
            self.policy = policies.build(policies.q(hidden=(8,)))
            self.session.run(tf.compat.v1.global_variables_initializer())
        self._savers: list[RemotePolicySaver] = []
        self._held: list[HeldSave] = []

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with self.graph.as_default(), self.session.as_default():
            yield

    def saver(self, run: str, step: int = 0, **kwargs: Any) -> tuple[RemotePolicySaver, tf.Variable]:
        with self.active():
            train_step = tf.Variable(step, dtype=tf.int64)
            self.session.run(train_step.initializer)
            saver = RemotePolicySaver(
                self.policy, self.daemon.address, run=run, train_step=train_step, timeout=TIMEOUT, **kwargs
            )
        self._savers.append(saver)
        return saver, train_step

    def hold(self, saver: RemotePolicySaver, train_step: tf.Variable, export_dir: str) -> HeldSave:
        with self.active():
            held = HeldSave(self.daemon, saver, train_step, export_dir)
        self._held.append(held)
        return held

    def set_step(self, train_step: tf.Variable, value: int) -> None:
        self.session.run(train_step.assign(value))

    def close(self) -> None:
        for held in self._held:
            held.close()
        for saver in self._savers:
            try:
                saver.close(timeout=10)
            except CheckpointdError:
                pass  # the test has judged it
        self.session.close()


@pytest.fixture(scope="module")
def graph_env(daemon: Daemon) -> Iterator[GraphEnv]:
    env = GraphEnv(daemon)
    try:
        yield env
    finally:
        env.close()


def _in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, dict[str, object]]:
    out: dict[str, object] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def _joined(thread: threading.Thread, out: dict[str, object]) -> Any:
    thread.join(TIMEOUT)
    assert not thread.is_alive(), "the call did not return in time"
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out.get("value")


def test_graph_mode_save_while_one_is_in_flight_is_skipped(graph_env: GraphEnv) -> None:
    saver, step = graph_env.saver("fid-graph-skip", step=7)
    held = graph_env.hold(saver, step, "held")
    with graph_env.active():
        ticket = saver.save("skipped")
        ck_ticket = saver.save_checkpoint("skipped-ck")
    for t in (ticket, ck_ticket):
        assert t.skipped and t.done() and "in flight" in t.reason, t.reason
        assert t.step == 7
    held.release()
    saver.flush(timeout=TIMEOUT)
    assert sorted(os.listdir(graph_env.daemon.root / "fid-graph-skip")) == ["held"]
    assert saved_step(held.path) == 7
    assert run_status(graph_env.daemon, "fid-graph-skip").saves_skipped == 2


def test_graph_mode_blocking_save_waits_for_the_save_in_flight_then_returns_durable(graph_env: GraphEnv) -> None:
    # session=: the save runs on another thread, which has no default session.
    saver, step = graph_env.saver("fid-graph-blocking", step=3, session=graph_env.session)
    held = graph_env.hold(saver, step, "held")
    target = graph_env.daemon.root / "fid-graph-blocking" / "blocking"

    def blocking_save() -> tuple[object, bool]:
        ticket = saver.save("blocking", blocking=True)
        return ticket, target.is_dir()

    thread, out = _in_thread(blocking_save)
    wait_until(
        lambda: run_status(graph_env.daemon, "fid-graph-blocking").in_flight.waiting == 1, "it is queued", TIMEOUT
    )
    assert thread.is_alive() and not target.exists()
    held.release()
    ticket, durable_at_return = _joined(thread, out)
    assert durable_at_return and not ticket.skipped and ticket.result(timeout=0).step == 3
    assert saved_step(target) == 3


def test_graph_mode_flush_waits_until_no_save_is_in_flight(graph_env: GraphEnv) -> None:
    saver, step = graph_env.saver("fid-graph-flush", step=4)
    held = graph_env.hold(saver, step, "held")
    with pytest.raises(DeadlineError):
        saver.flush(timeout=0.3)

    def flush() -> bool:
        saver.flush(timeout=TIMEOUT)
        return held.path.is_dir()

    thread, out = _in_thread(flush)
    held.release()
    assert _joined(thread, out)  # durable when flushed
    with graph_env.active():
        ticket = saver.save("own")  # this saver's own background upload
    saver.flush(timeout=TIMEOUT)
    assert ticket.done() and ticket.result(timeout=0) is not None


def test_graph_mode_close_flushes_then_refuses_saves(graph_env: GraphEnv) -> None:
    saver, step = graph_env.saver("fid-graph-close", step=5)
    with graph_env.active():
        ticket = saver.save("save_model")
    saver.close(timeout=TIMEOUT)  # outside the graph: it must not touch TF
    assert ticket.done() and ticket.result(timeout=0) is not None
    assert saved_step(graph_env.daemon.root / "fid-graph-close" / "save_model") == 5
    assert run_status(graph_env.daemon, "fid-graph-close").state == "closed"
    with graph_env.active(), pytest.raises(RunClosedError):
        saver.save("again")


def test_graph_mode_restore_assigns_through_the_session(graph_env: GraphEnv) -> None:
    saver, step = graph_env.saver("fid-graph-restore", step=6)
    variables = graph_env.policy.variables()
    with graph_env.active():
        saved = graph_env.session.run(variables)
        saver.save("saved", blocking=True)
        _assign(graph_env.session, [*variables, step], [*_random_values(variables, 5), 60])
        restored = saver.restore()
        assert restored.step == 6
        assert graph_env.session.run(step) == 6
        for value, want in zip(graph_env.session.run(variables), saved, strict=True):
            assert value.tobytes() == want.tobytes()


def test_graph_mode_without_a_session_says_how_to_give_one(graph_env: GraphEnv) -> None:
    saver, _ = graph_env.saver("fid-graph-no-session")
    with graph_env.graph.as_default(), pytest.raises(ValueError, match="session"):
        saver.save("nowhere")
    assert _unknown_to_daemon(graph_env.daemon, "fid-graph-no-session")


# Policies without variables.


class PolicyNoDistribution(tf_policy.TFPolicy):
    """Upstream policy_saver_test's: no variables, and distribution() not implemented."""

    def __init__(self) -> None:
        super().__init__(ts.TimeStep(step_type=(), reward=(), discount=(), observation=()), ())

    def _action(self, **kwargs: Any) -> policy_step.PolicyStep:
        return policy_step.PolicyStep((), ())

    def _distribution(self, **kwargs: Any) -> Any:
        raise NotImplementedError("_distribution has not been implemented.")


def _random_policy() -> tf_policy.TFPolicy:
    return random_tf_policy.RandomTFPolicy(policies.time_step_spec(), policies.DISCRETE)


def test_random_policy_save_loads_and_acts_as_policy_saver_output(daemon: Daemon, tmp_path: Path) -> None:
    policy = _random_policy()
    step = tf.Variable(17, dtype=tf.int64)
    meta = {"env_steps": tf.Variable(5, dtype=tf.int64)}  # the template's only other variable
    reference = policy_saver.PolicySaver(policy, train_step=step, metadata=meta)
    reference.save(str(tmp_path / "ref"))
    with RemotePolicySaver(
        policy, daemon.address, run="fid-random", train_step=step, metadata=meta, timeout=TIMEOUT
    ) as saver:
        result = saver.save("policy", blocking=True).result()
    assert result is not None and result.step == 17
    out = daemon.root / "fid-random" / "policy"
    assert files_under(out) == files_under(tmp_path / "ref") | {MANIFEST_NAME}
    got, want = read_checkpoint(out), read_checkpoint(tmp_path / "ref")
    assert got.keys() == want.keys() and len(got) == 3  # train step, metadata, object graph
    assert all(got[k].tobytes() == want[k].tobytes() for k in want)
    loaded, ref = tf.saved_model.load(str(out)), tf.saved_model.load(str(tmp_path / "ref"))
    assert int(loaded.get_train_step()) == int(ref.get_train_step()) == 17
    assert int(loaded.get_metadata()["env_steps"]) == 5
    assert set(loaded.signatures) == set(ref.signatures) >= policies.SIGNATURES
    actions = loaded.action(policies.time_steps(64, seed=1)).action.numpy()
    assert actions.shape == (64,) and actions.min() >= 0 and actions.max() <= 2
    assert len(set(actions.tolist())) > 1  # it samples


def test_policy_without_distribution_or_variables_saves_like_policy_saver(daemon: Daemon, tmp_path: Path) -> None:
    policy = PolicyNoDistribution()
    step = tf.Variable(2, dtype=tf.int64)
    with RemotePolicySaver(policy, daemon.address, run="fid-no-distribution", train_step=step) as saver:
        saver.save("policy", blocking=True)
    loaded = tf.saved_model.load(str(daemon.root / "fid-no-distribution" / "policy"))
    assert int(loaded.get_train_step()) == 2
    empty = ts.TimeStep(step_type=(), reward=(), discount=(), observation=())
    with pytest.raises(tf.errors.InvalidArgumentError, match="_distribution has not been implemented"):
        loaded.distribution(empty)


@pytest.mark.parametrize("make", [_random_policy, PolicyNoDistribution], ids=["random", "no_distribution"])
def test_save_checkpoint_of_a_variable_less_policy_raises_what_policy_saver_raises_and_sends_nothing(
    daemon: Daemon, tmp_path: Path, make: Callable[[], tf_policy.TFPolicy]
) -> None:
    policy = make()
    step = tf.Variable(1, dtype=tf.int64)
    with pytest.raises(ValueError) as theirs:
        policy_saver.PolicySaver(policy, train_step=step).save_checkpoint(str(tmp_path / "ref"))
    run = f"fid-no-vars-ck-{make.__name__.lower().strip('_')}"
    saver = RemotePolicySaver(policy, daemon.address, run=run, train_step=step, timeout=TIMEOUT)
    try:
        with pytest.raises(ValueError) as ours:
            saver.save_checkpoint("ck")
        assert str(ours.value) == str(theirs.value)
        assert "model_variables" in str(ours.value)
        assert _unknown_to_daemon(daemon, run)
        saver.save("sm", blocking=True)  # save() works, and save_checkpoint() still refuses
        with pytest.raises(ValueError, match="model_variables"):
            saver.save_checkpoint("ck", blocking=True)
    finally:
        saver.close(timeout=TIMEOUT)
    assert run_status(daemon, run).saves_ok == 1
    assert sorted(os.listdir(daemon.root / run)) == ["sm"]


# options=.


def _meta_graph(export_dir: Path) -> Any:
    saved_model = saved_model_pb2.SavedModel.FromString((export_dir / "saved_model.pb").read_bytes())
    (meta_graph,) = saved_model.meta_graphs
    return meta_graph


def _aliases(export_dir: Path) -> set[str]:
    return set(_meta_graph(export_dir).meta_info_def.function_aliases.values())


def test_save_options_apply_at_template_export_and_a_change_registers_again(daemon: Daemon, tmp_path: Path) -> None:
    policy = policies.build(policies.q(hidden=(8,)))
    step = tf.Variable(1, dtype=tf.int64)
    reference = policy_saver.PolicySaver(policy, train_step=step)
    run = "fid-save-options"
    saver = RemotePolicySaver(policy, daemon.address, run=run, train_step=step, timeout=TIMEOUT)

    def options() -> tf.saved_model.SaveOptions:  # a new object each call, equal in effect
        return tf.saved_model.SaveOptions(function_aliases={"act": saver.policy.action}, save_debug_info=True)

    reference.save(str(tmp_path / "ref"), options=options())
    try:
        saver.save("plain", blocking=True)
        saver.save("aliased", blocking=True, options=options())
        step.assign(2)
        ticket = saver.save("positional", options())  # PolicySaver.save(export_dir, options)
        assert ticket.result(timeout=TIMEOUT) is not None and not ticket.skipped
        saver.save_checkpoint("checkpoint", blocking=True)  # variables only: keeps the template
        saver.save("plain-again", blocking=True)
    finally:
        saver.close(timeout=TIMEOUT)
    run_dir = daemon.root / run
    assert _aliases(tmp_path / "ref") == {"act"}
    assert _aliases(run_dir / "aliased") == _aliases(run_dir / "positional") == {"act"}
    assert _aliases(run_dir / "plain") == _aliases(run_dir / "plain-again") == set()
    debug_info = "debug/saved_model_debug_info.pb"
    assert debug_info in files_under(tmp_path / "ref")
    assert debug_info in files_under(run_dir / "aliased")
    assert debug_info not in files_under(run_dir / "plain-again")
    assert saved_step(run_dir / "positional") == 2
    # Exported for "plain", "aliased" and "plain-again": equal options made no new export.
    assert daemon.log().count(f"registered run={run} ") == 3
    loaded = tf.saved_model.load(str(run_dir / "aliased"))
    assert int(loaded.get_train_step()) == 1


def test_checkpoint_options_write_callbacks_run_once_durable(daemon: Daemon) -> None:
    policy = policies.build(policies.q(hidden=(8,)))
    step = tf.Variable(3, dtype=tf.int64)
    seen: list[tuple[str, bool]] = []
    calls: list[str] = []

    def with_path(save_path: str) -> None:
        seen.append((save_path, os.path.exists(save_path + ".index")))

    options = tf.train.CheckpointOptions(
        experimental_write_callbacks=[with_path, lambda: calls.append("no-arg")], enable_async=True
    )
    with RemotePolicySaver(policy, daemon.address, run="fid-ck-options", train_step=step, timeout=TIMEOUT) as saver:
        saver.save_checkpoint("blocking", blocking=True, options=options)
        assert seen == [(str(daemon.root / "fid-ck-options" / "blocking" / "variables" / "variables"), True)]
        saver.save_checkpoint("background", options=options)
        saver.flush(timeout=TIMEOUT)
    assert [path for path, _ in seen][1:] == [
        str(daemon.root / "fid-ck-options" / "background" / "variables" / "variables")
    ]
    assert all(exists for _, exists in seen) and calls == ["no-arg", "no-arg"]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda s: s.save("d", options=tf.saved_model.SaveOptions(experimental_io_device="/job:localhost")),
         "experimental_io_device"),
        (lambda s: s.save_checkpoint("d", options=tf.train.CheckpointOptions(experimental_io_device="/job:localhost")),
         "experimental_io_device"),
        (lambda s: s.save("d", options=tf.train.CheckpointOptions()), "SaveOptions"),
        (lambda s: s.save_checkpoint("d", options=tf.saved_model.SaveOptions()), "CheckpointOptions"),
        (lambda s: s.save("d", tf.saved_model.SaveOptions(), options=tf.saved_model.SaveOptions()), "twice"),
    ],
    ids=["save_io_device", "checkpoint_io_device", "save_wrong_type", "checkpoint_wrong_type", "given_twice"],
)  # fmt: skip
def test_options_that_cannot_apply_remotely_are_refused_before_anything_is_sent(
    daemon: Daemon, call: Callable[[RemotePolicySaver], object], match: str, request: pytest.FixtureRequest
) -> None:
    policy = policies.build(policies.q(hidden=(8,)))
    run = f"fid-refused-{request.node.callspec.id.replace('_', '-')}"
    saver = RemotePolicySaver(policy, daemon.address, run=run, timeout=TIMEOUT)
    try:
        with pytest.raises((ValueError, TypeError), match=match):
            call(saver)
    finally:
        saver.close(timeout=TIMEOUT)
    assert _unknown_to_daemon(daemon, run)
