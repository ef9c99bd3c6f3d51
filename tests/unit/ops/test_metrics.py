"""Prometheus metrics read back from a fresh registry, and the /metrics endpoint."""

from __future__ import annotations

import re
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, start_http_server

from checkpointd.metrics import KINDS, OUTCOMES, PHASES, PREEMPTION_OUTCOMES, Metrics

# Upper bound on an HTTP round trip to the local endpoint; reached only on failure.
LIMIT = 5.0


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> Metrics:
    return Metrics(registry)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_every_kind_and_outcome_series_exists_at_zero(registry: CollectorRegistry, metrics: Metrics) -> None:
    for kind in KINDS:
        for outcome in OUTCOMES:
            assert sample(registry, "checkpointd_saves_total", kind=kind, outcome=outcome) == 0
        assert sample(registry, "checkpointd_saves_skipped_total", kind=kind) == 0
        assert sample(registry, "checkpointd_written_bytes_total", kind=kind) == 0
        assert sample(registry, "checkpointd_save_duration_seconds_count", kind=kind) == 0
        assert sample(registry, "checkpointd_save_duration_seconds_sum", kind=kind) == 0
    assert sample(registry, "checkpointd_saves_in_flight") == 0


def test_a_known_sequence_gives_exact_values(registry: CollectorRegistry, metrics: Metrics) -> None:
    metrics.in_flight_changed(+1)
    metrics.save_skipped("r1", "saved_model")
    metrics.save_skipped("r1", "saved_model")
    metrics.save_skipped("r1", "checkpoint")
    metrics.in_flight_changed(+1)
    metrics.save_written("r1", "saved_model", 1000, 0.5, 1_700_000_000.0)
    metrics.in_flight_changed(-1)
    metrics.save_written("r2", "checkpoint", 24, 0.25, 1_700_000_100.0)
    metrics.save_written("r1", "saved_model", 500, 1.5, 1_700_000_200.0)
    metrics.save_failed("r2", "checkpoint", 2.0)

    def saves(kind: str, outcome: str) -> float | None:
        return sample(registry, "checkpointd_saves_total", kind=kind, outcome=outcome)

    assert saves("saved_model", "ok") == 2
    assert saves("saved_model", "skipped") == 2
    assert saves("saved_model", "failed") == 0
    assert saves("checkpoint", "ok") == 1
    assert saves("checkpoint", "skipped") == 1
    assert saves("checkpoint", "failed") == 1
    assert sample(registry, "checkpointd_saves_skipped_total", kind="saved_model") == 2
    assert sample(registry, "checkpointd_saves_skipped_total", kind="checkpoint") == 1
    assert sample(registry, "checkpointd_saves_in_flight") == 1
    assert sample(registry, "checkpointd_written_bytes_total", kind="saved_model") == 1500
    assert sample(registry, "checkpointd_written_bytes_total", kind="checkpoint") == 24
    # Failed saves are timed too: that is how slow failures show.
    assert sample(registry, "checkpointd_save_duration_seconds_count", kind="saved_model") == 2
    assert sample(registry, "checkpointd_save_duration_seconds_sum", kind="saved_model") == 2.0
    assert sample(registry, "checkpointd_save_duration_seconds_count", kind="checkpoint") == 2
    assert sample(registry, "checkpointd_save_duration_seconds_sum", kind="checkpoint") == 2.25
    assert sample(registry, "checkpointd_save_duration_seconds_bucket", kind="checkpoint", le="0.25") == 1
    last_success = "checkpointd_last_success_timestamp_seconds"
    assert sample(registry, last_success, run="r1") == 1_700_000_200.0
    # r2's later failure does not move its last success.
    assert sample(registry, last_success, run="r2") == 1_700_000_100.0
    assert sample(registry, last_success, run="r3") is None


def test_a_cancelled_save_is_counted_as_cancelled_and_never_as_failed(
    registry: CollectorRegistry, metrics: Metrics
) -> None:
    metrics.save_cancelled("r1", "training_checkpoint", 0.5)
    assert sample(registry, "checkpointd_saves_total", kind="training_checkpoint", outcome="cancelled") == 1
    assert sample(registry, "checkpointd_saves_total", kind="training_checkpoint", outcome="failed") == 0
    assert sample(registry, "checkpointd_last_success_timestamp_seconds", run="r1") is None


def test_run_count_gauge_reads_its_source_at_scrape(registry: CollectorRegistry, metrics: Metrics) -> None:
    runs = ["a", "b", "c"]
    metrics.runs.set_function(lambda: len(runs))
    assert sample(registry, "checkpointd_runs") == 3
    runs.append("d")
    assert sample(registry, "checkpointd_runs") == 4


def test_two_metrics_on_two_registries_are_independent() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    a, _ = Metrics(first), Metrics(second)

    a.save_skipped("r", "checkpoint")

    assert sample(first, "checkpointd_saves_skipped_total", kind="checkpoint") == 1
    assert sample(second, "checkpointd_saves_skipped_total", kind="checkpoint") == 0


def test_labels_are_bounded(registry: CollectorRegistry, metrics: Metrics) -> None:
    metrics.save_written("r1", "saved_model", 1, 0.1, 1.0)

    for family in registry.collect():
        for s in family.samples:
            assert set(s.labels) <= {"kind", "outcome", "run", "phase", "transport", "route", "le"}, (
                s.name, s.labels,
            )  # fmt: skip


def test_incremental_saves_are_counted_by_route_and_unknown_routes_refused(
    registry: CollectorRegistry, metrics: Metrics
) -> None:
    metrics.incremental_path("training_checkpoint", "receive")
    metrics.incremental_path("training_checkpoint", "receive")
    metrics.incremental_path("training_checkpoint", "clone")
    assert sample(registry, "checkpointd_incremental_path_total", kind="training_checkpoint", route="receive") == 2
    assert sample(registry, "checkpointd_incremental_path_total", kind="training_checkpoint", route="clone") == 1
    assert sample(registry, "checkpointd_incremental_path_total", kind="saved_model", route="copy") == 0
    with pytest.raises(ValueError, match="unknown incremental path"):
        metrics.incremental_path("saved_model", "/tmp/x")


def test_snapshots_are_counted_by_transport_and_unknown_transports_refused(
    registry: CollectorRegistry, metrics: Metrics
) -> None:
    metrics.snapshot_received("saved_model", "shm")
    metrics.snapshot_received("saved_model", "shm")
    metrics.snapshot_received("checkpoint", "grpc")

    def count(kind: str, transport: str) -> float | None:
        return registry.get_sample_value("checkpointd_snapshots_received_total", {"kind": kind, "transport": transport})

    assert (count("saved_model", "shm"), count("saved_model", "grpc")) == (2, 0)
    assert (count("checkpoint", "shm"), count("checkpoint", "grpc")) == (0, 1)
    with pytest.raises(ValueError, match="unknown transport"):
        metrics.snapshot_received("saved_model", "carrier-pigeon")


@pytest.fixture
def endpoint(registry: CollectorRegistry, metrics: Metrics) -> Iterator[str]:
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)  # as server.py does
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(LIMIT)


def test_serve_metrics_on_port_zero_serves_the_registry(endpoint: str, metrics: Metrics) -> None:
    metrics.save_written("r1", "saved_model", 1234, 0.5, 1_700_000_000.0)

    with urllib.request.urlopen(endpoint, timeout=LIMIT) as response:
        assert response.status == 200
        body = response.read().decode()

    for name in (
        "checkpointd_saves_total",
        "checkpointd_saves_skipped_total",
        "checkpointd_saves_in_flight",
        "checkpointd_written_bytes_total",
        "checkpointd_save_duration_seconds_count",
        "checkpointd_save_duration_seconds_sum",
        "checkpointd_last_success_timestamp_seconds",
    ):
        assert name in body
    assert 'checkpointd_written_bytes_total{kind="saved_model"} 1234.0' in body
    assert 'checkpointd_saves_total{kind="saved_model",outcome="ok"} 1.0' in body


def test_declared_prometheus_client_floor_returns_server_and_thread() -> None:
    pyproject = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    floors = [
        tuple(int(part) for part in match.group(1).split("."))
        for requirements in extras.values()
        for requirement in requirements
        if (match := re.fullmatch(r"prometheus[-_]client\s*>=\s*([0-9.]+).*", requirement))
    ]

    assert floors, "prometheus-client is not declared with a >= floor"
    assert all(floor >= (0, 20) for floor in floors)


def test_every_kind_and_phase_series_exists_at_zero(registry: CollectorRegistry, metrics: Metrics) -> None:
    for kind in KINDS:
        for phase in PHASES:
            labels = {"kind": kind, "phase": phase}
            assert sample(registry, "checkpointd_save_phase_duration_seconds_count", **labels) == 0


def test_observe_phase_times_one_phase_and_refuses_unknown_ones(registry: CollectorRegistry, metrics: Metrics) -> None:
    metrics.observe_phase("checkpoint", "write", 0.2)
    metrics.observe_phase("checkpoint", "write", 0.3)

    name = "checkpointd_save_phase_duration_seconds"
    assert sample(registry, f"{name}_count", kind="checkpoint", phase="write") == 2
    assert sample(registry, f"{name}_sum", kind="checkpoint", phase="write") == 0.5
    assert sample(registry, f"{name}_count", kind="checkpoint", phase="queue") == 0
    with pytest.raises(ValueError, match="unknown save phase"):
        metrics.observe_phase("checkpoint", "step_42", 1.0)


def test_closing_a_run_drops_its_last_success_series(registry: CollectorRegistry, metrics: Metrics) -> None:
    metrics.save_written("done", "checkpoint", 10, 0.1, 1_700_000_000.0)
    metrics.save_written("live", "checkpoint", 10, 0.1, 1_700_000_001.0)
    metrics.run_closed("done")
    metrics.run_closed("never-saved")  # no series: nothing to drop, no error
    assert sample(registry, "checkpointd_last_success_timestamp_seconds", run="done") is None
    assert sample(registry, "checkpointd_last_success_timestamp_seconds", run="live") == 1_700_000_001.0


def test_store_uploads_are_the_upload_phase_and_their_bytes(registry: CollectorRegistry, metrics: Metrics) -> None:
    for kind in KINDS:
        assert sample(registry, "checkpointd_store_uploaded_bytes_total", kind=kind) == 0
    metrics.store_uploaded("saved_model", 0.25, 1000)
    metrics.store_uploaded("saved_model", 0.5, 24)
    name = "checkpointd_save_phase_duration_seconds"
    assert sample(registry, f"{name}_count", kind="saved_model", phase="upload") == 2
    assert sample(registry, f"{name}_sum", kind="saved_model", phase="upload") == 0.75
    assert sample(registry, f"{name}_count", kind="saved_model", phase="write") == 0
    assert sample(registry, "checkpointd_store_uploaded_bytes_total", kind="saved_model") == 1024
    assert sample(registry, "checkpointd_store_uploaded_bytes_total", kind="checkpoint") == 0


def test_leases_held_and_lost_are_counted(registry: CollectorRegistry, metrics: Metrics) -> None:
    assert sample(registry, "checkpointd_leases_held") == 0
    assert sample(registry, "checkpointd_leases_lost_total") == 0
    metrics.leases_held(3)
    metrics.leases_held(2)
    metrics.lease_lost("r")
    assert sample(registry, "checkpointd_leases_held") == 2
    assert sample(registry, "checkpointd_leases_lost_total") == 1


def test_payload_bytes_received_and_copied_are_counted_by_kind(registry: CollectorRegistry, metrics: Metrics) -> None:
    for kind in KINDS:
        assert sample(registry, "checkpointd_payload_received_bytes_total", kind=kind) == 0
        assert sample(registry, "checkpointd_payload_copied_bytes_total", kind=kind) == 0
    metrics.payload_bytes("training_checkpoint", 100, 900)
    metrics.payload_bytes("training_checkpoint", 1000, 0)
    assert sample(registry, "checkpointd_payload_received_bytes_total", kind="training_checkpoint") == 1100
    assert sample(registry, "checkpointd_payload_copied_bytes_total", kind="training_checkpoint") == 900
    assert sample(registry, "checkpointd_payload_copied_bytes_total", kind="saved_model") == 0


def test_saves_on_notice_are_counted_by_outcome_and_timed_from_notice_to_durable(
    registry: CollectorRegistry, metrics: Metrics
) -> None:
    for outcome in PREEMPTION_OUTCOMES:
        assert sample(registry, "checkpointd_preemption_saves_total", outcome=outcome) == 0
    metrics.preemption_save("ok", 0.3)
    metrics.preemption_save("ok", None)  # the trainer did not say when its notice came
    metrics.preemption_save("failed", None)

    assert sample(registry, "checkpointd_preemption_saves_total", outcome="ok") == 2
    assert sample(registry, "checkpointd_preemption_saves_total", outcome="failed") == 1
    assert sample(registry, "checkpointd_preemption_notice_to_durable_seconds_count") == 1
    assert sample(registry, "checkpointd_preemption_notice_to_durable_seconds_bucket", le="0.5") == 1
    assert sample(registry, "checkpointd_preemption_notice_to_durable_seconds_bucket", le="0.25") == 0
    with pytest.raises(ValueError, match="unknown outcome 'skipped'"):
        metrics.preemption_save("skipped", None)  # a save on notice is never skipped
