"""Per-request speculation stats in responses (vLLM's metrics.speculative_decoding,
llama.cpp's timings), checked against the edge's own Prometheus counters for the same
requests, in every speculative mode; streamed and not; the official client still parses.

Real processes (the e2e module's fixtures): one cloud, an edge per mode, the tiny pair.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from asymspec.modes import get_mode
from loadtest.processes import Service
from tests.services.test_e2e import SPECULATIVE, edges, feature_draft, pair  # noqa: F401 - module fixtures

COUNTERS = {  # the stats field -> (counter, labels)
    "num_drafts": ("asymspec_spec_decode_num_drafts", {}),
    "num_draft_tokens": ("asymspec_spec_decode_num_draft_tokens", {}),
    "num_accepted_tokens": ("asymspec_spec_decode_num_accepted_tokens", {}),
    "uplink_bytes": ("asymspec_link_bytes", {"direction": "uplink"}),
    "downlink_bytes": ("asymspec_link_bytes", {"direction": "downlink"}),
}
KINDS = ("topk", "proposals", "full", "cloud")


def counters(edge: Service) -> dict[str, float]:
    """The counters the stats must add up to, from the edge's /metrics."""
    found: dict[str, float] = {}
    text = httpx.get(f"{edge.url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            name = sample.name.removesuffix("_total")
            for field, (counter, labels) in COUNTERS.items():
                if name == counter and all(sample.labels.get(k) == v for k, v in labels.items()):
                    found[field] = found.get(field, 0.0) + sample.value
            if name == "asymspec_corrections":
                key = f"corrections.{sample.labels['kind']}"
                found[key] = found.get(key, 0.0) + sample.value
            if name == "asymspec_spec_decode_num_accepted_tokens_per_pos":
                key = f"pos.{sample.labels['position']}"
                found[key] = found.get(key, 0.0) + sample.value
    return found


def completion(edge: Service, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{edge.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def streamed_chat(edge: Service, body: dict[str, Any]) -> dict[str, Any]:
    """The last data chunk of a streamed chat (it carries the stats)."""
    last = None
    with httpx.stream("POST", f"{edge.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                last = json.loads(line.removeprefix("data: "))
    assert last is not None
    return last


@pytest.mark.parametrize("mode", SPECULATIVE)
def test_stats_add_up_to_the_edge_counters(edges: dict[str, Service], mode: str) -> None:  # noqa: F811
    edge = edges[mode]
    before = counters(edge)
    responses = [
        completion(edge, {"model": "asymspec", "prompt": "def add(a, b):", "max_tokens": 20,
                          "temperature": 0.9, "seed": 3, "ignore_eos": True}),
        completion(edge, {"model": "asymspec", "prompt": "The quick", "max_tokens": 12,
                          "temperature": 0, "ignore_eos": True}),
        streamed_chat(edge, {"model": "asymspec", "max_tokens": 16, "temperature": 0.7,
                             "seed": 5, "stream": True,
                             "messages": [{"role": "user", "content": "print the squares"}]}),
        streamed_chat(edge, {"model": "asymspec", "max_tokens": 10, "temperature": 0,
                             "stream": True, "stream_options": {"include_usage": True},
                             "messages": [{"role": "user", "content": "hello"}]}),
    ]  # fmt: skip
    after = counters(edge)
    stats = [r["metrics"]["speculative_decoding"] for r in responses]
    for s, r in zip(stats, responses, strict=True):
        assert 0 <= s["num_accepted_tokens"] <= s["num_draft_tokens"]
        assert s["num_drafts"] >= 1 and s["verify_round_trips"] == s["num_drafts"]
        assert sum(s["num_accepted_tokens_per_pos"]) == s["num_accepted_tokens"]
        assert r["timings"]["draft_n"] == s["num_draft_tokens"]
        assert r["timings"]["draft_n_accepted"] == s["num_accepted_tokens"]
        assert r["timings"]["prompt_ms"] >= 0 and r["timings"]["predicted_ms"] >= 0
    assert responses[-1]["usage"] is not None  # include_usage: the usage chunk is the last
    for field in COUNTERS:
        increase = after.get(field, 0.0) - before.get(field, 0.0)
        assert sum(s[field] for s in stats) == increase, field
    for kind in KINDS:
        key = f"corrections.{kind}"
        increase = after.get(key, 0.0) - before.get(key, 0.0)
        assert sum(s["corrections"].get(kind, 0) for s in stats) == increase, kind
    positions = max(len(s["num_accepted_tokens_per_pos"]) for s in stats)
    for position in range(positions):
        key = f"pos.{position}"
        increase = after.get(key, 0.0) - before.get(key, 0.0)
        per_request = [s["num_accepted_tokens_per_pos"] for s in stats]
        assert sum(p[position] for p in per_request if position < len(p)) == increase


@pytest.mark.parametrize("mode", SPECULATIVE)
def test_a_speculating_requests_first_token_is_sampled_from_its_prefill(
    edges: dict[str, Service],  # noqa: F811
    mode: str,
) -> None:
    """The system's own modes take the first token from the prompt's last row, sent down
    behind the open: a one-token request needs no block and no verify trip. The baselines
    draft it as the systems they stand for do."""
    body = {"model": "asymspec", "prompt": "Once upon", "max_tokens": 1, "temperature": 0.8,
            "seed": 11, "ignore_eos": True}  # fmt: skip
    response = completion(edges[mode], body)
    stats = response["metrics"]["speculative_decoding"]
    assert response["usage"]["completion_tokens"] == 1 and stats["paused_tokens"] == {}
    if get_mode(mode).first_token_from_prefill:
        assert stats["num_drafts"] == 0 and stats["verify_round_trips"] == 0, stats
    else:
        assert stats["num_drafts"] == 1 and stats["verify_round_trips"] == 1, stats


def test_official_client_parses_responses_with_stats(edges: dict[str, Service]) -> None:  # noqa: F811
    client = OpenAI(base_url=f"{edges['asymspec'].url}/v1", api_key="unused")
    done = client.completions.create(model="asymspec", prompt="hi", max_tokens=6, temperature=0)
    extra = done.model_extra or {}
    assert extra["metrics"]["speculative_decoding"]["num_drafts"] >= 1
    assert extra["timings"]["predicted_n"] == done.usage.completion_tokens  # type: ignore[union-attr]
    chunks = list(
        client.chat.completions.create(
            model="asymspec",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=6,
            stream=True,
        )
    )
    assert (chunks[-1].model_extra or {})["timings"]["draft_n"] >= 1
