"""The load generator: closed-loop streaming completions, one record per request.

A body with ``messages`` goes to the chat route, any other to completions. Conversations
(``run_conversations``) are replayed round by round, each answer going into the next
round's history, one record per round.

``concurrency`` workers take the phase's requests in order; each sends its next request
when the last one ended, as vLLM's and Locust's closed-loop clients do. Per request the
client times the first text chunk (TTFT) and the end of the stream (e2e) and reads the
token counts from the final ``usage`` chunk; TPOT is (e2e - TTFT) / (tokens - 1), vLLM's
benchmark definition. A phase's wall time runs from its first send to its last end.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx

REQUEST_TIMEOUT_S = 900.0  # a slow mode on a weak link at full concurrency is slow, not dead


@dataclass
class RequestRecord:
    index: int
    start_s: float  # since the phase started
    e2e_s: float
    ttft_s: float | None  # None: the stream carried no text (or failed before any)
    prompt_tokens: int
    completion_tokens: int
    text: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**data)


@dataclass
class PhaseResult:
    records: list[RequestRecord]
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        return {"wall_s": self.wall_s, "records": [r.to_json() for r in self.records]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PhaseResult:
        return cls([RequestRecord.from_json(r) for r in data["records"]], data["wall_s"])


async def stream_completion(
    client: httpx.AsyncClient, index: int, body: dict[str, Any], phase_start_s: float
) -> RequestRecord:
    """Send one streaming completion (or chat) and time it; failures become records, never
    raise."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    start = time.perf_counter()
    first_text_s: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    error: str | None = None
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    if "error" in chunk:
                        error = str(chunk["error"])[:300]
                        break
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices", []):
                        text = choice.get("text") or (choice.get("delta") or {}).get("content")
                        if text:
                            first_text_s = first_text_s or time.perf_counter()
                            parts.append(text)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    if error is None and not usage:
        error = "the stream ended without a usage chunk"
    return RequestRecord(
        index=index,
        start_s=start - phase_start_s,
        e2e_s=end - start,
        ttft_s=None if first_text_s is None else first_text_s - start,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        text="".join(parts),
        error=error,
    )


async def run_phase(
    client: httpx.AsyncClient,
    bodies: Sequence[dict[str, Any]],
    concurrency: int,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> PhaseResult:
    """All ``bodies`` through ``concurrency`` closed-loop workers; records in request order."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(bodies)):
        queue.put_nowait(i)
    records: list[RequestRecord | None] = [None] * len(bodies)
    phase_start = time.perf_counter()
    last_end = phase_start

    async def worker() -> None:
        nonlocal last_end
        while not queue.empty():
            i = queue.get_nowait()
            record = await stream_completion(client, i, bodies[i], phase_start)
            records[i] = record
            last_end = max(last_end, time.perf_counter())
            if on_done is not None:
                on_done(record)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(bodies)))))
    done = [r for r in records if r is not None]
    return PhaseResult(done, last_end - phase_start)


async def run_conversations(
    client: httpx.AsyncClient,
    conversations: Sequence[Sequence[dict[str, Any]]],
    concurrency: int,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> PhaseResult:
    """Conversations through ``concurrency`` closed-loop workers, each replayed round by
    round: a conversation is a list of chat bodies, the first with the opening messages,
    each later one with only its new user turn; a round is sent with the history before it
    and the answers given so far. A failed round ends its conversation. Records in
    (conversation, round) order, one per round sent."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(conversations)):
        queue.put_nowait(i)
    offsets = [0]
    for rounds in conversations:
        offsets.append(offsets[-1] + len(rounds))
    records: list[RequestRecord | None] = [None] * offsets[-1]
    phase_start = time.perf_counter()
    last_end = phase_start

    async def worker() -> None:
        nonlocal last_end
        while not queue.empty():
            i = queue.get_nowait()
            history: list[dict[str, str]] = []
            for k, body in enumerate(conversations[i]):
                history = [*history, *body["messages"]]
                record = await stream_completion(
                    client, offsets[i] + k, {**body, "messages": history}, phase_start
                )
                records[offsets[i] + k] = record
                last_end = max(last_end, time.perf_counter())
                if on_done is not None:
                    on_done(record)
                if not record.ok:
                    break
                history.append({"role": "assistant", "content": record.text})

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(conversations)))))
    done = [r for r in records if r is not None]
    return PhaseResult(done, last_end - phase_start)
