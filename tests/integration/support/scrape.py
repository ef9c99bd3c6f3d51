"""One scrape of a daemon's /metrics, parsed with prometheus_client's own parser."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

TIMEOUT = 30.0


class Metrics:
    """One scrape: sample values by name and labels, and family types."""

    def __init__(self, url: str) -> None:
        with urllib.request.urlopen(url, timeout=TIMEOUT) as reply:
            assert reply.status == 200
            text = reply.read().decode("utf-8")
        self.types: dict[str, str] = {}
        self.samples: dict[tuple[str, frozenset], float] = {}
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for s in family.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    def __call__(self, name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        assert key in self.samples, f"no sample {name}{labels} in /metrics"
        return self.samples[key]

    def total(self, *names: str) -> float:
        """The sum of every sample of these names, whatever their labels."""
        return sum(value for (name, _), value in self.samples.items() if name in names)
