"""The tier never loads TensorFlow: proved in a fresh interpreter, whatever else this session imported.

The autouse guard in conftest.py checks after each test, but only when
TensorFlow was not loaded before it (a whole-suite run collects the
integration tier, which imports it). Here a child process serves a Server
with the fakes, registers a run, saves, restores and stops, then reports
which of TensorFlow's modules it loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.component.fakes import LIMIT

_REPO = Path(__file__).resolve().parents[2]

_CHILD = """
import json, sys, tempfile
from pathlib import Path

from checkpointd.core.config import ServeConfig
from checkpointd.rpc.auth import ServerAuth
from checkpointd.server import Server
from checkpointd.v1 import checkpointd_pb2 as pb
import grpc

from tests.component.conftest import snapshot
from tests.component.fakes import FakeFormat, FakeStore
from tests.component.raw import Stub, register, save_header, save_requests

root = Path(tempfile.mkdtemp())
store = FakeStore(root / "staging")
config = ServeConfig(
    root=root / "root", port=0, metrics_port=None, shm_root=None, fsync=False, write_nice=0, notice_window_seconds=0
)
server = Server(config, store=store, formats=[FakeFormat(store.files)], auth=ServerAuth())
server.start()
try:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = Stub(channel)
        register(stub, "run1")
        answers = list(stub.Save(save_requests(save_header("run1", "one"), snapshot(1)), timeout=10))
        assert answers[-1].WhichOneof("item") == "result", answers
        assert len(list(stub.Restore(pb.RestoreRequest(run="run1"), timeout=10))) > 1
finally:
    server.stop(grace=10)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "tf_agents"))))
"""


def test_serving_with_the_fakes_never_imports_tensorflow() -> None:
    child = subprocess.run(
        [sys.executable, "-c", _CHILD],
        cwd=_REPO,
        capture_output=True,
        text=True,
        timeout=3 * LIMIT,
        check=False,
    )

    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout.splitlines()[-1]) == []
