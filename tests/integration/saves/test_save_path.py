"""The save path end to end: RemotePolicySaver -> real daemon -> files TF-Agents loads.

Every output is compared with what an in-process `PolicySaver` writes for the
same policy state. One module-scoped build per (policy, use_nest_path_signatures)
registers its own run on the module's daemon and makes all of that case's saves;
the tests then inspect the files. Each case saves at step S and, before
waiting on the result, changes every variable, the train step and the
metadata, so a writer that read live values (as upstream AsyncPolicySaver
does) would be caught.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from tf_agents.networks import q_network
from tf_agents.policies import policy_loader, policy_saver, py_tf_eager_policy, q_policy
from tf_agents.policies.tf_policy import TFPolicy

from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.tensors import TEMPLATE_OBJECT_GRAPH
from checkpointd.storage.save_manifest import MANIFEST_NAME
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client import RemotePolicySaver, SaveResult
from tests.integration.support import policies, raw
from tests.integration.support.daemon import Daemon
from tests.integration.support.disk import (
    CHECKPOINT_FILES,
    TRAIN_STEP_KEY,
    checkpointd_entries,
    files_under,
)

STEP = 4242  # the train step at the save call
LATER_STEP = 9999  # assigned right after it
SEED = 98723  # PolicySaver's action seed: the actor samples
TIMEOUT = 60.0
SAVED_MODEL_FILES = {
    "saved_model.pb",
    "fingerprint.pb",
    "policy_specs.pbtxt",
    "variables/variables.index",
    "variables/variables.data-00000-of-00001",
}
DAEMON_FILES = {MANIFEST_NAME}  # the daemon's own file beside PolicySaver's (checkpointd.storage.save_manifest)

KINDS = ("q", "actor", "recurrent")
ALL = [(kind, nest) for kind in KINDS for nest in (True, False)]


def _ids(params: list[tuple[str, bool]]) -> list[str]:
    return [f"{kind}-{'nest_paths' if nest else 'spec_names'}" for kind, nest in params]


def make_policy(kind: str) -> TFPolicy:
    if kind == "q":
        return policies.build(policies.greedy(policies.q()))
    if kind == "actor":
        return policies.build(policies.actor())  # stochastic: compared through its distribution
    return policies.build(policies.greedy(policies.recurrent()))


def read_checkpoint(export_dir: Path) -> dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(str(export_dir / "variables" / "variables"))
    return {k: np.asarray(reader.get_tensor(k)) for k in reader.get_variable_to_shape_map()}


@dataclass
class Case:
    kind: str
    nest: bool
    run: str
    policy: TFPolicy
    saver: RemotePolicySaver
    # The state at the save call.
    expected: list[np.ndarray]
    metadata: dict[str, np.ndarray]
    # The state assigned right after the call, before waiting on the result.
    later: list[np.ndarray]
    initial: Path  # daemon SavedModel at step 0, before any change
    out_sm: Path  # daemon save() at STEP
    out_ck: Path  # daemon save_checkpoint() at STEP
    ref_sm: Path  # in-process PolicySaver.save() at STEP
    ref_ck: Path  # in-process PolicySaver.save_checkpoint() at STEP
    results: dict[SaveKind, SaveResult]
    _loaded: dict[str, Any] = field(default_factory=dict)

    def load(self, which: str) -> Any:
        """`tf.saved_model.load` of out_sm or ref_sm, once per module."""
        if which not in self._loaded:
            self._loaded[which] = tf.saved_model.load(str(getattr(self, which)))
        return self._loaded[which]


def _set_state(policy: TFPolicy, step: tf.Variable, meta: dict[str, tf.Variable], seed: int) -> None:
    policies.perturb(policy, seed)
    step.assign(STEP if seed == 1 else LATER_STEP)
    meta["env_steps"].assign(1000 * seed)
    meta["mean_return"].assign(seed + 0.25)


def _point_in_time_save(
    saver: RemotePolicySaver, kind: SaveKind, export_dir: str, change: Callable[[], None]
) -> SaveResult:
    """A non-blocking save, the state changed at once, then the wait."""
    save = saver.save if kind is SaveKind.SAVED_MODEL else saver.save_checkpoint
    ticket = save(export_dir)
    change()
    assert not ticket.skipped, ticket.reason
    result = ticket.result(timeout=TIMEOUT)
    assert result is not None
    return result


def _build_case(daemon: Daemon, tmp: Path, kind: str, nest: bool) -> Case:
    run = f"path-{kind}-{'nest' if nest else 'names'}"
    policy = make_policy(kind)
    step = tf.Variable(0, dtype=tf.int64)
    meta = {
        "env_steps": tf.Variable(0, dtype=tf.int64),
        "mean_return": tf.Variable(0.0, dtype=tf.float32),
    }
    args = dict(batch_size=None, use_nest_path_signatures=nest, seed=SEED, train_step=step, metadata=meta)
    # The daemon shares its host with this test, so saves go through shared
    # memory; the spec-names cases turn it off and stream 256-byte chunks,
    # so every policy kind is checked byte for byte on both transports.
    saver = RemotePolicySaver(
        policy, daemon.address, run=run, chunk_bytes=256, timeout=TIMEOUT,
        shared_memory=nest, **args,
    )  # fmt: skip
    reference = policy_saver.PolicySaver(policy, **args)
    saver.register()
    assert saver.save("initial", blocking=True).result() is not None

    _set_state(policy, step, meta, seed=1)
    expected = policies.values(policy)
    metadata = {k: v.numpy() for k, v in meta.items()}
    reference.save(str(tmp / "ref_sm"))
    reference.save_checkpoint(str(tmp / "ref_ck"))

    def change() -> None:
        _set_state(policy, step, meta, seed=2)

    results = {SaveKind.CHECKPOINT: _point_in_time_save(saver, SaveKind.CHECKPOINT, "checkpoints/ck", change)}
    later = policies.values(policy)
    policies.restore(policy, expected)  # back to the state at STEP for the second kind
    step.assign(STEP)
    for k, v in meta.items():
        v.assign(metadata[k])
    results[SaveKind.SAVED_MODEL] = _point_in_time_save(saver, SaveKind.SAVED_MODEL, f"policies/{STEP:08d}", change)
    run_dir = daemon.root / run
    return Case(
        kind, nest, run, policy, saver, expected, metadata, later,
        initial=run_dir / "initial",
        out_sm=run_dir / "policies" / f"{STEP:08d}",
        out_ck=run_dir / "checkpoints" / "ck",
        ref_sm=tmp / "ref_sm",
        ref_ck=tmp / "ref_ck",
        results=results,
    )  # fmt: skip


@pytest.fixture(scope="module")
def cases(daemon: Daemon, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str, bool], Case]]:
    """Builds each case at its first use; closes every saver at the end."""
    built: dict[tuple[str, bool], Case] = {}

    def get(kind: str, nest: bool) -> Case:
        if (kind, nest) not in built:
            tmp = tmp_path_factory.mktemp(f"{kind}-{nest}")
            built[(kind, nest)] = _build_case(daemon, tmp, kind, nest)
        return built[(kind, nest)]

    yield get
    for case in built.values():
        case.saver.close(timeout=TIMEOUT)


def decide(loaded: Any, kind: str, time_step: Any, state: Any = ()) -> np.ndarray:
    """What a loaded policy does on a batch, deterministically.

    The actor samples, so its distribution's mean and stddev stand for its action.
    """
    if kind == "actor":
        dist = loaded.distribution(time_step, state).action
        return np.stack([dist.mean().numpy(), dist.stddev().numpy()])
    return loaded.action(time_step, state).action.numpy()


# What the daemon wrote loads as a TF-Agents policy.


@pytest.mark.parametrize("kind, nest", ALL, ids=_ids(ALL))
def test_output_loads_with_every_policy_function(cases: Callable[[str, bool], Case], kind: str, nest: bool) -> None:
    case = cases(kind, nest)
    loaded, ref = case.load("out_sm"), case.load("ref_sm")
    policies.assert_policy_functions(loaded)
    assert set(loaded.signatures) == set(ref.signatures)
    got = [v.numpy() for v in loaded.model_variables]
    assert len(got) == len(case.expected)
    for value, want in zip(got, case.expected, strict=True):
        assert value.tobytes() == want.tobytes()
    distribution = loaded.distribution(policies.time_steps(2), loaded.get_initial_state(batch_size=2))
    assert distribution.action.batch_shape == [2]


@pytest.mark.parametrize("kind, nest", ALL, ids=_ids(ALL))
def test_each_case_used_its_transport(
    daemon: Daemon, cases: Callable[[str, bool], Case], kind: str, nest: bool
) -> None:
    case = cases(kind, nest)
    saved = [line for line in daemon.log().splitlines() if f"saved run={case.run} " in line]
    assert len(saved) == 3, saved  # initial, the checkpoint, the SavedModel
    want = "transport=shm" if nest else "transport=grpc"
    assert all(line.endswith(want) for line in saved), saved


@pytest.mark.parametrize("kind, nest", ALL, ids=_ids(ALL))
def test_variables_are_bit_identical_to_policy_saver(cases: Callable[[str, bool], Case], kind: str, nest: bool) -> None:
    case = cases(kind, nest)
    for ours, theirs in ((case.out_sm, case.ref_sm), (case.out_ck, case.ref_ck)):
        got, want = read_checkpoint(ours), read_checkpoint(theirs)
        assert set(got) == set(want)
        assert len(got) > len(case.expected)  # the policy's, train step, metadata, object graph
        for key, value in want.items():
            assert got[key].dtype == value.dtype, key
            assert got[key].tobytes() == value.tobytes(), key
        assert int(got[TRAIN_STEP_KEY]) == STEP
        for i, value in enumerate(case.expected):
            assert got[f"model_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE"].tobytes() == (value.tobytes())


@pytest.mark.parametrize("kind, nest", ALL, ids=_ids(ALL))
def test_actions_match_policy_saver_output(cases: Callable[[str, bool], Case], kind: str, nest: bool) -> None:
    case = cases(kind, nest)
    loaded, ref = case.load("out_sm"), case.load("ref_sm")
    steps = policies.mid_steps(16, seed=3)
    state = loaded.get_initial_state(batch_size=16)
    ours, theirs = decide(loaded, kind, steps, state), decide(ref, kind, steps, state)
    np.testing.assert_array_equal(ours, theirs)
    # A decision that ignored the observations would match trivially.
    assert np.ptp(ours[0] if kind == "actor" else ours) > 0


@pytest.mark.parametrize("nest", [True, False], ids=["nest_paths", "spec_names"])
def test_recurrent_state_threads_through_action_like_policy_saver(
    cases: Callable[[str, bool], Case], nest: bool
) -> None:
    case = cases("recurrent", nest)
    loaded, ref = case.load("out_sm"), case.load("ref_sm")
    ours = loaded.get_initial_state(batch_size=3)
    theirs = ref.get_initial_state(batch_size=3)
    assert [s.shape for s in ours] == [(3, 8), (3, 8)]
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)
    for t in range(2):
        steps = policies.mid_steps(3, seed=10 + t)
        ours_step = loaded.action(steps, ours)
        theirs_step = ref.action(steps, theirs)
        np.testing.assert_array_equal(ours_step.action, theirs_step.action)
        for new, old, other in zip(ours_step.state, ours, theirs_step.state, strict=True):
            np.testing.assert_array_equal(new, other)
            assert not np.array_equal(new, old), f"step {t}: the state did not change"
        ours, theirs = ours_step.state, theirs_step.state


def _flat_call(
    fn: Callable[..., dict[str, tf.Tensor]],
    input_spec: object,
    inputs: object,
) -> dict[str, np.ndarray]:
    """Calls a flat signature with its own argument names, matched to the specs' names."""
    by_name = {s.name: v for s, v in zip(tf.nest.flatten(input_spec), tf.nest.flatten(inputs), strict=True)}
    arguments = fn.structured_input_signature[1]
    assert {s.name for s in arguments.values()} == set(by_name)
    outputs = fn(**{k: by_name[s.name] for k, s in arguments.items()})
    return {k: v.numpy() for k, v in outputs.items()}


@pytest.mark.parametrize("kind, nest", ALL, ids=_ids(ALL))
def test_flat_action_signature_matches_the_nested_call(
    cases: Callable[[str, bool], Case], kind: str, nest: bool
) -> None:
    case = cases(kind, nest)
    if kind == "actor":
        # Fresh loads: the seeded sampler gives the same first sample in every
        # copy of the function (and a new one at each later call).
        loaded, ref = tf.saved_model.load(str(case.out_sm)), tf.saved_model.load(str(case.ref_sm))
    else:
        loaded, ref = case.load("out_sm"), case.load("ref_sm")
    steps = policies.mid_steps(5, seed=4)
    state = loaded.get_initial_state(batch_size=5)
    names = [s.name for s in tf.nest.flatten(case.saver.policy_step_spec)]

    spec = case.saver.action_input_spec
    ours = _flat_call(loaded.signatures["action"], spec, (steps, state))
    theirs = _flat_call(ref.signatures["action"], spec, (steps, state))
    nested = loaded.action(steps, state)
    assert set(ours) == set(theirs) == set(names)
    for name, value in zip(names, tf.nest.flatten(nested), strict=True):
        np.testing.assert_array_equal(ours[name], value.numpy(), err_msg=name)
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    assert np.ptp(ours["action"]) > 0  # not a constant


# Point in time: the values at the call, not the live ones after it.


@pytest.mark.parametrize("kind, nest", ALL, ids=_ids(ALL))
def test_save_holds_the_state_at_the_call_not_the_changes_after_it(
    cases: Callable[[str, bool], Case], kind: str, nest: bool
) -> None:
    case = cases(kind, nest)
    # The premise: the live policy moved on before the saves were awaited.
    assert int(case.saver.get_train_step()) == LATER_STEP
    assert all(not np.array_equal(a, b) for a, b in zip(case.later, case.expected, strict=True))
    loaded = case.load("out_sm")
    assert int(loaded.get_train_step()) == STEP
    assert case.results[SaveKind.SAVED_MODEL].step == STEP
    assert case.results[SaveKind.CHECKPOINT].step == STEP
    for v, want, live in zip(loaded.model_variables, case.expected, case.later, strict=True):
        assert v.numpy().tobytes() == want.tobytes()
        assert v.numpy().tobytes() != live.tobytes()
    ck = read_checkpoint(case.out_ck)
    assert int(ck[TRAIN_STEP_KEY]) == STEP
    weights = ck["model_variables/0/.ATTRIBUTES/VARIABLE_VALUE"]
    assert weights.tobytes() == case.expected[0].tobytes()


@pytest.mark.parametrize("kind, nest", ALL, ids=_ids(ALL))
def test_metadata_round_trips_through_get_metadata(cases: Callable[[str, bool], Case], kind: str, nest: bool) -> None:
    case = cases(kind, nest)
    got = {k: v.numpy() for k, v in case.load("out_sm").get_metadata().items()}
    assert got.keys() == case.metadata.keys() == {"env_steps", "mean_return"}
    for key, want in case.metadata.items():
        assert got[key].dtype == want.dtype, key
        assert got[key] == want, key
    live = {k: np.asarray(v) for k, v in case.saver.get_metadata().items()}
    assert live["env_steps"] != got["env_steps"]  # it changed after the call


# TF-Agents' own loaders on the daemon's output. Restoring variables does not
# depend on the signatures, so one flavour per policy kind is enough.
LOADERS = [("q", True), ("actor", True), ("recurrent", False)]


@pytest.mark.parametrize("kind, nest", LOADERS, ids=_ids(LOADERS))
def test_checkpoint_updates_a_loaded_policy(cases: Callable[[str, bool], Case], kind: str, nest: bool) -> None:
    case = cases(kind, nest)
    policy = py_tf_eager_policy.SavedModelPyTFEagerPolicy(str(case.initial), load_specs_from_pbtxt=True)
    assert policy.get_train_step() == 0
    before = [v.numpy() for v in policy.variables()]
    assert any(a.tobytes() != b.tobytes() for a, b in zip(before, case.expected, strict=True))
    policy.update_from_checkpoint(str(case.out_ck))
    assert policy.get_train_step() == STEP
    for v, want in zip(policy.variables(), case.expected, strict=True):
        assert v.numpy().tobytes() == want.tobytes()

    loaded = policy_loader.load(str(case.initial), str(case.out_ck))
    assert loaded.get_train_step() == STEP
    for v, want in zip(loaded.variables(), case.expected, strict=True):
        assert v.numpy().tobytes() == want.tobytes()


# Layout on disk and the SaveResult.


@pytest.mark.parametrize("kind, nest", ALL, ids=_ids(ALL))
def test_layout_and_save_result(cases: Callable[[str, bool], Case], daemon: Daemon, kind: str, nest: bool) -> None:
    case = cases(kind, nest)
    assert files_under(case.ref_sm) == SAVED_MODEL_FILES
    assert files_under(case.out_sm) == SAVED_MODEL_FILES | DAEMON_FILES
    assert (case.out_sm / "assets").is_dir() and not os.listdir(case.out_sm / "assets")
    assert files_under(case.ref_ck) == CHECKPOINT_FILES
    assert files_under(case.out_ck) == CHECKPOINT_FILES | DAEMON_FILES
    assert sorted(os.listdir(case.out_ck)) == sorted({"variables"} | DAEMON_FILES)
    for kind_, path in ((SaveKind.SAVED_MODEL, case.out_sm), (SaveKind.CHECKPOINT, case.out_ck)):
        result = case.results[kind_]
        assert os.path.realpath(result.path) == os.path.realpath(path)
        assert result.kind is kind_
        assert result.step == STEP
        # The files the manifest lists, as verify counts them (not the manifest itself).
        listed = files_under(path) - {MANIFEST_NAME}
        assert result.bytes_written == sum((path / f).stat().st_size for f in listed) > 0
        assert result.duration_seconds >= 0
    assert checkpointd_entries(daemon.root) == []


def test_an_existing_export_dir_is_replaced_completely(daemon: Daemon) -> None:
    policy = policies.build(policies.q())
    step = tf.Variable(1, dtype=tf.int64)
    export = daemon.root / "path-replace" / "export"
    with RemotePolicySaver(policy, daemon.address, run="path-replace", train_step=step, timeout=TIMEOUT) as saver:
        saver.save("export", blocking=True)
        assert files_under(export) == SAVED_MODEL_FILES | DAEMON_FILES
        (export / "stray.txt").write_text("left by someone")

        policies.perturb(policy, 11)
        step.assign(2)
        saver.save_checkpoint("export", blocking=True)
        # saved_model.pb, fingerprint.pb, policy_specs.pbtxt, assets/ and stray.txt are gone.
        assert files_under(export) == CHECKPOINT_FILES | DAEMON_FILES
        assert sorted(os.listdir(export)) == sorted({"variables"} | DAEMON_FILES)
        ck = read_checkpoint(export)
        assert int(ck[TRAIN_STEP_KEY]) == 2
        for i, value in enumerate(policies.values(policy)):
            saved = ck[f"model_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE"]
            assert saved.tobytes() == value.tobytes()

        step.assign(3)
        result = saver.save("export", blocking=True).result()
    assert files_under(export) == SAVED_MODEL_FILES | DAEMON_FILES
    assert result is not None and result.step == 3
    assert int(tf.saved_model.load(str(export)).get_train_step()) == 3
    assert checkpointd_entries(daemon.root / "path-replace") == []


def test_register_function_shows_up_in_the_saved_model(daemon: Daemon) -> None:
    # Upstream async_policy_saver_test.testRegisterFunction, plus a save before
    # the registration: the template must be exported again after it.
    net = q_network.QNetwork(policies.OBS_SPEC, policies.DISCRETE, fc_layer_params=(8,))
    policy = policies.build(q_policy.QPolicy(policies.time_step_spec(), policies.DISCRETE, q_network=net))
    saver = RemotePolicySaver(policy, daemon.address, run="path-register-fn", timeout=TIMEOUT)
    try:
        saver.save("before", blocking=True)
        saver.register_function("q_network", net, policies.OBS_SPEC)
        ticket = saver.save("after")
        saver.flush()
    finally:
        saver.close(timeout=TIMEOUT)
    assert ticket.done() and not ticket.skipped
    before = tf.saved_model.load(str(daemon.root / "path-register-fn" / "before"))
    assert not hasattr(before, "q_network")
    reloaded = tf.saved_model.load(str(daemon.root / "path-register-fn" / "after"))
    observations = policies.time_steps(3, seed=5).observation
    expected, _ = net(observations)
    got, _ = reloaded.q_network(observations)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-6)


# The template: no variable values from the client; a whole checkpoint from an older client.


def test_a_template_with_its_variable_values_saves_the_same_files_as_one_without(
    daemon: Daemon, tmp_path: Path
) -> None:
    # The client uploads the index and object graph only; an older client's
    # template (PolicySaver's whole output, data shard included) must still
    # register, and both runs' saves of one state must be the same files.
    policy = make_policy("q")
    template = raw.export_template(policy, tmp_path / "full", step=STEP)
    assert "variables/variables.data-00000-of-00001" in files_under(template.dir)
    with daemon.channel() as channel:
        old = raw.register(raw.Stub(channel), "path-old-client", template)
        with raw.RawSave(raw.Stub(channel), pb.SaveRequest(header=old.header("export"))) as call:
            assert call.decision().accepted
            call.finish(old.chunks())
    with RemotePolicySaver(
        policy, daemon.address, run="path-new-client", train_step=template.train_step, timeout=TIMEOUT
    ) as saver:
        saver.save("export", blocking=True)
    kept = daemon.root / ".checkpointd" / "templates"
    assert "variables/variables.data-00000-of-00001" in files_under(kept / "path-old-client")
    assert files_under(kept / "path-new-client") == files_under(kept / "path-old-client") - {
        "variables/variables.data-00000-of-00001"
    } | {TEMPLATE_OBJECT_GRAPH}
    old_out, new_out = daemon.root / "path-old-client" / "export", daemon.root / "path-new-client" / "export"
    assert files_under(old_out) == files_under(new_out) == SAVED_MODEL_FILES | DAEMON_FILES
    # Two exports name their functions apart (saved_model.pb differs); the checkpoints may not.
    for name in CHECKPOINT_FILES:
        assert (old_out / name).read_bytes() == (new_out / name).read_bytes(), name
    assert int(tf.saved_model.load(str(new_out)).get_train_step()) == STEP
