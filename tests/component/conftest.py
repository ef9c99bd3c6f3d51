"""The component tier: the real save pipeline and servicer, in-process, with fakes behind the seams.

Fixtures:
- `rig` / `make_rig`: a `SavePipeline` on real Lanes, budget, retention and
  writer pool, with a FakeStore, a FakeFormat and a recording sink; saves
  can run on its worker threads.
- `served`: a real `Server` on 127.0.0.1 port 0 with the same fakes, and a
  stub to it.

Teardown opens every gate first, so no worker is left waiting, then joins
the workers and stops what was started: a failed assert never hangs the
tier. No test here may import TensorFlow; a guard checks after each one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from checkpointd.core.config import ServeConfig
from checkpointd.core.lane import LaneStats
from checkpointd.core.ports import Leases, PhaseSink
from checkpointd.core.retention import RetentionPolicy
from checkpointd.core.variable_manifest import Manifest, VariableSpec
from checkpointd.protocol.kinds import SaveKind
from checkpointd.rpc.auth import ServerAuth
from checkpointd.saves.budget import UploadBudget
from checkpointd.saves.pipeline import Decision, Formats, Result, SavePipeline, SaveRequest
from checkpointd.saves.pool import WriterPool
from checkpointd.saves.retention import Retention
from checkpointd.saves.runs import Lanes, RunView
from checkpointd.server import Server
from checkpointd.v1 import checkpointd_pb2_grpc
from tests.component.fakes import LIMIT, TEMPLATE_MARKER, FakeFormat, FakeStore, Gate, RecordingSink, Upload

# A run's variables: 24 + 16 = 40 bytes a snapshot.
VARIABLES = (
    VariableSpec("w", "policy/w/.ATTRIBUTES/VARIABLE_VALUE", "float32", (2, 3)),
    VariableSpec("b", "policy/b/.ATTRIBUTES/VARIABLE_VALUE", "int64", (2,)),
)
SNAPSHOT_BYTES = Manifest(VARIABLES).nbytes
MiB = 1 << 20


def snapshot(step: int, nbytes: int = SNAPSHOT_BYTES) -> bytes:
    """A snapshot whose bytes differ from step to step."""
    return bytes((step * 31 + i) % 251 for i in range(nbytes))


@pytest.fixture(autouse=True)
def _no_tensorflow() -> Iterator[None]:
    # Vacuous when another tier loaded TensorFlow first (a whole-suite run);
    # test_tensorflow.py proves the tier in a fresh interpreter too.
    loaded = "tensorflow" in sys.modules
    yield
    if not loaded:
        assert "tensorflow" not in sys.modules, "a component test imported TensorFlow"


# The pipeline, driven directly.


@dataclass
class Rig:
    """A SavePipeline on real parts and fakes, and threads to run saves on."""

    pipeline: SavePipeline
    lanes: Lanes
    store: FakeStore
    fmt: FakeFormat
    sink: RecordingSink
    budget: UploadBudget
    retention: Retention
    pool: WriterPool
    template_root: Path
    workers: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(max_workers=8))
    gates: list[Gate] = field(default_factory=list)

    def register(self, run: str = "a", variables: tuple[VariableSpec, ...] = VARIABLES, folder: str = "") -> Manifest:
        """Registers `run` through the pipeline, with a one-file template."""
        staged = self.template_root / f"{run}-{len(self.fmt.registered)}"

        def receive() -> Path:
            staged.mkdir(parents=True)
            (staged / TEMPLATE_MARKER).write_bytes(b"graph of " + run.encode())
            return staged

        return self.pipeline.register(run, folder, variables, b"object graph", 1, receive)

    def gate(self) -> Gate:
        """A gate released in teardown at the latest."""
        gate = Gate()
        self.gates.append(gate)
        return gate

    def save(self, request: SaveRequest, receive: Upload | None = None, **options: Any) -> list[Decision | Result]:
        """Runs one save to its end on this thread; returns what it yielded."""
        upload = receive if receive is not None else Upload(snapshot(request.step))
        return list(self.pipeline.save(request, upload, **options))

    def in_background(
        self, request: SaveRequest, receive: Upload | None = None, **options: Any
    ) -> Future[list[Decision | Result]]:
        return self.workers.submit(self.save, request, receive, **options)

    def hold(self, request: SaveRequest) -> tuple[Future[list[Decision | Result]], Gate]:
        """Starts `request` on a worker and returns once it is accepted and receiving.

        The save stays in flight until the gate is released.
        """
        gate = self.gate()
        future = self.in_background(request, Upload(snapshot(request.step), hold=gate))
        gate.wait_reached()
        return future, gate

    def view(self, run: str = "a") -> RunView:
        (view,) = self.lanes.views(run)
        return view

    def stats(self, run: str = "a") -> LaneStats:
        return self.view(run).stats

    def close(self) -> None:
        self.store.release_all()
        self.fmt.release_all()
        for gate in self.gates:
            gate.release()
        self.workers.shutdown(wait=True, cancel_futures=True)
        self.retention.stop(timeout=LIMIT)
        self.pool.close()


def request(
    export_dir: str = "first",
    *,
    run: str = "a",
    step: int = 1,
    blocking: bool = False,
    kind: SaveKind = SaveKind.SAVED_MODEL,
    variables: tuple[VariableSpec, ...] = VARIABLES,
    snapshot_bytes: int = SNAPSHOT_BYTES,
) -> SaveRequest:
    return SaveRequest(
        run=run, kind=kind, export_dir=export_dir, blocking=blocking, step=step,
        variables=variables, snapshot_bytes=snapshot_bytes,
    )  # fmt: skip


MakeRig = Callable[..., Rig]


@pytest.fixture
def make_rig(tmp_path: Path) -> Iterator[MakeRig]:
    rigs: list[Rig] = []

    def make(
        *,
        max_uploads: int = 32,
        max_staging_bytes: int = 64 * MiB,
        admission_wait: float = 0.0,
        retention: RetentionPolicy | None = None,
        leases: Leases | None = None,
        phases: PhaseSink | None = None,
        **config: Any,
    ) -> Rig:
        where = tmp_path / f"rig{len(rigs)}"
        config.setdefault("upload_timeout_seconds", LIMIT)
        serve = ServeConfig(root=where / "root", port=0, metrics_port=None, fsync=False, write_nice=0, **config)
        store = FakeStore(where / "staging")
        fmt = FakeFormat(store.files)
        sink = RecordingSink()
        lanes = Lanes(sink=sink)
        budget = UploadBudget(max_uploads, max_staging_bytes, admission_wait)
        kept = Retention(store, retention or RetentionPolicy())
        kept.start()
        pool = WriterPool()
        pipeline = SavePipeline(
            serve, lanes, store, Formats(fmt), pool, budget=budget, retention=kept, leases=leases, phases=phases
        )
        rig = Rig(pipeline, lanes, store, fmt, sink, budget, kept, pool, where / "templates")
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.close()


@pytest.fixture
def rig(make_rig: MakeRig) -> Rig:
    """A pipeline with run "a" registered."""
    made = make_rig()
    made.register("a")
    return made


# The servicer, through real gRPC.


Stub = checkpointd_pb2_grpc.CheckpointServiceStub


@dataclass
class Served:
    """A running Server with fake seams, and a channel to it."""

    server: Server
    store: FakeStore
    fmt: FakeFormat
    channel: grpc.Channel
    stub: Stub
    closers: list[Callable[[], None]] = field(default_factory=list)

    def stop(self) -> bool:
        return self.server.stop(grace=LIMIT)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """A server without a notice window: stop() refuses every save at once (test_notice.py has the window)."""
    yield from serving(tmp_path, notice_window_seconds=0.0)


def serving(tmp_path: Path, **config: Any) -> Iterator[Served]:
    """Starts a Served with these ServeConfig fields; stops it when resumed."""
    store = FakeStore(tmp_path / "staging")
    fmt = FakeFormat(store.files)
    serve = ServeConfig(
        root=tmp_path / "root", port=0, metrics_port=None, shm_root=None, fsync=False,
        write_nice=0, grace_seconds=LIMIT, upload_timeout_seconds=LIMIT, **config,
    )  # fmt: skip
    server = Server(serve, store=store, formats=[fmt], auth=ServerAuth())
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    up = Served(server, store, fmt, channel, Stub(channel))
    try:
        yield up
    finally:
        store.release_all()
        fmt.release_all()
        for close in up.closers:
            close()
        channel.close()
        if not server.wait(0):
            server.stop(grace=LIMIT)
