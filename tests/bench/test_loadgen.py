"""The load generator against a fake streaming server, and the workload's request bodies."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from loadtest.bench.loadgen import PhaseResult, run_conversations, run_phase
from loadtest.bench.workload import (
    Sampling,
    measured_bodies,
    measured_conversations,
    warmup_bodies,
    warmup_conversations,
    with_fields,
)
from loadtest.prompts import humaneval_prompts


def sse(*chunks: dict[str, Any]) -> bytes:
    lines = [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
    return "".join(lines).encode()


def fake_edge(request: httpx.Request) -> httpx.Response:
    """An OpenAI-style streaming completion: text chunks, the finish chunk, then usage."""
    body = json.loads(request.content)
    if body["prompt"] == "fail":
        return httpx.Response(200, content=sse({"error": {"message": "cloud verifier down"}}))
    if body["prompt"] == "bad":
        return httpx.Response(400, json={"error": {"message": "max_tokens too large"}})
    n = body["max_tokens"]
    chunks: list[dict[str, Any]] = [
        {"choices": [{"text": "ab", "finish_reason": None}]} for _ in range(n // 2)
    ]
    chunks.append({"choices": [{"text": "", "finish_reason": "length"}]})
    chunks.append({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}})
    return httpx.Response(200, content=sse(*chunks), headers={"content-type": "text/event-stream"})


def run(bodies: list[dict[str, Any]], concurrency: int) -> PhaseResult:
    async def go() -> PhaseResult:
        transport = httpx.MockTransport(fake_edge)
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            return await run_phase(client, bodies, concurrency)

    return asyncio.run(go())


def test_phase_records_tokens_text_and_timings_in_request_order() -> None:
    bodies = [{"prompt": f"p{i}", "max_tokens": 8 + 2 * i} for i in range(5)]
    result = run(bodies, concurrency=2)
    assert [r.index for r in result.records] == list(range(5))
    assert [r.completion_tokens for r in result.records] == [8, 10, 12, 14, 16]
    first = result.records[0]
    assert first.ok and first.prompt_tokens == 7 and first.text == "ab" * 4
    assert first.ttft_s is not None and 0 <= first.ttft_s <= first.e2e_s
    assert first.tpot_s is not None and first.tpot_s >= 0
    assert result.wall_s >= max(r.start_s + r.e2e_s for r in result.records) - 1e-6
    assert PhaseResult.from_json(json.loads(json.dumps(result.to_json()))) == result


def test_errors_become_records_not_exceptions() -> None:
    result = run([{"prompt": "fail", "max_tokens": 4}, {"prompt": "bad", "max_tokens": 4}], 2)
    assert [r.ok for r in result.records] == [False, False]
    assert "cloud verifier down" in (result.records[0].error or "")
    assert (result.records[1].error or "").startswith("HTTP 400")
    assert result.records[0].tpot_s is None


def test_bodies_use_fixed_seeds_and_disjoint_prompts() -> None:
    sampling = Sampling(max_tokens=32, temperature=0.7, num_draft_tokens=3)
    measured = measured_bodies(40, sampling, base_seed=5)
    heldout = humaneval_prompts("heldout")
    assert [b["seed"] for b in measured[:3]] == [5, 6, 7]
    assert measured[0]["prompt"] == heldout[0] and measured[33]["prompt"] == heldout[0]
    assert measured[0]["stream"] and measured[0]["stream_options"] == {"include_usage": True}
    assert measured[0]["ignore_eos"] and measured[0]["num_draft_tokens"] == 3
    assert "fidelity_budget" not in measured[0]  # None: the edge's own default
    warm = warmup_bodies(3, sampling, base_seed=5)
    assert not {b["prompt"] for b in warm} & set(heldout)
    assert not {b["seed"] for b in warm} & {b["seed"] for b in measured}
    assert [b["num_draft_tokens"] for b in with_fields(warm, num_draft_tokens=6)] == [6] * 3
    assert warm[0]["num_draft_tokens"] == 3  # copies, not the originals


def fake_chat_edge(request: httpx.Request) -> httpx.Response:
    """A streaming chat route whose answer names the history it was sent."""
    assert request.url.path == "/v1/chat/completions"
    messages = json.loads(request.content)["messages"]
    if messages[-1]["content"] == "fail":
        return httpx.Response(200, content=sse({"error": {"message": "cloud verifier down"}}))
    answer = "|".join(f"{m['role'][0]}:{m['content']}" for m in messages)
    chunks: list[dict[str, Any]] = [
        {"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]},
        {"choices": [{"delta": {"content": answer}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": len(messages), "completion_tokens": 3}},
    ]
    return httpx.Response(200, content=sse(*chunks), headers={"content-type": "text/event-stream"})


def test_conversations_replay_round_by_round_with_the_answers_in_the_history() -> None:
    def user(text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": text}]

    conversations = [
        [{"messages": user("a1")}, {"messages": user("a2")}, {"messages": user("a3")}],
        [{"messages": [{"role": "system", "content": "s"}, *user("b1")]}, {"messages": user("b2")}],
        [{"messages": user("c1")}, {"messages": user("fail")}, {"messages": user("c3")}],
    ]

    async def go() -> PhaseResult:
        transport = httpx.MockTransport(fake_chat_edge)
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            return await run_conversations(client, conversations, concurrency=2)

    result = asyncio.run(go())
    texts = [r.text for r in result.records]
    assert [r.index for r in result.records] == [0, 1, 2, 3, 4, 5, 6]  # c3 was never sent
    assert texts[0] == "u:a1"
    assert texts[1] == "u:a1|a:u:a1|u:a2"  # round 2 saw round 1's answer
    assert texts[2] == "u:a1|a:u:a1|u:a2|a:u:a1|a:u:a1|u:a2|u:a3"
    assert texts[4] == "s:s|u:b1|a:s:s|u:b1|u:b2"
    assert [r.ok for r in result.records] == [True] * 6 + [False]  # a failed round ends it


def test_agent_conversations_as_bodies_keep_the_splits_apart() -> None:
    sampling = Sampling(max_tokens=16, temperature=0.0)
    measured = measured_conversations(4, sampling, base_seed=0)
    warm = warmup_conversations(2, sampling, base_seed=0)
    assert len(measured) == 4 and all(len(c) == 3 for c in measured)
    first = measured[0][0]
    assert "prompt" not in first and first["messages"][-1]["role"] == "user"
    assert [b["seed"] for b in measured[1]] == [100, 101, 102]
    assert all(len(body["messages"]) == 1 for c in measured for body in c[1:])
    held = {b["messages"][-1]["content"] for c in measured for b in c[:1]}
    trained = {b["messages"][-1]["content"] for c in warm for b in c[:1]}
    assert not held & trained
