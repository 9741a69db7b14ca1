"""Prometheus plumbing shared by both services: per-app registries, fixed labels, buckets.

Every metric lives in a ``CollectorRegistry`` created per app, never in prometheus_client's
process-global default registry, so two apps in one process (tests, an edge and a cloud
side by side) do not collide. ``MetricFactory`` binds the per-app labels (``model_name``,
``mode``) once, so call sites give only their per-event labels.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

from fastapi import APIRouter, Request, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

# vLLM v1's buckets (vllm/v1/metrics/loggers.py), so dashboards built for vLLM read ours.
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TPOT_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# Our own: one forward or one link round trip, from sub-millisecond (tiny models, loopback)
# to seconds (a CPU target behind a weak link).
FORWARD_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip
ROUND_TRIP_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TOPK_K_BUCKETS = tuple(float(2**i) for i in range(17))  # 1 .. 65536
# 0 has its own bucket: most requests (exact corrections, greedy) spend nothing.
FIDELITY_BUCKETS = (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0)

CORRECTION_KINDS = ("topk", "proposals", "full", "cloud")
DIRECTIONS = ("uplink", "downlink")
FINISHED_REASONS = ("stop", "length")
FAILURE_REASONS = ("error", "abort")

M = TypeVar("M", Counter, Gauge, Histogram)


class Family(Generic[M]):
    """A labelled metric with its per-app labels (model_name, mode) already bound.

    ``family.labels(kind="topk")`` returns the child for the remaining labels, as
    prometheus_client's own ``labels`` does, so call sites read the same.
    """

    def __init__(self, parent: M, fixed: dict[str, str]) -> None:
        self._parent: M = parent
        self._fixed = fixed

    def labels(self, **labels: str) -> M:
        return self._parent.labels(**self._fixed, **labels)

    def preset(self, label: str, values: Iterable[str]) -> None:
        """Create the children up front, so that rate() sees them from 0 rather than from
        their first event (a series that appears at 1 loses that first increment)."""
        for value in values:
            self.labels(**{label: value})


class MetricFactory:
    """Builds metrics in one registry with the same fixed labels on every series."""

    def __init__(self, registry: CollectorRegistry, fixed: dict[str, str]) -> None:
        self.registry = registry
        self.fixed = fixed

    def counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, list(self.fixed), registry=self.registry).labels(**self.fixed)

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, list(self.fixed), registry=self.registry).labels(**self.fixed)

    def histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        metric = Histogram(name, doc, list(self.fixed), registry=self.registry, buckets=buckets)
        return metric.labels(**self.fixed)

    def counter_family(self, name: str, doc: str, label: str) -> Family[Counter]:
        return self.counter_family2(name, doc, (label,))

    def counter_family2(self, name: str, doc: str, labels: Sequence[str]) -> Family[Counter]:
        """A counter with several per-event labels."""
        parent = Counter(name, doc, [*self.fixed, *labels], registry=self.registry)
        return Family(parent, self.fixed)

    def gauge_family2(self, name: str, doc: str, labels: Sequence[str]) -> Family[Gauge]:
        """A gauge with several per-event labels."""
        parent = Gauge(name, doc, [*self.fixed, *labels], registry=self.registry)
        return Family(parent, self.fixed)


def render_metrics(registry: CollectorRegistry, accept: str = "") -> Response:
    """The registry in the exposition format the scraper's Accept header asks for (the
    Prometheus text format by default; OpenMetrics when asked)."""
    encoder, content_type = choose_encoder(accept)
    return Response(content=encoder(registry), media_type=content_type)


def metrics_router(registry: CollectorRegistry) -> APIRouter:
    """``GET /metrics`` as a plain route: mounting prometheus_client's ASGI app at /metrics
    would answer /metrics with a redirect to /metrics/, which scrapers do not all follow."""
    router = APIRouter()

    @router.get("/metrics", include_in_schema=False)
    def get_metrics(request: Request) -> Response:
        return render_metrics(registry, request.headers.get("accept", ""))

    return router
