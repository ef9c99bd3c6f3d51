"""Prometheus metrics: the core's MetricsSink, backed by prometheus-client.

Names follow Prometheus practice: `checkpointd_` prefix, base units, `_total`
on counters, bounded labels (kind, outcome, run; never step or path).
Nothing is registered at import time: build `Metrics(registry)`.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from checkpointd.core.incremental_path import PATHS
from checkpointd.protocol.kinds import LABELS
from checkpointd.protocol.standby import OUTCOMES as STANDBY_OUTCOMES

_LOGGER = logging.getLogger(__name__)

KINDS = LABELS  # every kind, training_checkpoint included: series exist from the start
OUTCOMES = ("ok", "skipped", "failed", "cancelled")
# Where an accepted save's time goes: the blocking wait before the accept, the
# snapshot upload (accept -> last chunk), and writer.write; with an object
# store, "upload" is the part of write that sends the files and manifest.
PHASES = ("queue", "transfer", "write", "upload")
TRANSPORTS = ("grpc", "shm")
# From a 5k-parameter checkpoint (a few ms) to a multi-GB SavedModel (minutes).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# An accepted save on notice ends like any accepted save (never skipped).
PREEMPTION_OUTCOMES = ("ok", "failed", "cancelled")
# Notice to durable must fit a grace period: Kubernetes' default is 30 s.
NOTICE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 25, 30, 60)


class Metrics:
    """Implements `checkpointd.core.ports.MetricsSink` with Prometheus metrics."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self._children: dict[tuple[object, ...], Any] = {}  # see _child
        self.save_duration = Histogram(
            "checkpointd_save_duration_seconds",
            "Seconds from a save's accept to durable on disk (or failure), by kind.",
            ["kind"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.saves = Counter(
            "checkpointd_saves_total",
            "Save requests by kind and outcome (ok, skipped, failed, cancelled: accepted, then the caller went away).",
            ["kind", "outcome"],
            registry=registry,
        )
        self.skipped = Counter(
            "checkpointd_saves_skipped_total",
            "Non-blocking saves skipped because a save of the run was in flight.",
            ["kind"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "checkpointd_saves_in_flight",
            "Saves accepted and not yet durable or failed.",
            registry=registry,
        )
        self.written_bytes = Counter(
            "checkpointd_written_bytes",
            "Bytes of the files successful saves wrote (as their manifests list them; SaveResult.bytes_written), by kind.",
            ["kind"],
            registry=registry,
        )
        self.last_success = Gauge(
            "checkpointd_last_success_timestamp_seconds",
            "Unix time of the run's last successful save.",
            ["run"],
            registry=registry,
        )
        self.phase_duration = Histogram(
            "checkpointd_save_phase_duration_seconds",
            "Seconds an accepted save spent in each phase: queue (blocking wait before "
            "the accept), transfer (accept to last chunk received), write (files written and "
            "committed), upload (with an object store: the part of write that uploads the files "
            "and the manifest to it).",
            ["kind", "phase"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.snapshots = Counter(
            "checkpointd_snapshots_received",
            "Snapshots of accepted saves received in full, by kind and transport: grpc "
            "(chunks over the connection) or shm (a same-host trainer's shared-memory segment).",
            ["kind", "transport"],
            registry=registry,
        )
        self.runs = Gauge(
            "checkpointd_runs",
            "Runs registered on this daemon.",
            registry=registry,
        )
        self.draining = Gauge(
            "checkpointd_draining",
            "1 from the daemon's notice (SIGTERM) until it exits: new runs refused, the runs registered here "
            "saving for --notice-window, then every save refused while accepted ones finish; else 0.",
            registry=registry,
        )
        self.recovered = Gauge(
            "checkpointd_recovery_done",
            "1 once the start's recovery has finished: at once on a local root; for an object store, once its "
            "tidy of the bucket (run while the daemon serves) has gone through every folder; else 0.",
            registry=registry,
        )
        self.uploaded_bytes = Counter(
            "checkpointd_store_uploaded_bytes",
            "Bytes uploaded to the object store by committed saves (files and manifest), by kind.",
            ["kind"],
            registry=registry,
        )
        self.s3_requests = Counter(
            "checkpointd_s3_requests",
            "Requests this daemon sent to the object store, by operation (PutObject, ListObjectsV2, ...); "
            "a retried request counts once per attempt.",
            ["operation"],
            registry=registry,
        )
        self.s3_errors = Counter(
            "checkpointd_s3_errors",
            "Requests (attempts) to the object store that the store failed, by operation and kind: "
            "connection (refused, reset, closed), timeout, throttled (503 SlowDown) or server (other 5xx).",
            ["operation", "kind"],
            registry=registry,
        )
        self.leases = Gauge(
            "checkpointd_leases_held",
            "Run leases this daemon holds in a shared object store (it writes those runs).",
            registry=registry,
        )
        self.leases_lost = Counter(
            "checkpointd_leases_lost",
            "Run leases this daemon lost to another daemon (or that vanished) while holding them; "
            "that run's saves here then fail ABORTED.",
            registry=registry,
        )
        # Incremental saves: payload bytes that travelled vs bytes copied from the base save.
        self.payload_received = Counter(
            "checkpointd_payload_received_bytes",
            "Payload bytes of committed saves that the daemon received (gRPC chunks or shared memory), by kind.",
            ["kind"],
            registry=registry,
        )
        self.payload_copied = Counter(
            "checkpointd_payload_copied_bytes",
            "Payload bytes of committed saves copied from their base save instead of received, by kind.",
            ["kind"],
            registry=registry,
        )
        self.incremental_paths = Counter(
            "checkpointd_incremental_path",
            "Committed incremental saves by kind and route (SaveResult.incremental_path): clone (the base's extents shared), copy (copied "
            "from the base's file), server_copy (by the object store), receive (the daemon found receiving "
            "the unchanged bytes cheaper and offered no base), no_base (none to copy from).",
            ["kind", "route"],  # not "path": a label of that name would read as a file's
            registry=registry,
        )
        self.preemption_saves = Counter(
            "checkpointd_preemption_saves_total",
            "Accepted saves on notice (a trainer's last snapshot before it is stopped) by outcome: "
            "ok, failed, cancelled (the trainer went away first).",
            ["outcome"],
            registry=registry,
        )
        self.standby_saves = Counter(
            "checkpointd_standby_saves_total",
            "Trainers watched for their standby snapshot (continuous saves on this host) that ended, by what "
            "became of it: written (a checkpoint newer than the run's newest), not_newer (the run held one as "
            "new: a save on notice, a flush), no_whole_slot (killed while copying its first), failed.",
            ["outcome"],
            registry=registry,
        )
        self.notice_to_durable = Histogram(
            "checkpointd_preemption_notice_to_durable_seconds",
            "Seconds from a trainer's notice (its clock) to its save on notice durable here (this clock).",
            buckets=NOTICE_BUCKETS,
            registry=registry,
        )
        for outcome in PREEMPTION_OUTCOMES:
            self.preemption_saves.labels(outcome)
        for outcome in STANDBY_OUTCOMES:
            self.standby_saves.labels(outcome)
        for kind in KINDS:
            self.payload_received.labels(kind)
            self.payload_copied.labels(kind)
            for route in PATHS:
                self.incremental_paths.labels(kind, route)
        for kind in KINDS:
            self.save_duration.labels(kind)
            self.skipped.labels(kind)
            self.written_bytes.labels(kind)
            self.uploaded_bytes.labels(kind)
            for outcome in OUTCOMES:
                self.saves.labels(kind, outcome)
            for phase in PHASES:
                self.phase_duration.labels(kind, phase)
            for transport in TRANSPORTS:
                self.snapshots.labels(kind, transport)

    def _child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, looked up once per metric and labels (`labels()` validates at every call).

        Only for series never removed (bounded labels: kind, outcome, phase,
        transport, operation); a run's series are removed when it closes.
        """
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def save_skipped(self, run: str, kind: str) -> None:
        self._child(self.saves, kind, "skipped").inc()
        self._child(self.skipped, kind).inc()

    def save_written(self, run: str, kind: str, bytes_written: int, seconds: float, at: float) -> None:
        self._child(self.saves, kind, "ok").inc()
        self._child(self.save_duration, kind).observe(seconds)
        self._child(self.written_bytes, kind).inc(bytes_written)
        self.last_success.labels(run).set(at)

    def save_failed(self, run: str, kind: str, seconds: float) -> None:
        self._child(self.saves, kind, "failed").inc()
        self._child(self.save_duration, kind).observe(seconds)

    def save_cancelled(self, run: str, kind: str, seconds: float) -> None:
        self._child(self.saves, kind, "cancelled").inc()

    def observe_phase(self, kind: str, phase: str, seconds: float) -> None:
        """Times one phase of an accepted save.

        Raises:
            ValueError: `phase` is not one of PHASES (labels stay bounded).
        """
        if phase not in PHASES:
            raise ValueError(f"unknown save phase {phase!r}; expected one of {PHASES}")
        self._child(self.phase_duration, kind, phase).observe(seconds)

    def snapshot_received(self, kind: str, transport: str) -> None:
        """Counts one snapshot received in full over `transport` (one of TRANSPORTS).

        Raises:
            ValueError: an unknown transport (labels stay bounded).
        """
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {transport!r}; expected one of {TRANSPORTS}")
        self._child(self.snapshots, kind, transport).inc()

    def payload_bytes(self, kind: str, received: int, copied: int) -> None:
        """Counts one committed save's payload: bytes received, and bytes copied from its base."""
        self._child(self.payload_received, kind).inc(received)
        self._child(self.payload_copied, kind).inc(copied)

    def incremental_path(self, kind: str, path: str) -> None:
        """Counts one committed incremental save by its path.

        Raises:
            ValueError: a path not in PATHS (labels stay bounded).
        """
        if path not in PATHS:
            raise ValueError(f"unknown incremental path {path!r}; expected one of {PATHS}")
        self._child(self.incremental_paths, kind, path).inc()

    def preemption_save(self, outcome: str, notice_to_durable: float | None) -> None:
        """Counts one accepted save on notice; observes notice to durable if it was written and the notice's time is known.

        Raises:
            ValueError: an outcome not in PREEMPTION_OUTCOMES (labels stay bounded).
        """
        if outcome not in PREEMPTION_OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r} of a save on notice; expected one of {PREEMPTION_OUTCOMES}")
        self._child(self.preemption_saves, outcome).inc()
        if notice_to_durable is not None:
            self.notice_to_durable.observe(notice_to_durable)

    def standby_save(self, outcome: str) -> None:
        """Counts one watched trainer's end by its standby snapshot's outcome.

        Raises:
            ValueError: an outcome not in STANDBY_OUTCOMES (labels stay bounded).
        """
        if outcome not in STANDBY_OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r} of a standby snapshot; expected one of {STANDBY_OUTCOMES}")
        self._child(self.standby_saves, outcome).inc()

    def store_uploaded(self, kind: str, seconds: float, nbytes: int) -> None:
        """One commit's upload to the object store: phase "upload", and its bytes."""
        self._child(self.phase_duration, kind, "upload").observe(seconds)
        self._child(self.uploaded_bytes, kind).inc(nbytes)

    def s3_request(self, operation: str) -> None:
        """One request (an attempt) sent to the object store."""
        self._child(self.s3_requests, operation).inc()

    def s3_error(self, operation: str, kind: str) -> None:
        """One attempt the object store failed (`s3_client.ERROR_KINDS`)."""
        self._child(self.s3_errors, operation, kind).inc()

    def leases_held(self, count: int) -> None:
        self.leases.set(count)

    def lease_lost(self, run: str) -> None:
        self.leases_lost.inc()

    def in_flight_changed(self, delta: int) -> None:
        self.in_flight.inc(delta)

    def run_closed(self, run: str) -> None:
        # A closed run stops saving on purpose: dropping its last-success
        # series keeps "no successful save for 30 min" alerts for live runs.
        try:
            self.last_success.remove(run)
        except KeyError:
            pass
