"""The policy format and the local store, composed as the save pipeline composes
them, against real TF-Agents policies and in-process PolicySaver output.

No daemon: the writer is called directly, with the variables and object graph
the client's own `snapshot.bind` would register. Module-scoped fixtures build
each policy, its template and one pair of writes once; the tests then inspect them.
Each policy is registered in both template forms: as the client sends it (no
variable data, `template.drop_variable_data`) and as older clients sent it
(PolicySaver's whole output); the writes must be byte-identical either way.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import fingerprint_pb2, trackable_object_graph_pb2
from tensorflow.python.saved_model.pywrap_saved_model import fingerprinting
from tf_agents.networks import actor_distribution_network, q_network
from tf_agents.policies import (
    actor_policy,
    greedy_policy,
    policy_saver,
    py_tf_eager_policy,
    q_policy,
)
from tf_agents.specs import tensor_spec
from tf_agents.trajectories import time_step as ts

from checkpointd.core.ports import SaveMeta
from checkpointd.core.variable_manifest import VariableSpec
from checkpointd.formats.policy import PolicyFormat
from checkpointd.protocol.errors import InvalidRequestError, RunNotFoundError, SaveFailedError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.tensors import TEMPLATE_OBJECT_GRAPH
from checkpointd.saves.writes import write_save
from checkpointd.storage.local import LocalStore
from checkpointd.storage.save_manifest import MANIFEST_NAME
from checkpointd.storage.verify import verify_dir
from checkpointd_client import snapshot as client_snapshot
from checkpointd_client import template as client_template
from tests.integration.support import policies
from tests.integration.support.disk import files_under


class TfWriter:
    """PolicyFormat + LocalStore with the save pipeline's `write_save`: one save at a time."""

    def __init__(self, state_dir: Path, *, fsync: bool = True) -> None:
        self.format = PolicyFormat(state_dir, fsync=fsync)
        self._fsync = fsync
        self._manifests: dict = {}

    def register(self, run, staged_dir, variables, checkpoint_object_graph):  # noqa: ANN001, ANN201
        manifest = self.format.register(run, staged_dir, variables, checkpoint_object_graph)
        self._manifests[run] = manifest
        return manifest

    def write(self, run, kind, target, snapshot, *, step=-1, export_dir=None, numpy_state=None):  # noqa: ANN001, ANN201
        target = Path(target)
        store = LocalStore(target.parent, fsync=self._fsync)
        manifest = self._manifests.get(run)  # None: the format says the run is not found
        meta = SaveMeta(run, kind, step, target.name if export_dir is None else export_dir)
        return write_save(store, self.format, meta, manifest, target, snapshot, numpy_state)


_VARIABLES = ("variables.index", "variables.data-00000-of-00001")
_OBS_SPEC = tf.TensorSpec([4], tf.float32)
_SNAPSHOT_STEP = 42


def bind(saver: policy_saver.PolicySaver, template_dir: Path) -> tuple[list[tuple[VariableSpec, tf.Variable]], bytes]:
    """What the client sends at registration: variable specs (with their variables), object graph."""
    bindings = client_snapshot.bind(saver, str(template_dir))
    bound = [(VariableSpec(b.key, b.checkpoint_key, b.dtype, b.shape), b.variable) for b in bindings.variables]
    return bound, bindings.object_graph


def snapshot(bound: list[tuple[VariableSpec, tf.Variable]]) -> bytes:
    return b"".join(np.ascontiguousarray(v.numpy()).astype(v.dtype.as_numpy_dtype).tobytes() for _, v in bound)


def read_checkpoint(prefix: Path) -> dict[str, np.ndarray | bytes]:
    reader = tf.train.load_checkpoint(str(prefix / "variables" / "variables"))
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}


def _observations() -> ts.TimeStep:
    obs = tf.constant(np.random.default_rng(7).normal(size=(16, 4)), tf.float32)
    return ts.restart(obs, batch_size=16)


def _decision(policy: object) -> np.ndarray:
    """What the policy decides on a fixed batch, deterministically.

    QPolicy.action samples from Categorical(logits=q_values), so its logits are
    compared; the greedy actor's actions are deterministic.
    """
    step = _observations()
    distribution = policy.distribution(step).action  # type: ignore[attr-defined]
    if isinstance(distribution.parameters.get("logits"), tf.Tensor):
        return distribution.logits.numpy()
    return policy.action(step).action.numpy()  # type: ignore[attr-defined]


def _make_policy(name: str, train_step: tf.Variable) -> policy_saver.PolicySaver:
    time_step_spec = ts.time_step_spec(_OBS_SPEC)
    metadata = {"m": tf.Variable(1.5)}
    if name == "q":
        action_spec = tensor_spec.BoundedTensorSpec([], tf.int32, 0, 1)
        net = q_network.QNetwork(_OBS_SPEC, action_spec, fc_layer_params=(8,))
        policy = q_policy.QPolicy(time_step_spec, action_spec, q_network=net)
    else:  # a greedy continuous actor: deterministic actions, different variables
        action_spec = tensor_spec.BoundedTensorSpec([2], tf.float32, -1.0, 1.0)
        net = actor_distribution_network.ActorDistributionNetwork(_OBS_SPEC, action_spec, fc_layer_params=(8,))
        policy = greedy_policy.GreedyPolicy(actor_policy.ActorPolicy(time_step_spec, action_spec, actor_network=net))
    return policy_saver.PolicySaver(policy, train_step=train_step, metadata=metadata)


def _assign_all(bound: list[tuple[VariableSpec, tf.Variable]], step: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for spec, v in bound:
        if spec.dtype == "int64":
            v.assign(step)
        else:
            v.assign(rng.normal(size=spec.shape).astype(spec.dtype))


def _copy_template(template: Path, target: Path, form: str) -> Path:
    """A copy of a PolicySaver.save() output, as a template of `form` ("client" or "full")."""
    shutil.copytree(template, target)
    if form == "client":
        client_template.drop_variable_data(str(target))
    return target


@dataclass
class Case:
    name: str
    template: Path  # pristine PolicySaver.save() output (never consumed)
    specs: list[VariableSpec]
    graph: bytes
    snap: bytes
    expected: dict[str, np.ndarray]  # key -> value at snapshot time
    actions: np.ndarray  # in-process decisions (_decision) at snapshot time
    ref_sm: Path  # in-process PolicySaver.save at snapshot time
    ref_ck: Path  # in-process PolicySaver.save_checkpoint at snapshot time
    out_sm: Path  # TfWriter SAVED_MODEL write
    out_ck: Path  # TfWriter CHECKPOINT write
    written: dict[SaveKind, int]


@pytest.fixture(scope="module", params=["q-client", "q-full", "actor-client", "actor-full"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    name, form = request.param.split("-")
    root = tmp_path_factory.mktemp(request.param)
    train_step = tf.Variable(0, dtype=tf.int64)
    saver = _make_policy(name, train_step)
    saver.save(str(root / "template"))
    bound, graph = bind(saver, root / "template")

    # State B: snapshotted and saved in-process; then state C, to prove the
    # written files hold the snapshot, not the live variables.
    _assign_all(bound, _SNAPSHOT_STEP, seed=1)
    snap = snapshot(bound)
    expected = {spec.key: v.numpy() for spec, v in bound}
    actions = _decision(saver.policy)
    saver.save(str(root / "ref_sm"))
    saver.save_checkpoint(str(root / "ref_ck"))
    _assign_all(bound, _SNAPSHOT_STEP + 57, seed=2)

    writer = TfWriter(root / "state")
    staged = _copy_template(root / "template", root / "staged", form)
    specs = [spec for spec, _ in bound]
    manifest = writer.register("run1", staged, specs, graph)
    assert list(manifest.variables) == specs
    assert memoryview(snap).nbytes == manifest.nbytes
    written = {
        SaveKind.SAVED_MODEL: writer.write("run1", SaveKind.SAVED_MODEL, root / "out" / "sm", memoryview(snap)),
        SaveKind.CHECKPOINT: writer.write("run1", SaveKind.CHECKPOINT, root / "out" / "ck", bytearray(snap)),
    }
    return Case(
        name, root / "template", specs, graph, snap, expected, actions,
        root / "ref_sm", root / "ref_ck", root / "out" / "sm", root / "out" / "ck", written,
    )  # fmt: skip


def test_importing_the_writer_does_not_import_tensorflow() -> None:
    code = "import sys, checkpointd.formats.policy; sys.exit('tensorflow' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_the_client_template_holds_no_variable_data(tmp_path: Path, q_case: tuple[Path, list, bytes, bytes]) -> None:
    template = _copy_template(q_case[0], tmp_path / "t", "client")
    assert files_under(template) == files_under(q_case[0]) - {"variables/variables.data-00000-of-00001"} | {
        TEMPLATE_OBJECT_GRAPH
    }
    full = tf.train.load_checkpoint(str(q_case[0] / "variables" / "variables"))
    assert (template / TEMPLATE_OBJECT_GRAPH).read_bytes() == full.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH")
    assert (template / "variables" / "variables.index").read_bytes() == (
        q_case[0] / "variables" / "variables.index"
    ).read_bytes()


def test_binding_graph_is_what_save_checkpoint_writes(case: Case) -> None:
    # Guards the test's own premise: the client-side recipe matches upstream.
    assert read_checkpoint(case.ref_ck)["_CHECKPOINTABLE_OBJECT_GRAPH"] == case.graph


def test_saved_model_loads_with_the_policy_functions(case: Case) -> None:
    loaded = tf.saved_model.load(str(case.out_sm))
    policies.assert_policy_functions(loaded)
    assert files_under(case.out_sm) == files_under(case.ref_sm) | {MANIFEST_NAME}


def test_saved_model_holds_the_snapshot_not_the_live_state(case: Case) -> None:
    loaded = tf.saved_model.load(str(case.out_sm))
    assert int(loaded.get_train_step()) == _SNAPSHOT_STEP
    assert float(loaded.get_metadata()["m"]) == pytest.approx(
        float(case.expected["metadata/m/.ATTRIBUTES/VARIABLE_VALUE"])
    )
    np.testing.assert_array_equal(_decision(loaded), case.actions)


def test_saved_model_variables_are_bit_identical_to_policy_saver(case: Case) -> None:
    ours, theirs = read_checkpoint(case.out_sm), read_checkpoint(case.ref_sm)
    assert set(ours) == set(theirs) == {s.key for s in case.specs} | {"_CHECKPOINTABLE_OBJECT_GRAPH"}
    for key, value in theirs.items():
        assert np.asarray(ours[key]).tobytes() == np.asarray(value).tobytes(), key
        if key in case.expected:
            assert np.asarray(value).tobytes() == case.expected[key].tobytes(), key
    # Same tensor order as TF's saver: the files themselves are identical.
    for name in _VARIABLES:
        assert (case.out_sm / "variables" / name).read_bytes() == (case.ref_sm / "variables" / name).read_bytes()


def test_fingerprint_is_true_for_the_written_content(case: Case) -> None:
    ours = fingerprint_pb2.FingerprintDef.FromString((case.out_sm / "fingerprint.pb").read_bytes())
    theirs = fingerprint_pb2.FingerprintDef.FromString((case.ref_sm / "fingerprint.pb").read_bytes())
    created = fingerprinting.CreateFingerprintDef(str(case.out_sm))
    fresh = fingerprint_pb2.FingerprintDef.FromString(created)
    assert ours.checkpoint_hash == theirs.checkpoint_hash != 0
    assert ours.saved_model_checksum == fresh.saved_model_checksum != 0
    assert ours == fresh
    # The daemon reuses the template's graph hashes: the file is still TF's own, byte for byte.
    assert (case.out_sm / "fingerprint.pb").read_bytes() == created


def test_the_manifest_sums_known_from_memory_are_the_files_on_disk(case: Case) -> None:
    # Template files, fingerprint.pb and the index are summed from memory, not read back.
    for out in (case.out_sm, case.out_ck):
        report = verify_dir(out)
        assert report.ok, report.reason
        assert report.files == len(files_under(out)) - 1
    # What the commit says it wrote: every file the manifest lists (as verify counts them), not the manifest.
    assert case.written[SaveKind.SAVED_MODEL] == sum(
        (case.out_sm / rel).stat().st_size for rel in files_under(case.out_sm) - {MANIFEST_NAME}
    )


def test_checkpoint_is_the_layout_of_save_checkpoint(case: Case) -> None:
    assert (
        files_under(case.out_ck) - {MANIFEST_NAME} == files_under(case.ref_ck) == {f"variables/{n}" for n in _VARIABLES}
    )
    ours, theirs = read_checkpoint(case.out_ck), read_checkpoint(case.ref_ck)
    assert set(ours) == set(theirs) == {s.checkpoint_key for s in case.specs} | {"_CHECKPOINTABLE_OBJECT_GRAPH"}
    for key, value in theirs.items():
        assert np.asarray(ours[key]).tobytes() == np.asarray(value).tobytes(), key
    for name in _VARIABLES:
        assert (case.out_ck / "variables" / name).read_bytes() == (case.ref_ck / "variables" / name).read_bytes()
    assert case.written[SaveKind.CHECKPOINT] == sum(
        (case.out_ck / n).stat().st_size for n in (f"variables/{n}" for n in _VARIABLES)
    )


def test_checkpoint_updates_a_loaded_policy(case: Case) -> None:
    policy = py_tf_eager_policy.SavedModelPyTFEagerPolicy(str(case.template), load_specs_from_pbtxt=True)
    assert policy.get_train_step() == 0
    policy.update_from_checkpoint(str(case.out_ck))
    assert policy.get_train_step() == _SNAPSHOT_STEP
    by_checkpoint_key = {s.checkpoint_key: case.expected[s.key] for s in case.specs}
    for i, variable in enumerate(policy.variables()):
        want = by_checkpoint_key[f"model_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE"]
        assert variable.numpy().tobytes() == want.tobytes()


# Failures: one policy is enough.


@pytest.fixture(scope="module")
def q_case(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, list[VariableSpec], bytes, bytes]:
    root = tmp_path_factory.mktemp("q_failures")
    train_step = tf.Variable(3, dtype=tf.int64)
    saver = _make_policy("q", train_step)
    saver.save(str(root / "template"))
    bound, graph = bind(saver, root / "template")
    return root / "template", [s for s, _ in bound], graph, snapshot(bound)


@pytest.fixture(scope="module")
def module_saved_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SavedModel of a plain tf.Module: right files, no policy signatures."""
    module = tf.Module()
    module.v = tf.Variable([1.0, 2.0])
    module.f = tf.function(lambda x: x * module.v, input_signature=[tf.TensorSpec([2], tf.float32)])
    path = tmp_path_factory.mktemp("module") / "sm"
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.f})
    return path


def _staged(tmp_path: Path, template: Path) -> Path:
    staged = tmp_path / "upload" / "staged"
    shutil.copytree(template, staged)
    return staged


_WEIGHTS = "model_variables/0/.ATTRIBUTES/VARIABLE_VALUE"  # same key in both layouts


def _replace(specs: list[VariableSpec], which: str, **changes: object) -> list[VariableSpec]:
    i = [s.key for s in specs].index(which)
    old = specs[i]
    fields = {
        "key": old.key,
        "checkpoint_key": old.checkpoint_key,
        "dtype": old.dtype,
        "shape": old.shape,
    }
    return specs[:i] + [VariableSpec(**{**fields, **changes})] + specs[i + 1 :]  # type: ignore[arg-type]


def _graph_with_attribute_name(graph: bytes, name: str) -> bytes:
    proto = trackable_object_graph_pb2.TrackableObjectGraph.FromString(graph)
    next(n for n in proto.nodes if n.attributes).attributes[0].name = name
    return proto.SerializeToString()


@pytest.mark.parametrize(
    "defect, match",
    [
        ("no_specs", "policy_specs.pbtxt"),
        ("garbage_saved_model", "saved_model.pb"),
        ("no_variables", "has no variables/variables.index"),
        ("index_only", "neither variables/object_graph.pb nor the data shards"),
        ("both_forms", "two object graphs"),
        ("client_no_index", "has no variables/variables.index"),
        ("client_garbage_index", r"variables/variables.index\) is unreadable"),
        ("client_garbage_graph", "variables/object_graph.pb"),
        ("client_graph_of_another_model", "variables/object_graph.pb has key 'v/.ATTRIBUTES/VARIABLE_VALUE'"),
        ("module_saved_model", "'action'"),
        ("key_mismatch", "model_variables/0/.ATTRIBUTES/VARIABLE_VALUE'.*no declared variable"),
        ("dtype_mismatch", "float64"),
        ("shape_mismatch", r"\[3, 8\]"),
        ("graph_garbage", "checkpoint_object_graph"),
        ("graph_key_mismatch", "model_variables/0"),
        ("non_variable_state", "non-variable state is not supported"),
    ],
)
def test_a_bad_template_is_refused_and_leaves_nothing(
    q_case: tuple[Path, list[VariableSpec], bytes, bytes],
    module_saved_model: Path,
    tmp_path: Path,
    defect: str,
    match: str,
) -> None:
    template, specs, graph, _ = q_case
    staged = _staged(tmp_path, module_saved_model if defect == "module_saved_model" else template)
    if defect.startswith("client_"):
        client_template.drop_variable_data(str(staged))
    if defect == "index_only":
        (staged / "variables" / "variables.data-00000-of-00001").unlink()
    elif defect == "both_forms":
        (staged / TEMPLATE_OBJECT_GRAPH).write_bytes(graph)
    elif defect == "client_no_index":
        (staged / "variables" / "variables.index").unlink()
    elif defect == "client_garbage_index":
        (staged / "variables" / "variables.index").write_bytes(b"\xffnot an index" * 100)
    elif defect == "client_garbage_graph":
        (staged / TEMPLATE_OBJECT_GRAPH).write_bytes(b"\xff\xffgarbage")
    elif defect == "client_graph_of_another_model":
        other = tf.train.load_checkpoint(str(module_saved_model / "variables" / "variables"))
        (staged / TEMPLATE_OBJECT_GRAPH).write_bytes(other.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    elif defect == "module_saved_model":
        shutil.copy(template / "policy_specs.pbtxt", staged)
    elif defect == "no_specs":
        (staged / "policy_specs.pbtxt").unlink()
    elif defect == "no_variables":
        shutil.rmtree(staged / "variables")
    elif defect == "garbage_saved_model":
        (staged / "saved_model.pb").write_bytes(b"\xffnot a saved model")
    elif defect == "key_mismatch":
        specs = _replace(specs, _WEIGHTS, key="model_variables/0/x")
    elif defect == "dtype_mismatch":
        specs = _replace(specs, "metadata/m/.ATTRIBUTES/VARIABLE_VALUE", dtype="float64")
    elif defect == "shape_mismatch":
        specs = _replace(specs, _WEIGHTS, shape=(3, 8))
    elif defect == "graph_garbage":
        graph = b"\xff\xffgarbage"
    elif defect == "graph_key_mismatch":
        specs = _replace(specs, _WEIGHTS, checkpoint_key="model_variables/0/y")
    elif defect == "non_variable_state":
        graph = _graph_with_attribute_name(graph, "TABLE")
    writer = TfWriter(tmp_path / "state")
    with pytest.raises(InvalidRequestError, match=match):
        writer.register("run1", staged, specs, graph)
    assert not staged.exists()
    assert files_under(tmp_path) == set()
    with pytest.raises(RunNotFoundError):
        writer.write("run1", SaveKind.CHECKPOINT, tmp_path / "out", b"")


@pytest.fixture
def writer(q_case: tuple[Path, list[VariableSpec], bytes, bytes], tmp_path: Path) -> TfWriter:
    template, specs, graph, _ = q_case
    writer = TfWriter(tmp_path / "state", fsync=False)
    writer.register("run1", _staged(tmp_path, template), specs, graph)
    return writer


def test_writing_over_an_export_dir_replaces_it_completely(
    writer: TfWriter, q_case: tuple[Path, list[VariableSpec], bytes, bytes], tmp_path: Path
) -> None:
    target = tmp_path / "exports" / "policy"
    (target / "variables").mkdir(parents=True)
    (target / "stale.txt").write_text("old")
    (target / "variables" / "variables.data-00000-of-00002").write_text("old shard")
    (target / "old_dir").mkdir()
    writer.write("run1", SaveKind.SAVED_MODEL, target, q_case[3])
    assert files_under(target) == files_under(q_case[0]) | {MANIFEST_NAME}
    assert os.listdir(target.parent) == ["policy"]


def test_a_re_registered_template_replaces_the_old_one(
    writer: TfWriter, q_case: tuple[Path, list[VariableSpec], bytes, bytes], tmp_path: Path
) -> None:
    template, specs, graph, snap = q_case
    staged = tmp_path / "again"
    shutil.copytree(template, staged)
    (staged / "assets" / "vocab.txt").write_text("new asset")
    writer.register("run1", staged, specs, graph)
    assert os.listdir(tmp_path / "state" / "templates") == ["run1"]
    assert (tmp_path / "state" / "templates" / "run1" / "assets" / "vocab.txt").exists()
    writer.write("run1", SaveKind.SAVED_MODEL, tmp_path / "out", snap)
    assert (tmp_path / "out" / "assets" / "vocab.txt").read_text() == "new asset"


def test_a_target_that_is_a_file_fails_and_is_left_alone(
    writer: TfWriter, q_case: tuple[Path, list[VariableSpec], bytes, bytes], tmp_path: Path
) -> None:
    target = tmp_path / "exports" / "policy"
    target.parent.mkdir()
    target.write_text("not a dir")
    with pytest.raises(SaveFailedError, match="not a directory"):
        writer.write("run1", SaveKind.SAVED_MODEL, target, q_case[3])
    assert os.listdir(target.parent) == ["policy"]
    assert target.read_text() == "not a dir"


def test_an_unwritable_parent_fails_and_leaves_no_temp_dir(
    writer: TfWriter, q_case: tuple[Path, list[VariableSpec], bytes, bytes], tmp_path: Path
) -> None:
    blocker = tmp_path / "exports"
    blocker.write_text("a file where a folder should be")
    target = blocker / "policy"
    with pytest.raises(SaveFailedError, match="exports") as raised:
        writer.write("run1", SaveKind.CHECKPOINT, target, q_case[3])
    assert "Not a directory" in str(raised.value)
    assert sorted(os.listdir(tmp_path)) == ["exports", "state", "upload"]
    assert blocker.read_text() == "a file where a folder should be"


def test_a_snapshot_of_the_wrong_size_fails_before_writing(
    writer: TfWriter, q_case: tuple[Path, list[VariableSpec], bytes, bytes], tmp_path: Path
) -> None:
    with pytest.raises(SaveFailedError, match="bytes"):
        writer.write("run1", SaveKind.SAVED_MODEL, tmp_path / "out", q_case[3][:-1])
    assert not (tmp_path / "out").exists()


def test_an_unknown_run_is_not_found(writer: TfWriter, tmp_path: Path) -> None:
    with pytest.raises(RunNotFoundError, match="run2"):
        writer.write("run2", SaveKind.SAVED_MODEL, tmp_path / "out", b"")


def test_a_save_accepted_before_the_run_registered_again_is_written_with_its_own_template(
    writer: TfWriter, q_case: tuple[Path, list[VariableSpec], bytes, bytes], tmp_path: Path
) -> None:
    template, specs, graph, snap = q_case
    first = writer._manifests["run1"]  # the manifest a save in flight was checked against
    staged = _staged(tmp_path, template)
    (staged / "assets").mkdir(exist_ok=True)
    (staged / "assets" / "vocab.txt").write_text("the second template's asset")
    second = writer.register("run1", staged, specs, graph)  # same variables, other files

    store = LocalStore(tmp_path, fsync=False)
    for name, manifest in (("old", first), ("new", second)):
        meta = SaveMeta("run1", SaveKind.SAVED_MODEL, 7, name)
        write_save(store, writer.format, meta, manifest, tmp_path / name, snap)

    assert not (tmp_path / "old" / "assets" / "vocab.txt").exists()
    assert (tmp_path / "new" / "assets" / "vocab.txt").read_text() == "the second template's asset"
    # Past what the format keeps, an old accept fails instead of borrowing a newer template.
    for _ in range(4):
        writer.register("run1", _staged_again(tmp_path, template), specs, graph)
    with pytest.raises(SaveFailedError, match="registered again"):
        write_save(
            store, writer.format, SaveMeta("run1", SaveKind.SAVED_MODEL, 7, "gone"), first, tmp_path / "gone", snap
        )
    assert not (tmp_path / "gone").exists()


def _staged_again(tmp_path: Path, template: Path) -> Path:
    staged = tmp_path / "upload" / "staged"
    shutil.rmtree(staged, ignore_errors=True)
    return _staged(tmp_path, template)
