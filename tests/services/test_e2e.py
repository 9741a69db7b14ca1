"""End to end through real processes: a cloud verifier and edge gateways in several modes,
on loopback, with a tiny real model pair, driven over HTTP like a user would.

- greedy output through every speculative mode equals target-only output, also where
  requests go from speculation to the cloud's own decoding and back (a batch limit);
- at temperature 1 the first three tokens follow the target's exact joint distribution;
- concurrent streams finish with correct usage, and /metrics agrees with the clients;
- the official openai client works unmodified; bad input gets OpenAI error bodies.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from scipy import stats
from transformers import AutoModelForCausalLM

from asymspec.sampling import SamplingParams, transform
from loadtest.processes import (
    Service,
    cloud_env,
    edge_env,
    free_port,
    running,
    running_all,
)
from loadtest.tiny_models import save_tiny_feature_draft, save_tiny_pair
from tests.engine.conftest import full_logits

SPECULATIVE = (
    "asymspec", "no-topk", "full-upload", "standard", "no-pipeline", "runahead", "pipeinfer",
)  # fmt: skip
STOP_CONFIDENCE = "0.1"
# Edge variants by name: (mode, extra edge settings).
VARIANTS = {
    **{mode: (mode, {}) for mode in ("target-only", "draft-only", *SPECULATIVE)},
    "asymspec-adaptive": ("asymspec", {"draft_length": "adaptive"}),
    # Blocks end after an unsure draft token; τ cuts some of the tiny draft's blocks, not all.
    "asymspec-stop": ("asymspec", {"draft_stop_confidence": STOP_CONFIDENCE}),
    # Speculation pauses while more than one request decodes: the cloud decodes them alone.
    # A request that opens paused opens its draft empty; in chunks of 8 tokens, the draft's
    # catch-up when it drafts again is longer than one chunk.
    "asymspec-paused": (
        "asymspec",
        {"speculative_disable_by_batch_size": "1", "draft_prefill_chunk_tokens": "8"},
    ),
    # The product's default: speculation pauses where the goodput model says it loses.
    "asymspec-goodput": ("asymspec", {"goodput_pause": "true"}),
    # Suffix blocks only where the drafter has no doubt, for a comparison without them.
    "asymspec-nosuffix": ("asymspec", {"suffix_drafting": "false"}),
}
# Edges whose draft is a feature draft of the tiny target (fed the target's hidden states).
FEATURE_VARIANTS = {
    "feature-asymspec": "asymspec", "feature-runahead": "runahead",
    "feature-pipeinfer": "pipeinfer",
}  # fmt: skip
PROMPT_IDS = [40, 41, 42, 43, 44, 45]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def feature_draft(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_feature_draft(pair[0], tmp_path_factory.mktemp("feature-draft"))


@pytest.fixture(scope="module")
def edges(
    pair: tuple[Path, Path], feature_draft: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("logs")
    with ExitStack() as stack:
        cloud_port = free_port()
        stack.enter_context(
            running("cloud_verifier", cloud_port, cloud_env(pair[0], cloud_port), logs)
        )
        specs = {}
        for name, (mode, extra) in VARIANTS.items():
            port = free_port()
            env = edge_env(pair[1], port, cloud_port, mode, max_model_len="512", **extra)
            specs[name] = ("edge_gateway", port, env)
        for name, mode in FEATURE_VARIANTS.items():
            port = free_port()
            env = edge_env(feature_draft, port, cloud_port, mode, max_model_len="512")
            specs[name] = ("edge_gateway", port, env)
        yield stack.enter_context(running_all(specs, logs))


def complete(edge: Service, **body: object) -> dict:
    body = {"model": "asymspec", **body}
    response = httpx.post(f"{edge.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def stream_chat(edge: Service, **body: object) -> tuple[str, dict | None, str | None]:
    """Streamed chat: (content, usage chunk, finish_reason)."""
    body = {"model": "asymspec", "stream": True, **body}
    content, usage, finish = "", None, None
    with httpx.stream("POST", f"{edge.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        assert "error" not in chunk, chunk
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk["choices"]:
            content += choice["delta"].get("content") or ""
            finish = choice.get("finish_reason") or finish
    return content, usage, finish


# ---------------------------------------------------------------- greedy equivalence


@pytest.mark.parametrize(
    "mode", [*SPECULATIVE, "asymspec-adaptive", "asymspec-stop", *FEATURE_VARIANTS]
)
def test_greedy_completions_match_target_only(edges: dict[str, Service], mode: str) -> None:
    for prompt in ("def add(a, b):", "The quick brown", PROMPT_IDS):
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        expected = complete(edges["target-only"], **body)["choices"][0]["text"]
        got = complete(edges[mode], **body)["choices"][0]["text"]
        assert got == expected


@pytest.mark.parametrize("mode", [*SPECULATIVE, *FEATURE_VARIANTS])
def test_greedy_chat_stream_matches_target_only(edges: dict[str, Service], mode: str) -> None:
    messages = [{"role": "user", "content": "print the squares"}]
    body = {"messages": messages, "max_tokens": 20, "temperature": 0}
    expected = httpx.post(
        f"{edges['target-only'].url}/v1/chat/completions", json=body, timeout=60
    ).json()["choices"][0]["message"]["content"]
    content, usage, _ = stream_chat(edges[mode], stream_options={"include_usage": True}, **body)
    assert content == expected
    assert usage is not None and usage["completion_tokens"] <= 20


async def completed_together(edge: Service, bodies: list[dict[str, Any]]) -> list[dict]:
    """The replies to ``bodies`` sent to ``edge``'s completions route all at once."""
    async with httpx.AsyncClient(base_url=edge.url, timeout=60) as client:
        replies = await asyncio.gather(
            *(client.post("/v1/completions", json={"model": "asymspec", **b}) for b in bodies)
        )
    return [r.json() for r in replies]


def texts(replies: list[dict]) -> list[str]:
    return [reply["choices"][0]["text"] for reply in replies]


def test_paused_speculation_keeps_greedy_output(edges: dict[str, Service]) -> None:
    """Above its batch limit (1 here) a request lets the cloud decode it alone, and stops
    the cloud's generation to speculate again once alone: of three concurrent greedy
    requests of different lengths the longest goes both ways, and each equals target-only's
    output. The longest opened paused, so its draft opened empty and caught up (the cloud
    decoding meanwhile) before it drafted."""
    edge = edges["asymspec-paused"]
    bodies = [
        {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        for prompt, n in (("def add(a, b):", 12), ("The quick brown", 24), (PROMPT_IDS, 100))
    ]
    expected = [complete(edges["target-only"], **body)["choices"][0]["text"] for body in bodies]
    names = ("asymspec_cloud_decoded_tokens_total", "asymspec_spec_decode_num_drafts_total")
    before = [metric_value(edge, name) for name in names]

    replies = asyncio.run(completed_together(edge, bodies))
    assert texts(replies) == expected
    decoded, blocks = (metric_value(edge, name) - b for name, b in zip(names, before, strict=True))
    assert decoded >= 16 and blocks >= 1, (decoded, blocks)
    longest = replies[2]["metrics"]["speculative_decoding"]
    assert longest["num_drafts"] >= 1 and longest["paused_tokens"]["batch_size"] >= 1, longest
    assert longest["paused_tokens"]["draft_catching_up"] >= 1, longest


def test_the_goodput_pause_measures_both_modes_for_a_lone_request(
    edges: dict[str, Service],
) -> None:
    """The measured pause tries speculating and the cloud decoding alone in turn for lone
    requests (32 tokens each before it compares them, whatever the goodput model says),
    shows both rates at batch size 1, and every output equals target-only's."""
    edge = edges["asymspec-goodput"]
    bodies = [
        {"prompt": [*PROMPT_IDS, 90 + i], "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        for i in range(6)
    ]
    names = ("asymspec_cloud_decoded_tokens_total", "asymspec_spec_decode_num_drafts_total")
    before = [metric_value(edge, name) for name in names]
    for body in bodies:
        expected = complete(edges["target-only"], **body)["choices"][0]["text"]
        assert complete(edge, **body)["choices"][0]["text"] == expected
    decoded, blocks = (metric_value(edge, name) - b for name, b in zip(names, before, strict=True))
    assert decoded >= 32 and blocks >= 8, (decoded, blocks)
    text = httpx.get(f"{edge.url}/metrics").text
    rates = {
        sample.labels["source"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "asymspec_pause_measured_tokens_per_second"
        and sample.labels["batch"] == "1"
        and sample.labels["sampling"] == "greedy"
    }
    assert set(rates) == {"speculating", "decoding"} and min(rates.values()) > 0, rates


def test_the_goodput_pause_hands_a_crowd_to_the_cloud_exactly(edges: dict[str, Service]) -> None:
    """With the goodput pause on, once the edge has seen enough blocks and the verifier's
    fitted cost, eight concurrent greedy requests let the cloud decode for them where the
    model says speculation loses (the tiny pair's noisy draft, two groups taking turns):
    some tokens come from the cloud's own decoding, some from blocks, and every output
    equals target-only's."""
    edge = edges["asymspec-goodput"]
    bodies = [
        {"prompt": [*PROMPT_IDS, 50 + i], "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        for i in range(8)
    ]
    expected = [complete(edges["target-only"], **body)["choices"][0]["text"] for body in bodies]
    names = ("asymspec_cloud_decoded_tokens_total", "asymspec_spec_decode_num_drafts_total")
    before = [metric_value(edge, name) for name in names]

    for _ in range(3):  # the first round teaches the edge α and the cost
        assert texts(asyncio.run(completed_together(edge, bodies))) == expected
    decoded, blocks = (metric_value(edge, name) - b for name, b in zip(names, before, strict=True))
    assert decoded >= 32 and blocks >= 8, (decoded, blocks)
    # The same edge with the pause off speculates throughout (the other variants' default).
    assert metric_value(edges["asymspec"], "asymspec_cloud_decoded_tokens_total") == 0


def _rounds(edge: Service, first: list[int], n_rounds: int, max_tokens: int) -> list[list[int]]:
    """A conversation replayed round by round on ``edge``: each round's prompt is the last
    prompt, the model's own answer and the first prompt again (an agent resending its
    history and asking again), greedy. Returns each round's output token ids."""
    prompt, outputs = list(first), []
    for _ in range(n_rounds):
        body: dict[str, Any] = {
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True,
        }  # fmt: skip
        choice = complete(edge, **body)["choices"][0]
        outputs.append(choice["token_ids"])
        prompt = [*prompt, *choice["token_ids"], 7, *first]
    return outputs


@pytest.mark.parametrize("mode", ["asymspec", "full-upload", "standard", "asymspec-paused"])
def test_suffix_blocks_keep_greedy_output_over_rounds(edges: dict[str, Service], mode: str) -> None:
    """Multi-round conversations where the history repeats: the suffix drafter proposes
    blocks without the draft model, and every round's output equals target-only's."""
    names = (
        "asymspec_spec_decode_num_suffix_drafts_total",
        "asymspec_spec_decode_num_suffix_draft_tokens_total",
    )
    before = [metric_value(edges[mode], name) for name in names]
    for first in ([*PROMPT_IDS, 60], [12, 13, 14, 15, 16]):
        expected = _rounds(edges["target-only"], first, 3, 40)
        assert _rounds(edges[mode], first, 3, 40) == expected
    blocks, tokens = (metric_value(edges[mode], n) - b for n, b in zip(names, before, strict=True))
    assert blocks >= 2 and tokens >= 2 * blocks, (blocks, tokens)
    assert metric_value(edges["asymspec-nosuffix"], names[0]) == 0


def test_concurrent_conversations_with_suffix_blocks_match_target_only(
    edges: dict[str, Service],
) -> None:
    """Several conversations at once, the edge's store of outputs shared between them."""
    firsts = [[*PROMPT_IDS, 70 + i] for i in range(4)]
    expected = [_rounds(edges["target-only"], f, 2, 32) for f in firsts]

    async def together() -> list[list[list[int]]]:
        return await asyncio.gather(
            *(asyncio.to_thread(_rounds, edges["asymspec"], f, 2, 32) for f in firsts)
        )

    assert asyncio.run(together()) == expected


# ---------------------------------------------------------------- distribution


def exact_joint(
    target_dir: Path, params: SamplingParams, length: int
) -> dict[tuple[int, ...], float]:
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        grown = {}
        for seq, prob in joint.items():
            row = transform(full_logits(model, [*PROMPT_IDS, *seq])[-1], params).double()
            for token in torch.nonzero(row).flatten().tolist():
                grown[(*seq, token)] = prob * float(row[token] / row.sum())
        joint = grown
    return joint


async def sample_first_tokens(edge: Service, n: int, top_k: int) -> Counter[tuple[int, ...]]:
    counts: Counter[tuple[int, ...]] = Counter()
    limit = asyncio.Semaphore(16)
    async with httpx.AsyncClient(base_url=edge.url, timeout=60) as client:

        async def one(seed: int) -> None:
            body = {
                "model": "asymspec", "prompt": PROMPT_IDS, "max_tokens": 3, "temperature": 1.0,
                "top_k": top_k, "seed": seed, "ignore_eos": True, "return_token_ids": True,
            }  # fmt: skip
            async with limit:
                response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            counts[tuple(response.json()["choices"][0]["token_ids"][:3])] += 1

        await asyncio.gather(*(one(seed) for seed in range(n)))
    return counts


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode",
    [
        "asymspec",
        "asymspec-stop",
        "no-topk",
        "full-upload",
        "runahead",
        "asymspec-paused",
        "target-only",
        "feature-asymspec",
        "feature-runahead",
    ],
)
def test_first_three_tokens_follow_the_target(
    edges: dict[str, Service], pair: tuple[Path, Path], mode: str
) -> None:
    n, top_k = 2000, 4  # top-k keeps the joint to 4^3 = 64 cells
    joint = exact_joint(pair[0], SamplingParams(temperature=1.0, top_k=top_k), 3)
    counts = asyncio.run(sample_first_tokens(edges[mode], n, top_k))
    assert sum(counts.values()) == n and set(counts) <= set(joint)
    assert chi_square_pvalue(joint, counts) > 0.001


async def sample_tokens(
    edge: Service, n: int, length: int, temperature: float, fidelity_budget: float
) -> list[tuple[int, ...]]:
    """``n`` seeded samples of the first ``length`` tokens, untruncated (no top-k/top-p)."""
    limit = asyncio.Semaphore(16)
    async with httpx.AsyncClient(base_url=edge.url, timeout=60) as client:

        async def one(seed: int) -> tuple[int, ...]:
            body = {
                "model": "asymspec", "prompt": PROMPT_IDS, "max_tokens": length,
                "temperature": temperature, "seed": seed, "ignore_eos": True,
                "return_token_ids": True, "fidelity_budget": fidelity_budget,
            }  # fmt: skip
            async with limit:
                response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return tuple(response.json()["choices"][0]["token_ids"][:length])

        return list(await asyncio.gather(*(one(seed) for seed in range(n))))


def exact_marginals(target_dir: Path, params: SamplingParams) -> list[dict[tuple[int, ...], float]]:
    """The exact distributions of the first and of the second generated token."""
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    first = transform(full_logits(model, PROMPT_IDS)[-1], params).double()
    first = first / first.sum()
    second = torch.zeros_like(first)
    for token in torch.nonzero(first).flatten().tolist():
        row = transform(full_logits(model, [*PROMPT_IDS, token])[-1], params).double()
        second += first[token] * row / row.sum()
    return [
        {(t,): float(dist[t]) for t in torch.nonzero(dist).flatten().tolist()}
        for dist in (first, second)
    ]


def corrections(edge: Service, kind: str) -> float:
    text = httpx.get(f"{edge.url}/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "asymspec_corrections_total" and sample.labels.get("kind") == kind
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("budget", "rung"),
    [(0.0, "proposals"), (0.05, "topk")],
    ids=["exact-proposals-first", "bounded-topk"],
)
def test_untruncated_sampling_follows_the_target(
    edges: dict[str, Service], pair: tuple[Path, Path], budget: float, rung: str
) -> None:
    """asymspec's default path: T = 0.7 with no truncation, so with ε = 0 a rejection is
    recovered from cloud proposals first (top-K can never certify exactly), and with ε > 0
    from a top-K whose certificate fits the budget. Both against the exact marginals of the
    first two tokens (the χ² cannot tell an ε-bounded deviation this small from exact)."""
    edge = edges["asymspec"]
    before = corrections(edge, rung)
    n = 3000
    samples = asyncio.run(sample_tokens(edge, n, 2, 0.7, budget))
    marginals = exact_marginals(pair[0], SamplingParams(temperature=0.7))
    for position, exact in enumerate(marginals):
        counts: Counter[tuple[int, ...]] = Counter((s[position],) for s in samples)
        assert chi_square_pvalue(exact, counts) > 0.001, position
    used = corrections(edge, rung) - before
    assert used > 50, f"only {used} {rung} corrections: the path under test barely ran"


def chi_square_pvalue(
    joint: dict[tuple[int, ...], float], counts: Counter[tuple[int, ...]]
) -> float:
    """Pearson's χ² of the observed sequences against the exact joint; cells expected
    fewer than 5 times are pooled into one."""
    n = sum(counts.values())
    cells = sorted(set(joint) | set(counts))
    expected = np.array([joint.get(c, 0.0) for c in cells]) * n
    observed = np.array([counts.get(c, 0) for c in cells])
    keep = expected >= 5
    observed = np.append(observed[keep], observed[~keep].sum())
    expected = np.append(expected[keep], expected[~keep].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return float(stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


# ---------------------------------------------------------------- load, usage, metrics


def metric_value(edge: Service, name: str) -> float:
    text = httpx.get(f"{edge.url}/metrics").text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_unsure_drafts_end_their_blocks_early(edges: dict[str, Service]) -> None:
    """With τ > 0 the same greedy request is drafted in more, shorter blocks than without,
    and some blocks still run their full γ (pinned: the goodput γ would move it)."""
    body = {
        "prompt": "The quick brown",
        "max_tokens": 64,
        "temperature": 0,
        "ignore_eos": True,
        "num_draft_tokens": 4,
    }
    per_block = {}
    for name in ("asymspec", "asymspec-stop"):
        blocks = metric_value(edges[name], "asymspec_spec_decode_num_drafts_total")
        drafted = metric_value(edges[name], "asymspec_spec_decode_num_draft_tokens_total")
        complete(edges[name], **body)
        blocks = metric_value(edges[name], "asymspec_spec_decode_num_drafts_total") - blocks
        drafted = metric_value(edges[name], "asymspec_spec_decode_num_draft_tokens_total") - drafted
        per_block[name] = drafted / blocks
    assert 1.0 < per_block["asymspec-stop"] < per_block["asymspec"] - 0.5


def test_a_feature_draft_is_sent_features_and_drafts_from_them(
    edges: dict[str, Service],
) -> None:
    """Whole blocks and rejections both happen: the draft opened on the prompt's features
    and fed each verdict's (a draft without them would fail the request)."""
    edge = edges["feature-asymspec"]
    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    before = [metric_value(edge, f"asymspec_spec_decode_{n}_total") for n in names]
    for seed in range(4):
        body = {"prompt": f"item {seed}:", "max_tokens": 32, "temperature": 0.7, "seed": seed}
        assert complete(edge, **body)["usage"]["completion_tokens"] > 0
    blocks, drafted, accepted = (
        metric_value(edge, f"asymspec_spec_decode_{n}_total") - b
        for n, b in zip(names, before, strict=True)
    )
    assert blocks > 0 and 0 < accepted < drafted


def test_draft_only_with_a_feature_draft_is_refused(feature_draft: Path, tmp_path: Path) -> None:
    """draft-only has no target to send features: the edge says why it cannot serve."""
    port = free_port()
    env = edge_env(feature_draft, port, free_port(), "draft-only")
    service = Service("edge_gateway", port, env, tmp_path / "edge.log")
    try:
        deadline = time.monotonic() + 120
        reason = ""
        while time.monotonic() < deadline and "feature draft" not in reason:
            with suppress(httpx.HTTPError):
                reason = httpx.get(f"{service.url}/health", timeout=2).json().get("reason", "")
            time.sleep(0.2)
        assert "needs a token draft" in reason
        assert httpx.get(f"{service.url}/health").status_code == 503
    finally:
        service.stop()


def test_concurrent_streams_report_correct_usage_and_metrics(edges: dict[str, Service]) -> None:
    edge = edges["asymspec"]
    before = metric_value(edge, "asymspec_generation_tokens_total")

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, int]:
        body = {
            "model": "asymspec", "prompt": f"item {i}:", "max_tokens": 16 + i % 8,
            "temperature": 0.8, "seed": i, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        pieces, usage = 0, None
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                usage = chunk.get("usage") or usage
                pieces += len(chunk["choices"])
        assert usage is not None and pieces > 0
        assert usage["completion_tokens"] <= body["max_tokens"]
        return usage["completion_tokens"], usage["prompt_tokens"]

    async def run() -> list[tuple[int, int]]:
        async with httpx.AsyncClient(base_url=edge.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(run())
    generated = sum(c for c, _ in results)
    assert metric_value(edge, "asymspec_generation_tokens_total") - before == generated
    drafts = metric_value(edge, "asymspec_spec_decode_num_drafts_total")
    accepted = metric_value(edge, "asymspec_spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 <= accepted <= metric_value(
        edge, "asymspec_spec_decode_num_draft_tokens_total"
    )


def test_official_openai_client(edges: dict[str, Service]) -> None:
    client = OpenAI(base_url=f"{edges['asymspec'].url}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data]
    stream = client.chat.completions.create(
        model="asymspec",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    completion = client.completions.create(
        model="asymspec", prompt="def add(a, b):", max_tokens=10, temperature=0
    )
    assert completion.usage is not None and completion.choices[0].text is not None
    assert isinstance(text, str)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "max_tokens": -1},
        {"prompt": "x", "max_tokens": "many"},
        {"prompt": "x", "temperature": -0.5},
        {"prompt": ""},
        {"prompt": "word " * 600, "max_tokens": 8},  # over max_model_len = 512
        {"prompt": "x", "n": 2},
    ],
)
def test_bad_input_gets_openai_400_and_service_survives(
    edges: dict[str, Service], body: dict
) -> None:
    edge = edges["asymspec"]
    response = httpx.post(f"{edge.url}/v1/completions", json={"model": "asymspec", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert complete(edge, prompt="ok", max_tokens=2)["choices"]


def test_bad_chat_input(edges: dict[str, Service]) -> None:
    url = f"{edges['asymspec'].url}/v1/chat/completions"
    bodies: list[dict[str, Any]] = [
        {"messages": []},
        {"messages": "hi"},
        {"messages": [{"role": "user"}]},
    ]
    for body in bodies:
        response = httpx.post(url, json={"model": "asymspec", **body})
        assert response.status_code == 400 and "error" in response.json()


def test_all_modes_serve(edges: dict[str, Service]) -> None:
    for mode, edge in edges.items():
        assert (
            complete(edge, prompt="abc", max_tokens=4, temperature=0.7, seed=1)["usage"][
                "completion_tokens"
            ]
            > 0
        ), mode
