"""The benchmark's pure parts: percentiles, metric deltas, the latency breakdown, per-token
figures and the results.json row schema."""

from __future__ import annotations

import math

import numpy as np
import pytest

from asymspec.links import get_profile
from loadtest.bench.loadgen import RequestRecord
from loadtest.bench.prometheus import Snapshot
from loadtest.bench.report import (
    BREAKDOWN,
    breakdown,
    link_split,
    percentile,
    summarize,
)
from loadtest.bench.tables import REQUIRED_ROW_FIELDS, check_rows

EXPOSITION = """\
# HELP asymspec_link_bytes_total Channel bytes as seen by the edge.
# TYPE asymspec_link_bytes_total counter
asymspec_link_bytes_total{direction="uplink",mode="asymspec",model_name="m"} 1000.0
asymspec_link_bytes_total{direction="downlink",mode="asymspec",model_name="m"} 3000.0
# HELP asymspec_corrections_total Recovered tokens by kind.
# TYPE asymspec_corrections_total counter
asymspec_corrections_total{kind="topk",mode="asymspec",model_name="m"} 5.0
asymspec_corrections_total{kind="full",mode="asymspec",model_name="m"} 1.0
# HELP asymspec_draft_forward_seconds Time of one batched draft forward.
# TYPE asymspec_draft_forward_seconds histogram
asymspec_draft_forward_seconds_bucket{le="+Inf",mode="asymspec",model_name="m"} 4.0
asymspec_draft_forward_seconds_count{mode="asymspec",model_name="m"} 4.0
asymspec_draft_forward_seconds_sum{mode="asymspec",model_name="m"} 0.2
"""


def snapshot(**values: float) -> Snapshot:
    """A snapshot from ``name=value`` (labels as ``name__label_value``)."""
    samples = {}
    for key, value in values.items():
        name, _, label = key.partition("__")
        pairs = [part.partition("_") for part in label.split("__")] if label else []
        samples[(name, tuple(sorted((k, v) for k, _, v in pairs)))] = value
    return Snapshot(samples)


def test_percentile_is_linear_and_empty_is_none() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5  # between the middle two
    assert percentile(list(range(101)), 90) == pytest.approx(90.0)
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)


def test_snapshot_parse_drops_app_labels_and_takes_deltas() -> None:
    before = Snapshot.parse(EXPOSITION)
    assert before.value("asymspec_link_bytes_total", direction="uplink") == 1000.0
    assert before.by_label("asymspec_corrections_total", "kind") == {"topk": 5.0, "full": 1.0}
    assert before.total("asymspec_corrections_total") == 6.0
    assert before.value("asymspec_draft_forward_seconds_sum") == pytest.approx(0.2)
    assert before.value("asymspec_never_fired_total") == 0.0
    after = Snapshot.parse(EXPOSITION.replace("1000.0", "1800.0"))
    delta = after.minus(before)
    assert delta.value("asymspec_link_bytes_total", direction="uplink") == 800.0
    assert delta.value("asymspec_link_bytes_total", direction="downlink") == 0.0
    assert Snapshot.from_json(delta.to_json()) == delta


def test_link_split_weights_each_direction_by_its_line_rate() -> None:
    weak = get_profile("weak")  # 50 up / 150 down Mbit/s
    # Equal bytes take 3x longer up than down, so the uplink gets 3/4 of the network time.
    up, down = link_split(1.0, 1000, 1000, weak)
    assert (up, down) == pytest.approx((0.75, 0.25))
    up, down = link_split(1.0, 0, 5000, weak)
    assert (up, down) == (0.0, 1.0)
    assert link_split(0.4, 100, 300, get_profile("ideal")) == pytest.approx((0.1, 0.3))
    assert link_split(0.4, 0, 0, weak) == (0.2, 0.2)


def test_breakdown_of_a_speculative_mode_sums_to_the_mean_e2e() -> None:
    # 40 blocks over 4 requests (10 per request); per block: draft 20 ms, round trip 100 ms
    # of which queue 10 ms and verify 50 ms, so 40 ms on the wire.
    edge = snapshot(
        asymspec_spec_decode_num_drafts_total=40,
        asymspec_draft_forward_seconds_sum=0.4, asymspec_draft_forward_seconds_count=20,
        asymspec_verify_round_trip_seconds_sum=4.0, asymspec_verify_round_trip_seconds_count=40,
        asymspec_link_bytes_total__direction_uplink=1000,
        asymspec_link_bytes_total__direction_downlink=3000,
    )  # fmt: skip
    cloud = snapshot(
        asymspec_verify_queue_wait_seconds_sum=0.4, asymspec_verify_queue_wait_seconds_count=40,
        asymspec_target_forward_seconds_sum=1.0, asymspec_target_forward_seconds_count=20,
    )  # fmt: skip
    parts = breakdown("asymspec", edge, cloud, get_profile("weak"), 2.0, 4, 64)
    assert list(parts) == list(BREAKDOWN)
    per_request = {k: v / 10 for k, v in parts.items()}
    assert per_request["draft"] == pytest.approx(0.02)
    assert per_request["queue"] == pytest.approx(0.01)
    assert per_request["verify"] == pytest.approx(0.05)
    # 1000 B up at 50 Mbit/s = 160 us, 3000 B down at 150 Mbit/s = 160 us: an even split.
    assert per_request["upload"] == pytest.approx(0.02)
    assert per_request["download"] == pytest.approx(0.02)
    assert sum(parts.values()) == pytest.approx(2.0)
    assert parts["wait"] == pytest.approx(2.0 - 1.2)


def test_breakdown_never_goes_negative() -> None:
    edge = snapshot(
        asymspec_spec_decode_num_drafts_total=10,
        asymspec_verify_round_trip_seconds_sum=0.1, asymspec_verify_round_trip_seconds_count=10,
    )  # fmt: skip
    cloud = snapshot(
        asymspec_target_forward_seconds_sum=1.0, asymspec_target_forward_seconds_count=10
    )
    parts = breakdown("standard", edge, cloud, get_profile("strong"), 0.5, 1, 32)
    assert parts["upload"] == parts["download"] == 0.0  # round trip < forward: clipped
    assert parts["wait"] == 0.0 and all(v >= 0 for v in parts.values())


def test_breakdown_of_the_non_speculative_modes() -> None:
    edge = snapshot(
        asymspec_draft_forward_seconds_sum=1.0, asymspec_draft_forward_seconds_count=100
    )
    parts = breakdown("draft-only", edge, Snapshot.empty(), get_profile("weak"), 1.0, 2, 64)
    assert parts["draft"] == pytest.approx(0.64) and parts["wait"] == pytest.approx(0.36)
    cloud = snapshot(
        asymspec_target_forward_seconds_sum=2.0, asymspec_target_forward_seconds_count=100
    )
    parts = breakdown("target-only", Snapshot.empty(), cloud, get_profile("weak"), 2.0, 2, 64)
    assert parts["verify"] == pytest.approx(1.28) and parts["draft"] == 0.0


def record(index: int, ttft: float, e2e: float, tokens: int, error: str | None = None):
    return RequestRecord(index, 0.0, e2e, ttft, 100, tokens, "x" * tokens, error)


def test_summarize_row_has_the_schema_and_per_token_figures() -> None:
    records = [record(0, 0.5, 2.5, 65), record(1, 1.0, 5.0, 65), record(2, 0, 0, 0, "boom")]
    edge = snapshot(
        asymspec_generation_tokens_total=130,
        asymspec_link_bytes_total__direction_uplink=2600,
        asymspec_link_bytes_total__direction_downlink=1300,
        asymspec_link_message_bytes_total__direction_uplink__message_OpenSession=300,
        asymspec_link_message_bytes_total__direction_uplink__message_CloseSession=40,
        asymspec_link_message_bytes_total__direction_uplink__message_VerifyBlock=2260,
        asymspec_spec_decode_num_drafts_total=40,
        asymspec_spec_decode_num_draft_tokens_total=160,
        asymspec_spec_decode_num_accepted_tokens_total=90,
        asymspec_corrections_total__kind_topk=25,
        asymspec_edge_busy_seconds_total=2.0,
    )
    cloud = snapshot(
        asymspec_target_forward_calls_total__kind_verify=30,
        asymspec_target_forward_calls_total__kind_prefill=2,
        asymspec_verify_batch_size_sum=40,
        asymspec_verify_batch_size_count=30,
    )
    row = summarize("asymspec", get_profile("weak"), records, 10.0, edge, cloud)
    assert set(REQUIRED_ROW_FIELDS) <= set(row)
    check_rows([row])
    assert row["failed"] == 1 and row["generated_tokens"] == 130
    assert row["throughput_tok_s"] == pytest.approx(13.0)
    assert row["uplink_bytes_per_token"] == pytest.approx(20.0)
    assert row["downlink_bytes_per_token"] == pytest.approx(10.0)
    assert row["target_calls_per_token"] == pytest.approx(32 / 130)
    assert row["target_sequence_calls_per_token"] == pytest.approx(42 / 130)
    assert row["mean_accepted_per_block"] == pytest.approx(2.25)
    assert row["acceptance_rate"] == pytest.approx(90 / 160)
    assert row["corrections_topk"] == 25 and row["corrections_full"] == 0
    assert row["ttft_p50_s"] == pytest.approx(0.75)
    assert row["tpot_p50_s"] == pytest.approx(np.mean([2.0 / 64, 4.0 / 64]))
    assert row["e2e_p50_s"] == pytest.approx(3.75)
    assert row["edge_idle_s"] == pytest.approx(8.0)
    assert row["uplink_session_bytes_per_token"] * 130 == pytest.approx(340)
    blocks = row["uplink_block_bytes_per_token"] + row["uplink_session_bytes_per_token"]
    assert blocks == pytest.approx(20.0)
    assert math.isclose(sum(row[f"breakdown_{k}_s"] for k in BREAKDOWN), row["e2e_mean_s"])


def test_check_rows_rejects_a_row_missing_a_field_but_not_a_failed_cell() -> None:
    check_rows([{"mode": "standard", "profile": "weak", "error": "cloud exited"}])
    with pytest.raises(ValueError, match="throughput_tok_s"):
        check_rows([{"mode": "standard", "profile": "weak", "error": None}])
