"""Load test of the edge gateway's OpenAI-compatible API (see loadtest/README.md).

    locust -f loadtest/locustfile.py --headless -u 16 -r 4 -t 60s \
        --csv out/run --html out/run.html --host http://127.0.0.1:8000

Three user classes, closed loop (each user sends its next request when the last one ends):
streaming chat, streaming completions and non-streaming completions, with HumanEval's
held-out prompts (``loadtest.prompts``; chat users get them phrased as a request). A fourth,
``AgentUser``, replays held-out multi-round agent conversations (``loadtest.conversations``)
round by round with the model's own answers in the history; it runs only with
ASYMSPEC_LOAD_AGENT_WEIGHT > 0 (its weight beside the others' 2 : 1 : 1), or named alone
on the command line (``locust -f loadtest/locustfile.py AgentUser``).

Besides the HTTP rows, each finished request fires custom events (response_time in ms):

| request_type | name | response_time | response_length |
|---|---|---|---|
| ``TTFT`` | endpoint | time to the first content chunk (streaming only) | 0 |
| ``TPOT`` | endpoint | (e2e - TTFT) / (tokens - 1), as vLLM's benchmark (streaming) | tokens - 1 |
| ``OUTPUT_TOKENS`` | endpoint | end-to-end latency | completion tokens (usage) |

So the OUTPUT_TOKENS row's "Average Content Size" is tokens per request, and its total
content length over the run time is the output throughput. A streaming POST row times only
the response headers; use TTFT and OUTPUT_TOKENS for latency.

Settings (environment): ASYMSPEC_LOAD_MODEL (asymspec), ASYMSPEC_LOAD_MAX_TOKENS (128),
ASYMSPEC_LOAD_TEMPERATURE (1.0), ASYMSPEC_LOAD_FIDELITY_BUDGET (unset: the edge's default),
ASYMSPEC_LOAD_API_KEY (sent as a bearer token when set), ASYMSPEC_LOAD_TIMEOUT_S (300),
ASYMSPEC_LOAD_AGENT_WEIGHT (0).

Exit status 1 when an HTTP request failed (more than ASYMSPEC_SLO_MAX_FAIL_RATIO, default 0)
or an SLO is breached: ASYMSPEC_SLO_TTFT_P90_S, ASYMSPEC_SLO_TPOT_P90_S and
ASYMSPEC_SLO_E2E_P90_S, in seconds over all endpoints, each unset = not checked.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from locust import HttpUser, events, task
from locust.env import Environment
from locust.stats import StatsEntry
from requests import RequestException

from loadtest.conversations import agent_conversations
from loadtest.prompts import code_as_chat, humaneval_prompts

log = logging.getLogger("asymspec.loadtest")

# Custom event types (the "Type" column of Locust's stats).
TTFT, TPOT, OUTPUT_TOKENS = "TTFT", "TPOT", "OUTPUT_TOKENS"
SLO_EVENTS = {"TTFT_P90_S": TTFT, "TPOT_P90_S": TPOT, "E2E_P90_S": OUTPUT_TOKENS}


def env_float(name: str) -> float | None:
    """A number from the environment; unset or empty is None (compose passes '' for unset)."""
    value = os.environ.get(name, "").strip()
    return float(value) if value else None


def env_or(name: str, default: float) -> float:
    value = env_float(name)
    return default if value is None else value


@dataclass(frozen=True)
class LoadSettings:
    model: str
    max_tokens: int
    temperature: float
    fidelity_budget: float | None
    api_key: str
    timeout_s: float

    @classmethod
    def from_env(cls) -> LoadSettings:
        return cls(
            model=os.environ.get("ASYMSPEC_LOAD_MODEL", "").strip() or "asymspec",
            max_tokens=int(env_or("ASYMSPEC_LOAD_MAX_TOKENS", 128)),
            temperature=env_or("ASYMSPEC_LOAD_TEMPERATURE", 1.0),
            fidelity_budget=env_float("ASYMSPEC_LOAD_FIDELITY_BUDGET"),
            api_key=os.environ.get("ASYMSPEC_LOAD_API_KEY", "").strip(),
            timeout_s=env_or("ASYMSPEC_LOAD_TIMEOUT_S", 300.0),
        )

    def body(self, stream: bool) -> dict[str, Any]:
        """The sampling fields every request carries."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": stream,
        }
        if stream:  # the usage chunk gives the exact token count for TPOT
            body["stream_options"] = {"include_usage": True}
        if self.fidelity_budget is not None:
            body["fidelity_budget"] = self.fidelity_budget  # asymspec's extension
        return body


SETTINGS = LoadSettings.from_env()
PROMPTS = humaneval_prompts("heldout")
USER_NUMBERS = itertools.count()


class StreamError(Exception):
    """The server ended a stream with an error event or without a usage chunk."""


@dataclass
class StreamTiming:
    """What one streamed response showed, timed from the request's start."""

    ttft_s: float | None = None
    e2e_s: float = 0.0
    completion_tokens: int = 0
    content: str = ""  # the generated text (an agent puts it into its history)


def sse_events(lines: Iterator[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON payloads of an SSE stream, up to ``data: [DONE]``."""
    for raw in lines:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise StreamError(event["error"].get("message", "error event"))
        yield event


def content_of(event: dict[str, Any]) -> str:
    """The generated text a chunk carries ('' for the role-only first chat delta)."""
    return "".join(
        choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        for choice in event.get("choices") or []
    )


def read_stream(lines: Iterator[bytes], started_s: float) -> StreamTiming:
    timing = StreamTiming()
    for event in sse_events(lines):
        text = content_of(event)
        if timing.ttft_s is None and text:
            timing.ttft_s = time.perf_counter() - started_s
        timing.content += text
        if event.get("usage"):
            timing.completion_tokens = int(event["usage"]["completion_tokens"])
    timing.e2e_s = time.perf_counter() - started_s
    if not timing.completion_tokens:
        raise StreamError("the stream ended without a usage chunk")
    return timing


def fire(environment: Environment, kind: str, name: str, time_ms: float, length: int) -> None:
    environment.events.request.fire(
        request_type=kind,
        name=name,
        response_time=time_ms,
        response_length=length,
        exception=None,
        context={},
    )


def record_stream(environment: Environment, name: str, timing: StreamTiming) -> None:
    tokens = timing.completion_tokens
    fire(environment, OUTPUT_TOKENS, name, timing.e2e_s * 1000, tokens)
    if timing.ttft_s is None:  # every token was cut by a stop string: nothing to time
        return
    fire(environment, TTFT, name, timing.ttft_s * 1000, 0)
    if tokens > 1:
        tpot_s = (timing.e2e_s - timing.ttft_s) / (tokens - 1)
        fire(environment, TPOT, name, tpot_s * 1000, tokens - 1)


class EdgeUser(HttpUser):
    """A closed-loop client of the edge gateway; subclasses choose the endpoint."""

    abstract = True

    def on_start(self) -> None:
        if SETTINGS.api_key:
            self.client.headers["Authorization"] = f"Bearer {SETTINGS.api_key}"
        # Users start at different prompts, so concurrent requests differ in length.
        offset = next(USER_NUMBERS) * 7 % len(PROMPTS)
        self.prompts = itertools.cycle(PROMPTS[offset:] + PROMPTS[:offset])

    def stream(self, path: str, name: str, body: dict[str, Any]) -> StreamTiming | None:
        """One streamed request, recorded; its timing and text, None when it failed."""
        started_s = time.perf_counter()
        with self.client.post(
            path,
            json=body,
            name=name,
            stream=True,
            catch_response=True,
            timeout=SETTINGS.timeout_s,
        ) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return None
            try:
                timing = read_stream(response.iter_lines(), started_s)
            except (StreamError, RequestException, ValueError, KeyError) as error:
                response.failure(f"{type(error).__name__}: {error}")
                return None
            response.success()
        record_stream(self.environment, name, timing)
        return timing


class StreamingChatUser(EdgeUser):
    weight = 2

    @task
    def chat(self) -> None:
        body = {**SETTINGS.body(stream=True), "messages": code_as_chat(next(self.prompts))}
        self.stream("/v1/chat/completions", "chat (stream)", body)


class StreamingCompletionUser(EdgeUser):
    weight = 1

    @task
    def complete(self) -> None:
        body = {**SETTINGS.body(stream=True), "prompt": next(self.prompts)}
        self.stream("/v1/completions", "completions (stream)", body)


class CompletionUser(EdgeUser):
    weight = 1

    @task
    def complete(self) -> None:
        name = "completions"
        body = {**SETTINGS.body(stream=False), "prompt": next(self.prompts)}
        started_s = time.perf_counter()
        with self.client.post(
            "/v1/completions", json=body, name=name, catch_response=True, timeout=SETTINGS.timeout_s
        ) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            try:
                tokens = int(response.json()["usage"]["completion_tokens"])
            except (ValueError, KeyError, TypeError) as error:
                response.failure(f"no usage in the response: {error}")
                return
        e2e_ms = (time.perf_counter() - started_s) * 1000
        fire(self.environment, OUTPUT_TOKENS, name, e2e_ms, tokens)


CONVERSATIONS = agent_conversations("heldout", per_kind=4)
AGENT_WEIGHT = int(env_or("ASYMSPEC_LOAD_AGENT_WEIGHT", 0))


class AgentUser(EdgeUser):
    """An agent: one held-out conversation per task, replayed round by round, each round's
    answer going into the next round's history (so what repeats is up to the server)."""

    abstract = AGENT_WEIGHT == 0  # off unless asked for: the other classes' mix stays
    weight = max(1, AGENT_WEIGHT)

    def on_start(self) -> None:
        super().on_start()
        offset = next(USER_NUMBERS) % len(CONVERSATIONS)
        self.conversations = itertools.cycle(CONVERSATIONS[offset:] + CONVERSATIONS[:offset])

    @task
    def converse(self) -> None:
        conversation = next(self.conversations)
        messages = conversation.first_messages()
        for i, turn in enumerate(conversation.turns):
            if i:
                messages.append({"role": "user", "content": turn})
            body = {**SETTINGS.body(stream=True), "messages": messages}
            timing = self.stream("/v1/chat/completions", f"agent round {i + 1} (stream)", body)
            if timing is None:
                return  # the conversation cannot go on without its answer
            messages.append({"role": "assistant", "content": timing.content})


# ---------------------------------------------------------------------------------------
# Exit status: failures and SLOs, checked once when Locust quits.


def merged(environment: Environment, request_type: str) -> StatsEntry:
    """One entry over every name of a request type (e.g. TTFT of all three endpoints)."""
    total = StatsEntry(
        environment.stats, request_type, request_type, use_response_times_cache=False
    )
    for entry in environment.stats.entries.values():
        if entry.method == request_type:
            total.extend(entry)
    return total


def slo_breaches(environment: Environment) -> list[str]:
    """Each breached objective as a sentence; empty when the run met them all."""
    breaches = []
    http = [e for e in environment.stats.entries.values() if e.method not in SLO_EVENTS.values()]
    requests = sum(e.num_requests for e in http)
    failures = sum(e.num_failures for e in http)
    max_fail_ratio = env_or("ASYMSPEC_SLO_MAX_FAIL_RATIO", 0.0)
    if requests == 0:
        breaches.append("no request completed")
    elif failures / requests > max_fail_ratio:
        breaches.append(f"{failures} of {requests} requests failed (allowed {max_fail_ratio:.0%})")
    if environment.runner is not None and environment.runner.exceptions:
        breaches.append(f"{len(environment.runner.exceptions)} unhandled exceptions in users")
    for suffix, request_type in SLO_EVENTS.items():
        limit_s = env_float(f"ASYMSPEC_SLO_{suffix}")
        entry = merged(environment, request_type)
        if limit_s is None or entry.num_requests == 0:
            continue
        p90_s = entry.get_response_time_percentile(0.9) / 1000
        if p90_s > limit_s:
            breaches.append(f"{request_type} p90 {p90_s:.3f} s > ASYMSPEC_SLO_{suffix}={limit_s}")
    return breaches


@events.quitting.add_listener
def check_slos(environment: Environment, **_: Any) -> None:
    breaches = slo_breaches(environment)
    for breach in breaches:
        log.error("SLO breached: %s", breach)
    if breaches:
        environment.process_exit_code = 1
    elif env_or("ASYMSPEC_SLO_MAX_FAIL_RATIO", 0.0) > 0:
        # Failures within the allowance: Locust alone would exit 1 on any failure.
        environment.process_exit_code = 0
    if not breaches:
        log.info("all SLOs met")
