"""Bad input against a real daemon: the right status, nothing on disk, the daemon serving on.

Every request here is built by hand and sent over real gRPC, so the daemon's
own checks are what is tested (the client refuses some of these itself). Each
test registers a run of its own on the module's daemon with a template the real
PolicySaver exported, then checks, after the refusal:
- the status code (`e.code()` on raw calls, the exception class through the client);
- a listing of the root (and of any directory outside it a request aimed at)
  is unchanged: nothing written, nothing left behind;
- the run's counts: a request refused before the daemon's decision counts as
  nothing; one that fails after the accept counts as failed;
- health is SERVING and a good save on the same run is accepted and written.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import crc32c
import grpc
import numpy as np
import pytest
import tensorflow as tf
from grpc_health.v1 import health_pb2, health_pb2_grpc

from checkpointd.protocol import wire
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client import (
    CheckpointdError,
    InvalidRequestError,
    LimitExceededError,
    RemotePolicySaver,
)
from checkpointd_client import template as client_template
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon, start_daemon

# test_fuzz.py imports Template, export_template and listing from this module.
from tests.integration.support.disk import listing
from tests.integration.support.raw import (
    RawSave,
    Run,
    Stub,
    Template,
    counts,
    export_template,
    register,
    register_requests,
)

RPC_TIMEOUT = 30.0


# Raw calls that must be refused, and a good one.


def save_header_only(stub: Stub, header: pb.SaveHeader) -> grpc.RpcError:
    """Sends a header the daemon must refuse before any decision; returns the error."""
    with RawSave(stub, pb.SaveRequest(header=header)) as call:
        with pytest.raises(grpc.RpcError) as caught:
            call.next()
    return caught.value


def good_save(stub: Stub, run: Run, export_dir: str = "good") -> pb.SaveResult:
    with RawSave(stub, pb.SaveRequest(header=run.header(export_dir))) as call:
        assert call.decision().accepted
        return call.finish(run.chunks())


# What the tests check after every refusal.


def assert_serving(daemon: Daemon, stub: Stub, run: Run) -> None:
    """Health is SERVING and a good save of `run` is accepted and written."""
    assert daemon.proc.poll() is None
    with grpc.insecure_channel(daemon.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="checkpointd.v1.CheckpointService"),
            timeout=RPC_TIMEOUT,
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    ok_before = counts(stub, run.name)[0]
    result = good_save(stub, run)
    assert result.path == str(daemon.root / run.name / "good")
    assert (Path(result.path) / "saved_model.pb").is_file()
    assert counts(stub, run.name)[0] == ok_before + 1


def assert_not_registered(stub: Stub, run: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.GetStatus(pb.StatusRequest(run=run), timeout=RPC_TIMEOUT)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


# Fixtures.


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    return export_template(policies.build(policies.q()), tmp_path_factory.mktemp("template"))


@pytest.fixture(scope="module")
def stub(daemon: Daemon, template: Template) -> Iterator[Stub]:
    with grpc.insecure_channel(daemon.address) as channel:
        stub = Stub(channel)
        # A first registration makes the daemon's state dir, so the root
        # listings the tests compare hold only what a test itself changes.
        register(stub, "baseline", template)
        yield stub


@pytest.fixture
def run(request: pytest.FixtureRequest, stub: Stub, template: Template) -> Run:
    """A run of the test's own, registered, named after the test."""
    return register(stub, run_name(request.node.name), template)


def run_name(test_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", test_name.removeprefix("test_"))[:128]


@pytest.fixture
def savers() -> Iterator[Callable[..., RemotePolicySaver]]:
    """Makes RemotePolicySavers of a template's policy; closes them at teardown."""
    made: list[RemotePolicySaver] = []

    def make(template: Template, address: str, run: str) -> RemotePolicySaver:
        saver = RemotePolicySaver(
            template.policy, address, run=run, train_step=template.train_step, timeout=RPC_TIMEOUT
        )
        made.append(saver)
        return saver

    yield make
    for saver in made:
        with contextlib.suppress(CheckpointdError):
            saver.close()


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """An empty directory outside the daemon's root that requests aim at."""
    path = tmp_path / "outside"
    path.mkdir()
    return path


# Unknown runs, bad run names, bad protocol.


def test_save_for_an_unknown_run_is_not_found(daemon: Daemon, stub: Stub, run: Run) -> None:
    before = listing(daemon.root)
    error = save_header_only(stub, run.header(run="never-registered"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "never-registered" in error.details()
    assert_not_registered(stub, "never-registered")
    for call in (
        lambda: stub.Flush(pb.FlushRequest(run="never-registered"), timeout=RPC_TIMEOUT),
        lambda: stub.CloseRun(pb.CloseRunRequest(run="never-registered"), timeout=RPC_TIMEOUT),
    ):
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert listing(daemon.root) == before
    assert_serving(daemon, stub, run)


BAD_RUN_NAMES = {
    "empty": "",
    "leading-dash": "-run",
    "leading-dot": ".run",
    "reserved": ".checkpointd",
    "slash": "a/b",
    "dotdot": "..",
    "parent": "../escape",
    "space": "a b",
    "non-ascii": "r\u00e9sum\u00e9",
    "nul": "a\x00b",
    "newline": "a\nb",
    "too-long": "r" * 129,
}


@pytest.mark.parametrize("name", BAD_RUN_NAMES.values(), ids=list(BAD_RUN_NAMES))
def test_bad_run_name_is_invalid_for_register_and_save(
    daemon: Daemon, stub: Stub, template: Template, run: Run, name: str
) -> None:
    before = listing(daemon.root)
    with pytest.raises(grpc.RpcError) as caught:
        stub.RegisterRun(
            register_requests(name, template.dir, run.variables(), template.bindings.object_graph),
            timeout=RPC_TIMEOUT,
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert save_header_only(stub, run.header(run=name)).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert listing(daemon.root) == before
    assert_serving(daemon, stub, run)


def test_first_message_must_be_a_header(daemon: Daemon, stub: Stub, run: Run) -> None:
    before = listing(daemon.root)
    chunk = run.chunks()[0]
    with RawSave(stub, pb.SaveRequest(chunk=chunk), pb.SaveRequest(header=run.header())) as call:
        assert call.refused() == grpc.StatusCode.INVALID_ARGUMENT
    with RawSave(stub) as call:  # no message at all
        call.half_close()
        assert call.refused() == grpc.StatusCode.INVALID_ARGUMENT
    for requests in (
        [pb.RegisterRunRequest(chunk=chunk)],
        [],
    ):
        with pytest.raises(grpc.RpcError) as caught:
            stub.RegisterRun(iter(requests), timeout=RPC_TIMEOUT)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert counts(stub, run.name) == (0, 0, 0)
    assert listing(daemon.root) == before
    assert_serving(daemon, stub, run)


@pytest.mark.parametrize("kind", [pb.SAVE_KIND_UNSPECIFIED, 99], ids=["unspecified", "unknown"])
def test_save_kind_must_be_saved_model_or_checkpoint(daemon: Daemon, stub: Stub, run: Run, kind: int) -> None:
    before = listing(daemon.root)
    error = save_header_only(stub, run.header(kind=kind))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert counts(stub, run.name) == (0, 0, 0)
    assert listing(daemon.root) == before
    assert_serving(daemon, stub, run)


# Snapshots that do not match the run's manifest: refused before the decision.


def _renamed(variables: list[pb.Variable]) -> str:
    variables[1].key = "model_variables/renamed/.ATTRIBUTES/VARIABLE_VALUE"
    return variables[1].key


def _reshaped(variables: list[pb.Variable]) -> str:
    for v in variables[1:3]:  # two differ; the first of them must be named
        v.shape[0] += 1
    return variables[1].key


def _retyped(variables: list[pb.Variable]) -> str:
    for v in variables[1:3]:
        v.dtype = "float64"
    return variables[1].key


def _fewer(variables: list[pb.Variable]) -> str:
    return variables.pop().key


def _more(variables: list[pb.Variable]) -> str:
    extra = pb.Variable(key="extra/.ATTRIBUTES/VARIABLE_VALUE", checkpoint_key="extra", dtype="float32", shape=[1])
    variables.append(extra)
    return extra.key


@pytest.mark.parametrize("mismatch", [_renamed, _reshaped, _retyped, _fewer, _more], ids=lambda f: f.__name__[1:])
def test_snapshot_not_matching_the_manifest_names_the_first_offender(
    daemon: Daemon, stub: Stub, run: Run, mismatch
) -> None:
    before = listing(daemon.root)
    variables = run.variables()
    offender = mismatch(variables)
    error = save_header_only(stub, run.header(variables=variables))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert offender in error.details()
    assert run.variables()[2].key not in error.details()  # the second offender is not the one named
    assert counts(stub, run.name) == (0, 0, 0)
    assert listing(daemon.root) == before
    assert_serving(daemon, stub, run)


def test_snapshot_bytes_not_matching_the_variables_is_invalid(daemon: Daemon, stub: Stub, run: Run) -> None:
    before = listing(daemon.root)
    error = save_header_only(stub, run.header(snapshot_bytes=run.template.nbytes + 4))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert counts(stub, run.name) == (0, 0, 0)
    assert listing(daemon.root) == before
    assert_serving(daemon, stub, run)


# Export dirs that leave the run's folder, or cannot name a folder.


BAD_EXPORT_DIRS = {
    "empty": "",
    "dot": ".",
    "parent": "..",
    "dotdot": "../escaped",
    "nested-dotdot": "a/../../escaped",
    "deep-dotdot": "a/../../../outside",
    "reserved": ".checkpointd-tmp-x",
    "nul": "a\x00b",
    "newline": "a\nb",
    "escape": "a\x1b[2Jb",
    "del": "a\x7fb",
    "bidi": "a\u202eb",
    "backslash": "..\\escaped",
}


@pytest.mark.parametrize("export_dir", BAD_EXPORT_DIRS.values(), ids=list(BAD_EXPORT_DIRS))
def test_export_dir_leaving_the_run_folder_is_invalid(
    daemon: Daemon, stub: Stub, run: Run, outside: Path, export_dir: str
) -> None:
    before = listing(daemon.root, outside)
    error = save_header_only(stub, run.header(export_dir))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert counts(stub, run.name) == (0, 0, 0)
    assert listing(daemon.root, outside) == before
    # Where the `..` cases would land beside the root.
    assert not {p.name for p in daemon.root.parent.iterdir()} & {"escaped", "outside"}
    assert_serving(daemon, stub, run)


def test_absolute_export_dir_is_invalid(daemon: Daemon, stub: Stub, run: Run, outside: Path) -> None:
    before = listing(daemon.root, outside)
    for export_dir in (str(outside / "abs"), str(daemon.root / run.name / "abs"), "/"):
        error = save_header_only(stub, run.header(export_dir))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, export_dir
    assert counts(stub, run.name) == (0, 0, 0)
    assert listing(daemon.root, outside) == before
    assert_serving(daemon, stub, run)


def test_an_export_dir_name_too_long_for_the_temp_dirs_is_invalid_at_the_header(
    daemon: Daemon, stub: Stub, run: Run
) -> None:
    # 214 bytes fits a filesystem name, but not the ".checkpointd-tmp-<name>-<hex>"
    # the daemon would write it through: it used to be accepted, then fail INTERNAL.
    before = listing(daemon.root)
    for name in ("x" * 214, "policies/" + "\u00e9" * 107, "x" * 245):
        error = save_header_only(stub, run.header(name))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert "at most 213" in error.details(), error.details()
    assert counts(stub, run.name) == (0, 0, 0)
    assert listing(daemon.root) == before
    # The longest allowed name is written, replaced (parking the old tree) and stays whole.
    longest = "x" * 213
    for _ in range(2):
        assert good_save(stub, run, longest).path == str(daemon.root / run.name / longest)
    assert (daemon.root / run.name / longest / "saved_model.pb").is_file()
    assert counts(stub, run.name) == (2, 0, 0)


def test_symlink_out_of_the_root_is_invalid(
    daemon: Daemon, stub: Stub, template: Template, outside: Path, savers
) -> None:
    name = "symlink-out"
    saver = savers(template, daemon.address, name)
    saver.register()
    run = Run(name, template)
    run_dir = daemon.root / name
    run_dir.mkdir()
    (run_dir / "link").symlink_to(outside, target_is_directory=True)
    (run_dir / "inner").mkdir()
    (run_dir / "inner" / "up").symlink_to(outside.parent, target_is_directory=True)
    before = listing(daemon.root, outside)

    for export_dir in ("link", "link/policy", "link/a/b", "inner/up/outside/policy"):
        error = save_header_only(stub, run.header(export_dir))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, export_dir
        # The client maps the daemon's status to the same exception class.
        with pytest.raises(InvalidRequestError):
            saver.save(export_dir)
        with pytest.raises(InvalidRequestError):
            saver.save_checkpoint(export_dir, blocking=True)

    assert counts(stub, name) == (0, 0, 0)
    assert listing(daemon.root, outside) == before
    assert listing(outside) == {}
    assert_serving(daemon, stub, run)


def test_symlink_planted_after_the_accept_is_not_followed(daemon: Daemon, stub: Stub, run: Run, outside: Path) -> None:
    run_dir = daemon.root / run.name
    run_dir.mkdir(exist_ok=True)
    with RawSave(stub, pb.SaveRequest(header=run.header("later/policy"))) as call:
        assert call.decision().accepted  # "later" did not exist: the path is fine
        # The save was staged before its accept was answered, in a "later" the daemon made:
        # swap that for a symlink leading out of the root.
        assert (run_dir / "later").is_dir() and not (run_dir / "later").is_symlink()
        (run_dir / "later").rename(run_dir / "later-moved")
        (run_dir / "later").symlink_to(outside, target_is_directory=True)
        call.send_chunks(run.chunks())
        call.half_close()
        try:
            written = call.next().result.path
        except grpc.RpcError as error:
            written = None
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert written is None, f"saved through the symlink into {os.path.realpath(written)}"
    assert listing(outside) == {}
    shutil.rmtree(run_dir / "later-moved", ignore_errors=True)  # the staging the swap orphaned


def test_a_link_planted_in_a_committed_save_is_not_followed_by_restores(
    daemon: Daemon, stub: Stub, run: Run, outside: Path
) -> None:
    good_save(stub, run, "kept")
    save_dir = daemon.root / run.name / "kept"
    # A decoy byte for byte the save's own: a restore that followed the link would succeed.
    shutil.copytree(save_dir / "variables", outside / "variables")
    (save_dir / "variables").rename(save_dir / "variables-moved")
    (save_dir / "variables").symlink_to(outside / "variables", target_is_directory=True)
    calls = {
        "Restore": lambda: list(stub.Restore(pb.RestoreRequest(run=run.name, export_dir="kept"), timeout=RPC_TIMEOUT)),
        "RestoreFiles": lambda: list(
            stub.RestoreFiles(pb.RestoreFilesRequest(run=run.name, export_dir="kept"), timeout=RPC_TIMEOUT)
        ),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, caught.value.details())
        assert "'variables' is a symlink" in caught.value.details(), (name, caught.value.details())
    assert_serving(daemon, stub, run)


@pytest.mark.parametrize(
    ("slots", "code", "message"),
    [
        (["/etc/passwd", "/etc/hosts"], grpc.StatusCode.INVALID_ARGUMENT, "is not a slot in this daemon's"),
        (["/etc/passwd"], grpc.StatusCode.INVALID_ARGUMENT, "send exactly 2"),
    ],
)
def test_watch_standby_with_slots_that_are_not_the_daemons_is_invalid_and_watches_nothing(
    daemon: Daemon, stub: Stub, run: Run, slots: list[str], code: grpc.StatusCode, message: str
) -> None:
    before = listing(daemon.root)
    with pytest.raises(grpc.RpcError) as caught:
        stub.WatchStandby(pb.WatchStandbyRequest(run=run.name, slot_paths=slots), timeout=RPC_TIMEOUT)
    assert caught.value.code() == code, caught.value.details()
    assert message in caught.value.details()
    with pytest.raises(grpc.RpcError) as unknown:
        stub.WatchStandby(pb.WatchStandbyRequest(run="no-such-run", slot_paths=slots[:1] * 2), timeout=RPC_TIMEOUT)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND, unknown.value.details()
    assert listing(daemon.root) == before
    assert_serving(daemon, stub, run)


# Snapshots that go wrong after the accept: the save counts as failed.


def _accepted(stub: Stub, run: Run) -> RawSave:
    call = RawSave(stub, pb.SaveRequest(header=run.header("broken")))
    assert call.decision().accepted
    return call


def test_chunk_with_a_bad_crc32c_is_data_loss_and_counts_as_failed(daemon: Daemon, stub: Stub, run: Run) -> None:
    before = listing(daemon.root)
    chunks = run.chunks()
    chunks[1].crc32c ^= 1
    with _accepted(stub, run) as call:
        call.send_chunks(chunks)
        call.half_close()
        assert call.refused() == grpc.StatusCode.DATA_LOSS
    assert counts(stub, run.name) == (0, 0, 1)
    assert listing(daemon.root) == before
    assert_serving(daemon, stub, run)


def test_chunks_out_of_order_are_invalid(daemon: Daemon, stub: Stub, run: Run) -> None:
    before = listing(daemon.root)
    chunks = run.chunks()
    assert len(chunks) >= 3
    with _accepted(stub, run) as call:
        call.send_chunks([chunks[1], chunks[0], *chunks[2:]])
        call.half_close()
        assert call.refused() == grpc.StatusCode.INVALID_ARGUMENT
    assert counts(stub, run.name) == (0, 0, 1)
    assert listing(daemon.root) == before
    assert_serving(daemon, stub, run)


@pytest.mark.parametrize("where", ["first", "after-accept"])
def test_bytes_that_are_no_save_request_are_invalid_saying_so_and_write_nothing(
    daemon: Daemon, stub: Stub, run: Run, where: str
) -> None:
    before = listing(daemon.root)
    garbage = b"\x12\x05\x1a\x09abc"  # a chunk whose data runs past the message
    first = [] if where == "first" else [pb.SaveRequest(header=run.header("broken")).SerializeToString()]
    with grpc.insecure_channel(daemon.address) as channel:
        save = channel.stream_stream(
            "/checkpointd.v1.CheckpointService/Save",
            request_serializer=lambda b: b,  # the bytes as they are
            response_deserializer=pb.SaveResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as caught:
            answers = list(save(iter([*first, garbage]), timeout=RPC_TIMEOUT))
            raise AssertionError(f"answered {answers}")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.match(
        r"Save: a message is not a SaveRequest that protobuf can decode \(.+\); build", caught.value.details()
    )
    assert counts(stub, run.name) == ((0, 0, 0) if where == "first" else (0, 0, 1))
    assert listing(daemon.root) == before
    assert_serving(daemon, stub, run)


def test_truncated_snapshot_is_invalid(daemon: Daemon, stub: Stub, run: Run) -> None:
    before = listing(daemon.root)
    with _accepted(stub, run) as call:
        call.send_chunks(run.chunks()[:-1])
        call.half_close()  # early: the last chunk never comes
        assert call.refused() == grpc.StatusCode.INVALID_ARGUMENT
    assert counts(stub, run.name) == (0, 0, 1)
    assert listing(daemon.root) == before
    assert_serving(daemon, stub, run)


def test_more_data_than_announced_is_refused(daemon: Daemon, stub: Stub, run: Run) -> None:
    before = listing(daemon.root)
    chunks = run.chunks()
    extra = b"\x00" * 8
    chunks.append(pb.Chunk(offset=run.template.nbytes, data=extra, crc32c=crc32c.crc32c(extra)))
    with _accepted(stub, run) as call:
        call.send_chunks(chunks)
        call.half_close()
        code = call.refused()
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert counts(stub, run.name) == (0, 0, 1)
    assert listing(daemon.root) == before
    assert_serving(daemon, stub, run)


def test_second_header_after_the_accept_is_invalid(daemon: Daemon, stub: Stub, run: Run) -> None:
    before = listing(daemon.root)
    with _accepted(stub, run) as call:
        call.send(pb.SaveRequest(header=run.header("other")))
        assert call.refused() == grpc.StatusCode.INVALID_ARGUMENT
    assert counts(stub, run.name) == (0, 0, 1)
    assert listing(daemon.root) == before
    assert_serving(daemon, stub, run)


# Templates that are not a TF-Agents policy SavedModel, or not what was announced.


@pytest.fixture(scope="module")
def not_policies(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, list[pb.Variable]]]:
    """Uploads that must not register: files dir and the variables the header declares."""
    base = tmp_path_factory.mktemp("not-policies")

    class Plain(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.v = tf.Variable([1.0, 2.0])

        @tf.function(input_signature=[tf.TensorSpec([2], tf.float32)])
        def __call__(self, x: tf.Tensor) -> tf.Tensor:
            return x * self.v

    tf.saved_model.save(Plain(), str(base / "plain"))
    plain_vars = [
        pb.Variable(
            key="v/.ATTRIBUTES/VARIABLE_VALUE",
            checkpoint_key="v/.ATTRIBUTES/VARIABLE_VALUE",
            dtype="float32",
            shape=[2],
        )
    ]

    garbage = base / "garbage"
    rng = np.random.default_rng(3)
    for rel in (
        "saved_model.pb",
        "policy_specs.pbtxt",
        "variables/variables.index",
        "variables/variables.data-00000-of-00001",
    ):
        (garbage / rel).parent.mkdir(parents=True, exist_ok=True)
        (garbage / rel).write_bytes(rng.bytes(4096))
    return {"plain-module": (base / "plain", plain_vars), "garbage": (garbage, plain_vars)}


@pytest.mark.parametrize(
    "upload", ["plain-module", "garbage", "policy-without-variables", "index-without-object-graph"]
)
def test_template_that_is_not_a_policy_saved_model_is_invalid(
    daemon: Daemon, stub: Stub, template: Template, not_policies, tmp_path: Path, upload: str
) -> None:
    name = f"not-a-policy-{upload}"
    if upload == "policy-without-variables":
        files = tmp_path / "partial"
        for rel in ("saved_model.pb", "policy_specs.pbtxt", "fingerprint.pb"):
            (files / rel).parent.mkdir(parents=True, exist_ok=True)
            (files / rel).write_bytes((template.dir / rel).read_bytes())
        variables = template.bindings.protos()
    elif upload == "index-without-object-graph":
        # The client's data-free template less the object graph it sends in place of the data.
        files = shutil.copytree(template.dir, tmp_path / "index-only")
        (files / "variables" / "variables.data-00000-of-00001").unlink()
        variables = template.bindings.protos()
    else:
        files, variables = not_policies[upload]
    before = listing(daemon.root)
    with pytest.raises(grpc.RpcError) as caught:
        stub.RegisterRun(
            register_requests(name, files, variables, template.bindings.object_graph),
            timeout=RPC_TIMEOUT,
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    if upload == "index-without-object-graph":
        assert "variables/object_graph.pb" in caught.value.details()
    assert_not_registered(stub, name)
    assert listing(daemon.root) == before  # no template kept, nothing left in staging
    assert_serving(daemon, stub, register(stub, name, template))  # the same name registers fine


@pytest.mark.parametrize("planted", ["checkpointd.manifest.json", "numpy_state/numpy_state.index"])
def test_a_template_holding_a_name_the_daemon_writes_is_invalid(
    daemon: Daemon, stub: Stub, template: Template, tmp_path: Path, planted: str
) -> None:
    # Registered, such a template would make every later save of the run fail
    # (the manifest is created exclusively) or mix foreign NumPy state in.
    name = "template-with-" + planted.split("/")[0].replace(".", "-")
    files = tmp_path / "planted"
    shutil.copytree(template.dir, files)
    (files / planted).parent.mkdir(parents=True, exist_ok=True)
    (files / planted).write_text("{}")
    before = listing(daemon.root)
    with pytest.raises(grpc.RpcError) as caught:
        stub.RegisterRun(
            register_requests(name, files, template.bindings.protos(), template.bindings.object_graph),
            timeout=RPC_TIMEOUT,
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert planted.split("/")[0] in caught.value.details() and "written by the daemon" in caught.value.details()
    assert_not_registered(stub, name)
    assert listing(daemon.root) == before
    assert_serving(daemon, stub, register(stub, name, template))


def test_bad_template_for_a_registered_run_keeps_its_old_one(
    daemon: Daemon, stub: Stub, not_policies, run: Run
) -> None:
    before = listing(daemon.root)
    files, variables = not_policies["garbage"]
    with pytest.raises(grpc.RpcError) as caught:
        stub.RegisterRun(register_requests(run.name, files, variables, b"garbage"), timeout=RPC_TIMEOUT)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert listing(daemon.root) == before  # the run's template files are untouched
    assert_serving(daemon, stub, run)  # saves still match the old manifest


@pytest.mark.parametrize("announced", [-1, +1], ids=["more-than-announced", "less-than-announced"])
def test_template_bytes_not_as_announced_is_invalid(
    daemon: Daemon, stub: Stub, template: Template, announced: int
) -> None:
    name = f"template-{'more' if announced < 0 else 'less'}-than-announced"
    before = listing(daemon.root)
    with pytest.raises(grpc.RpcError) as caught:
        stub.RegisterRun(
            register_requests(
                name,
                template.dir,
                template.bindings.protos(),
                template.bindings.object_graph,
                template_bytes=template.size + announced,
            ),
            timeout=RPC_TIMEOUT,
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_not_registered(stub, name)
    assert listing(daemon.root) == before
    assert_serving(daemon, stub, register(stub, name, template))


# Checkpoint keys: the daemon derives each variable's from the template's object
# graphs, so two variables alike in dtype and shape cannot trade names.


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> Template:
    """A template whose two hidden layers of 4 give two (4, 4) kernels and two (4,) biases."""
    return export_template(policies.build(policies.q((4, 4))), tmp_path_factory.mktemp("twins"))


def _swap_checkpoint_keys(variables: list[pb.Variable]) -> tuple[pb.Variable, pb.Variable]:
    """Swaps the checkpoint keys of the first two variables of one dtype and shape; returns both."""
    alike: dict[tuple[str, tuple[int, ...]], list[pb.Variable]] = {}
    for v in variables:
        alike.setdefault((v.dtype, tuple(v.shape)), []).append(v)
    a, b = next(group for group in alike.values() if len(group) > 1)[:2]
    assert a.key != b.key and a.checkpoint_key != b.checkpoint_key
    a.checkpoint_key, b.checkpoint_key = b.checkpoint_key, a.checkpoint_key
    return a, b


def _holds_each_variable_under_its_own_key(path: Path, template: Template) -> None:
    """A CHECKPOINT save at `path` stores every variable's value under its save_checkpoint key."""
    reader = tf.train.load_checkpoint(str(path / "variables" / "variables"))
    for b in template.bindings.variables:
        assert reader.get_tensor(b.checkpoint_key).tobytes() == b.variable.numpy().tobytes(), b.key


def test_registration_with_swapped_checkpoint_keys_is_invalid(
    daemon: Daemon, stub: Stub, twins: Template, run: Run
) -> None:
    name = "swapped-checkpoint-keys"
    variables = twins.bindings.protos()
    a, b = _swap_checkpoint_keys(variables)
    values = {x.key: x.variable.numpy().tobytes() for x in twins.bindings.variables}
    assert values[a.key] != values[b.key]  # else a swapped checkpoint would look right
    before = listing(daemon.root)
    with pytest.raises(grpc.RpcError) as caught:
        stub.RegisterRun(
            register_requests(name, twins.dir, variables, twins.bindings.object_graph), timeout=RPC_TIMEOUT
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details()
    # The first variable in manifest order, with the key it came with and the one it has.
    assert repr(a.key) in details
    assert repr(a.checkpoint_key) in details and repr(b.checkpoint_key) in details
    assert_not_registered(stub, name)
    assert listing(daemon.root) == before  # no template kept, nothing left in staging
    assert_serving(daemon, stub, run)
    # The right mapping registers, and its checkpoints hold each value under its own name.
    twin_run = register(stub, name, twins)
    with RawSave(stub, pb.SaveRequest(header=twin_run.header("ckpt", kind=pb.CHECKPOINT))) as call:
        assert call.decision().accepted
        result = call.finish(twin_run.chunks())
    _holds_each_variable_under_its_own_key(Path(result.path), twins)


def test_re_registration_with_swapped_checkpoint_keys_keeps_the_old_manifest(
    daemon: Daemon, stub: Stub, twins: Template, request: pytest.FixtureRequest
) -> None:
    twin_run = register(stub, run_name(request.node.name), twins)
    variables = twins.bindings.protos()
    _swap_checkpoint_keys(variables)
    before = listing(daemon.root)
    with pytest.raises(grpc.RpcError) as caught:
        stub.RegisterRun(
            register_requests(twin_run.name, twins.dir, variables, twins.bindings.object_graph),
            timeout=RPC_TIMEOUT,
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert listing(daemon.root) == before  # the run's template files are untouched
    assert_serving(daemon, stub, twin_run)  # saves still match the old manifest
    assert counts(stub, twin_run.name) == (1, 0, 0)


@pytest.mark.parametrize("kind", [pb.CHECKPOINT, pb.SAVED_MODEL], ids=["checkpoint", "saved_model"])
def test_save_header_with_swapped_checkpoint_keys_is_invalid(
    daemon: Daemon, stub: Stub, twins: Template, request: pytest.FixtureRequest, kind: int
) -> None:
    twin_run = register(stub, run_name(request.node.name), twins)
    variables = twin_run.variables()
    a, b = _swap_checkpoint_keys(variables)
    before = listing(daemon.root)
    error = save_header_only(stub, twin_run.header("swapped", kind=kind, variables=variables))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert repr(a.key) in error.details()
    assert repr(a.checkpoint_key) in error.details() and repr(b.checkpoint_key) in error.details()
    assert counts(stub, twin_run.name) == (0, 0, 0)  # refused before the decision
    assert listing(daemon.root) == before
    assert_serving(daemon, stub, twin_run)


# The daemon's configured limits, on a daemon of this module's own.


@dataclass(frozen=True)
class Limited:
    daemon: Daemon
    fits: Template  # within both limits
    big_snapshot: Template  # its template fits; its snapshot does not
    big_template: Template  # its template does not fit


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory, template: Template) -> Iterator[Limited]:
    base = tmp_path_factory.mktemp("limited")
    big_snapshot = export_template(policies.build(policies.q((64,))), base / "big-snapshot")
    max_snapshot = 2 * template.nbytes
    max_template = 2 * max(template.size, big_snapshot.size)
    # The client sends no variable values (template.drop_variable_data), so
    # what makes its template too big is an asset, which it does send.
    big_policy = policies.build(policies.q((256, 256)))
    (base / "big-asset.bin").write_bytes(b"\x00" * max_template)
    big_policy.big_asset = tf.saved_model.Asset(str(base / "big-asset.bin"))
    big_template = export_template(big_policy, base / "big-template")
    sent = shutil.copytree(big_template.dir, base / "big-template-as-sent")
    client_template.drop_variable_data(str(sent))
    # The premises of the tests below, checked rather than assumed.
    assert template.nbytes <= max_snapshot < big_snapshot.nbytes
    assert big_snapshot.size <= max_template < wire.template_size(sent) < big_template.size
    daemon = start_daemon(
        base / "root", base / "work",
        "--max-snapshot-bytes", str(max_snapshot), "--max-template-bytes", str(max_template),
    )  # fmt: skip
    try:
        yield Limited(daemon, template, big_snapshot, big_template)
    finally:
        daemon.terminate()


def test_snapshot_over_max_snapshot_bytes_is_resource_exhausted(limited: Limited, savers) -> None:
    daemon = limited.daemon
    saver = savers(limited.big_snapshot, daemon.address, "big-snapshot")
    saver.register()
    with grpc.insecure_channel(daemon.address) as channel:
        stub = Stub(channel)
        before = listing(daemon.root)
        with pytest.raises(LimitExceededError, match="--max-snapshot-bytes"):
            saver.save("policy").result(60)  # a non-blocking save: its ticket fails
        with pytest.raises(LimitExceededError):
            saver.save_checkpoint("checkpoint", blocking=True)
        assert counts(stub, "big-snapshot") == (0, 0, 0)
        assert listing(daemon.root) == before
        assert_serving(daemon, stub, register(stub, "fits", limited.fits))


def test_template_over_max_template_bytes_is_resource_exhausted(limited: Limited, savers) -> None:
    daemon = limited.daemon
    with grpc.insecure_channel(daemon.address) as channel:
        stub = Stub(channel)
        register(stub, "fits-first", limited.fits)  # the state dir exists before the listing
        before = listing(daemon.root)
        saver = savers(limited.big_template, daemon.address, "big-template")
        with pytest.raises(LimitExceededError, match="--max-template-bytes"):
            saver.register()
        # A header that announces too much is refused before any byte is taken.
        big = limited.big_template
        with pytest.raises(grpc.RpcError) as caught:
            stub.RegisterRun(
                register_requests("big-template", big.dir, big.bindings.protos(), big.bindings.object_graph),
                timeout=RPC_TIMEOUT,
            )
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert_not_registered(stub, "big-template")
        assert listing(daemon.root) == before
        assert_serving(daemon, stub, register(stub, "fits-after", limited.fits))
