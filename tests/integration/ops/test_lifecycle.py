"""The daemon's lifecycle and CLI against real `checkpointd` processes.

Startup (port file, log line, health, reflection), SIGTERM with a save in
flight, the ops commands (`status`, `flush`, `close`) against a live daemon,
the per-save log lines, and recovery of interrupted publications on restart.
A save is held in flight by a raw Save stream that has its accept but has not
sent its chunks; the test releases it when it chooses.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client import (
    CheckpointdError,
    RemotePolicySaver,
    RunClosedError,
    SaveFailedError,
    UnavailableError,
    snapshot,
)
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon
from tests.integration.support.disk import read_only
from tests.integration.support.raw import HeldSave, Stub, run_status, saver_header

RPC_TIMEOUT = 30.0
EXIT_TIMEOUT = 30.0
SERVICE = "checkpointd.v1.CheckpointService"
CHECKPOINTD = str(Path(sys.executable).with_name("checkpointd"))


# Helpers: savers, held saves, the CLI.


class Saver:
    """A RemotePolicySaver on a fresh small policy, its train_step, and the saves it holds."""

    def __init__(self, daemon: Daemon, run: str) -> None:
        self.daemon = daemon
        self.train_step = tf.Variable(0, dtype=tf.int64)
        self.remote = RemotePolicySaver(
            policies.build(policies.q()),
            daemon.address,
            run=run,
            train_step=self.train_step,
            timeout=RPC_TIMEOUT,
        )
        self.remote.register()
        self._held: list[HeldSave] = []

    def hold(self, kind: int, export_dir: str) -> HeldSave:
        held = HeldSave(self.daemon, self.remote, self.train_step, export_dir, kind=kind, chunk_bytes=1 << 20)
        self._held.append(held)
        return held

    def close(self) -> None:
        for held in self._held:
            held.close()
        with contextlib.suppress(CheckpointdError):
            self.remote.close(timeout=5)


@pytest.fixture
def saver() -> Iterator[Callable[[Daemon, str], Saver]]:
    """Makes Savers; closes them and their held saves at teardown, even after a failed assert."""
    made: list[Saver] = []

    def make(daemon: Daemon, run: str) -> Saver:
        made.append(Saver(daemon, run))
        return made[-1]

    yield make
    for s in made:
        s.close()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Runs the `checkpointd` entry point; bounded."""
    return subprocess.run([CHECKPOINTD, *args], capture_output=True, text=True, timeout=RPC_TIMEOUT, check=False)


def raw_save_code(daemon: Daemon, saver: Saver, export_dir: str) -> grpc.StatusCode:
    """Status code of a raw save the daemon must refuse before its decision."""
    header, _ = saver_header(saver.remote, saver.train_step, export_dir)
    with daemon.channel() as channel, pytest.raises(grpc.RpcError) as caught:
        for _ in Stub(channel).Save(iter([pb.SaveRequest(header=header)]), timeout=RPC_TIMEOUT):
            pass
    return caught.value.code()


def tree_digest(root: Path) -> dict[str, str]:
    """Relative path -> SHA-256 of every file under `root`."""
    return {
        str(Path(d, f).relative_to(root)): hashlib.sha256(Path(d, f).read_bytes()).hexdigest()
        for d, _, files in os.walk(root)
        for f in files
    }


def assert_holds_snapshot(export_dir: Path, snap: snapshot.Snapshot) -> None:
    """The SavedModel loads, and its checkpoint holds exactly the snapshot's values."""
    loaded = tf.saved_model.load(str(export_dir))
    assert int(loaded.get_train_step().numpy()) == snap.step
    reader = tf.train.load_checkpoint(str(export_dir / "variables" / "variables"))
    for key, array in zip(snap.keys, snap.arrays, strict=True):
        np.testing.assert_array_equal(reader.get_tensor(key), array)


# Startup: port file, log line, health, reflection.


def test_serve_writes_the_bound_port_to_its_port_file_and_logs_it(daemon: Daemon) -> None:
    # The fixture ran `checkpointd serve --port 0 --port-file <work>/port`.
    port_file = daemon.log_path.with_name("port")
    assert port_file.read_text() == f"{daemon.port}\n"
    assert daemon.port != 0
    assert re.search(rf"listening on port {daemon.port}\b", daemon.log())
    with grpc.insecure_channel(f"127.0.0.1:{int(port_file.read_text())}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_health_is_serving_for_the_server_and_the_service(daemon: Daemon) -> None:
    with grpc.insecure_channel(daemon.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as caught:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=RPC_TIMEOUT)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_the_service(daemon: Daemon) -> None:
    with grpc.insecure_channel(daemon.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE),
        ]
        listed, described = stub.ServerReflectionInfo(iter(requests), timeout=RPC_TIMEOUT)
    services = {s.name for s in listed.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= services
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in described.file_descriptor_response.file_descriptor_proto
    ]
    (proto,) = [f for f in files if f.package == "checkpointd.v1"]
    (service,) = proto.service
    assert {m.name for m in service.method} == {
        "RegisterRun",
        "Save",
        "Flush",
        "CloseRun",
        "GetStatus",
        "GetLatest",
        "Restore",
        "RestoreFiles",
        "WatchStandby",
    }


# Shutdown without a notice window: SIGTERM drains the save in flight, refuses new ones, exits 0.


def test_sigterm_without_a_notice_window_refuses_new_saves_finishes_the_accepted_one_and_exits_zero(
    fresh_daemon, saver
) -> None:
    daemon = fresh_daemon("--notice-window", "0")  # test_notice.py has the window
    s = saver(daemon, "drain")
    s.train_step.assign(42)
    held = s.hold(pb.SAVED_MODEL, "accepted-before-sigterm")

    with grpc.insecure_channel(daemon.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=RPC_TIMEOUT
        )
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        daemon.proc.send_signal(signal.SIGTERM)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()

    # From NOT_SERVING on, every new save is refused as "retry later".
    assert run_status(daemon, "drain").in_flight.export_dir == "accepted-before-sigterm"
    with pytest.raises(UnavailableError):
        s.remote.save("after-sigterm").result(60)  # a non-blocking save: its ticket fails
    with pytest.raises(UnavailableError):
        s.remote.save_checkpoint("after-sigterm-blocking", blocking=True)
    assert raw_save_code(daemon, s, "after-sigterm-raw") == grpc.StatusCode.UNAVAILABLE
    assert daemon.proc.poll() is None  # still draining: the accepted save holds it

    result = held.release()
    assert daemon.proc.wait(EXIT_TIMEOUT) == 0
    assert result.path == str(daemon.root / "drain" / "accepted-before-sigterm")
    assert result.step == 42
    assert_holds_snapshot(Path(result.path), held.snapshot)
    assert sorted(p.name for p in (daemon.root / "drain").iterdir()) == ["accepted-before-sigterm"]
    assert "drained in" in daemon.log()


# A second signal during the drain stops at once; a burst never hangs the daemon.


def _draining(daemon: Daemon) -> None:
    """Waits until the daemon has taken the first signal (health says NOT_SERVING)."""
    with grpc.insecure_channel(daemon.address) as channel:
        for reply in health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=RPC_TIMEOUT
        ):
            if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                return


def _assert_stopped_now(daemon: Daemon, shm: Path, run: str, export_dir: str) -> None:
    # Exit 1: a save was abandoned. Bounded: the hang this guards against never exits.
    assert daemon.proc.wait(EXIT_TIMEOUT) == 1
    log = daemon.log()
    assert re.search(
        rf"again: stopping now, abandoning 1 unfinished saves: run={run} kind=saved_model "
        rf"export_dir={export_dir} step=\d+",
        log,
    ), log
    assert "Traceback" not in log
    assert list(shm.iterdir()) == []  # the shared-memory folder went with it
    assert not (daemon.root / run / export_dir).exists()  # abandoned, not torn


@pytest.mark.parametrize("round_", range(3))
def test_a_burst_of_sigterms_during_a_drain_stops_at_once_and_never_hangs(
    fresh_daemon, saver, tmp_path: Path, round_: int
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    daemon = fresh_daemon("--shm-dir", str(shm))
    s = saver(daemon, "burst")
    s.hold(pb.SAVED_MODEL, "held")  # accepted; its upload never comes
    daemon.proc.send_signal(signal.SIGTERM)
    _draining(daemon)
    for _ in range(20):  # what an impatient operator or a supervisor sends
        daemon.proc.send_signal(signal.SIGTERM)
    _assert_stopped_now(daemon, shm, "burst", "held")


def test_signals_arriving_all_at_once_drain_then_stop_at_once(fresh_daemon, saver, tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    daemon = fresh_daemon("--shm-dir", str(shm))
    s = saver(daemon, "at-once")
    s.hold(pb.SAVED_MODEL, "held")
    for sig in [signal.SIGTERM, signal.SIGINT] * 25:  # the first drains, the next stops now
        daemon.proc.send_signal(sig)
    _assert_stopped_now(daemon, shm, "at-once", "held")


def test_sigint_during_a_sigterm_drain_stops_at_once_and_the_next_start_recovers(
    fresh_daemon, saver, tmp_path: Path
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    daemon = fresh_daemon("--shm-dir", str(shm))
    s = saver(daemon, "ctrl-c")
    s.remote.save("before", blocking=True)
    held = s.hold(pb.SAVED_MODEL, "held")
    held.send_chunks(held.chunks()[:1])  # part of the upload arrived: a slow trainer
    daemon.proc.send_signal(signal.SIGTERM)
    _draining(daemon)
    assert daemon.proc.poll() is None  # the first signal only drains
    daemon.proc.send_signal(signal.SIGINT)
    _assert_stopped_now(daemon, shm, "ctrl-c", "held")

    again = fresh_daemon()  # the same root: what was cut off is cleaned, what was saved is whole
    assert sorted(p.name for p in (again.root / "ctrl-c").iterdir()) == ["before"]
    assert (again.root / "ctrl-c" / "before" / "saved_model.pb").is_file()


def test_a_second_signal_after_an_idle_drain_exits_zero(fresh_daemon) -> None:
    daemon = fresh_daemon()
    for _ in range(10):
        daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(EXIT_TIMEOUT) == 0  # nothing was abandoned, however it ended
    assert "Traceback" not in daemon.log()


# Start-up refusals: exit 2, one line that says what to fix, nothing left behind.


def serve_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Runs `checkpointd serve` that must refuse to start; bounded."""
    return subprocess.run(
        [CHECKPOINTD, "serve", *args],
        capture_output=True, text=True, timeout=EXIT_TIMEOUT + RPC_TIMEOUT, check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )  # fmt: skip


def _assert_cannot_start(done: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "cannot start:" in line]
    for needle in needles:
        assert needle in line, line
    assert "listening" not in done.stderr
    return line


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another process (here: a listening socket) holds."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.mark.parametrize("which", ["--port", "--metrics-port"])
def test_a_busy_port_is_cannot_start_exit_2_and_leaves_no_shared_memory(
    tmp_path: Path, busy_port: int, which: str
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    ports = {"--port": "0", "--metrics-port": "0", which: str(busy_port)}
    done = serve_cli("--root", str(tmp_path / "root"), "--shm-dir", str(shm), *[x for kv in ports.items() for x in kv])
    what = "gRPC" if which == "--port" else "/metrics"
    _assert_cannot_start(
        done, f"cannot bind {what} to 127.0.0.1:{busy_port}", "Address already in use", f"another {which}"
    )
    assert list(shm.iterdir()) == []  # start() made a folder there, and removed it


def test_an_unresolvable_host_is_cannot_start_exit_2(tmp_path: Path) -> None:
    done = serve_cli(
        "--root", str(tmp_path / "root"), "--host", "no-such-host.invalid", "--insecure", "--port", "0",
        "--metrics-port", "-1", "--no-shm",
    )  # fmt: skip
    _assert_cannot_start(done, "cannot resolve --host 'no-such-host.invalid'")


def test_a_root_that_is_a_regular_file_is_cannot_start_exit_2(tmp_path: Path) -> None:
    root = tmp_path / "afile"
    root.write_text("not a dir")
    done = serve_cli("--root", str(root), "--port", "0", "--metrics-port", "-1", "--no-shm")
    _assert_cannot_start(done, f"the root (--root) {root} is not a directory", "must be a directory")


@pytest.mark.parametrize("which", ["root", "state dir"])
def test_an_unwritable_root_or_state_dir_is_cannot_start_exit_2_with_the_os_reason(tmp_path: Path, which: str) -> None:
    root = tmp_path / "root"
    unwritable = root if which == "root" else root / ".checkpointd"
    unwritable.mkdir(parents=True)
    with read_only(unwritable) as reason:
        done = serve_cli("--root", str(root), "--port", "0", "--metrics-port", "-1", "--no-shm")
    what = "the root (--root)" if which == "root" else "the daemon's state dir"
    _assert_cannot_start(done, f"{what} {unwritable} is not a writable directory: {reason}")


def test_with_only_the_client_extra_serve_says_to_install_the_daemon_extra(tmp_path: Path) -> None:
    # As if grpcio-health-checking were not installed: importing it fails.
    script = (
        "import sys; sys.modules['grpc_health'] = None\n"
        "from checkpointd.cli import main\n"
        f"sys.exit(main(['serve', '--root', {str(tmp_path / 'root')!r}, '--port', '0']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=RPC_TIMEOUT, check=False
    )
    _assert_cannot_start(done, "needs grpc_health", "pip install 'checkpointd[daemon]'")
    assert not (tmp_path / "root").exists()


# The ops CLI against a live daemon.


def test_cli_status_prints_a_table_and_json_with_the_run(daemon: Daemon, saver) -> None:
    s = saver(daemon, "cli-status")
    s.remote.save("sm", blocking=True)
    s.remote.save_checkpoint("ck", blocking=True)

    table = cli("status", "--address", daemon.address)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:2] == ["RUN", "STATE"]
    (row,) = [line.split() for line in lines if line.split()[:1] == ["cli-status"]]
    assert row[:6] == [
        "cli-status",
        "open",
        "-",
        "2",
        "0",
        "0",
    ]  # run, state, in flight, ok, skipped, failed

    as_json = cli("status", "--address", daemon.address, "--json")
    assert as_json.returncode == 0, as_json.stderr
    runs = {r["run"]: r for r in json.loads(as_json.stdout)["runs"]}
    status = runs["cli-status"]
    assert (int(status["saves_ok"]), int(status["saves_skipped"]), int(status["saves_failed"])) == (
        2,
        0,
        0,
    )
    assert status["state"] == "open"
    assert status["last_success"]["path"] == str(daemon.root / "cli-status" / "ck")


def test_cli_flush_exits_zero_once_every_accepted_save_is_durable(daemon: Daemon, saver) -> None:
    s = saver(daemon, "cli-flush")
    ticket = s.remote.save("policy")  # non-blocking: returns at the accept
    assert not ticket.skipped
    done = cli("flush", "--address", daemon.address)
    assert done.returncode == 0, done.stderr
    assert "every accepted save is durable" in done.stdout
    assert "cli-flush" in done.stdout
    status = run_status(daemon, "cli-flush")
    assert not status.HasField("in_flight")
    assert status.saves_ok == 1
    assert (daemon.root / "cli-flush" / "policy" / "saved_model.pb").is_file()


def test_cli_flush_with_timeout_fails_clearly_while_a_save_is_held(daemon: Daemon, saver) -> None:
    s = saver(daemon, "cli-held")
    held = s.hold(pb.CHECKPOINT, "held")
    timed_out = cli("flush", "--address", daemon.address, "--timeout", "1")
    assert timed_out.returncode == 1  # the documented "saves still busy"
    assert "DeadlineError" in timed_out.stderr
    assert "timed out" in timed_out.stderr and "cli-held" in timed_out.stderr
    assert held.release().bytes_written > 0  # the held save was not disturbed
    assert cli("flush", "--address", daemon.address, "--timeout", "10").returncode == 0


def test_cli_close_ends_the_run_and_later_saves_fail_precondition(daemon: Daemon, saver) -> None:
    s = saver(daemon, "cli-close")
    s.remote.save("before-close", blocking=True)
    closed = cli("close", "--address", daemon.address, "--run", "cli-close")
    assert closed.returncode == 0, closed.stderr
    assert "cli-close" in closed.stdout
    assert run_status(daemon, "cli-close").state == "closed"
    assert raw_save_code(daemon, s, "after-close") == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(RunClosedError):
        s.remote.save("after-close")
    assert sorted(p.name for p in (daemon.root / "cli-close").iterdir()) == ["before-close"]


def test_cli_naming_a_run_the_daemon_does_not_have_lists_the_open_ones(daemon: Daemon, saver) -> None:
    saver(daemon, "cli-known")
    for command in (["status"], ["flush"], ["close"]):
        done = cli(*command, "--address", daemon.address, "--run", "nope")
        assert done.returncode == 2, done.stderr
        assert "no run named 'nope' is open on this daemon; open runs: " in done.stderr
        assert "cli-known" in done.stderr
        assert "register it first" not in done.stderr and "Traceback" not in done.stderr


def test_cli_against_nothing_listening_says_cannot_reach() -> None:
    for command in (["status"], ["flush"], ["close", "--run", "r"]):
        unreachable = cli(*command, "--address", "127.0.0.1:1")
        assert unreachable.returncode == 2  # the documented "no daemon answered"
        assert "cannot reach" in unreachable.stderr, unreachable.stderr
        assert "Traceback" not in unreachable.stderr


# The daemon's log: one line per save outcome.


_OUTCOME = re.compile(
    r"(?P<outcome>saved|skipped|failed) run=(?P<run>\S+) kind=(?P<kind>\w+) "
    r"export_dir=(?P<export_dir>\S+) step=(?P<step>-?\d+)"
    r"(?: bytes=(?P<bytes>\d+))?(?: duration=(?P<duration>[0-9.]+)s)?"
)


def test_daemon_logs_one_line_per_save_outcome(daemon: Daemon, saver) -> None:
    run = "logged"
    s = saver(daemon, run)
    s.train_step.assign(11)
    ok_sm = s.remote.save("sm", blocking=True).result()
    s.train_step.assign(12)
    ok_ck = s.remote.save_checkpoint("ck", blocking=True).result()
    s.train_step.assign(13)
    held = s.hold(pb.CHECKPOINT, "held")
    s.train_step.assign(14)
    assert s.remote.save("skipped").skipped
    ok_held = held.release()
    (daemon.root / run / "blocker").write_text("a regular file where the export dir would go")
    s.train_step.assign(15)
    with pytest.raises(SaveFailedError):
        s.remote.save("blocker", blocking=True)

    # Each outcome is logged before the daemon answers, so the log is complete now.
    lines = [m.groupdict() for m in map(_OUTCOME.search, daemon.log().splitlines()) if m and m["run"] == run]
    by_dir = {line["export_dir"]: line for line in lines}
    assert len(lines) == len(by_dir) == 5, lines  # one line per save, none twice
    expected = {
        "sm": ("saved", "saved_model", 11, ok_sm.bytes_written),
        "ck": ("saved", "checkpoint", 12, ok_ck.bytes_written),
        "held": ("saved", "checkpoint", 13, ok_held.bytes_written),
        "skipped": ("skipped", "saved_model", 14, None),
        "blocker": ("failed", "saved_model", 15, None),
    }
    for export_dir, (outcome, kind, step, nbytes) in expected.items():
        line = by_dir[export_dir]
        assert (line["outcome"], line["kind"], int(line["step"])) == (outcome, kind, step), line
        if outcome == "saved":
            assert int(line["bytes"]) == nbytes
        if outcome != "skipped":
            assert line["duration"] is not None, line


# Restart: interrupted publications are repaired before serving.


def test_restart_cleans_temp_dirs_and_restores_a_parked_old_tree(fresh_daemon, saver) -> None:
    first = fresh_daemon()
    s = saver(first, "recover")
    s.remote.save("policy", blocking=True)
    s.remote.save("other", blocking=True)
    s.remote.close()
    assert first.terminate(EXIT_TIMEOUT) == 0

    run_dir = first.root / "recover"
    policy = tree_digest(run_dir / "policy")
    other = tree_digest(run_dir / "other")
    hex16 = "0123456789abcdef"
    # A crash between publish_dir's two renames: the old tree parked, its name free.
    (run_dir / "policy").rename(run_dir / f".checkpointd-old-policy-{hex16}")
    # A parked tree whose name was taken by the new one: stale.
    (run_dir / f".checkpointd-old-other-{hex16}").mkdir()
    # Unfinished writes, at several depths.
    temps = [
        run_dir / f".checkpointd-tmp-policy-{hex16}",
        run_dir / "nested" / f".checkpointd-tmp-deep-{hex16}",
        first.root / f".checkpointd-tmp-top-{hex16}",
    ]
    for tmp in temps:
        (tmp / "variables").mkdir(parents=True)
        (tmp / "variables" / "variables.index").write_bytes(b"half-written")
    # Names recovery must not touch: not its pattern (no 16-hex suffix), or a user's.
    untouched = [run_dir / ".checkpointd-old-policy-nothex", run_dir / "user-dir"]
    for path in untouched:
        path.mkdir()

    second = fresh_daemon()  # the same root
    assert second.root == first.root
    assert tree_digest(run_dir / "policy") == policy
    assert tree_digest(run_dir / "other") == other
    assert not list(run_dir.glob(f".checkpointd-old-*-{hex16}"))
    assert not [t for t in temps if t.exists()]
    assert all(path.is_dir() for path in untouched)
    assert (run_dir / "nested").is_dir()  # only the temp dir inside it went
    assert re.search(r"recovered 5 interrupted save dirs", second.log())
    loaded = tf.saved_model.load(str(run_dir / "policy"))
    assert int(loaded.get_train_step().numpy()) == 0


# Writing at a lower priority than training.


def _thread_nice_values(pid: int) -> dict[int, int]:
    """tid -> nice of every thread of `pid` (field 19 of /proc/<pid>/task/<tid>/stat)."""
    values = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:
            continue  # the thread ended while we looked
        values[int(task.name)] = int(stat.rsplit(")", 1)[1].split()[16])
    return values


@pytest.mark.parametrize("nice", [10, 0])
def test_saves_are_written_by_threads_at_write_nice(fresh_daemon: Callable[..., Daemon], nice: int) -> None:
    daemon = fresh_daemon("--write-nice", str(nice))
    policy = policies.build(policies.q())
    with RemotePolicySaver(policy, daemon.address, run="nice", timeout=60) as saver:
        assert saver.save("s", blocking=True).result(60) is not None
        values = _thread_nice_values(daemon.proc.pid)

    assert values[daemon.proc.pid] == 0  # the main thread, and the gRPC threads, keep theirs
    # The writer and fsync threads that ran the save (and only they) are at `nice`.
    assert set(values.values()) == ({0, nice} if nice else {0}), values
