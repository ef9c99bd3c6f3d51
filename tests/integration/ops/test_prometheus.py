"""Prometheus against the real daemon: promtool accepts our files and the
daemon's output, and a real Prometheus scraping a real daemon sees exactly the
saves that happened and fires the alerts it should.

The scenario (one daemon, one Prometheus, scrape and rule evaluation every
second) drives saves of one run through RemotePolicySaver:
- `first` (SavedModel) and `ckpt` (checkpoint), both blocking: ok;
- a raw Save stream holds the lane (accepted, chunks not sent yet);
- `skipped`, non-blocking, while the lane is held: skipped;
- `queued`, blocking, waits behind the held save (its queue phase);
- Prometheus shows the held save in flight; then the held stream sends its
  chunks: ok; then `queued` is written: ok;
- `blocker`, blocking, into a path that is a regular file: failed.
So for saved_model: 3 ok, 1 skipped, 1 failed, 4 timed saves; for checkpoint: 1 ok.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tensorflow as tf
import yaml

from checkpointd.metrics import PHASES
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client import CheckpointdError, RemotePolicySaver, SaveFailedError, SaveResult
from tests.integration.support import policies
from tests.integration.support.daemon import Daemon, wait_until
from tests.integration.support.raw import HeldSave, run_status

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
# Both come from one package; skip before any daemon starts if either is missing.
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="prometheus/promtool not installed (scripts/test.sh installs Debian's `prometheus` package)",
)

FILES = Path(__file__).resolve().parents[3] / "docker" / "prometheus"
RUN = "prom"
JOB = 'job="checkpointd"'
# Upper bounds, reached only on failure: Prometheus scrapes and evaluates every second.
START_TIMEOUT = 30.0
QUERY_TIMEOUT = 30.0
RPC_TIMEOUT = 60.0
POLL = 0.1


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, text=True, timeout=60, cwd=FILES)


def _ok(done: subprocess.CompletedProcess[str]) -> str:
    output = f"$ {' '.join(done.args)}\n{done.stdout}{done.stderr}"
    assert done.returncode == 0, output
    return output


# promtool on the files in docker/prometheus.


def test_prometheus_config_is_valid() -> None:
    assert "1 rule files found" in _ok(promtool("check", "config", "prometheus.yml"))


def test_alert_rules_are_valid() -> None:
    assert "6 rules found" in _ok(promtool("check", "rules", "alerts.yml"))


def test_alert_rule_unit_tests_pass() -> None:
    assert "SUCCESS" in _ok(promtool("test", "rules", "alerts_test.yml"))


# A real Prometheus process.


def _series(name: str, **labels: str) -> str:
    matchers = [JOB, *(f'{key}="{value}"' for key, value in labels.items())]
    return f"{name}{{{','.join(matchers)}}}"


@dataclass
class Prometheus:
    proc: subprocess.Popen
    url: str
    log_path: Path

    def get(self, path: str, **params: str) -> object:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:  # 4xx: a bad query; the body says why
            body = json.load(error)
        assert body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def values(self, expr: str) -> list[float]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", data
        return [float(r["value"][1]) for r in data["result"]]

    def wait_for(self, expr: str, check: Callable[[float], bool] | float) -> float:
        """Polls `expr` until it has one value that passes `check` (or equals it)."""
        test = check if callable(check) else (lambda value: value == check)
        deadline = time.monotonic() + QUERY_TIMEOUT
        seen: list[float] = []
        while time.monotonic() < deadline:
            seen = self.values(expr)
            if len(seen) == 1 and test(seen[0]):
                return seen[0]
            time.sleep(POLL)  # polling a query for a result, with a deadline
        pytest.fail(f"{expr} was {seen} for {QUERY_TIMEOUT}s, expected {check}")

    def wait_for_alerts(self, check: Callable[[dict[str, dict]], bool]) -> dict[str, dict]:
        """Polls /api/v1/alerts until `check({name: alert})` holds."""
        deadline = time.monotonic() + QUERY_TIMEOUT
        alerts: dict[str, dict] = {}
        while time.monotonic() < deadline:
            alerts = {a["labels"]["alertname"]: a for a in self.get("/api/v1/alerts")["alerts"]}
            if check(alerts):
                return alerts
            time.sleep(POLL)  # polling for rule evaluation, with a deadline
        pytest.fail(f"alerts did not reach the expected state in {QUERY_TIMEOUT}s: {alerts}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_prometheus(workdir: Path, metrics_port: int) -> Prometheus:
    """Runs Prometheus with docker/prometheus's config, aimed at one daemon, every second."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load((FILES / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(FILES / name) for name in config["rule_files"]]
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
    (workdir / "prom.yml").write_text(yaml.safe_dump(config))
    port = _free_port()
    log_path = workdir / "prometheus.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={workdir / 'prom.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    prom = Prometheus(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as response:
                if response.status == 200:
                    return prom
        except OSError:
            pass
        if time.monotonic() > deadline:
            prom.stop()
            raise TimeoutError(f"prometheus not ready in {START_TIMEOUT}s:\n{log_path.read_text()}")
        time.sleep(POLL)  # polling readiness, with a deadline


# The scenario.


@dataclass
class Scenario:
    daemon: Daemon
    prom: Prometheus
    results: dict[str, SaveResult | pb.SaveResult]
    last_success: float
    held_lower_bound: float


@pytest.fixture(scope="module")
def scenario(daemon: Daemon, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    """Runs the module docstring's saves against the module's own daemon."""
    prom = start_prometheus(tmp_path_factory.mktemp("prometheus"), daemon.metrics_port)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    held: HeldSave | None = None
    saver: RemotePolicySaver | None = None
    try:
        prom.wait_for(f"up{{{JOB}}}", 1)
        train_step = tf.Variable(0, dtype=tf.int64)
        saver = RemotePolicySaver(policies.build(policies.q()), daemon.address, run=RUN, train_step=train_step)
        saver.register()
        results: dict[str, SaveResult | pb.SaveResult] = {}
        results["first"] = saver.save("first", blocking=True).result()
        results["ckpt"] = saver.save_checkpoint("ckpt", blocking=True).result()

        held = HeldSave(daemon, saver, train_step, "held", chunk_bytes=1 << 20)
        skipped = saver.save("skipped")
        assert skipped.skipped, "a non-blocking save while the lane was held was not skipped"
        queued = pool.submit(lambda: saver.save("queued", blocking=True).result())
        wait_until(
            lambda: run_status(daemon, RUN).in_flight.waiting == 1,
            f"1 blocking save(s) queued on {RUN}",
            RPC_TIMEOUT,
        )
        waiting_seen = time.monotonic()
        # While the lane is held, Prometheus must see the accepted save in flight.
        prom.wait_for(_series("checkpointd_saves_in_flight"), 1)
        # `queued` has waited, and `held` has been transferring, at least this long.
        held_lower_bound = time.monotonic() - waiting_seen
        results["held"] = held.release()
        results["queued"] = queued.result(RPC_TIMEOUT)

        (daemon.root / RUN / "blocker").write_text("a regular file where a save should go")
        with pytest.raises(SaveFailedError):
            saver.save("blocker", blocking=True)
        saver.flush(RPC_TIMEOUT)
        status = run_status(daemon, RUN)
        assert (status.saves_ok, status.saves_skipped, status.saves_failed) == (4, 1, 1)
        yield Scenario(daemon, prom, results, status.last_success.unix_seconds, held_lower_bound)
    finally:
        if held is not None:
            held.close()  # lets a queued save go on if the scenario failed midway
        pool.shutdown(wait=True)
        if saver is not None:
            with contextlib.suppress(CheckpointdError):  # the scenario's own error is the news
                saver.close(RPC_TIMEOUT)
        prom.stop()


@pytest.mark.parametrize(
    ("kind", "outcome", "expected"),
    [
        ("saved_model", "ok", 3),
        ("saved_model", "skipped", 1),
        ("saved_model", "failed", 1),
        ("checkpoint", "ok", 1),
        ("checkpoint", "skipped", 0),
        ("checkpoint", "failed", 0),
    ],
)
def test_prometheus_counts_every_outcome(scenario: Scenario, kind: str, outcome: str, expected: int) -> None:
    expr = _series("checkpointd_saves_total", kind=kind, outcome=outcome)
    scenario.prom.wait_for(expr, expected)


def test_prometheus_sees_the_skip_counter_and_nothing_in_flight(scenario: Scenario) -> None:
    scenario.prom.wait_for(_series("checkpointd_saves_skipped_total", kind="saved_model"), 1)
    scenario.prom.wait_for(_series("checkpointd_saves_skipped_total", kind="checkpoint"), 0)
    scenario.prom.wait_for(_series("checkpointd_saves_in_flight"), 0)


def test_prometheus_sees_every_timed_save_in_the_latency_histogram(scenario: Scenario) -> None:
    # Accepted saves are timed, failed ones too; skipped ones never started.
    name = "checkpointd_save_duration_seconds"
    scenario.prom.wait_for(_series(f"{name}_count", kind="saved_model"), 4)
    scenario.prom.wait_for(_series(f"{name}_count", kind="checkpoint"), 1)
    scenario.prom.wait_for(_series(f"{name}_bucket", kind="saved_model", le="+Inf"), 4)


def test_prometheus_sees_each_phase_of_each_accepted_save(scenario: Scenario) -> None:
    name = "checkpointd_save_phase_duration_seconds"
    for phase in PHASES:
        # "upload" is the object store's part of write: none on a local root.
        local = phase == "upload"
        scenario.prom.wait_for(_series(f"{name}_count", kind="saved_model", phase=phase), 0 if local else 4)
        scenario.prom.wait_for(_series(f"{name}_count", kind="checkpoint", phase=phase), 0 if local else 1)
    # `queued` queued, and `held` transferred, while the test watched the lane held.
    bound = scenario.held_lower_bound
    for phase in ("queue", "transfer"):
        scenario.prom.wait_for(_series(f"{name}_sum", kind="saved_model", phase=phase), lambda v: v >= bound)


def test_prometheus_sees_the_written_bytes(scenario: Scenario) -> None:
    r = scenario.results
    saved_model = r["first"].bytes_written + r["held"].bytes_written + r["queued"].bytes_written
    scenario.prom.wait_for(_series("checkpointd_written_bytes_total", kind="saved_model"), saved_model)
    scenario.prom.wait_for(_series("checkpointd_written_bytes_total", kind="checkpoint"), r["ckpt"].bytes_written)


def test_prometheus_sees_the_runs_last_success(scenario: Scenario) -> None:
    assert scenario.last_success > 0
    scenario.prom.wait_for(_series("checkpointd_last_success_timestamp_seconds", run=RUN), scenario.last_success)
    # A run that saved a moment ago is far from the 30-minute alert.
    age = scenario.prom.values(f"time() - {_series('checkpointd_last_success_timestamp_seconds', run=RUN)}")
    assert len(age) == 1 and -5 < age[0] < 300, age


def test_the_failed_save_fires_its_alert_and_nothing_else_fires(scenario: Scenario) -> None:
    alerts = scenario.prom.wait_for_alerts(lambda a: a.get("CheckpointdSaveFailed", {}).get("state") == "firing")
    failed = alerts["CheckpointdSaveFailed"]
    assert failed["labels"]["kind"] == "saved_model"
    assert "checkpointd status" in failed["annotations"]["description"]
    assert set(alerts) == {"CheckpointdSaveFailed"}, alerts
    rules = {r["name"]: r for group in scenario.prom.get("/api/v1/rules")["groups"] for r in group["rules"]}
    assert set(rules) == {
        "CheckpointdRunNotCheckpointing",
        "CheckpointdSkipRatioHigh",
        "CheckpointdSaveFailed",
        "CheckpointdDown",
        "CheckpointdLeaseLost",
        "CheckpointdPreemptionSaveFailed",
    }
    assert all(r["health"] in ("ok", "unknown") for r in rules.values()), rules


def test_every_dashboard_query_runs_and_returns_data(scenario: Scenario) -> None:
    dashboard = json.loads((FILES.parent / "grafana" / "dashboards" / "checkpointd.json").read_text())
    grafana_variables = {"$instance": ".*", "$__rate_interval": "5m"}
    # Once the failure (the scenario's last save) is scraped, every panel has data.
    scenario.prom.wait_for(_series("checkpointd_saves_total", kind="saved_model", outcome="failed"), 1)
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in grafana_variables.items():
                expr = expr.replace(variable, value)
            # The query API refuses an expression that does not parse.
            assert scenario.prom.values(expr), f"panel {panel['title']!r}: no data for {expr}"


def test_the_daemons_metrics_pass_promtool(scenario: Scenario) -> None:
    with urllib.request.urlopen(scenario.daemon.metrics_url, timeout=10) as response:
        text = response.read().decode()
    assert "checkpointd_last_success_timestamp_seconds{run=" in text  # the scenario's data is in
    _ok(promtool("check", "metrics", stdin=text))


def test_a_stopped_daemon_makes_the_down_alert_pending(fresh_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    d = fresh_daemon()
    prom = start_prometheus(tmp_path / "prometheus", d.metrics_port)
    try:
        prom.wait_for(f"up{{{JOB}}}", 1)
        assert d.terminate() == 0
        prom.wait_for(f"up{{{JOB}}}", 0)
        # `for: 1m`: pending now, firing (and paging) only if it stays down.
        prom.wait_for_alerts(lambda a: a.get("CheckpointdDown", {}).get("state") == "pending")
    finally:
        prom.stop()
