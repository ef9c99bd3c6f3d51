"""The fuzz harness: sends scenarios to a real daemon and judges every answer, the disk and the counts.

`Fuzzer.run` sends one `Scenario` (fuzz_world.py), checks that the call
ended with a code of the errors table (INTERNAL only with the scenario's
reason; the exact code where the scenario knows it), that nothing was
written outside accepted saves and the daemon's state, and keeps the tally
the final checks compare with the daemon's counts. Multi-step scenarios (a
held lane, a cancel, an incremental save against its base, a staged
restore) are driven by fuzz_sequences.py.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from checkpointd.storage import save_manifest
from checkpointd.storage.verify import verify_dir, verify_prefix
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd.v1 import checkpointd_pb2_grpc
from tests.integration.support.daemon import Daemon
from tests.integration.support.disk import listing
from tests.integration.support.fuzz.fuzz_world import (
    CLOSABLE,
    CLOSED,
    COUNTED,
    MAIN,
    MAIN_FOLDER,
    MAIN_FOLDERED,
    PLANTED_DIRS,
    PLANTED_FILES,
    PLANTED_LINKS,
    Code,
    Scenario,
    World,
)
from tests.integration.support.raw import RawSave

Stub = checkpointd_pb2_grpc.CheckpointServiceStub
Sequence_ = Callable[["Fuzzer", Scenario], None]  # drives one multi-step scenario

RPC_TIMEOUT = 30.0  # per call; the daemon answers every fuzz request long before
SERVICE = "checkpointd.v1.CheckpointService"

# The errors table (checkpointd.protocol.codes.CODES) minus what fuzzing cannot reach
# legitimately: UNAVAILABLE (draining), UNAUTHENTICATED (no tokens here),
# INTERNAL (allowed per scenario only, with a reason).
TABLE = frozenset(
    {
        Code.OK,
        Code.INVALID_ARGUMENT,
        Code.NOT_FOUND,
        Code.DATA_LOSS,
        Code.RESOURCE_EXHAUSTED,
        Code.FAILED_PRECONDITION,
        Code.DEADLINE_EXCEEDED,
    }
)


@dataclass
class Outcome:
    code: Code
    details: str = ""
    decision: pb.SaveDecision | None = None
    result: pb.SaveResult | None = None
    seconds: float = 0.0


# --- Sending scenarios and judging the answers ---


class Fuzzer:
    """Sends scenarios to the daemon, checks every answer and the disk, keeps the tally."""

    def __init__(
        self, daemon: Daemon, world: World, channel: grpc.Channel, sequences: Mapping[str, Sequence_] = {}
    ) -> None:
        """Args:
        daemon, world, channel: the daemon under test, what scenarios are built from, a channel to it.
        sequences: drivers of multi-step scenarios by `Scenario.rpc` (fuzz_sequences.SEQUENCES).
        """
        self.sequences = dict(sequences)
        self.daemon = daemon
        self.world = world
        self.channel = channel
        self.stub = Stub(channel)
        self.requests = 0
        self.codes: collections.Counter[str] = collections.Counter()
        self.by_category: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.internal: collections.Counter[str] = collections.Counter()
        self.cancelled_by_client = 0
        self.known_bugs: collections.Counter[str] = collections.Counter()
        self.accepted_ok: dict[str, int] = {}  # export dir path -> step of its last good save
        # What the fuzzer saw for the main runs: ok, skipped (decided, or
        # reported by the request as skipped by its trainer), failed, cancelled.
        self.seen = {run: [0, 0, 0, 0] for run in COUNTED}
        # Training checkpoints written, by real prefix (their files share dirs).
        self.accepted_prefixes: dict[str, int] = {}
        self.planted = planted_paths(world)
        self.beside_root = sorted(p.name for p in world.root.parent.iterdir())
        self.slowest = (0.0, "")
        self.registered = {MAIN, MAIN_FOLDERED, CLOSED, *CLOSABLE}  # runs with templates
        self.offers: dict[str, pb.SharedMemory] = {}  # the last segment (and lock) offered, by run
        self.staged_restores = 0  # RestoreFiles answered with staged files, checked
        self.based_saves = 0  # incremental saves written against a base

    # Calls.

    def _record(self, scenario: Scenario, outcome: Outcome) -> None:
        self.requests += 1
        self.codes[outcome.code.name] += 1
        self.by_category[scenario.category.split("/")[0]][outcome.code.name] += 1
        if outcome.seconds > self.slowest[0]:
            self.slowest = (outcome.seconds, scenario.category)

    def save(self, requests: Sequence[pb.SaveRequest]) -> Outcome:
        started = time.monotonic()
        decision = result = None
        try:
            for response in self.stub.Save(iter(requests), timeout=RPC_TIMEOUT):
                item = response.WhichOneof("item")
                if item == "decision":
                    assert decision is None, "two decisions in one call"
                    decision = response.decision
                else:
                    assert (
                        item == "result" and decision is not None and decision.accepted
                    ), f"a {item} without an accept: {response}"
                    assert result is None, "two results in one call"
                    result = response.result
            return Outcome(Code.OK, "", decision, result, time.monotonic() - started)
        except grpc.RpcError as e:
            return Outcome(e.code(), e.details() or "", decision, None, time.monotonic() - started)

    def unary(self, method: Callable, request: Any, streaming: bool = False) -> Outcome:
        started = time.monotonic()
        try:
            if streaming:
                list(method(request, timeout=RPC_TIMEOUT))
            else:
                method(request, timeout=RPC_TIMEOUT)
            return Outcome(Code.OK, seconds=time.monotonic() - started)
        except grpc.RpcError as e:
            return Outcome(e.code(), e.details() or "", seconds=time.monotonic() - started)

    def _raw(self, method: str, payload: list[bytes]) -> Outcome:
        path = f"/{SERVICE}/{method}"
        started = time.monotonic()
        try:
            if method in ("Save",):
                list(self.channel.stream_stream(path)(iter(payload), timeout=RPC_TIMEOUT))
            elif method in ("Restore", "RestoreFiles"):
                call = self.channel.unary_stream(path)(payload[0], timeout=RPC_TIMEOUT)
                for response in call:  # a staged call stays open until the client ends it
                    if method == "RestoreFiles" and pb.RestoreFilesResponse.FromString(response).HasField("staged"):
                        call.cancel()
                        break
            elif method == "RegisterRun":
                self.channel.stream_unary(path)(iter(payload), timeout=RPC_TIMEOUT)
            else:
                self.channel.unary_unary(path)(payload[0], timeout=RPC_TIMEOUT)
            return Outcome(Code.OK, seconds=time.monotonic() - started)
        except grpc.RpcError as e:
            return Outcome(e.code(), e.details() or "", seconds=time.monotonic() - started)

    def run(self, scenario: Scenario) -> None:
        sequence = self.sequences.get(scenario.rpc)
        if sequence is not None:
            sequence(self, scenario)
        else:
            outcome = self._send(scenario)
            self.judge(scenario, outcome)
        self.check_disk(scenario)
        self._reopen_closed()

    def _send(self, scenario: Scenario) -> Outcome:
        rpc = scenario.rpc
        if rpc.startswith("raw:"):
            return self._raw(rpc[4:], scenario.payload)
        if rpc == "Save":
            return self.save(scenario.payload)
        if rpc == "RegisterRun":
            return self.unary(self.stub.RegisterRun, iter(scenario.payload))
        return self.unary(getattr(self.stub, rpc), scenario.payload)

    def judge(self, scenario: Scenario, outcome: Outcome) -> None:
        self._record(scenario, outcome)
        where = f"{scenario.category}: {outcome.code.name} {outcome.details!r}"
        assert self.daemon.proc.poll() is None, f"the daemon died ({where}):\n{self.daemon.log()[-3000:]}"
        assert outcome.code is not Code.UNKNOWN, where
        assert outcome.seconds < RPC_TIMEOUT - 1, f"the daemon did not answer in time: {where}"
        if outcome.code is Code.INTERNAL:
            assert scenario.internal, f"INTERNAL without a reason: {where}\n{scenario!r}"
            self.internal[scenario.internal] += 1
        else:
            assert outcome.code in TABLE or outcome.code in scenario.also, where
        if scenario.exact is not None:
            # A refusal the scenario allows anyway (`also`: e.g. the run is open as another stream) may come first.
            assert (
                outcome.code is scenario.exact or outcome.code in scenario.also
            ), f"expected {scenario.exact.name}; {where}\n{scenario!r}"
        if scenario.reported_skips is not None:
            run, n = scenario.reported_skips
            self.seen[run][1] += n
        if scenario.rpc == "RegisterRun" and outcome.code is Code.OK:
            self.registered.add(scenario.payload[0].header.run)
        if scenario.rpc != "Save":
            return
        # A Save ends OK only as a skip (no result) or a written save (a result).
        d, r = outcome.decision, outcome.result
        if outcome.code is Code.OK:
            assert d is not None and (r is not None) == d.accepted, where
        header = next((m.header for m in scenario.payload[:1] if m.WhichOneof("item") == "header"), None)
        run = header.run if header is not None else None
        if run in self.seen and d is not None:
            slot = 1 if not d.accepted else (0 if r is not None else 2)
            self.seen[run][slot] += 1
        if r is not None and r.kind == pb.TRAINING_CHECKPOINT:
            assert Path(r.path + ".index").is_file() and Path(r.path).is_relative_to(self.world.root), r.path
            assert r.step == header.step, r
            self.accepted_prefixes[os.path.realpath(r.path)] = header.step
        elif r is not None:
            assert Path(r.path).is_dir() and Path(r.path).is_relative_to(self.world.root), r.path
            assert r.step == header.step and r.duration_seconds >= 0, r
            # Kept by real path: a save through a planted in-folder link
            # ("insidelink/x") lands inside another save ("p0").
            real = os.path.realpath(r.path)
            # A save replaces whole what lay at or under its path.
            for p in [p for p in self.accepted_ok if Path(p).is_relative_to(real)]:
                del self.accepted_ok[p]
            self.accepted_ok[real] = header.step
        if scenario.expect_ok_path is not None:
            assert r is not None and r.path == scenario.expect_ok_path, where

    def cancelled(self) -> None:
        """Tallies a save this client cancelled after its accept, then waits out its end."""
        self.requests += 1
        self.codes["CANCELLED(by the client)"] += 1
        self.cancelled_by_client += 1
        self.seen[MAIN][3] += 1  # accepted, then the caller went away: saves_cancelled, not a failure
        self.flush_main()

    def flush_main(self) -> None:
        """Waits (bounded) until the main run is idle again, e.g. after a cancel."""
        self.stub.Flush(pb.FlushRequest(run=MAIN, timeout_seconds=RPC_TIMEOUT), timeout=RPC_TIMEOUT + 5)

    def _reopen_closed(self) -> None:
        for status in self.stub.GetStatus(pb.StatusRequest(), timeout=RPC_TIMEOUT).runs:
            if status.run in CLOSABLE and status.state == "closed":
                register(self.stub, status.run, self.world)

    # The disk.

    def check_disk(self, scenario: Scenario) -> None:
        root = self.world.root
        accepted = set(self.accepted_ok)
        parents = {str(p) for ok in [*accepted, *self.accepted_prefixes] for p in Path(ok).parents}
        prefix_dirs = {str(Path(p).parent) for p in self.accepted_prefixes}
        # Nothing committed goes away unless a later save replaced it (then it left these maps).
        lost = [p for p in accepted if not os.path.isdir(p)]
        lost += [p for p in self.accepted_prefixes if not os.path.isfile(p + ".index")]
        lost += [d for d in prefix_dirs if not os.path.isfile(os.path.join(d, "checkpoint"))]
        assert not lost, f"committed saves gone after {scenario!r}: {lost[:5]}"
        stray = []
        for dirpath, dirnames, filenames in os.walk(root):
            if dirpath == str(root):
                dirnames[:] = [d for d in dirnames if d != ".checkpointd"]  # the daemon's own
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                if Path(path) in self.planted or path in parents:
                    continue
                # A training checkpoint's files, and its dir's state file.
                if any(path.startswith(p + ".") for p in self.accepted_prefixes):
                    continue
                if name == "checkpoint" and dirpath in prefix_dirs:
                    continue
                # Inside an accepted save: the path or one of its parents is accepted.
                if path in accepted or any(str(p) in accepted for p in Path(path).parents):
                    continue
                stray.append(path)
        assert not stray, f"written outside accepted saves: {stray[:10]}\n{scenario!r}"
        state = root / ".checkpointd"
        assert not any((state / "staging").iterdir()), f"staging left behind after {scenario.category}"
        assert {p.name for p in state.iterdir()} <= {"templates", "staging", "daemon.lock"}, list(state.iterdir())
        templates = {p.name for p in (state / "templates").iterdir()}
        assert templates <= self.registered, templates - self.registered
        assert listing(self.world.outside) == {}, f"wrote outside the root after {scenario.category}"
        assert sorted(p.name for p in root.parent.iterdir()) == self.beside_root, scenario.category

    def final_checks(self) -> None:
        """Counts, verify, health and a good save, after the whole fuzz."""
        self.stub.Flush(pb.FlushRequest(timeout_seconds=RPC_TIMEOUT), timeout=RPC_TIMEOUT + 5)
        for run, seen in self.seen.items():
            (status,) = self.stub.GetStatus(pb.StatusRequest(run=run), timeout=RPC_TIMEOUT).runs
            counted = [status.saves_ok, status.saves_skipped, status.saves_failed, status.saves_cancelled]
            assert counted == seen, f"{run}: daemon counts {status} != fuzzer saw ok, skipped, failed, cancelled {seen}"
        # Every save that is still whole on disk passes verify with the step it was sent.
        for path, step in self.accepted_ok.items():
            if any(Path(other).is_relative_to(path) and other != path for other in self.accepted_ok):
                continue  # a later save inside it replaced one of its dirs
            report = verify_dir(Path(path))
            assert report.ok and report.step == step, report
        # Every training checkpoint verifies, and each dir's state file names exactly its committed ones.
        for prefix, step in self.accepted_prefixes.items():
            report = verify_prefix(Path(prefix))
            assert report.ok and report.step == step, report
        for directory in {Path(p).parent for p in self.accepted_prefixes}:
            committed = {
                p.name[: -len(save_manifest.PREFIX_MANIFEST_SUFFIX)]
                for p in directory.glob("*" + save_manifest.PREFIX_MANIFEST_SUFFIX)
            }
            listed = (directory / "checkpoint").read_text().count("all_model_checkpoint_paths")
            assert committed == {Path(p).name for p in self.accepted_prefixes if Path(p).parent == directory}
            assert listed == len(committed), (directory, listed, committed)
        assert_serving(self.daemon, self.stub, self.world)


def planted_paths(world: World) -> set[Path]:
    run_dir = world.root / MAIN
    return {run_dir} | {run_dir / p for p in (*PLANTED_DIRS, *PLANTED_LINKS, *PLANTED_FILES)}


def plant(world: World) -> None:
    run_dir = world.root / MAIN
    run_dir.mkdir(parents=True, exist_ok=True)
    for d in PLANTED_DIRS:
        (run_dir / d).mkdir()
    for f in PLANTED_FILES:
        (run_dir / f).write_bytes(b"not a save")
    for name, target in PLANTED_LINKS.items():
        os.symlink(world.fill(target), run_dir / name)


def register(stub: Stub, run: str, world: World, folder: str = "") -> None:
    header = pb.RegisterRunHeader(
        run=run,
        variables=world.variables,
        checkpoint_object_graph=world.graph,
        template_bytes=world.template_bytes,
        folder=folder,
    )
    chunks = [pb.RegisterRunRequest(chunk=c) for c in world.template_chunks]
    requests = [pb.RegisterRunRequest(header=header), *chunks]
    reply = stub.RegisterRun(iter(requests), timeout=RPC_TIMEOUT)
    assert reply.snapshot_bytes == world.nbytes


def good_save(stub: Stub, world: World, export_dir: str, run: str = MAIN) -> pb.SaveResult:
    header = pb.SaveHeader(
        run=run,
        kind=pb.SAVED_MODEL,
        export_dir=export_dir,
        step=world.step,
        variables=world.variables,
        snapshot_bytes=world.nbytes,
    )
    requests = [pb.SaveRequest(header=header)] + [pb.SaveRequest(chunk=c) for c in world.good_chunks]
    decision, result = list(stub.Save(iter(requests), timeout=RPC_TIMEOUT))
    assert decision.decision.accepted and result.WhichOneof("item") == "result"
    return result.result


def assert_serving(daemon: Daemon, stub: Stub, world: World) -> None:
    """The daemon is alive, health is SERVING, and a good save is written and verifies."""
    assert daemon.proc.poll() is None
    reply = health_pb2_grpc.HealthStub(grpc.insecure_channel(daemon.address)).Check(
        health_pb2.HealthCheckRequest(service=SERVICE), timeout=RPC_TIMEOUT
    )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    result = good_save(stub, world, "after-fuzz", run=MAIN_FOLDERED)
    assert result.path == str(world.root / MAIN_FOLDER / "after-fuzz")
    assert verify_dir(Path(result.path)).ok


def good_header(world: World, run: str, export_dir: str) -> pb.SaveHeader:
    return pb.SaveHeader(
        run=run,
        kind=pb.SAVED_MODEL,
        export_dir=export_dir,
        step=world.step,
        variables=world.variables,
        snapshot_bytes=world.nbytes,
    )


def hold(stub: Stub, header: pb.SaveHeader) -> RawSave:
    """Opens a Save, sends `header` and waits for the accept; the lane stays busy."""
    call = RawSave(stub, pb.SaveRequest(header=header))
    decision = call.decision()
    assert decision.accepted, f"the lane was not idle: {decision.reason}"
    return call
