"""Edge and cloud metrics: names, buckets, per-app registries, the request timer, /metrics."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cloud_verifier.metrics import CloudMetrics
from edge_gateway.metrics import (
    E2E_BUCKETS_S,
    TPOT_BUCKETS_S,
    TTFT_BUCKETS_S,
    EdgeMetrics,
    RequestTimer,
    metrics_router,
)

EDGE_NAMES = {
    "asymspec_time_to_first_token_seconds",
    "asymspec_time_per_output_token_seconds",
    "asymspec_e2e_request_latency_seconds",
    "asymspec_prompt_tokens",
    "asymspec_generation_tokens",
    "asymspec_request_success",
    "asymspec_request_failure",
    "asymspec_num_requests_running",
    "asymspec_num_requests_waiting",
    "asymspec_spec_decode_num_drafts",
    "asymspec_spec_decode_num_draft_tokens",
    "asymspec_spec_decode_num_accepted_tokens",
    "asymspec_spec_decode_num_accepted_tokens_per_pos",
    "asymspec_spec_decode_num_recovered_tokens",
    "asymspec_spec_decode_num_bonus_tokens",
    "asymspec_corrections",
    "asymspec_correction_rounds",
    "asymspec_correction_topk_k",
    "asymspec_fidelity_budget_spent",
    "asymspec_fidelity_budget_spent_per_request",
    "asymspec_link_bytes",
    "asymspec_link_frames",
    "asymspec_verify_round_trip_seconds",
    "asymspec_draft_forward_seconds",
    "asymspec_draft_batch_size",
    "asymspec_edge_busy_seconds",
    "asymspec_edge_idle_seconds",
    "asymspec_wasted_draft_tokens",
    "asymspec_spec_decode_num_suffix_drafts",
    "asymspec_spec_decode_num_suffix_draft_tokens",
    "asymspec_spec_decode_num_suffix_accepted_tokens",
    "asymspec_cloud_decoded_tokens",
    "asymspec_pause_measured_tokens_per_second",
    "asymspec_cloud_connected",
    "asymspec_link_message_bytes",
    "asymspec_cloud_session_reopens",
    "asymspec_request_rejected",
}  # family names: prometheus_client strips a counter's _total (its samples keep it)
CLOUD_NAMES = {
    "asymspec_verify_batch_size",
    "asymspec_verify_queue_wait_seconds",
    "asymspec_target_forward_seconds",
    "asymspec_target_forward_calls",
    "asymspec_verified_blocks",
    "asymspec_cloud_corrections",
    "asymspec_link_bytes",
    "asymspec_link_frames",
    "asymspec_channel_auth_failures",
    "asymspec_cloud_sessions",
    "asymspec_cloud_connected_edges",
    "asymspec_target_forward_base_seconds",
    "asymspec_target_forward_row_seconds",
    "asymspec_prefix_reused_tokens",
    "asymspec_cloud_edge_sessions_opened",
    "asymspec_cloud_edge_link_bytes",
}


def families(registry: CollectorRegistry) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """name -> [(sample name, labels, value)], parsed back from the exposition text."""
    text = generate_latest(registry).decode()
    return {
        f.name: [(s.name, s.labels, s.value) for s in f.samples]
        for f in text_string_to_metric_families(text)
        if not f.name.endswith("_created")
    }


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    result = registry.get_sample_value(name, {"model_name": "m", "mode": "asymspec", **labels})
    assert result is not None, (name, labels)
    return result


def buckets(registry: CollectorRegistry, name: str) -> list[float]:
    return [
        float(labels["le"])
        for sample, labels, _ in families(registry)[name]
        if sample.endswith("_bucket") and labels["le"] != "+Inf"
    ]


@pytest.fixture
def edge() -> EdgeMetrics:
    return EdgeMetrics.create(model_name="m", mode="asymspec")


def test_edge_names_and_labels(edge: EdgeMetrics) -> None:
    found = families(edge.registry)
    assert set(found) == EDGE_NAMES
    for samples in found.values():
        for _, labels, _ in samples:
            assert labels["model_name"] == "m" and labels["mode"] == "asymspec"


def test_cloud_names(edge: EdgeMetrics) -> None:
    cloud = CloudMetrics.create(model_name="target")
    assert set(families(cloud.registry)) == CLOUD_NAMES
    assert buckets(cloud.registry, "asymspec_verify_batch_size") == [1, 2, 4, 8, 16, 32, 64, 128]


def test_latency_buckets_are_vllms(edge: EdgeMetrics) -> None:
    assert buckets(edge.registry, "asymspec_time_to_first_token_seconds") == list(TTFT_BUCKETS_S)
    assert buckets(edge.registry, "asymspec_time_per_output_token_seconds") == list(TPOT_BUCKETS_S)
    assert buckets(edge.registry, "asymspec_e2e_request_latency_seconds") == list(E2E_BUCKETS_S)
    assert TTFT_BUCKETS_S[0] == 0.001 and TTFT_BUCKETS_S[-1] == 2560.0 and len(TTFT_BUCKETS_S) == 22
    assert TPOT_BUCKETS_S[0] == 0.01 and TPOT_BUCKETS_S[-1] == 80.0 and len(TPOT_BUCKETS_S) == 19
    assert E2E_BUCKETS_S[0] == 0.3 and E2E_BUCKETS_S[-1] == 7680.0 and len(E2E_BUCKETS_S) == 21
    assert buckets(edge.registry, "asymspec_correction_topk_k")[-1] == 65536


def test_registries_are_per_app() -> None:
    """Two edges and a cloud in one process: separate registries, no collision."""
    first, second = EdgeMetrics.create(), EdgeMetrics.create()
    cloud = CloudMetrics.create()
    first.generation_tokens.inc(5)
    cloud.link_bytes.labels(direction="uplink").inc(7)
    assert first.registry is not second.registry
    assert (
        first.registry.get_sample_value(
            "asymspec_generation_tokens_total", {"model_name": "", "mode": ""}
        )
        == 5
    )
    assert (
        second.registry.get_sample_value(
            "asymspec_generation_tokens_total", {"model_name": "", "mode": ""}
        )
        == 0
    )
    assert (
        first.registry.get_sample_value(
            "asymspec_link_bytes_total", {"model_name": "", "mode": "", "direction": "uplink"}
        )
        == 0
    )
    with pytest.raises(ValueError, match="Duplicated"):
        EdgeMetrics.create(first.registry)  # the same registry twice is a programming error


def test_label_sets_start_at_zero(edge: EdgeMetrics) -> None:
    """Known label values exist before their first event, so rate() counts that event."""
    for kind in ("topk", "proposals", "full", "cloud"):
        assert value(edge.registry, "asymspec_corrections_total", kind=kind) == 0
    for reason in ("stop", "length"):
        assert value(edge.registry, "asymspec_request_success_total", finished_reason=reason) == 0
    for direction in ("uplink", "downlink"):
        assert value(edge.registry, "asymspec_link_bytes_total", direction=direction) == 0


def test_record_block(edge: EdgeMetrics) -> None:
    edge.record_block(num_draft_tokens=4, num_accepted=2)  # rejects x_3: recovered
    edge.record_block(num_draft_tokens=4, num_accepted=4)  # all accepted: bonus
    registry = edge.registry
    assert value(registry, "asymspec_spec_decode_num_drafts_total") == 2
    assert value(registry, "asymspec_spec_decode_num_draft_tokens_total") == 8
    assert value(registry, "asymspec_spec_decode_num_accepted_tokens_total") == 6
    per_pos = "asymspec_spec_decode_num_accepted_tokens_per_pos_total"
    assert [value(registry, per_pos, position=str(i)) for i in range(4)] == [2, 2, 1, 1]
    assert value(registry, "asymspec_spec_decode_num_recovered_tokens_total") == 1
    assert value(registry, "asymspec_spec_decode_num_bonus_tokens_total") == 1


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0  # steps below are exact binary fractions: no rounding at bucket edges

    def __call__(self) -> float:
        return self.now_s


def test_request_timer_ttft_tpot_e2e(edge: EdgeMetrics) -> None:
    clock = FakeClock()
    timer = RequestTimer(edge, arrival_s=clock.now_s, clock=clock)
    timer.started(prompt_tokens=11)
    assert value(edge.registry, "asymspec_num_requests_running") == 1
    clock.now_s += 0.5
    timer.tokens(3)  # first chunk: TTFT 0.5 s, its other tokens are not inter-token gaps
    clock.now_s += 0.375
    timer.tokens(3)  # a block of 3 after 0.375 s: three tokens of 0.125 s each
    clock.now_s += 0.25
    timer.tokens(1)
    timer.finished("length")
    registry = edge.registry
    assert value(registry, "asymspec_time_to_first_token_seconds_sum") == 0.5
    assert value(registry, "asymspec_time_to_first_token_seconds_count") == 1
    assert value(registry, "asymspec_time_per_output_token_seconds_count") == 4
    assert value(registry, "asymspec_time_per_output_token_seconds_sum") == 0.625
    tpot = "asymspec_time_per_output_token_seconds_bucket"
    assert [value(registry, tpot, le=le) for le in ("0.1", "0.15", "0.2", "0.3")] == [0, 3, 3, 4]
    assert value(registry, "asymspec_e2e_request_latency_seconds_sum") == 1.125
    assert value(registry, "asymspec_prompt_tokens_total") == 11
    assert value(registry, "asymspec_generation_tokens_total") == 7
    assert value(registry, "asymspec_request_success_total", finished_reason="length") == 1
    assert value(registry, "asymspec_num_requests_running") == 0


def test_request_timer_counts_a_failure_once(edge: EdgeMetrics) -> None:
    timer = RequestTimer(edge, arrival_s=0.0, clock=FakeClock())
    timer.started(prompt_tokens=1)
    timer.failed("abort")
    timer.failed("abort")  # e.g. reached from two cleanup paths
    assert value(edge.registry, "asymspec_num_requests_running") == 0
    assert value(edge.registry, "asymspec_request_failure_total", reason="abort") == 2
    assert value(edge.registry, "asymspec_e2e_request_latency_seconds_count") == 0


def test_cloud_call_sites(edge: EdgeMetrics) -> None:
    """The verifier's call patterns: per-event labels only, the model label is bound."""
    cloud = CloudMetrics.create(model_name="t")
    cloud.target_forward_calls.labels(kind="verify").inc()
    cloud.verify_batch_size.observe(3)
    cloud.sessions.inc()
    labels = {"model_name": "t"}
    get = cloud.registry.get_sample_value
    assert get("asymspec_target_forward_calls_total", {**labels, "kind": "verify"}) == 1
    assert get("asymspec_target_forward_calls_total", {**labels, "kind": "prefill"}) == 0
    assert get("asymspec_verify_batch_size_bucket", {**labels, "le": "4.0"}) == 1
    assert get("asymspec_cloud_sessions", labels) == 1


def test_metrics_route_serves_the_apps_registry(edge: EdgeMetrics) -> None:
    app = FastAPI()
    app.include_router(metrics_router(edge.registry))
    edge.prompt_tokens.inc(42)
    with TestClient(app) as client:
        response = client.get("/metrics", follow_redirects=False)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert 'asymspec_prompt_tokens_total{mode="asymspec",model_name="m"} 42.0' in response.text
        openmetrics = client.get("/metrics", headers={"accept": "application/openmetrics-text"})
        assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
        assert openmetrics.text.endswith("# EOF\n")
