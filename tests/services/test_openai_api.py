"""The OpenAI-compatible API through a real uvicorn server on a loopback port.

Clients are httpx (raw bytes: SSE framing, status codes, error bodies) and the official
``openai`` client. The engine is ``LocalEngine``: a tiny random-weight Llama really decoding
in-process, so the texts are gibberish but deterministic under greedy or a fixed seed.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, MutableMapping
from typing import Any

import httpx
import openai
import pytest
import torch
import uvicorn
from fastapi import FastAPI
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families
from transformers import PreTrainedTokenizerFast

from asymspec.sampling_params import Penalties
from edge_gateway.api_errors import install_error_handlers
from edge_gateway.api_requests import ApiSettings
from edge_gateway.metrics import EdgeMetrics, metrics_router
from edge_gateway.openai_api import build_router
from edge_gateway.sse import EventStream
from edge_gateway.text import render_chat
from tests.services.local_engine import LocalEngine, build_test_model, build_test_tokenizer

MODEL = "tiny-test"
MAX_MODEL_LEN = 1024  # the tiny Llama's max_position_embeddings
MAX_TOKENS_LIMIT = 512
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello, how are you?"}]


class Server:
    """uvicorn in a background thread, bound to a free loopback port."""

    def __init__(self, app: FastAPI) -> None:
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        )

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()


class Harness:
    def __init__(
        self,
        engine: LocalEngine,
        tokenizer: PreTrainedTokenizerFast,
        port: int,
        serving: list[LocalEngine | None],
    ):
        self.engine, self.tokenizer = engine, tokenizer
        self.serving = serving  # what the router's engine provider returns (None: loading)
        self.base_url = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.base_url, timeout=30)
        self.client = openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key="x", max_retries=0, timeout=30
        )

    def post(self, path: str, body: Any) -> httpx.Response:
        # json.dumps escapes to ASCII, so a lone surrogate travels as "\\ud800", as JSON
        # allows (httpx's own encoder would refuse to send it).
        content = json.dumps(body).encode()
        return self.http.post(path, content=content, headers={"content-type": "application/json"})

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics by (name, labels without model_name/mode)."""
        text = self.http.get("/metrics").text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in FIXED))
                samples[(s.name, labels)] = s.value
        return samples


FIXED = ("model_name", "mode")


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny forwards: thread hand-offs cost more than they save
    tokenizer = build_test_tokenizer()
    engine = LocalEngine(build_test_model(vocab_size=len(tokenizer)), tokens_per_chunk=3)
    metrics = EdgeMetrics.create(model_name=MODEL, mode="target-only")
    settings = ApiSettings(
        served_model_name=MODEL, max_model_len=MAX_MODEL_LEN, max_tokens_limit=MAX_TOKENS_LIMIT
    )
    app = FastAPI()
    serving: list[LocalEngine | None] = [engine]
    app.include_router(build_router(lambda: serving[0], lambda: tokenizer, settings, metrics))
    app.include_router(metrics_router(metrics.registry))
    install_error_handlers(app)
    try:
        with Server(app) as server:
            yield Harness(engine, tokenizer, server.port, serving)
    finally:
        torch.set_num_threads(threads)


def sse_events(raw: str) -> list[str]:
    """The data payloads of an SSE body, checking the framing on the way."""
    assert raw.endswith("data: [DONE]\n\n")
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e.removeprefix("data: ") for e in events]


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# -- the happy paths ----------------------------------------------------------------------


def test_models_lists_the_served_model(harness: Harness) -> None:
    models = harness.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "asymspec"
    assert harness.http.get("/v1/models").json()["object"] == "list"
    assert harness.client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        harness.client.models.retrieve("no-such-model")


def test_chat_non_streaming(harness: Harness) -> None:
    response = harness.client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=12,
        temperature=0,
    )
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    assert response.model == MODEL
    (choice,) = response.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage is not None
    chat = [{"role": "user", "content": "Hello, how are you?"}]  # CHAT as render_chat takes it
    assert usage.prompt_tokens == len(render_chat(harness.tokenizer, chat))
    assert 1 <= usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    sent = harness.engine.requests[-1]
    assert sent.request_id == response.id and sent.params.is_greedy


def test_chat_streaming_matches_non_streaming(harness: Harness) -> None:
    whole = harness.client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=20,
        temperature=0,
    )
    chunks = list(
        harness.client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == whole.choices[0].finish_reason and not any(finish[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_chat_stream_framing_without_usage(harness: Harness) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "stream": True}
    response = harness.post("/v1/chat/completions", body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["choices"] for c in chunks)  # no usage chunk unless asked for
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["choices"][0]["logprobs"] is None for c in chunks)


def test_completions_non_streaming_and_streaming(harness: Harness) -> None:
    whole = harness.client.completions.create(
        model=MODEL, prompt="The quick brown", max_tokens=15, temperature=0
    )
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion"
    assert whole.choices[0].logprobs is None
    chunks = list(
        harness.client.completions.create(
            model=MODEL,
            prompt="The quick brown",
            max_tokens=15,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == (
        whole.choices[0].finish_reason
    )
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_prompt_as_token_ids_equals_the_text_prompt(harness: Harness) -> None:
    ids = harness.tokenizer("def add(a, b):")["input_ids"]
    by_text = harness.client.completions.create(
        model=MODEL, prompt="def add(a, b):", max_tokens=10, temperature=0
    )
    by_ids = harness.client.completions.create(
        model=MODEL, prompt=ids, max_tokens=10, temperature=0
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)
    batch_of_one = harness.post("/v1/completions", {"prompt": [ids], "max_tokens": 10})
    assert batch_of_one.status_code == 200


def test_max_tokens_ends_with_length(harness: Harness) -> None:
    response = harness.client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, temperature=0
    )
    produced = harness.engine.generated[response.id]
    assert not set(produced) & harness.engine.requests[-1].stop_token_ids  # no eos by chance
    assert response.choices[0].finish_reason == "length"
    assert response.usage is not None and response.usage.completion_tokens == 5


def test_max_completion_tokens_wins_over_max_tokens(harness: Harness) -> None:
    response = harness.client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=10,
        max_completion_tokens=3,
        temperature=0,
    )
    assert harness.engine.requests[-1].max_new_tokens == 3
    assert response.usage is not None and response.usage.completion_tokens <= 3


def test_default_max_tokens_is_capped_by_the_context(harness: Harness) -> None:
    prompt = [5] * (MAX_MODEL_LEN - 4)
    response = harness.post("/v1/completions", {"prompt": prompt, "temperature": 0})
    assert response.status_code == 200
    assert harness.engine.requests[-1].max_new_tokens == 4


def test_stop_string_cuts_the_text(harness: Harness) -> None:
    free = (
        harness.client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0
        )
        .choices[0]
        .text
    )
    # Two letters or digits from the middle: a stop string that ends mid-answer.
    stop = next(free[i : i + 2] for i in range(8, len(free) - 1) if free[i : i + 2].isalnum())
    expected = free[: free.index(stop)]
    assert 0 < len(expected) < len(free) - 2
    for stream in (False, True):
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 40,
            "temperature": 0,
            "stop": ["never-in-this-text", stop],
            "stream": stream,
        }
        response = harness.post("/v1/completions", body)
        if stream:
            chunks = [json.loads(e) for e in sse_events(response.text)[:-1]]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            finish_reason = chunks[-1]["choices"][0]["finish_reason"]
        else:
            text = response.json()["choices"][0]["text"]
            finish_reason = response.json()["choices"][0]["finish_reason"]
        assert text == expected and finish_reason == "stop"


def test_stop_token_ends_the_answer_and_is_not_shown(harness: Harness) -> None:
    free = harness.client.completions.create(
        model=MODEL, prompt="Hello, world", max_tokens=30, temperature=0
    )
    produced = harness.engine.generated[free.id]
    assert free.usage is not None and free.usage.completion_tokens == len(produced)
    if produced[-1] in harness.engine.requests[-1].stop_token_ids:  # eos (this one does)
        assert free.choices[0].finish_reason == "stop"
    stop_id = produced[len(produced) // 2]
    k = produced.index(stop_id)  # its first occurrence ends the answer
    stopped = harness.client.completions.create(
        model=MODEL,
        prompt="Hello, world",
        max_tokens=30,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id]},
    )
    assert stop_id in harness.engine.requests[-1].stop_token_ids
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.completion_tokens == k + 1
    assert stopped.choices[0].text == harness.tokenizer.decode(
        produced[:k], skip_special_tokens=True
    )


def test_eos_is_a_stop_token(harness: Harness) -> None:
    harness.client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    eos = harness.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert eos in harness.engine.requests[-1].stop_token_ids


def test_seed_makes_sampling_repeatable(harness: Harness) -> None:
    def sample(seed: int) -> str:
        response = harness.client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=24, temperature=1.0, seed=seed
        )
        return response.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first  # 24 tokens at temperature 1: equal by chance is negligible


def test_greedy_is_repeatable_whatever_the_seed(harness: Harness) -> None:
    texts = {
        harness.client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=16,
            temperature=0,
            seed=seed,
        )
        .choices[0]
        .message.content
        for seed in (1, 2, 3)
    }
    assert len(texts) == 1


def test_sampling_and_extension_fields_reach_the_engine(harness: Harness) -> None:
    harness.client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=3,
        temperature=0.7,
        top_p=0.9,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias={"7": 2.5, "3": -1.0},  # type: ignore[dict-item]  # floats: OpenAI types ints
        extra_body={
            "top_k": 5,
            "min_p": 0.05,
            "repetition_penalty": 1.3,
            "fidelity_budget": 0.25,
            "num_draft_tokens": 4,
        },
    )
    sent = harness.engine.requests[-1]
    assert (sent.params.temperature, sent.params.top_p, sent.params.top_k) == (0.7, 0.9, 5)
    assert (sent.params.min_p, sent.params.logit_bias) == (0.05, ((3, -1.0), (7, 2.5)))
    assert sent.penalties == Penalties(repetition=1.3, presence=0.5, frequency=-0.25)
    assert (sent.seed, sent.fidelity_budget, sent.num_draft_tokens) == (7, 0.25, 4)
    assert sent.max_new_tokens == 3
    with pytest.raises(openai.BadRequestError, match="junk"):  # never silently dropped
        harness.client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=3, extra_body={"junk": 1}
        )
    with pytest.raises(openai.NotFoundError, match=r"model_not_found|does not exist"):
        harness.client.completions.create(model="gpt-4o-nonexistent", prompt="Hi", max_tokens=1)
    harness.client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=1, extra_body={"top_k": -1}
    )
    sent = harness.engine.requests[-1]
    assert (sent.params.top_k, sent.params.temperature, sent.seed) == (0, 1.0, None)
    assert (sent.fidelity_budget, sent.num_draft_tokens) == (None, None)
    harness.client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, temperature=1e-9)
    assert harness.engine.requests[-1].params.is_greedy  # as vLLM: no overflow to NaN


def test_chat_content_parts_are_joined(harness: Harness) -> None:
    parts = [{"type": "text", "text": "Hello,"}, {"type": "text", "text": "how are you?"}]
    harness.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": parts}], "max_tokens": 1},
    ).raise_for_status()
    expected = render_chat(harness.tokenizer, [{"role": "user", "content": "Hello,\nhow are you?"}])
    assert harness.engine.requests[-1].prompt_ids == expected


def test_concurrent_streams_decode_independently(harness: Harness) -> None:
    """Four streams at once share the engine; each equals its own greedy answer."""
    prompts = ["Hello", "def add(a, b):", "Café crème", "for i in range(10):"]
    expected = [
        harness.client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]
    results: dict[int, str] = {}

    def stream(i: int) -> None:
        chunks = harness.client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=12, temperature=0, stream=True
        )
        results[i] = "".join(c.choices[0].text for c in chunks if c.choices)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [results[i] for i in range(len(prompts))] == expected


# -- refusals -----------------------------------------------------------------------------

CHAT_PATH, CMPL_PATH = "/v1/chat/completions", "/v1/completions"
LONG_CHAT = [{"role": "user", "content": "hi " * 1100}]
IMAGE_CHAT = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
# (path, body, the param the error should name), one per refusal.
BAD_REQUESTS = [
    pytest.param(CMPL_PATH, {"prompt": "hi", "max_tokens": 0}, "max_tokens", id="max_tokens=0"),
    pytest.param(CHAT_PATH, {"messages": CHAT, "max_tokens": -3}, "max_tokens", id="max_tokens<0"),
    pytest.param(CMPL_PATH, {"prompt": "hi", "max_tokens": "x"}, "max_tokens", id="max_tokens=str"),
    pytest.param(
        CHAT_PATH,
        {"messages": CHAT, "max_completion_tokens": 0},
        "max_completion_tokens",
        id="max_completion_tokens=0",
    ),
    pytest.param(CMPL_PATH, {"prompt": "hi", "max_tokens": 513}, "max_tokens", id="over limit"),
    pytest.param(
        CHAT_PATH,
        {"messages": CHAT, "max_tokens": 5, "max_completion_tokens": 513},
        "max_completion_tokens",
        id="max_completion_tokens over limit",
    ),
    pytest.param(CMPL_PATH, {"prompt": "hi", "temperature": -0.5}, "temperature", id="temp<0"),
    pytest.param(CHAT_PATH, {"messages": CHAT, "temperature": 2.5}, "temperature", id="temp>2"),
    pytest.param(CMPL_PATH, {"prompt": "hi", "top_p": 0}, "top_p", id="top_p=0"),
    pytest.param(CMPL_PATH, {"prompt": "hi", "top_p": 1.5}, "top_p", id="top_p>1"),
    pytest.param(CMPL_PATH, {"prompt": "hi", "top_k": -2}, "top_k", id="top_k<-1"),
    pytest.param(
        CMPL_PATH, {"prompt": "hi", "fidelity_budget": 1.5}, "fidelity_budget", id="budget>1"
    ),
    pytest.param(
        CHAT_PATH, {"messages": CHAT, "fidelity_budget": -0.1}, "fidelity_budget", id="budget<0"
    ),
    pytest.param(
        CMPL_PATH, {"prompt": "hi", "num_draft_tokens": -1}, "num_draft_tokens", id="gamma=-1"
    ),
    pytest.param(
        CMPL_PATH, {"prompt": "hi", "num_draft_tokens": 17}, "num_draft_tokens", id="gamma=17"
    ),
    pytest.param(CHAT_PATH, {"messages": CHAT, "n": 2}, "n", id="n=2"),
    pytest.param(CHAT_PATH, {"messages": []}, "messages", id="empty messages"),
    pytest.param(CHAT_PATH, {"max_tokens": 3}, "messages", id="no messages"),
    pytest.param(CHAT_PATH, {"messages": "hello"}, "messages", id="messages=str"),
    pytest.param(CHAT_PATH, {"messages": IMAGE_CHAT}, "messages", id="image content"),
    pytest.param(CMPL_PATH, {"prompt": ""}, "prompt", id="empty prompt"),
    pytest.param(CMPL_PATH, {"prompt": []}, "prompt", id="empty token prompt"),
    pytest.param(CMPL_PATH, {"prompt": ["a", "b"]}, "prompt", id="batch of prompts"),
    pytest.param(CMPL_PATH, {"prompt": [1, 10**6]}, "prompt", id="token id out of range"),
    pytest.param(CMPL_PATH, {"prompt": [5] * MAX_MODEL_LEN}, "prompt", id="prompt too long"),
    pytest.param(CHAT_PATH, {"messages": LONG_CHAT}, "messages", id="chat too long"),
    pytest.param(
        CMPL_PATH, {"prompt": [5] * 1000, "max_tokens": 100}, "max_tokens", id="no room left"
    ),
    pytest.param(CMPL_PATH, {"prompt": "hi", "stop": list("abcde")}, "stop", id="5 stops"),
    pytest.param(CMPL_PATH, {"prompt": "a\ud800b"}, "prompt", id="lone surrogate prompt"),
    pytest.param(
        CHAT_PATH,
        {"messages": [{"role": "user", "content": "x\udfffy"}]},
        "messages",
        id="lone surrogate message",
    ),
    pytest.param(CMPL_PATH, {"prompt": "hi", "stop": ["\ud800"]}, "stop", id="surrogate stop"),
    pytest.param(
        CMPL_PATH,
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        "stream_options",
        id="stream_options without stream",
    ),
    pytest.param(
        CHAT_PATH, {"messages": CHAT, "logprobs": True, "stream": True}, "logprobs", id="logprobs"
    ),
    pytest.param(CMPL_PATH, {"prompt": "hi", "echo": True}, "echo", id="echo"),
    pytest.param(
        CMPL_PATH, {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty", id="penalty>2"
    ),
    pytest.param(
        CMPL_PATH, {"prompt": "hi", "repetition_penalty": -1}, "repetition_penalty", id="rep<0"
    ),
    pytest.param(CMPL_PATH, {"prompt": "hi", "min_p": 5}, "min_p", id="min_p=5"),
    pytest.param(CMPL_PATH, {"prompt": "hi", "suffix": "end"}, "suffix", id="suffix"),
    pytest.param(CHAT_PATH, {"messages": CHAT, "echo": True}, "echo", id="chat echo"),
    pytest.param(CMPL_PATH, {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", id="bias id"),
    pytest.param(
        CMPL_PATH, {"prompt": "hi", "logit_bias": {"1": 101}}, "logit_bias", id="bias>100"
    ),
    pytest.param(
        CMPL_PATH,
        {"prompt": "hi", "guided_regex": "(", "max_tokens": 2},
        "guided_regex",
        id="regex",
    ),
    pytest.param(
        CMPL_PATH,
        {"prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]},
        "guided_choice",
        id="two constraints",
    ),
    pytest.param(CMPL_PATH, [1, 2], None, id="body is a list"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS)
def test_bad_requests_get_a_400_openai_error(
    harness: Harness, path: str, body: Any, param: str | None
) -> None:
    before = len(harness.engine.requests)
    response = harness.post(path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] is not None and error["param"].split(".")[0] == param
    assert len(harness.engine.requests) == before  # refused before the engine


def test_too_many_stops_names_the_limit(harness: Harness) -> None:
    response = harness.post(CMPL_PATH, {"prompt": "hi", "stop": [str(i) for i in range(10)]})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "stop: at most 4 stop sequences, got 10"


def test_negative_seed_is_an_int64_like_openai(harness: Harness) -> None:
    """OpenAI's seed is an int64: -1 is valid and names the same 64 bits as 2**64 - 1."""
    body = {"prompt": "hi", "max_tokens": 8, "temperature": 1.0}
    negative = harness.post(CMPL_PATH, {**body, "seed": -1})
    unsigned = harness.post(CMPL_PATH, {**body, "seed": 2**64 - 1})
    assert negative.status_code == 200 and unsigned.status_code == 200, negative.text
    assert negative.json()["choices"][0]["text"] == unsigned.json()["choices"][0]["text"]


def test_malformed_json_is_a_400(harness: Harness) -> None:
    response = harness.http.post(
        CHAT_PATH, content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_the_server_keeps_serving_after_refusals(harness: Harness) -> None:
    for case in BAD_REQUESTS[:5]:
        path, body, _ = case.values
        assert harness.post(str(path), body).status_code == 400
    ok = harness.post(CMPL_PATH, {"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"]


def test_openai_client_sees_bad_request_errors(harness: Harness) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        harness.client.chat.completions.create(model=MODEL, messages=CHAT, n=2)
    assert caught.value.status_code == 400
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "n"


def test_unknown_route_gets_an_openai_404(harness: Harness) -> None:
    response = harness.http.get("/v1/nothing-here")
    assert response.status_code == 404 and response.json()["error"]["message"]


def test_still_loading_is_503(harness: Harness) -> None:
    harness.serving[0] = None  # the draft is still loading
    try:
        response = harness.post(CMPL_PATH, {"prompt": "hi", "max_tokens": 2})
    finally:
        harness.serving[0] = harness.engine
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "service_unavailable_error"


# -- failures during generation -----------------------------------------------------------


def test_engine_error_mid_stream_is_an_error_event_then_done(harness: Harness) -> None:
    before = harness.metrics()[("asymspec_request_failure_total", (("reason", "error"),))]
    harness.engine.fail_after_tokens = 3  # one chunk of 3 tokens, then a failure
    try:
        response = harness.post(
            CMPL_PATH, {"prompt": "Hello", "max_tokens": 20, "temperature": 0, "stream": True}
        )
        events = sse_events(response.text)
        # Greedy throughout: a sampled answer can end at EOS before the injected failure.
        with pytest.raises(openai.APIError):
            list(
                harness.client.completions.create(
                    model=MODEL, prompt="Hello", max_tokens=20, stream=True, temperature=0
                )
            )
        non_streaming = harness.post(
            CMPL_PATH, {"prompt": "Hello", "max_tokens": 20, "temperature": 0}
        )
    finally:
        harness.engine.fail_after_tokens = None
    assert response.status_code == 200  # the stream had started
    error = json.loads(events[-2])["error"]
    assert error["message"] == "injected engine failure" and error["type"] == "server_error"
    assert any(json.loads(e).get("choices") for e in events[:-2])  # text came first
    assert non_streaming.status_code == 500
    assert non_streaming.json()["error"]["message"] == "injected engine failure"
    after = harness.metrics()[("asymspec_request_failure_total", (("reason", "error"),))]
    assert after - before == 3
    assert harness.engine.open_sessions() == 0


def disconnect_after_first_content(harness: Harness, body: dict[str, Any]) -> str:
    """Stream ``body``, read up to the first content chunk, then drop the connection."""
    with harness.http.stream("POST", CHAT_PATH, json=body) as response:
        lines = (line for line in response.iter_lines() if line)
        role_chunk = json.loads(next(lines).removeprefix("data: "))
        next(lines)  # a content chunk: the engine is generating
    return str(role_chunk["id"])


@pytest.mark.parametrize("stall", [False, True], ids=["tokens flowing", "engine stalled"])
def test_client_disconnect_closes_the_engine_iterator(harness: Harness, stall: bool) -> None:
    """Flowing: the disconnect shows when the next chunk is sent. Stalled (a lost cloud):
    nothing is sent any more, so only the disconnect watcher can notice."""
    before = harness.metrics()[("asymspec_request_failure_total", (("reason", "abort"),))]
    if stall:
        harness.engine.stall_after_tokens = 3
    else:
        harness.engine.step_delay_s = 0.02  # a slow link: the answer would take ~3 s
    body = {"messages": CHAT, "max_tokens": 500, "stream": True, "temperature": 0}
    try:
        request_id = disconnect_after_first_content(harness, body)
        wait_for(lambda: request_id in harness.engine.outcomes)
    finally:
        harness.engine.step_delay_s, harness.engine.stall_after_tokens = 0.0, None
    assert harness.engine.outcomes[request_id] == "closed"
    assert len(harness.engine.generated[request_id]) < 100
    assert harness.engine.open_sessions() == 0
    wait_for(lambda: harness.metrics()[("asymspec_num_requests_running", ())] == 0)
    after = harness.metrics()[("asymspec_request_failure_total", (("reason", "abort"),))]
    assert after - before == 1


def test_event_stream_watches_for_disconnects_under_asgi_2_4() -> None:
    """Starlette stops watching for disconnects under ASGI spec >= 2.4 (uvicorn says 2.3);
    EventStream still notices one while the engine is silent, and closes the iterator."""
    closed: list[bool] = []

    async def events() -> AsyncIterator[str]:
        try:
            yield "data: {}\n\n"
            await asyncio.Event().wait()  # an engine that never answers again
        finally:
            closed.append(True)

    async def scenario() -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []
        first_body = asyncio.Event()

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(dict(message))
            if message["type"] == "http.response.body":
                first_body.set()

        async def receive() -> dict[str, Any]:
            await first_body.wait()  # the client leaves once it has seen the first event
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}}
        await asyncio.wait_for(EventStream(events())(scope, receive, send), timeout=5)
        return sent

    sent = asyncio.run(scenario())
    assert closed == [True]
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]


# -- metrics ------------------------------------------------------------------------------


def test_metrics_count_what_clients_received(harness: Harness) -> None:
    def counters() -> dict[str, float]:
        samples = harness.metrics()
        return {
            "generation": samples[("asymspec_generation_tokens_total", ())],
            "prompt": samples[("asymspec_prompt_tokens_total", ())],
            "ttft": samples[("asymspec_time_to_first_token_seconds_count", ())],
            "e2e": samples[("asymspec_e2e_request_latency_seconds_count", ())],
            "success": sum(
                v for (name, _), v in samples.items() if name == "asymspec_request_success_total"
            ),
        }

    before = counters()
    usages: list[CompletionUsage | None] = []
    for max_tokens, stop in ((7, None), (20, None), (30, "e")):
        response = harness.client.completions.create(
            model=MODEL, prompt="Hello there", max_tokens=max_tokens, temperature=0, stop=stop
        )
        usages.append(response.usage)
    streamed = harness.client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    usages.append(list(streamed)[-1].usage)
    after = counters()
    received = [u for u in usages if u is not None]
    assert len(received) == len(usages)
    assert after["generation"] - before["generation"] == sum(u.completion_tokens for u in received)
    assert after["prompt"] - before["prompt"] == sum(u.prompt_tokens for u in received)
    assert after["success"] - before["success"] == len(usages)
    assert after["ttft"] - before["ttft"] == len(usages)
    assert after["e2e"] - before["e2e"] == len(usages)


def test_metrics_endpoint_exposes_the_edge_metrics(harness: Harness) -> None:
    response = harness.http.get("/metrics", follow_redirects=False)
    assert response.status_code == 200  # no redirect to /metrics/
    assert response.headers["content-type"].startswith("text/plain")
    assert 'model_name="tiny-test"' in response.text and 'mode="target-only"' in response.text
    samples = harness.metrics()
    for key in (
        ("asymspec_time_to_first_token_seconds_count", ()),
        ("asymspec_time_per_output_token_seconds_count", ()),
        ("asymspec_e2e_request_latency_seconds_count", ()),
        ("asymspec_prompt_tokens_total", ()),
        ("asymspec_generation_tokens_total", ()),
        ("asymspec_request_success_total", (("finished_reason", "length"),)),
        ("asymspec_request_failure_total", (("reason", "abort"),)),
        ("asymspec_num_requests_running", ()),
        ("asymspec_spec_decode_num_draft_tokens_total", ()),
        ("asymspec_link_bytes_total", (("direction", "uplink"),)),
        ("asymspec_cloud_connected", ()),
    ):
        assert key in samples, key
    assert samples[("asymspec_time_per_output_token_seconds_count", ())] > 0
