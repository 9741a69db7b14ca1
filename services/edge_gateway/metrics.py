"""Prometheus metrics of the edge gateway (base units, ``asymspec_`` prefix).

Every metric lives in a ``CollectorRegistry`` created per app, never in prometheus_client's
process-global default registry, so two apps in one process (tests, an edge and a cloud
side by side) do not collide. Every series carries ``model_name`` and ``mode`` labels, fixed
when ``EdgeMetrics.create`` builds them; callers only give the per-event labels
(``metrics.corrections.labels(kind="topk").inc()``) or none (``metrics.spec_accepted.inc(3)``).

Spec-decode terms are vLLM's: a block proposes *draft* tokens, a prefix of them is
*accepted*, the first rejection is replaced by a *recovered* token, and an all-accepted
block earns a *bonus* token; output per block = accepted + (recovered | bonus).
The counters are raw; ratios are PromQL:

    acceptance rate        rate(asymspec_spec_decode_num_accepted_tokens_total[1m])
                             / rate(asymspec_spec_decode_num_draft_tokens_total[1m])
    mean acceptance length 1 + rate(asymspec_spec_decode_num_accepted_tokens_total[1m])
                                 / rate(asymspec_spec_decode_num_drafts_total[1m])
    acceptance at pos i    rate(asymspec_spec_decode_num_accepted_tokens_per_pos_total{
                                  position="i"}[1m])
                             / rate(asymspec_spec_decode_num_drafts_total[1m])
    throughput (tokens/s)  rate(asymspec_generation_tokens_total[1m])
    uplink bits per token  8 * rate(asymspec_link_bytes_total{direction="uplink"}[1m])
                             / rate(asymspec_generation_tokens_total[1m])
    edge utilisation       rate(asymspec_edge_busy_seconds_total[1m])
                             / (rate(asymspec_edge_busy_seconds_total[1m])
                                + rate(asymspec_edge_idle_seconds_total[1m]))
    mean ε per request     rate(asymspec_fidelity_budget_spent_total[1m])
                             / rate(asymspec_request_success_total[1m])
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from asymspec.telemetry import (
    BATCH_SIZE_BUCKETS,
    CORRECTION_KINDS,
    DIRECTIONS,
    E2E_BUCKETS_S,
    FAILURE_REASONS,
    FIDELITY_BUCKETS,
    FINISHED_REASONS,
    FORWARD_BUCKETS_S,
    ROUND_TRIP_BUCKETS_S,
    TOPK_K_BUCKETS,
    TPOT_BUCKETS_S,
    TTFT_BUCKETS_S,
    Family,
    MetricFactory,
    metrics_router,
    render_metrics,
)

__all__ = ["EdgeMetrics", "RequestTimer", "metrics_router", "render_metrics"]


@dataclass(frozen=True)
class EdgeMetrics:
    """The edge's metrics; one instance per app. Who records what:

    | field | metric | unit, labels | recorded by |
    |---|---|---|---|
    | time_to_first_token | asymspec_time_to_first_token_seconds | s | API |
    | time_per_output_token | asymspec_time_per_output_token_seconds | s, inter-token | API |
    | e2e_request_latency | asymspec_e2e_request_latency_seconds | s | API |
    | prompt_tokens | asymspec_prompt_tokens_total | tokens | API |
    | generation_tokens | asymspec_generation_tokens_total | tokens sent to clients | API |
    | request_success | asymspec_request_success_total | finished_reason | API |
    | request_failure | asymspec_request_failure_total | reason=error/abort | API |
    | requests_running | asymspec_num_requests_running | requests | API |
    | requests_waiting | asymspec_num_requests_waiting | requests | engine |
    | spec_drafts | asymspec_spec_decode_num_drafts_total | blocks | engine |
    | spec_draft_tokens | asymspec_spec_decode_num_draft_tokens_total | tokens | engine |
    | spec_accepted | asymspec_spec_decode_num_accepted_tokens_total | tokens | engine |
    | spec_accepted_per_pos | ..._num_accepted_tokens_per_pos_total | position (0-based) | engine |
    | spec_recovered | asymspec_spec_decode_num_recovered_tokens_total | tokens | engine |
    | spec_bonus | asymspec_spec_decode_num_bonus_tokens_total | tokens | engine |
    | corrections | asymspec_corrections_total | kind=topk/proposals/full/cloud | engine |
    | correction_rounds | asymspec_correction_rounds_total | downlink answers | engine |
    | correction_topk_k | asymspec_correction_topk_k | K reached | engine |
    | fidelity_spent | asymspec_fidelity_budget_spent_total | sum of ε | engine |
    | fidelity_spent_per_request | asymspec_fidelity_budget_spent_per_request | ε | engine |
    | link_bytes | asymspec_link_bytes_total | bytes, direction | channel |
    | link_frames | asymspec_link_frames_total | frames, direction | channel |
    | link_message_bytes | asymspec_link_message_bytes_total | bytes, direction, message | channel |
    | verify_round_trip | asymspec_verify_round_trip_seconds | s | engine |
    | draft_forward | asymspec_draft_forward_seconds | s | engine |
    | draft_batch_size | asymspec_draft_batch_size | requests | engine |
    | edge_busy | asymspec_edge_busy_seconds_total | s | engine |
    | edge_idle | asymspec_edge_idle_seconds_total | s | engine |
    | wasted_draft_tokens | asymspec_wasted_draft_tokens_total | tokens (runahead) | engine |
    | suffix_drafts | asymspec_spec_decode_num_suffix_drafts_total | blocks (no draft) | engine |
    | suffix_draft_tokens | asymspec_spec_decode_num_suffix_draft_tokens_total | tokens | engine |
    | suffix_accepted | ..._num_suffix_accepted_tokens_total | tokens | engine |
    | cloud_decoded_tokens | asymspec_cloud_decoded_tokens_total | tokens (paused) | engine |
    | mode_tokens_per_s | asymspec_pause_measured_tokens_per_second | tokens/s | engine |
    | cloud_connected | asymspec_cloud_connected | connected replicas (0/1 with one) | channel |
    | session_reopens | asymspec_cloud_session_reopens_total | after a lost cloud | engine |
    | requests_rejected | asymspec_request_rejected_total | reason=auth/overload/slow_body | app |
    """

    registry: CollectorRegistry
    time_to_first_token: Histogram
    time_per_output_token: Histogram
    e2e_request_latency: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    request_success: Family[Counter]
    request_failure: Family[Counter]
    requests_running: Gauge
    requests_waiting: Gauge
    spec_drafts: Counter
    spec_draft_tokens: Counter
    spec_accepted: Counter
    spec_accepted_per_pos: Family[Counter]
    spec_recovered: Counter
    spec_bonus: Counter
    corrections: Family[Counter]
    correction_rounds: Counter
    correction_topk_k: Histogram
    fidelity_spent: Counter
    fidelity_spent_per_request: Histogram
    link_bytes: Family[Counter]
    link_frames: Family[Counter]
    link_message_bytes: Family[Counter]
    verify_round_trip: Histogram
    draft_forward: Histogram
    draft_batch_size: Histogram
    edge_busy: Counter
    edge_idle: Counter
    wasted_draft_tokens: Counter
    suffix_drafts: Counter
    suffix_draft_tokens: Counter
    suffix_accepted: Counter
    cloud_decoded_tokens: Counter
    mode_tokens_per_s: Family[Gauge]
    cloud_connected: Gauge
    session_reopens: Counter
    requests_rejected: Family[Counter]

    @classmethod
    def create(
        cls, registry: CollectorRegistry | None = None, *, model_name: str = "", mode: str = ""
    ) -> EdgeMetrics:
        """All edge metrics in ``registry`` (a fresh one by default)."""
        registry = registry if registry is not None else CollectorRegistry()
        f = MetricFactory(registry, {"model_name": model_name, "mode": mode})
        metrics = cls(
            registry=registry,
            time_to_first_token=f.histogram(
                "asymspec_time_to_first_token_seconds",
                "Time from request arrival to its first generated tokens.",
                TTFT_BUCKETS_S,
            ),
            time_per_output_token=f.histogram(
                "asymspec_time_per_output_token_seconds",
                "Inter-token latency: a chunk of n tokens after a gap g observes g/n n times.",
                TPOT_BUCKETS_S,
            ),
            e2e_request_latency=f.histogram(
                "asymspec_e2e_request_latency_seconds",
                "Time from request arrival to its last token, for finished requests.",
                E2E_BUCKETS_S,
            ),
            prompt_tokens=f.counter(
                "asymspec_prompt_tokens_total", "Prompt tokens of requests handed to the engine."
            ),
            generation_tokens=f.counter(
                "asymspec_generation_tokens_total",
                "Generated tokens counted in responses (completion_tokens), stop tokens included.",
            ),
            request_success=f.counter_family(
                "asymspec_request_success_total",
                "Finished requests by finish reason.",
                "finished_reason",
            ),
            request_failure=f.counter_family(
                "asymspec_request_failure_total",
                "Requests that did not finish: reason=error (engine failure) or abort "
                "(client gone).",
                "reason",
            ),
            requests_running=f.gauge(
                "asymspec_num_requests_running", "Requests the engine is generating for."
            ),
            requests_waiting=f.gauge(
                "asymspec_num_requests_waiting", "Requests queued in the engine, not yet started."
            ),
            spec_drafts=f.counter(
                "asymspec_spec_decode_num_drafts_total", "Draft blocks sent for verification."
            ),
            spec_draft_tokens=f.counter(
                "asymspec_spec_decode_num_draft_tokens_total", "Draft tokens proposed."
            ),
            spec_accepted=f.counter(
                "asymspec_spec_decode_num_accepted_tokens_total", "Draft tokens accepted."
            ),
            spec_accepted_per_pos=f.counter_family(
                "asymspec_spec_decode_num_accepted_tokens_per_pos_total",
                "Draft tokens accepted at each block position (0-based).",
                "position",
            ),
            spec_recovered=f.counter(
                "asymspec_spec_decode_num_recovered_tokens_total",
                "Correction tokens committed after a rejection.",
            ),
            spec_bonus=f.counter(
                "asymspec_spec_decode_num_bonus_tokens_total",
                "Bonus tokens committed after an all-accepted block.",
            ),
            corrections=f.counter_family(
                "asymspec_corrections_total",
                "Recovered tokens by the correction that produced them.",
                "kind",
            ),
            correction_rounds=f.counter(
                "asymspec_correction_rounds_total",
                "Correction responses received (the first one and every escalation).",
            ),
            correction_topk_k=f.histogram(
                "asymspec_correction_topk_k",
                "The K of the top-K certificate a correction ended at.",
                TOPK_K_BUCKETS,
            ),
            fidelity_spent=f.counter(
                "asymspec_fidelity_budget_spent_total", "Sum of the ε spent on bounded draws."
            ),
            fidelity_spent_per_request=f.histogram(
                "asymspec_fidelity_budget_spent_per_request",
                "Total ε a finished request spent.",
                FIDELITY_BUCKETS,
            ),
            link_bytes=f.counter_family(
                "asymspec_link_bytes_total", "Channel bytes as seen by the edge.", "direction"
            ),
            link_frames=f.counter_family(
                "asymspec_link_frames_total", "Channel frames as seen by the edge.", "direction"
            ),
            link_message_bytes=f.counter_family2(
                "asymspec_link_message_bytes_total",
                "Channel bytes by direction and message type (e.g. VerifyBlock vs OpenSession).",
                ("direction", "message"),
            ),
            verify_round_trip=f.histogram(
                "asymspec_verify_round_trip_seconds",
                "Time from sending a block to receiving its verdict.",
                ROUND_TRIP_BUCKETS_S,
            ),
            draft_forward=f.histogram(
                "asymspec_draft_forward_seconds",
                "Time of one batched draft forward.",
                FORWARD_BUCKETS_S,
            ),
            draft_batch_size=f.histogram(
                "asymspec_draft_batch_size",
                "Requests in one batched draft forward.",
                BATCH_SIZE_BUCKETS,
            ),
            edge_busy=f.counter(
                "asymspec_edge_busy_seconds_total", "Time the edge spent computing (drafting)."
            ),
            edge_idle=f.counter(
                "asymspec_edge_idle_seconds_total",
                "Time the edge had nothing to compute (all requests waiting on the cloud).",
            ),
            wasted_draft_tokens=f.counter(
                "asymspec_wasted_draft_tokens_total",
                "Draft tokens computed and thrown away (runahead from an unconfirmed prefix).",
            ),
            suffix_drafts=f.counter(
                "asymspec_spec_decode_num_suffix_drafts_total",
                "Blocks the suffix drafter proposed without a draft-model forward (also counted "
                "in asymspec_spec_decode_num_drafts_total).",
            ),
            suffix_draft_tokens=f.counter(
                "asymspec_spec_decode_num_suffix_draft_tokens_total",
                "Draft tokens of suffix blocks.",
            ),
            suffix_accepted=f.counter(
                "asymspec_spec_decode_num_suffix_accepted_tokens_total",
                "Accepted draft tokens of suffix blocks.",
            ),
            cloud_decoded_tokens=f.counter(
                "asymspec_cloud_decoded_tokens_total",
                "Tokens of speculative requests the cloud decoded alone while speculation "
                "was paused (the batch above speculative_disable_by_batch_size, the goodput "
                "rule's pause, or the draft catching up).",
            ),
            mode_tokens_per_s=f.gauge_family2(
                "asymspec_pause_measured_tokens_per_second",
                "One request's tokens per second as the goodput rule measures them, "
                "speculating, the cloud decoding alone or suffix blocks, greedy or sampled, "
                "by batch size (its bucket's top).",
                ("source", "sampling", "batch"),
            ),
            cloud_connected=f.gauge(
                "asymspec_cloud_connected",
                "Cloud verifier replicas whose channel is up (0 or 1 with one replica).",
            ),
            session_reopens=f.counter(
                "asymspec_cloud_session_reopens_total",
                "Sessions re-opened from their confirmed prefix after the cloud came back.",
            ),
            requests_rejected=f.counter_family(
                "asymspec_request_rejected_total",
                "Requests refused before generation (bad API key, too many at once).",
                "reason",
            ),
        )
        metrics.requests_rejected.preset("reason", ("auth", "overload"))
        metrics.request_success.preset("finished_reason", FINISHED_REASONS)
        metrics.request_failure.preset("reason", FAILURE_REASONS)
        metrics.corrections.preset("kind", CORRECTION_KINDS)
        metrics.link_bytes.preset("direction", DIRECTIONS)
        metrics.link_frames.preset("direction", DIRECTIONS)
        return metrics

    def record_block(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verified block: γ drafts, the first ``num_accepted`` accepted; its extra token
        is a bonus when all were accepted, else a recovered token."""
        self.spec_drafts.inc()
        self.spec_draft_tokens.inc(num_draft_tokens)
        self.spec_accepted.inc(num_accepted)
        for position in range(num_accepted):
            self.spec_accepted_per_pos.labels(position=str(position)).inc()
        if num_accepted == num_draft_tokens:
            self.spec_bonus.inc()
        else:
            self.spec_recovered.inc()


class RequestTimer:
    """One request's latency metrics, as the API layer sees its engine chunks arrive.

    TTFT runs from arrival to the first chunk. Each later chunk of n tokens after a gap g
    observes g/n n times, as vLLM's time_per_output_token does per step, so a block of
    several tokens counts as several fast tokens rather than one slow one. Tokens of the
    first chunk beyond its first share its TTFT and are not observed as inter-token latency.
    """

    def __init__(
        self,
        metrics: EdgeMetrics,
        arrival_s: float,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.metrics = metrics
        self.arrival_s = arrival_s
        self.clock = clock
        self.last_chunk_s: float | None = None
        self.running = False

    def started(self, prompt_tokens: int) -> None:
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.requests_running.inc()
        self.running = True

    def tokens(self, n: int) -> None:
        """A chunk of ``n`` tokens arrived (n counted into generation_tokens; may be 0 when a
        stop string ended the text before any token of the chunk)."""
        now = self.clock()
        if self.last_chunk_s is None:
            self.metrics.time_to_first_token.observe(now - self.arrival_s)
        elif n > 0:
            per_token_s = (now - self.last_chunk_s) / n
            for _ in range(n):
                self.metrics.time_per_output_token.observe(per_token_s)
        self.last_chunk_s = now
        self.metrics.generation_tokens.inc(n)

    def finished(self, finish_reason: str) -> None:
        self._stop_running()
        self.metrics.request_success.labels(finished_reason=finish_reason).inc()
        self.metrics.e2e_request_latency.observe(self.clock() - self.arrival_s)

    def failed(self, reason: str) -> None:
        self._stop_running()
        self.metrics.request_failure.labels(reason=reason).inc()

    def _stop_running(self) -> None:
        if self.running:  # both finished() and failed() may be reached; count down once
            self.metrics.requests_running.dec()
            self.running = False
