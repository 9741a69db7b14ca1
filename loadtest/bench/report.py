"""What one (mode, profile) cell reports: one row of results.json.

Inputs: the client's per-request records of the measured phase, and the deltas of both
services' Prometheus counters over that phase (scraped just before and just after it).

Throughput and latency (client side)
    throughput_tok_s  = sum(usage.completion_tokens) / wall time of the measured phase
                        (first request sent -> last stream ended); warm-up excluded
    ttft/tpot/e2e     = p50/p90/p99 over the successful requests (linear interpolation);
                        TPOT = (e2e - TTFT) / (completion_tokens - 1), vLLM's benchmark

Per generated token (``tokens`` = client-counted completion tokens)
    uplink/downlink_bytes_per_token = Δ edge asymspec_link_bytes_total{direction} / tokens
        (channel payload bytes, every frame: session open with the prompt ids, blocks,
        corrections, session close; not TCP/WebSocket headers)
    uplink_session_bytes_per_token  = the part of the uplink that opens and closes sessions:
        Δ edge asymspec_link_message_bytes_total{direction="uplink", message=OpenSession or
        CloseSession} (the prompt ids travel zlib-compressed, so their size depends on the
        text, not only its length); uplink_block_bytes_per_token is the rest: the per-block
        traffic (draft tokens, q(x), corrections requests)
    target_calls_per_token          = Δ cloud asymspec_target_forward_calls_total / tokens:
        batched target forwards (prefill + verify + decode); one forward verifies many blocks
    target_sequence_calls_per_token = (Δ verify_batch_size_sum + Δ prefill calls) / tokens:
        per-request target invocations as SPADE counts them (no batching credit)
    mean_accepted_per_block         = Δ accepted tokens / Δ drafts (blocks)

Latency breakdown (the paper's Fig. 2), per request, speculative modes
    A request's latency is a sequence of blocks; per block it waits for a draft forward, for
    the block's round trip to the cloud (upload, queue, target forward, download), and for
    whatever else holds it (its turn at the edge's batched drafting, the stop-and-wait lock,
    correction round trips, the event loop). From the metric sums, per block:

        draft    = Δ draft_forward_seconds_sum / Δ _count    (one batched draft forward)
        rtt      = Δ verify_round_trip_seconds_sum / Δ _count (edge: send -> verdict)
        queue    = Δ cloud verify_queue_wait_seconds_sum / Δ _count
        verify   = Δ cloud target_forward_seconds_sum / Δ _count (one batched forward)
        network  = max(0, rtt - queue - verify)
        upload   = network * t_up / (t_up + t_down),  download = network - upload, where
                   t_up = uplink bytes / uplink rate, t_down = downlink bytes / downlink rate
                   at the profile's rates (time each direction would need at line rate)

    Each component is scaled by blocks per request (Δ drafts / successful requests), and
        wait = max(0, mean e2e - draft - upload - queue - verify - download)
    so that the six components sum to the mean end-to-end latency, as the paper's bars do.
    "wait" is therefore the request's time not spent in its own draft or its own round trip.
    The edge's own idle time is reported beside it: edge_idle_s = wall - Δ edge busy
    seconds (the busy counter is exact; the idle counter only ticks when the next draft
    starts, so it would charge the pause before the phase to the phase).

    draft-only: draft = mean draft forward × tokens per request; target-only: queue and
    verify = mean queue wait and mean target forward × tokens per request (one decode step
    per token); wait is again the remainder. The cloud's queue-wait histogram also times
    prefill and session-close jobs, which are few (two per request) and short.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from asymspec.links import LinkProfile
from asymspec.modes import get_mode
from loadtest.bench.loadgen import PhaseResult, RequestRecord
from loadtest.bench.prometheus import Snapshot

_SESSION_MESSAGES = ("OpenSession", "CloseSession")

PERCENTILES = (50, 90, 99)
BREAKDOWN = ("draft", "upload", "queue", "verify", "download", "wait")
CORRECTION_KINDS = ("topk", "proposals", "full", "cloud")
_BITS_PER_BYTE = 8
_BITS_PER_MBIT = 1_000_000


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation, numpy's default); None for no values."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _mean_of(delta: Snapshot, histogram: str) -> float:
    count = delta.value(f"{histogram}_count")
    return delta.value(f"{histogram}_sum") / count if count else 0.0


def link_split(
    network_s: float, up_bytes: float, down_bytes: float, profile: LinkProfile
) -> tuple[float, float]:
    """Split a round trip's network time into (upload, download) by each direction's line-rate
    transfer time; by bytes alone when the link is unshaped."""
    up_rate = profile.uplink_mbit_s * _BITS_PER_MBIT / _BITS_PER_BYTE
    down_rate = profile.downlink_mbit_s * _BITS_PER_MBIT / _BITS_PER_BYTE
    if math.isinf(up_rate) or math.isinf(down_rate):
        t_up, t_down = up_bytes, down_bytes
    else:
        t_up, t_down = up_bytes / up_rate, down_bytes / down_rate
    total = t_up + t_down
    if total <= 0:
        return network_s / 2, network_s / 2
    return network_s * t_up / total, network_s * t_down / total


def breakdown(
    mode: str,
    edge: Snapshot,
    cloud: Snapshot,
    profile: LinkProfile,
    mean_e2e_s: float,
    requests: int,
    tokens_per_request: float,
) -> dict[str, float]:
    """Mean per-request latency split into BREAKDOWN components (see the module docstring)."""
    parts = dict.fromkeys(BREAKDOWN, 0.0)
    if requests <= 0:
        return parts
    operating = get_mode(mode)
    if operating.is_draft_only:
        parts["draft"] = _mean_of(edge, "asymspec_draft_forward_seconds") * tokens_per_request
    elif operating.is_target_only:
        parts["queue"] = _mean_of(cloud, "asymspec_verify_queue_wait_seconds") * tokens_per_request
        parts["verify"] = _mean_of(cloud, "asymspec_target_forward_seconds") * tokens_per_request
    else:
        blocks_per_request = edge.value("asymspec_spec_decode_num_drafts_total") / requests
        draft = _mean_of(edge, "asymspec_draft_forward_seconds")
        rtt = _mean_of(edge, "asymspec_verify_round_trip_seconds")
        queue = _mean_of(cloud, "asymspec_verify_queue_wait_seconds")
        verify = _mean_of(cloud, "asymspec_target_forward_seconds")
        upload, download = link_split(
            max(0.0, rtt - queue - verify),
            edge.value("asymspec_link_bytes_total", direction="uplink"),
            edge.value("asymspec_link_bytes_total", direction="downlink"),
            profile,
        )
        per_block = {
            "draft": draft, "upload": upload, "queue": queue, "verify": verify,
            "download": download,
        }  # fmt: skip
        parts.update({k: v * blocks_per_request for k, v in per_block.items()})
    parts["wait"] = max(0.0, mean_e2e_s - sum(v for k, v in parts.items() if k != "wait"))
    return parts


def summarize(
    mode: str,
    profile: LinkProfile,
    records: Sequence[RequestRecord],
    wall_s: float,
    edge: Snapshot,
    cloud: Snapshot,
) -> dict[str, Any]:
    """One results.json row (without the run configuration, which the runner adds)."""
    ok = [r for r in records if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    row: dict[str, Any] = {
        "mode": mode,
        "profile": profile.name,
        "requests": len(records),
        "failed": len(records) - len(ok),
        "wall_s": wall_s,
        "generated_tokens": tokens,
        "server_generated_tokens": edge.value("asymspec_generation_tokens_total"),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "throughput_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
    }
    series = {
        "ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
        "tpot": [t for r in ok if (t := r.tpot_s) is not None],
        "e2e": [r.e2e_s for r in ok],
    }
    for name, values in series.items():
        for q in PERCENTILES:
            row[f"{name}_p{q}_s"] = percentile(values, q)
        row[f"{name}_mean_s"] = float(np.mean(values)) if values else None
    row.update(_link_figures(edge, tokens))
    row.update(_spec_figures(edge, cloud, tokens))
    busy = edge.value("asymspec_edge_busy_seconds_total")
    row["edge_busy_s"] = busy
    row["edge_idle_s"] = max(0.0, wall_s - busy)
    row["edge_utilisation"] = _ratio(busy, wall_s)
    target_s = cloud.value("asymspec_target_forward_seconds_sum")
    row["cloud_target_forward_s"] = target_s
    row["cloud_utilisation"] = _ratio(target_s, wall_s)
    parts = breakdown(
        mode,
        edge,
        cloud,
        profile,
        row["e2e_mean_s"] or 0.0,
        len(ok),
        tokens / len(ok) if ok else 0.0,
    )
    row.update({f"breakdown_{k}_s": v for k, v in parts.items()})
    return row


def _link_figures(edge: Snapshot, tokens: int) -> dict[str, Any]:
    up = edge.value("asymspec_link_bytes_total", direction="uplink")
    down = edge.value("asymspec_link_bytes_total", direction="downlink")
    session = sum(
        edge.value("asymspec_link_message_bytes_total", direction="uplink", message=message)
        for message in _SESSION_MESSAGES
    )
    return {
        "uplink_bytes": up,
        "downlink_bytes": down,
        "uplink_bytes_per_token": _ratio(up, tokens),
        "downlink_bytes_per_token": _ratio(down, tokens),
        "uplink_session_bytes_per_token": _ratio(session, tokens),
        "uplink_block_bytes_per_token": _ratio(max(0.0, up - session), tokens),
        "uplink_frames": edge.value("asymspec_link_frames_total", direction="uplink"),
        "downlink_frames": edge.value("asymspec_link_frames_total", direction="downlink"),
    }


def _spec_figures(edge: Snapshot, cloud: Snapshot, tokens: int) -> dict[str, Any]:
    drafts = edge.value("asymspec_spec_decode_num_drafts_total")
    draft_tokens = edge.value("asymspec_spec_decode_num_draft_tokens_total")
    accepted = edge.value("asymspec_spec_decode_num_accepted_tokens_total")
    calls = cloud.by_label("asymspec_target_forward_calls_total", "kind")
    corrections = edge.by_label("asymspec_corrections_total", "kind")
    sequence_calls = cloud.value("asymspec_verify_batch_size_sum") + calls.get("prefill", 0.0)
    return {
        "blocks": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "mean_accepted_per_block": _ratio(accepted, drafts),
        "acceptance_rate": _ratio(accepted, draft_tokens),
        "target_calls": sum(calls.values()),
        "target_calls_by_kind": calls,
        "target_calls_per_token": _ratio(sum(calls.values()), tokens),
        "target_sequence_calls_per_token": _ratio(sequence_calls, tokens),
        "mean_verify_batch": _ratio(
            cloud.value("asymspec_verify_batch_size_sum"),
            cloud.value("asymspec_verify_batch_size_count"),
        ),
        **{f"corrections_{k}": corrections.get(k, 0.0) for k in CORRECTION_KINDS},
        "correction_rounds": edge.value("asymspec_correction_rounds_total"),
        "fidelity_spent": edge.value("asymspec_fidelity_budget_spent_total"),
        "wasted_draft_tokens": edge.value("asymspec_wasted_draft_tokens_total"),
    }


def summarize_phase(mode: str, profile: LinkProfile, phase: dict[str, Any]) -> dict[str, Any]:
    """``summarize`` of one phase as the driver wrote it (records, wall time, deltas)."""
    result = PhaseResult.from_json(phase)
    row = summarize(
        mode,
        profile,
        result.records,
        result.wall_s,
        Snapshot.from_json(phase["edge_delta"]),
        Snapshot.from_json(phase["cloud_delta"]),
    )
    row["error"] = None
    row["request_errors"] = [r.error for r in result.records if not r.ok][:3]
    return row
