"""Prometheus metrics of the cloud verifier (base units, ``asymspec_`` prefix).

One ``CollectorRegistry`` per app, as on the edge; every series carries ``model_name``,
fixed at creation. Ratios are PromQL:

    mean verification batch   rate(asymspec_verify_batch_size_sum[1m])
                                / rate(asymspec_verify_batch_size_count[1m])
    target calls per token    rate(asymspec_target_forward_calls_total[1m])
                                / rate(asymspec_generation_tokens_total[1m])   (edge metric)
    target busy fraction      rate(asymspec_target_forward_seconds_sum[1m])
    downlink bytes per block  rate(asymspec_link_bytes_total{direction="downlink"}[1m])
                                / rate(asymspec_verified_blocks_total[1m])

The metric-building helpers live in ``asymspec.telemetry``, so that both services label,
register and expose metrics the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from asymspec.telemetry import (
    BATCH_SIZE_BUCKETS,
    CORRECTION_KINDS,
    DIRECTIONS,
    FORWARD_BUCKETS_S,
    Family,
    MetricFactory,
    metrics_router,
    render_metrics,
)

__all__ = ["CloudMetrics", "metrics_router", "render_metrics"]

TARGET_CALL_KINDS = ("verify", "prefill", "decode")


@dataclass(frozen=True)
class CloudMetrics:
    """The cloud's metrics; one instance per app.

    | field | metric | unit, labels |
    |---|---|---|
    | verify_batch_size | asymspec_verify_batch_size | blocks per target forward |
    | verify_queue_wait | asymspec_verify_queue_wait_seconds | s, arrival to batch start |
    | target_forward_seconds | asymspec_target_forward_seconds | s, one target forward |
    | target_forward_calls | asymspec_target_forward_calls_total | kind=verify/prefill/decode |
    | verified_blocks | asymspec_verified_blocks_total | blocks |
    | cloud_corrections | asymspec_cloud_corrections_total | kind=topk/proposals/full/cloud |
    | link_bytes | asymspec_link_bytes_total | bytes, direction (as the cloud sees it) |
    | link_frames | asymspec_link_frames_total | frames, direction |
    | channel_auth_failures | asymspec_channel_auth_failures_total | handshakes refused |
    | edge_link_bytes | asymspec_cloud_edge_link_bytes_total | bytes, edge, direction |
    | edge_sessions_opened | asymspec_cloud_edge_sessions_opened_total | sessions, edge |
    | sessions | asymspec_cloud_sessions | open sessions (requests) |
    | connected_edges | asymspec_cloud_connected_edges | open channels |
    | forward_base_seconds | asymspec_target_forward_base_seconds | s, fitted fixed cost |
    | forward_row_seconds | asymspec_target_forward_row_seconds | s, fitted cost per row |
    | prefix_reused_tokens | asymspec_prefix_reused_tokens_total | prompt tokens not prefilled |
    """

    registry: CollectorRegistry
    verify_batch_size: Histogram
    verify_queue_wait: Histogram
    target_forward_seconds: Histogram
    target_forward_calls: Family[Counter]
    verified_blocks: Counter
    cloud_corrections: Family[Counter]
    link_bytes: Family[Counter]
    link_frames: Family[Counter]
    channel_auth_failures: Counter
    edge_link_bytes: Family[Counter]
    edge_sessions_opened: Family[Counter]
    sessions: Gauge
    connected_edges: Gauge
    forward_base_seconds: Gauge
    forward_row_seconds: Gauge
    prefix_reused_tokens: Counter

    @classmethod
    def create(
        cls, registry: CollectorRegistry | None = None, *, model_name: str = ""
    ) -> CloudMetrics:
        """All cloud metrics in ``registry`` (a fresh one by default)."""
        registry = registry if registry is not None else CollectorRegistry()
        f = MetricFactory(registry, {"model_name": model_name})
        metrics = cls(
            registry=registry,
            verify_batch_size=f.histogram(
                "asymspec_verify_batch_size",
                "Blocks verified in one target forward.",
                BATCH_SIZE_BUCKETS,
            ),
            verify_queue_wait=f.histogram(
                "asymspec_verify_queue_wait_seconds",
                "Time a block waited in the verification queue before its batch started.",
                FORWARD_BUCKETS_S,
            ),
            target_forward_seconds=f.histogram(
                "asymspec_target_forward_seconds",
                "Time of one target forward (any kind).",
                FORWARD_BUCKETS_S,
            ),
            target_forward_calls=f.counter_family(
                "asymspec_target_forward_calls_total",
                "Target forwards by kind (SPADE's target model calls).",
                "kind",
            ),
            verified_blocks=f.counter(
                "asymspec_verified_blocks_total", "Blocks the acceptance test was run on."
            ),
            cloud_corrections=f.counter_family(
                "asymspec_cloud_corrections_total",
                "Correction responses sent, by kind.",
                "kind",
            ),
            link_bytes=f.counter_family(
                "asymspec_link_bytes_total", "Channel bytes as seen by the cloud.", "direction"
            ),
            link_frames=f.counter_family(
                "asymspec_link_frames_total", "Channel frames as seen by the cloud.", "direction"
            ),
            channel_auth_failures=f.counter(
                "asymspec_channel_auth_failures_total",
                "Channel handshakes refused (no Hello, an unknown or revoked edge).",
            ),
            edge_link_bytes=f.counter_family2(
                "asymspec_cloud_edge_link_bytes_total",
                "Channel bytes per edge identity (certificate subject or edge id).",
                ("edge", "direction"),
            ),
            edge_sessions_opened=f.counter_family(
                "asymspec_cloud_edge_sessions_opened_total",
                "Sessions opened per edge identity.",
                "edge",
            ),
            sessions=f.gauge("asymspec_cloud_sessions", "Open verification sessions."),
            connected_edges=f.gauge(
                "asymspec_cloud_connected_edges", "Edges with an open channel."
            ),
            forward_base_seconds=f.gauge(
                "asymspec_target_forward_base_seconds",
                "Fitted fixed cost of a target forward (what the prefill budget uses).",
            ),
            forward_row_seconds=f.gauge(
                "asymspec_target_forward_row_seconds",
                "Fitted cost of each row a target forward scores (what the prefill budget uses).",
            ),
            prefix_reused_tokens=f.counter(
                "asymspec_prefix_reused_tokens_total",
                "Prompt tokens a new session took from a closed session's cache (not prefilled).",
            ),
        )
        metrics.target_forward_calls.preset("kind", TARGET_CALL_KINDS)
        metrics.cloud_corrections.preset("kind", CORRECTION_KINDS)
        metrics.link_bytes.preset("direction", DIRECTIONS)
        metrics.link_frames.preset("direction", DIRECTIONS)
        return metrics
