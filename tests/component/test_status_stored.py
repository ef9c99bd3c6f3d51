"""`status --stored`: the runs with committed saves in the store, from any daemon.

Two real `Server`s share one FakeStore, as two daemons of a fleet share a
bucket: a save made through daemon A is listed by daemon B, which never
registered the run. The catalog's bounds (the cap, the lease lookups) are
driven directly with a store of many folders and recording fake leases.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from checkpointd.cli import ops
from checkpointd.cli.parse import OpsCommand, config_from_args
from checkpointd.core.config import ServeConfig
from checkpointd.core.ports import CommittedSave
from checkpointd.protocol.kinds import SaveKind
from checkpointd.rpc.auth import ServerAuth
from checkpointd.rpc.servicer import CheckpointServicer
from checkpointd.saves import catalog
from checkpointd.server import Server
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc
from tests.component.conftest import Rig, request, snapshot
from tests.component.fakes import LIMIT, FakeFormat, FakeStore
from tests.component.raw import register, save_header, save_requests

Stub = checkpointd_pb2_grpc.CheckpointServiceStub


@dataclass
class Fleet:
    """Two daemons on one store."""

    store: FakeStore
    servers: list[Server]
    stubs: list[Stub]
    channels: list[grpc.Channel] = field(default_factory=list)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    store = FakeStore(tmp_path / "staging")
    up = Fleet(store, [], [])
    try:
        for name in ("a", "b"):
            config = ServeConfig(
                root=tmp_path / name, port=0, metrics_port=None, shm_root=None, fsync=False,
                write_nice=0, grace_seconds=LIMIT, upload_timeout_seconds=LIMIT, notice_window_seconds=0,
            )  # fmt: skip
            server = Server(config, store=store, formats=[FakeFormat(store.files)], auth=ServerAuth())
            up.servers.append(server)
            server.start()
            channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
            up.channels.append(channel)
            up.stubs.append(Stub(channel))
        yield up
    finally:
        store.release_all()
        for channel in up.channels:
            channel.close()
        for server in up.servers:
            if not server.wait(0):
                server.stop(grace=LIMIT)


def save(stub: Stub, run: str, export_dir: str, step: int, **fields: object) -> pb.SaveResult:
    (decision, result) = stub.Save(
        save_requests(save_header(run, export_dir, step, **fields), snapshot(step)), timeout=LIMIT
    )
    assert decision.decision.accepted, decision.decision.reason
    return result.result


def stored(stub: Stub, run: str = "") -> pb.StatusResponse:
    return stub.GetStatus(pb.StatusRequest(run=run, stored=True), timeout=LIMIT)


def test_a_save_made_through_one_daemon_is_listed_by_another(fleet: Fleet) -> None:
    a, b = fleet.stubs
    register(a, "r1")
    save(a, "r1", "first", 3)
    newest = save(a, "r1", "second", 7)
    reply = stored(b)
    assert list(reply.runs) == []  # b registered nothing
    (row,) = reply.stored_runs
    assert (row.folder, row.run, row.saves) == ("r1", "r1", 2)
    assert (row.kind, row.export_dir, row.step, row.path) == (pb.SAVED_MODEL, "second", 7, newest.path)
    assert row.unix_seconds == max(s.created for s in fleet.store.saves())
    assert not row.HasField("lease_holder")  # the fake store has no leases
    assert (reply.stored_truncated, reply.stored_folders) == (False, 1)


def test_runs_sharing_a_folder_are_listed_one_by_one_in_folder_then_run_order(fleet: Fleet) -> None:
    a, b = fleet.stubs
    for run, folder in (("zeta", "shared"), ("alpha", "shared"), ("solo", "")):
        register(a, run, folder=folder)
        save(a, run, f"{run}-dir", 1)
    register(b, "on-b")
    save(b, "on-b", "x", 2)
    rows = [(r.folder, r.run) for r in stored(a).stored_runs]
    assert rows == [("on-b", "on-b"), ("shared", "alpha"), ("shared", "zeta"), ("solo", "solo")]
    assert stored(a).stored_folders == 3


def test_one_run_is_looked_up_in_its_folder_even_unregistered(fleet: Fleet) -> None:
    a, b = fleet.stubs
    register(a, "r1")
    save(a, "r1", "d", 5)
    register(a, "other")
    save(a, "other", "d", 6)
    reply = stored(b, "r1")
    assert list(reply.runs) == [] and [(r.run, r.step) for r in reply.stored_runs] == [("r1", 5)]
    assert list(stored(b, "nobody").stored_runs) == []
    # Without stored, an unregistered run is still NOT_FOUND; a registered one answers both.
    with pytest.raises(grpc.RpcError) as caught:
        b.GetStatus(pb.StatusRequest(run="r1"), timeout=LIMIT)
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND
    both = stored(a, "r1")
    assert [r.run for r in both.runs] == ["r1"] and [r.run for r in both.stored_runs] == ["r1"]


def test_a_bad_run_name_with_stored_is_invalid_argument(fleet: Fleet) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stored(fleet.stubs[0], "../up")
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "run" in (caught.value.details() or "")


def test_status_stored_on_the_command_line_prints_the_table_and_json(fleet: Fleet) -> None:
    a, b = fleet.stubs
    register(a, "r1")
    save(a, "r1", "policy", 11)
    address = f"127.0.0.1:{fleet.servers[1].port}"
    command, _ = config_from_args(["status", "--address", address, "--stored"])
    assert isinstance(command, OpsCommand) and command.stored
    out, err = io.StringIO(), io.StringIO()
    assert ops.run(command, out, err) == 0, err.getvalue()
    header, line = out.getvalue().splitlines()
    assert header.split() == ["RUN", "FOLDER", "NEWEST", "SAVE", "STEP", "AGE", "SAVES", "HOLDER"]
    assert line.split()[:5] == ["r1", "r1", "saved_model", "policy", "11"] and line.split()[-1] == "-"
    command, _ = config_from_args(["status", "--address", address, "--stored", "--json"])
    out = io.StringIO()
    assert ops.run(command, out, err) == 0
    document = json.loads(out.getvalue())
    assert document["stored_runs"][0]["run"] == "r1" and document["stored_runs"][0]["step"] == "11"
    assert "lease_holder" not in document["stored_runs"][0]


def test_the_table_names_the_holder_and_says_when_capped() -> None:
    reply = pb.StatusResponse(stored_truncated=True, stored_folders=2500)
    for run, holder in (("mine", ""), ("theirs", "host-b pid 12"), ("free", None)):
        row = reply.stored_runs.add(
            folder=run, run=run, saves=1, kind=pb.TRAINING_CHECKPOINT, export_dir="ckpts/ckpt-4", step=4,
            unix_seconds=1000.0,
        )  # fmt: skip
        if holder is not None:
            row.lease_holder = holder
    lines = ops.format_stored(reply, now=1090.0).splitlines()
    assert lines[1].endswith("this daemon") and lines[2].endswith("host-b pid 12") and lines[3].endswith("-")
    assert "90s ago" in lines[1] and "training_checkpoint ckpts/ckpt-4" in lines[1]
    assert lines[-1].startswith("capped: showing the first 3 runs by folder of 2500 folders")
    empty = ops.format_stored(pb.StatusResponse(stored_folders=4))
    assert "no committed saves in any of the 4 run folders" in empty


# The catalog's bounds, driven directly.


class ManyFolders:
    """A Store of `n` folders, one run with two saves each; counts the folders read."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.read: list[str] = []

    def folders(self) -> list[str]:
        return [f"f{i:04d}" for i in range(self.n)]

    def committed(self, folder: str, run: str | None) -> list[CommittedSave]:
        self.read.append(folder)
        return [
            CommittedSave(Path("/x") / folder / str(step), str(step), f"run-{folder}", SaveKind.CHECKPOINT, step, step)
            for step in (1, 2)
            if run in (None, f"run-{folder}")
        ]


class OneByOne:
    """Leases that answer one run at a time, recording each lookup."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def holder(self, run: str) -> str | None:
        self.asked.append(run)
        return "" if run.endswith("0") else None


class InBulk(OneByOne):
    """Leases that also answer for many runs at once (one listing)."""

    def __init__(self) -> None:
        super().__init__()
        self.bulk: list[list[str]] = []

    def holders(self, runs: list[str]) -> dict[str, str | None]:
        self.bulk.append(list(runs))
        return {run: "host-b" for run in runs}


def test_the_search_stops_at_the_cap_and_says_so() -> None:
    store = ManyFolders(7)
    found = catalog.stored_runs(store, cap=5)  # type: ignore[arg-type]
    assert found.truncated and found.folders == 7 and len(found.runs) == 5
    assert sorted(store.read) == [f"f{i:04d}" for i in range(5)]  # the rest is never read
    assert [r.run for r in found.runs] == [f"run-f{i:04d}" for i in range(5)]
    assert all(r.saves == 2 and r.newest.step == 2 for r in found.runs)
    whole = catalog.stored_runs(ManyFolders(5), cap=5)  # type: ignore[arg-type]
    assert not whole.truncated and len(whole.runs) == 5


def test_lease_holders_come_in_one_call_when_the_leases_can_list_them() -> None:
    bulk, single = InBulk(), OneByOne()
    found = catalog.stored_runs(ManyFolders(3), bulk)  # type: ignore[arg-type]
    assert bulk.bulk == [["run-f0000", "run-f0001", "run-f0002"]] and bulk.asked == []
    assert {r.holder for r in found.runs} == {"host-b"}
    found = catalog.stored_runs(ManyFolders(3), single)  # type: ignore[arg-type]
    assert sorted(single.asked) == ["run-f0000", "run-f0001", "run-f0002"]
    assert [r.holder for r in found.runs] == ["", None, None]


def test_the_servicer_reports_the_pipelines_lease_holders(rig: Rig, tmp_path: Path) -> None:
    rig.save(request("d", step=9))
    rig.pipeline.leases = InBulk()  # type: ignore[attr-defined]  # as a fleet's server wires it
    reply = CheckpointServicer(rig.pipeline, tmp_path).GetStatus(pb.StatusRequest(stored=True), None)  # type: ignore[arg-type]
    (row,) = reply.stored_runs
    assert (row.run, row.step, row.lease_holder) == ("a", 9, "host-b")
