"""Scrape a service's /metrics and take deltas between two scrapes.

A snapshot is a flat list of samples ``(name, labels, value)`` with the per-app labels
(``model_name``, ``mode``) dropped, because one cell has one app per side and the bench
keys its figures by mode itself. Histograms appear as their ``_sum``/``_count``/``_bucket``
samples, exactly as exposed. Counters only grow within one process, so a delta between a
scrape before and one after a phase is that phase's share.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

_APP_LABELS = frozenset({"model_name", "mode"})
LabelKey = tuple[tuple[str, str], ...]  # sorted (label, value) pairs


def _key(labels: Mapping[str, str]) -> LabelKey:
    return tuple(sorted((k, v) for k, v in labels.items() if k not in _APP_LABELS))


@dataclass(frozen=True)
class Snapshot:
    """All samples of one scrape, keyed by (sample name, labels without the app labels)."""

    samples: Mapping[tuple[str, LabelKey], float]

    @classmethod
    def parse(cls, text: str) -> Snapshot:
        samples: dict[tuple[str, LabelKey], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, _key(sample.labels))] = float(sample.value)
        return cls(samples)

    @classmethod
    def empty(cls) -> Snapshot:
        """What a side that was never started reports: every value reads as 0."""
        return cls({})

    def value(self, name: str, **labels: str) -> float:
        """One sample; 0.0 when absent (a metric that never fired, or a side not started)."""
        return self.samples.get((name, _key(labels)), 0.0)

    def total(self, name: str) -> float:
        """The sum of a sample over all its label values (e.g. target calls of every kind)."""
        return sum(v for (n, _), v in self.samples.items() if n == name)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``{label value: sample}`` of a one-label family, e.g. corrections by kind."""
        out: dict[str, float] = {}
        for (n, key), v in self.samples.items():
            if n == name:
                value = dict(key).get(label)
                if value is not None:
                    out[value] = out.get(value, 0.0) + v
        return out

    def minus(self, before: Snapshot) -> Snapshot:
        """Per-sample ``self - before`` (``before``'s missing samples count as 0)."""
        return Snapshot({k: v - before.samples.get(k, 0.0) for k, v in self.samples.items()})

    def to_json(self) -> list[list[object]]:
        return [[name, dict(key), value] for (name, key), value in sorted(self.samples.items())]

    @classmethod
    def from_json(cls, rows: Iterable[list[object]]) -> Snapshot:
        samples: dict[tuple[str, LabelKey], float] = {}
        for name, labels, value in rows:
            assert isinstance(name, str) and isinstance(labels, dict)
            samples[(name, _key(labels))] = float(value)  # type: ignore[arg-type]
        return cls(samples)


async def scrape(client: httpx.AsyncClient, base_url: str | None) -> Snapshot:
    """GET ``base_url``/metrics; an absent side (``None``) is an empty snapshot."""
    if base_url is None:
        return Snapshot.empty()
    response = await client.get(f"{base_url}/metrics", timeout=30)
    response.raise_for_status()
    return Snapshot.parse(response.text)
