# mypy: disable-error-code="call-overload,arg-type,unused-ignore,union-attr,index"
"""Structured output, tool calls, penalties and per-request speculation through real
processes (a cloud verifier and edges in the asymspec and target-only modes, the tiny
real model pair), driven with the official ``openai`` client.

- JSON-schema answers parse and validate at T = 0 and T = 0.8 in both modes, and greedy
  ones are identical between them (float32);
- constrained speculative sampling (grammar, penalties, logit bias) follows the constrained
  target distribution (χ² on the first tokens against the target model's own rows);
- tool calls (required, named, auto; streamed and not; a second turn with a tool message);
- ``num_draft_tokens: 0`` turns speculation off and the stats say so;
- every request field of OpenAI's and vLLM's schemas is honoured (an assertion shows it)
  or refused with a 400 naming it;
- logprobs are the target's own log-softmax, and travel on the downlink only when asked.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from asymspec.constraint import Constraint
from asymspec.grammar import GrammarCompiler, from_regex
from asymspec.sampling_params import Penalties, SamplingParams
from loadtest.json_schemas import AGE, COLOR, NAME, SCHEMAS, USER, obj
from loadtest.processes import Service, cloud_env, edge_env, free_port, running, running_all
from loadtest.tiny_models import save_tiny_pair
from tests.engine.conftest import full_logits
from tests.services.test_e2e import chi_square_pvalue

MODES = ("asymspec", "target-only")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": obj({"city": NAME, "unit": {"enum": ["C", "F"]}}),
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": obj({"zone": {"enum": ["UTC", "CET"]}})},
}
TOOL_SCHEMAS = {
    "get_weather": WEATHER["function"]["parameters"],
    "get_time": TIME["function"]["parameters"],
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def edges(
    pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("logs")
    with ExitStack() as stack:
        cloud_port = free_port()
        stack.enter_context(
            running("cloud_verifier", cloud_port, cloud_env(pair[0], cloud_port), logs)
        )
        specs = {}
        for mode in MODES:
            port = free_port()
            env = edge_env(pair[1], port, cloud_port, mode, max_model_len="1024")
            specs[mode] = ("edge_gateway", port, env)
        yield stack.enter_context(running_all(specs, logs))


def client(edge: Service) -> OpenAI:
    return OpenAI(base_url=f"{edge.url}/v1", api_key="unused", max_retries=0)


# ---------------------------------------------------------------- JSON schemas


def json_answer(edge: Service, schema: dict[str, Any], temperature: float, seed: int) -> str:
    response = client(edge).chat.completions.create(
        model="asymspec",
        messages=USER,  # type: ignore[arg-type]
        max_completion_tokens=300,
        temperature=temperature,
        seed=seed,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        },
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice
    assert choice.message.content is not None
    return choice.message.content


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_json_schema_answers_parse_and_validate(
    edges: dict[str, Service], temperature: float
) -> None:
    jobs = [(mode, i) for mode in MODES for i in range(len(SCHEMAS))]
    with ThreadPoolExecutor(4) as pool:
        texts = list(
            pool.map(
                lambda job: json_answer(edges[job[0]], SCHEMAS[job[1]], temperature, job[1]), jobs
            )
        )
    answers = dict(zip(jobs, texts, strict=True))
    for (mode, i), text in answers.items():
        value = json.loads(text)
        assert jsonschema_rs.validator_for(SCHEMAS[i]).is_valid(value), (mode, i, text)
    if temperature == 0.0:  # float32 on both sides: the greedy answer is the target's
        for i in range(len(SCHEMAS)):
            assert answers[("asymspec", i)] == answers[("target-only", i)], i


def test_json_object_and_vllm_extensions(edges: dict[str, Service]) -> None:
    oai = client(edges["asymspec"])
    base: dict[str, Any] = {"model": "asymspec", "max_tokens": 200, "temperature": 0.8, "seed": 3}
    # Any object: its keys are unbounded strings, which a random model at T = 0.8 rarely
    # closes; greedy on a short chat it does.
    answer = oai.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}],
        response_format={"type": "json_object"},
        **{**base, "temperature": 0.0},
    ).choices[0]
    assert answer.finish_reason == "stop" and isinstance(
        json.loads(answer.message.content or ""), dict
    )
    choice = oai.completions.create(
        prompt="Pick:", extra_body={"guided_choice": ["alpha", "beta", "gamma"]}, **base
    )
    assert choice.choices[0].text in {"alpha", "beta", "gamma"}
    regex = oai.completions.create(prompt="Code:", extra_body={"guided_regex": "[A-F]{4}"}, **base)
    assert len(regex.choices[0].text) == 4 and set(regex.choices[0].text) <= set("ABCDEF")
    lark = oai.completions.create(
        prompt="Answer:", extra_body={"guided_grammar": 'start: "yes" | "no" | "maybe"'}, **base
    )
    assert lark.choices[0].text in {"yes", "no", "maybe"}
    schema = obj({"n": AGE})
    vllm = oai.completions.create(
        prompt="JSON:", extra_body={"structured_outputs": {"json": schema}}, **base
    )
    assert jsonschema_rs.validator_for(schema).is_valid(json.loads(vllm.choices[0].text))


# ---------------------------------------------------------------- distribution

PROMPT_IDS = [40, 41, 42, 43, 44, 45]
DIGITS = "[0-9]+"
PARAMS = SamplingParams(temperature=1.0, top_k=6, logit_bias=((7, 1.5),))
PENALTIES = Penalties(repetition=1.5, presence=0.5, frequency=0.25)


def constrained_joint(target_dir: Path, length: int) -> dict[tuple[int, ...], float]:
    """The exact joint of the first tokens under the constrained target: each row is the
    target's own logits through the same transform (penalties, the grammar's mask, top-k)."""
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    compiler = GrammarCompiler(tokenizer, model.config.vocab_size)
    grammar = from_regex(DIGITS)
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        grown = {}
        for seq, prob in joint.items():
            if seq and seq[-1] == tokenizer.eos_token_id:  # the answer ended: it stays
                grown[seq] = prob
                continue
            constraint = Constraint(
                PARAMS, PENALTIES, compiler.matcher(grammar), PROMPT_IDS, model.config.vocab_size
            )
            row = constraint.next_row(full_logits(model, [*PROMPT_IDS, *seq])[-1], seq).double()
            for token in row.nonzero().flatten().tolist():
                grown[(*seq, token)] = prob * float(row[token] / row.sum())
        joint = grown
    return joint


async def sample_constrained(edge: Service, n: int, length: int) -> Counter[tuple[int, ...]]:
    counts: Counter[tuple[int, ...]] = Counter()
    limit = asyncio.Semaphore(16)
    async with httpx.AsyncClient(base_url=edge.url, timeout=60) as http:

        async def one(seed: int) -> None:
            body = {
                "model": "asymspec", "prompt": PROMPT_IDS, "max_tokens": length,
                "temperature": PARAMS.temperature, "top_k": PARAMS.top_k,
                "logit_bias": {"7": 1.5}, "repetition_penalty": PENALTIES.repetition,
                "presence_penalty": PENALTIES.presence,
                "frequency_penalty": PENALTIES.frequency, "guided_regex": DIGITS,
                "seed": seed, "return_token_ids": True,
            }  # fmt: skip
            async with limit:
                response = await http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            counts[tuple(response.json()["choices"][0]["token_ids"][:length])] += 1

        await asyncio.gather(*(one(seed) for seed in range(n)))
    return counts


@pytest.mark.slow
def test_constrained_speculative_sampling_follows_the_constrained_target(
    edges: dict[str, Service], pair: tuple[Path, Path]
) -> None:
    n, length = 1500, 3
    joint = constrained_joint(pair[0], length)
    counts = asyncio.run(sample_constrained(edges["asymspec"], n, length))
    assert sum(counts.values()) == n and set(counts) <= set(joint), set(counts) - set(joint)
    assert chi_square_pvalue(joint, counts) > 0.001


# ---------------------------------------------------------------- tool calls


def _valid_call(call: Any, names: set[str]) -> dict[str, Any]:
    assert call.type == "function" and call.id and call.function.name in names
    arguments = json.loads(call.function.arguments)
    assert jsonschema_rs.validator_for(TOOL_SCHEMAS[call.function.name]).is_valid(arguments)
    return dict(arguments)


def _less_than_token(pair: tuple[Path, Path]) -> int:
    return int(AutoTokenizer.from_pretrained(pair[0]).convert_tokens_to_ids("<"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("choice", ["required", "named", "auto"])
def test_tool_calls_are_valid_streamed_and_not(
    edges: dict[str, Service], pair: tuple[Path, Path], mode: str, choice: str
) -> None:
    oai = client(edges[mode])
    tool_choice: Any = choice
    names = {"get_weather", "get_time"}
    extra: dict[str, Any] = {}
    if choice == "named":
        tool_choice = {"type": "function", "function": {"name": "get_time"}}
        names = {"get_time"}
    if choice == "auto":  # the tiny model would write text: lean it towards a call's "<"
        extra = {"logit_bias": {str(_less_than_token(pair)): 100}}
    request: dict[str, Any] = {
        "model": "asymspec", "messages": USER, "tools": [WEATHER, TIME],
        "tool_choice": tool_choice, "max_tokens": 200, "temperature": 0.8, "seed": 5, **extra,
    }  # fmt: skip
    response = oai.chat.completions.create(**request)
    choice0 = response.choices[0]
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
    assert choice0.message.tool_calls and len(choice0.message.tool_calls) == 1
    arguments = _valid_call(choice0.message.tool_calls[0], names)

    deltas = list(oai.chat.completions.create(stream=True, **request))
    calls = [
        d.choices[0].delta.tool_calls for d in deltas if d.choices and d.choices[0].delta.tool_calls
    ]
    finish = [
        d.choices[0].finish_reason for d in deltas if d.choices and d.choices[0].finish_reason
    ]
    assert finish == ["tool_calls"] and len(calls) == 1 and calls[0][0].index == 0
    streamed = calls[0][0]
    assert streamed.function.name == choice0.message.tool_calls[0].function.name
    assert json.loads(streamed.function.arguments) == arguments  # same seed, same call


def test_a_tool_answer_goes_back_into_the_conversation(edges: dict[str, Service]) -> None:
    oai = client(edges["asymspec"])
    first = oai.chat.completions.create(
        model="asymspec", messages=USER, tools=[WEATHER], tool_choice="required",  # type: ignore[arg-type, list-item]
        max_tokens=200, temperature=0, seed=1,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    second = oai.chat.completions.create(
        model="asymspec",
        messages=[
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'},
        ],  # type: ignore[list-item]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_tokens=8,
        temperature=0,
    )
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].message.content  # free text: the tool's answer was read
    alone = oai.chat.completions.create(
        model="asymspec",
        messages=USER,
        max_tokens=1,  # type: ignore[arg-type]
    )
    assert second.usage is not None and alone.usage is not None
    # the call and the tool's answer are in the prompt, beside the user's turn
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens + 30


# ---------------------------------------------------------------- speculation control


def test_num_draft_tokens_zero_turns_speculation_off(edges: dict[str, Service]) -> None:
    body = {"model": "asymspec", "prompt": PROMPT_IDS, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    off = httpx.post(
        f"{edges['asymspec'].url}/v1/completions", json={**body, "num_draft_tokens": 0}
    ).json()
    stats = off["metrics"]["speculative_decoding"]
    assert stats["num_drafts"] == 0 and stats["paused_tokens"] == {"request": 12}
    on = httpx.post(f"{edges['asymspec'].url}/v1/completions", json=body).json()
    assert on["metrics"]["speculative_decoding"]["num_drafts"] > 0
    assert on["metrics"]["speculative_decoding"]["paused_tokens"] == {}
    assert off["choices"][0]["text"] == on["choices"][0]["text"]  # greedy: the target's
    pinned = httpx.post(
        f"{edges['asymspec'].url}/v1/completions", json={**body, "num_draft_tokens": 16}
    ).json()
    # 12 tokens cannot hold a block of 16: the stats say the pinned γ was cut, and why
    assert pinned["metrics"]["speculative_decoding"]["shortened_blocks"]["max_tokens"] >= 1


# ---------------------------------------------------------------- every request field

# vLLM's request fields beyond OpenAI's (its protocol.py, both endpoints), here by name
VLLM_FIELDS = (
    "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "return_token_ids",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
    "use_beam_search", "length_penalty", "min_tokens", "include_stop_str_in_output",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "prompt_logprobs", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "structural_tag", "guided_decoding_backend",
    "guided_whitespace_pattern", "priority", "request_id", "logits_processors",
    "return_tokens_as_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs",
)  # fmt: skip
OURS = ("fidelity_budget", "num_draft_tokens")
# Accepted without effect, as docs/api.md lists them: the answer equals the baseline's.
BOOKKEEPING = {
    "user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
    "safety_identifier": "s-1", "prompt_cache_key": "c-1", "prompt_cache_retention": "24h",
}  # fmt: skip
# Refused with a 400 naming the field (a value that would change the answer).
REFUSED = {
    "n": 2, "best_of": 2, "echo": True, "suffix": "end",
    "audio": {"voice": "alloy", "format": "wav"}, "functions": [{"name": "f"}],
    "function_call": "auto", "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "high", "verbosity": "low", "web_search_options": {},
    "moderation": {}, "prompt_cache_options": {}, "modalities": ["audio"],
    "use_beam_search": True, "length_penalty": 2.0, "min_tokens": 4,
    "include_stop_str_in_output": True, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "truncate_prompt_tokens": 2,
    "prompt_logprobs": 1, "allowed_token_ids": [1], "bad_words": ["a"],
    "add_generation_prompt": False, "continue_final_message": True,
    "add_special_tokens": True, "documents": [], "chat_template": "x",
    "chat_template_kwargs": {}, "mm_processor_kwargs": {}, "structural_tag": "{}",
    "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ",
    "priority": 1, "request_id": "r", "logits_processors": ["x"],
    "return_tokens_as_token_ids": True, "cache_salt": "s", "kv_transfer_params": {},
    "vllm_xargs": {},
}  # fmt: skip


class Probe:
    """Requests against one edge, and the target's own greedy answer to compare with."""

    def __init__(self, edge: Service, target_dir: Path) -> None:
        self.edge = edge
        self.model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        self.vocab = self.model.config.vocab_size

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(
            f"{self.edge.url}/v1/{path}", json={"model": "asymspec", **body}, timeout=60
        )

    def ids(self, body: dict[str, Any], path: str = "completions") -> list[int]:
        response = self.post(path, {**CMPL, **body} if path == "completions" else body)
        assert response.status_code == 200, response.text
        return list(response.json()["choices"][0]["token_ids"])

    def greedy(self, params: SamplingParams, penalties: Penalties, n: int = 8) -> list[int]:
        """The target's greedy answer under the transform, token by token in float32."""
        constraint = Constraint(params, penalties, None, PROMPT_IDS, self.vocab)
        out: list[int] = []
        for _ in range(n):
            row = constraint.next_row(full_logits(self.model, [*PROMPT_IDS, *out])[-1], [])
            out.append(int(row.argmax()))
            constraint.commit([out[-1]])
        return out


CMPL = {"prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}  # fmt: skip
GREEDY = SamplingParams(temperature=0.0)


def _honoured(probe: Probe, field: str) -> None:
    """One assertion per honoured field that shows its effect."""
    base = probe.ids({})
    hot = {"temperature": 2.0, "seed": 11}
    checks: dict[str, Any] = {
        "prompt": lambda: probe.ids({"prompt": [50, 51]}) != base,
        "model": lambda: probe.post("completions", {**CMPL, "model": "gpt-4o"}).status_code == 404,
        "max_tokens": lambda: len(probe.ids({"max_tokens": 3})) == 3,
        "max_completion_tokens": lambda: len(probe.ids({"max_completion_tokens": 4})) == 4,
        "temperature": lambda: probe.ids(hot) != base,
        "seed": lambda: probe.ids(hot) == probe.ids(hot),
        "top_p": lambda: probe.ids({**hot, "top_p": 1e-6}) == base,
        "top_k": lambda: probe.ids({**hot, "top_k": 1}) == base,
        "min_p": lambda: probe.ids({"temperature": 1.8, "seed": 11, "min_p": 1.0}) == base,
        "presence_penalty": lambda: (
            probe.ids({"presence_penalty": 2.0}) == probe.greedy(GREEDY, Penalties(presence=2.0))
        ),
        "frequency_penalty": lambda: (
            probe.ids({"frequency_penalty": 2.0}) == probe.greedy(GREEDY, Penalties(frequency=2.0))
        ),
        "repetition_penalty": lambda: (
            probe.ids({"repetition_penalty": 2.0})
            == probe.greedy(GREEDY, Penalties(repetition=2.0))
        ),
        "logit_bias": lambda: probe.ids({"logit_bias": {"50": 100}}) == [50] * 8,
        "stop": lambda: _stops(probe, base),
        "stop_token_ids": lambda: probe.ids({"stop_token_ids": [base[2]]}) == base[:3],
        "ignore_eos": lambda: len(base) == 8,
        "return_token_ids": lambda: len(base) == 8,
        "stream": lambda: (
            "data: [DONE]" in probe.post("completions", {**CMPL, "stream": True}).text
        ),
        "stream_options": lambda: (
            '"usage":{'
            in probe.post(
                "completions", {**CMPL, "stream": True, "stream_options": {"include_usage": True}}
            ).text
        ),
        "response_format": lambda: (
            json.loads(
                _text(
                    probe,
                    {
                        "response_format": {
                            "type": "json_schema",
                            "json_schema": {"name": "c", "schema": obj({"c": COLOR})},
                        }
                    },
                )
            )["c"]
            in COLOR["enum"]
        ),
        "guided_json": lambda: "c" in json.loads(_text(probe, {"guided_json": obj({"c": COLOR})})),
        "guided_regex": lambda: (
            _text(probe, {"guided_regex": "[ab]{3}"})
            in {a + b + c for a in "ab" for b in "ab" for c in "ab"}
        ),
        "guided_choice": lambda: _text(probe, {"guided_choice": ["x1", "y2"]}) in {"x1", "y2"},
        "guided_grammar": lambda: _text(probe, {"guided_grammar": 'start: "ok"'}) == "ok",
        "structured_outputs": lambda: (
            _text(probe, {"structured_outputs": {"choice": ["q"]}}) == "q"
        ),
        "num_draft_tokens": lambda: (
            _stats(probe, {"num_draft_tokens": 0})["paused_tokens"] == {"request": 8}
        ),
        "fidelity_budget": lambda: _stats(probe, {"fidelity_budget": 0.0})["fidelity_spent"] == 0.0,
        "logprobs": lambda: _logprobs_shape(_choice(probe, {"logprobs": 2})["logprobs"]),
    }
    assert checks[field](), field


def _text(probe: Probe, body: dict[str, Any]) -> str:
    body = {**CMPL, "ignore_eos": False, "max_tokens": 60, **body}
    response = probe.post("completions", body)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def _logprobs_shape(logprobs: dict[str, Any]) -> bool:
    """8 tokens, each with its own logprob and up to 2 alternatives (keyed by text: bytes of
    one character share a key)."""
    tops = logprobs["top_logprobs"]
    return len(logprobs["token_logprobs"]) == 8 and all(1 <= len(t) <= 2 for t in tops)


def _choice(probe: Probe, body: dict[str, Any]) -> dict[str, Any]:
    response = probe.post("completions", {**CMPL, **body})
    assert response.status_code == 200, response.text
    return dict(response.json()["choices"][0])


def _stats(probe: Probe, body: dict[str, Any]) -> dict[str, Any]:
    response = probe.post("completions", {**CMPL, **body})
    assert response.status_code == 200, response.text
    return dict(response.json()["metrics"]["speculative_decoding"])


def _stops(probe: Probe, base: list[int]) -> bool:
    tokenizer = probe.tokenizer
    full = tokenizer.decode(base)
    stop = next(s for s in (tokenizer.decode([t]) for t in base[2:]) if s.strip() and s in full)
    response = probe.post("completions", {**CMPL, "stop": [stop]}).json()["choices"][0]
    return bool(response["finish_reason"] == "stop" and stop not in response["text"])


HONOURED = (
    "prompt", "model", "max_tokens", "max_completion_tokens", "temperature", "seed", "top_p",
    "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "stop", "stop_token_ids", "ignore_eos", "return_token_ids", "stream",
    "stream_options", "response_format", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "structured_outputs", "num_draft_tokens", "fidelity_budget", "logprobs",
)  # fmt: skip
# chat-only fields, shown in the tool-call and structured-output tests above
CHAT_HONOURED = ("messages", "tools", "tool_choice", "parallel_tool_calls", "top_logprobs")


def test_every_request_field_is_honoured_or_refused(
    edges: dict[str, Service], pair: tuple[Path, Path]
) -> None:
    from openai.types import completion_create_params as completion_params
    from openai.types.chat import completion_create_params as chat_params

    fields = {
        *completion_params.CompletionCreateParamsBase.__annotations__,
        *chat_params.CompletionCreateParamsBase.__annotations__,
        "stream", *VLLM_FIELDS, *OURS,
    }  # fmt: skip
    classified = {*HONOURED, *CHAT_HONOURED, *BOOKKEEPING, *REFUSED}
    assert fields <= classified, f"fields nobody probes: {sorted(fields - classified)}"
    probe = Probe(edges["asymspec"], pair[0])
    for field in HONOURED:
        _honoured(probe, field)
    chat = {"messages": USER, "max_tokens": 6, "temperature": 0}
    chat_base = probe.post("chat/completions", chat).json()["choices"][0]["message"]
    for field, value in BOOKKEEPING.items():  # no effect, as documented
        answer = probe.post("chat/completions", {**chat, field: value})
        assert answer.status_code == 200, (field, answer.text)
        assert answer.json()["choices"][0]["message"] == chat_base, field
    assert probe.post("chat/completions", {**chat, "modalities": ["text"]}).status_code == 200
    top = probe.post("chat/completions", {**chat, "logprobs": True, "top_logprobs": 3}).json()
    assert [len(t["top_logprobs"]) for t in top["choices"][0]["logprobs"]["content"]] == [3] * 6
    bare = probe.post("completions", {**CMPL, "top_logprobs": 3})  # a chat field
    assert bare.status_code == 400 and bare.json()["error"]["param"] == "top_logprobs"
    single = probe.post(
        "chat/completions",
        {**chat, "max_tokens": 200, "tools": [WEATHER], "tool_choice": "required",
         "parallel_tool_calls": False},
    )  # fmt: skip
    assert len(single.json()["choices"][0]["message"]["tool_calls"]) == 1
    for field, value in REFUSED.items():
        for path, body in (("completions", CMPL), ("chat/completions", chat)):
            answer = probe.post(path, {**body, field: value})
            assert answer.status_code == 400, (path, field, answer.text)
            param = answer.json()["error"]["param"]  # the field, or a path into it
            assert param.split(".")[0] == field, (path, field, answer.text)


# ---------------------------------------------------------------- target logprobs


@pytest.mark.parametrize("mode", MODES)
def test_logprobs_are_the_targets_own_log_softmax(
    edges: dict[str, Service], pair: tuple[Path, Path], mode: str
) -> None:
    """Raw (before the sampling transform), as vLLM reports them by default: equal to the
    target's own log-softmax in float32 on the same tokens, with its top alternatives."""
    model = AutoModelForCausalLM.from_pretrained(pair[0]).eval()
    for seed, prompt in enumerate(([40, 41, 42, 43, 44, 45], [7, 8, 9], [100, 30, 31, 200])):
        body = {
            "model": "asymspec", "prompt": prompt, "max_tokens": 10, "temperature": 0.8,
            "seed": seed, "logprobs": 5, "ignore_eos": True, "return_token_ids": True,
        }  # fmt: skip
        choice = httpx.post(f"{edges[mode].url}/v1/completions", json=body).json()["choices"][0]
        ids = choice["token_ids"]
        reported = choice["logprobs"]
        assert len(ids) == len(reported["token_logprobs"]) == 10
        rows = torch.log_softmax(full_logits(model, [*prompt, *ids])[len(prompt) - 1 : -1], -1)
        expected = rows[torch.arange(len(ids)), torch.tensor(ids)]
        got = torch.tensor(reported["token_logprobs"])
        assert torch.allclose(got, expected, atol=1e-4), (got, expected)
        for row, top in zip(rows, reported["top_logprobs"], strict=True):
            # keyed by text, as OpenAI's: tokens that decode alike (bytes of one character)
            # share a key, so each value is one of the target's 5 largest
            best = row.topk(5).values
            assert 1 <= len(top) <= 5
            for value in top.values():
                assert float((best - value).abs().min()) < 1e-4, (value, best)


def test_logprobs_travel_only_when_asked(edges: dict[str, Service]) -> None:
    """The same cloud-decoded request with and without log-probabilities: the downlink
    carries them (counted in the request's link bytes) only when asked."""
    body = {"model": "asymspec", "prompt": PROMPT_IDS, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "num_draft_tokens": 0}  # fmt: skip
    url = f"{edges['asymspec'].url}/v1/completions"
    plain = httpx.post(url, json=body).json()
    # without num_draft_tokens: a request with logprobs is decoded by the cloud anyway
    asked = httpx.post(url, json={**body, "num_draft_tokens": None, "logprobs": 5}).json()
    assert (
        plain["choices"][0]["logprobs"] is None
        and plain["choices"][0]["text"] == asked["choices"][0]["text"]
    )
    down = [r["metrics"]["speculative_decoding"]["downlink_bytes"] for r in (plain, asked)]
    # per token: its own float32 and 5 × (uint32 id + float32): at least 44 bytes more
    assert down[1] - down[0] >= 16 * 44, down
    assert asked["metrics"]["speculative_decoding"]["paused_tokens"] == {"logprobs": 16}
