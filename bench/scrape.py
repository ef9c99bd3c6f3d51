"""Reads the daemon's Prometheus /metrics: its own account of what it did and how long."""

from __future__ import annotations

import urllib.request

Sample = tuple[str, dict[str, str], float]


def scrape(url: str) -> list[Sample]:
    """(name, labels, value) of every sample on the page."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()  # noqa: S310 - loopback
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        pairs = {}
        for item in filter(None, labels.rstrip("}").split(",")):
            key, _, val = item.partition("=")
            pairs[key] = val.strip('"')
        samples.append((name, pairs, float(value)))
    return samples


def totals_by(url: str, metric: str, label: str) -> dict[str, float]:
    """The samples of `metric` summed by the value of `label` (over every other label)."""
    counts: dict[str, float] = {}
    for name, labels, value in scrape(url):
        if name == metric:
            counts[labels[label]] = counts.get(labels[label], 0.0) + value
    return counts


def saves_by_outcome(url: str) -> dict[str, float]:
    """checkpointd_saves_total by outcome (ok, skipped, failed), summed over kinds."""
    return totals_by(url, "checkpointd_saves_total", "outcome")


def phase_totals(url: str) -> dict[str, tuple[float, float]]:
    """(sum of seconds, count) of checkpointd_save_phase_duration_seconds, by "kind/phase".

    Empty if the daemon does not export phases.
    """
    totals: dict[str, list[float]] = {}
    for name, labels, value in scrape(url):
        for suffix, index in (("_sum", 0), ("_count", 1)):
            if name == "checkpointd_save_phase_duration_seconds" + suffix:
                key = f"{labels['kind']}/{labels['phase']}"
                totals.setdefault(key, [0.0, 0.0])[index] = value
    return {k: (v[0], v[1]) for k, v in totals.items()}


def phase_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean seconds per phase of the saves observed between two `phase_totals`."""
    means = {}
    for key, (total, count) in after.items():
        total0, count0 = before.get(key, (0.0, 0.0))
        if count > count0:
            means[key] = (total - total0) / (count - count0)
    return means


def transport_totals(url: str) -> dict[str, float]:
    """checkpointd_snapshots_received_total by transport (grpc, shm), summed over kinds."""
    return totals_by(url, "checkpointd_snapshots_received_total", "transport")
