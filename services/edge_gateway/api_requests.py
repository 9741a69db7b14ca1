"""From a validated OpenAI request body to what the engine needs: prompt ids, the token
budget, stop strings and sampling parameters; unsupported fields are refused with a 400
rather than silently ignored, as they would change what is sampled."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from asymspec import grammar
from asymspec.grammar import GrammarCompiler, GrammarError
from asymspec.sampling import SamplingParams
from asymspec.sampling_params import LogitBias, Penalties
from edge_gateway import tool_calls
from edge_gateway.api_errors import InvalidRequest
from edge_gateway.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    SamplingFields,
)
from edge_gateway.text import encode_prompt, render_chat


@dataclass(frozen=True)
class ApiSettings:
    """What the API layer needs to know about the served model and its limits."""

    served_model_name: str  # the id in /v1/models and in every response's ``model``
    max_model_len: int  # most prompt + generated tokens of one request
    default_max_tokens: int = 256  # when a request gives no max_tokens (capped by the room left)
    max_tokens_limit: int | None = None  # most tokens one request may ask for; None: no cap
    extra_stop_token_ids: frozenset[int] = frozenset()  # e.g. the generation config's eos
    created: int = field(default_factory=lambda: int(time.time()))  # /v1/models' timestamp


def check_model(body: SamplingFields, settings: ApiSettings) -> None:
    """A model this server does not serve is a 404, as vLLM answers (None: the served one)."""
    if body.model is not None and body.model != settings.served_model_name:
        raise InvalidRequest(
            f"the model {body.model!r} does not exist; this server serves "
            f"{settings.served_model_name!r}",
            "model",
            404,
            "model_not_found",
        )


def refuse_unsupported(body: SamplingFields) -> None:
    """Fields that are known but whose value this server cannot honour: a 400 naming them
    (unknown fields are refused by the schemas)."""
    if body.n is not None and body.n > 1:
        raise InvalidRequest("only n=1 is supported", "n")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise InvalidRequest("echo is not supported", "echo")
        if body.best_of is not None and body.best_of > 1:
            raise InvalidRequest("only best_of=1 is supported", "best_of")
        if body.suffix:
            raise InvalidRequest("suffix (fill-in-the-middle) is not supported", "suffix")
    if logprobs(body) is not None and body.stream:
        raise InvalidRequest("logprobs are not supported with stream", "logprobs")
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs and not body.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
        if body.tool_choice is not None and body.tool_choice != "none" and not body.tools:
            raise InvalidRequest("tool_choice needs tools", "tool_choice")
    if body.ignore_eos and grammar_source(body) is not None:
        # a complete grammar allows nothing but the end of the text
        raise InvalidRequest("ignore_eos cannot be combined with structured output", "ignore_eos")


def logprobs(body: SamplingFields) -> int | None:
    """How many top alternatives to report beside each token's log-probability, or None
    when the request asked for no log-probabilities."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    if isinstance(body, ChatCompletionRequest) and body.logprobs:
        return body.top_logprobs or 0
    return None


def grammar_source(body: SamplingFields) -> str | None:
    """The one field that constrains the output, or None; two at once are a 400."""
    named = [
        name
        for name in (
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "structured_outputs",
        )
        if getattr(body, name) is not None
    ]
    if body.response_format is not None and body.response_format.type != "text":
        named.append("response_format")
    if isinstance(body, ChatCompletionRequest) and tool_choice(body) != "none":
        named.append("tools")
    if len(named) > 1:
        raise InvalidRequest(f"only one output constraint at a time, got {named}", named[1])
    return named[0] if named else None


def tool_choice(body: ChatCompletionRequest) -> str | NamedToolChoice:
    """OpenAI's default: "auto" when tools are given, else "none"."""
    if not body.tools:
        return "none"
    return body.tool_choice if body.tool_choice is not None else "auto"


def _structured_grammar(body: SamplingFields) -> str:
    """The grammar text of the body's structured-output field (not tools)."""
    if body.response_format is not None and body.response_format.type != "text":
        fmt = body.response_format
        if fmt.type == "json_object":
            return grammar.from_json_object()
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise InvalidRequest("json_schema needs a schema", "response_format")
        return grammar.from_json_schema(fmt.json_schema.json_schema)
    guided = _from_fields(
        body.guided_json, body.guided_regex, body.guided_choice, body.guided_grammar, "guided_json"
    )
    if guided is not None:
        return guided
    so = body.structured_outputs
    assert so is not None
    given = [
        n for n in ("json_schema", "regex", "choice", "grammar", "json_object") if getattr(so, n)
    ]
    if len(given) != 1:
        raise InvalidRequest(
            "structured_outputs needs exactly one constraint", "structured_outputs"
        )
    found = _from_fields(so.json_schema, so.regex, so.choice, so.grammar, "structured_outputs")
    return grammar.from_json_object() if found is None else found


def _from_fields(
    json_schema: dict[str, Any] | str | None,
    regex: str | None,
    choice: list[str] | None,
    lark: str | None,
    param: str,
) -> str | None:
    """The grammar of vLLM's constraint fields (the first one set), None when none is."""
    if json_schema is not None:
        return grammar.from_json_schema(_schema(json_schema, param))
    if regex is not None:
        return grammar.from_regex(regex)
    if choice is not None:
        return grammar.from_choice(choice)
    if lark is not None:
        return grammar.from_lark(lark)
    return None


def _schema(value: dict[str, Any] | str, param: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"{param}: not JSON: {exc}", param) from None
    if not isinstance(parsed, dict):
        raise InvalidRequest(f"{param}: a JSON schema is an object", param)
    return parsed


def output_grammar(
    body: SamplingFields, compiler: GrammarCompiler | None, tools_grammar: str | None = None
) -> str:
    """The grammar text the request's output must follow ("" for none), checked to compile
    against the served tokenizer, so a bad schema is the client's 400, not a failed stream."""
    source = grammar_source(body)
    if source is None:
        return ""
    try:
        text = tools_grammar if source == "tools" else _structured_grammar(body)
        assert text is not None
        if compiler is None:
            raise GrammarError("this server cannot run grammars (its tokenizer is not a fast one)")
        compiler.check(text)
    except GrammarError as exc:
        raise InvalidRequest(f"{source}: {exc}", source) from None
    return text


def penalties(body: SamplingFields) -> Penalties:
    return Penalties(
        repetition=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence=body.presence_penalty or 0.0,
        frequency=body.frequency_penalty or 0.0,
    )


def completion_prompt_ids(body: CompletionRequest, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise InvalidRequest("only a single prompt is supported, not a batch", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt must not be empty", "prompt")
        return encode_prompt(tokenizer, checked_text(prompt, "prompt"))
    ids = [int(t) for t in prompt]  # type: ignore[arg-type]  # the batch case was unwrapped
    if not ids:
        raise InvalidRequest("prompt must not be empty", "prompt")
    if any(not 0 <= t < len(tokenizer) for t in ids):
        raise InvalidRequest(f"prompt token ids must be in [0, {len(tokenizer)})", "prompt")
    return ids


def _message_text(message: ChatMessage) -> str:
    if message.tool_calls:
        if message.role != "assistant":
            raise InvalidRequest("only an assistant message can hold tool_calls", "messages")
        try:
            calls = tool_calls.render_calls(message.tool_calls)
        except ValueError as exc:
            raise InvalidRequest(str(exc), "messages") from None
        text = _content_text(message) if message.content is not None else ""
        return f"{text}\n{calls}" if text else calls
    if message.role == "tool" and not message.tool_call_id:
        raise InvalidRequest("a 'tool' message needs tool_call_id", "messages")
    if message.content is None:
        # OpenAI allows a missing content only on assistant turns (e.g. tool calls).
        if message.role != "assistant":
            raise InvalidRequest(f"a {message.role!r} message needs content", "messages")
        return ""
    return _content_text(message)


def _content_text(message: ChatMessage) -> str:
    if isinstance(message.content, str):
        return checked_text(message.content, "messages")
    texts = []
    for part in message.content or []:
        if part.type != "text" or part.text is None:
            raise InvalidRequest(f"unsupported content part type {part.type!r}", "messages")
        texts.append(checked_text(part.text, "messages"))
    return "\n".join(texts)  # vLLM joins text parts with a newline too


def chat_prompt_ids(body: ChatCompletionRequest, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    messages = [{"role": m.role, "content": _message_text(m)} for m in body.messages]
    choice = tool_choice(body)
    if body.tools and choice != "none":
        try:
            described = tool_calls.tools_prompt(body.tools, choice)
        except ValueError as exc:
            raise InvalidRequest(str(exc), "tool_choice") from None
        messages.insert(0, {"role": "system", "content": described})
    try:
        ids = render_chat(tokenizer, messages)
    except Exception as exc:  # a template may reject a conversation (e.g. role order)
        raise InvalidRequest(f"cannot apply the chat template: {exc}", "messages") from exc
    if not ids:
        raise InvalidRequest("the chat template produced an empty prompt", "messages")
    return ids


def tools_grammar(body: ChatCompletionRequest) -> str | None:
    """The Lark grammar of an answer under the body's tools and tool_choice (or None)."""
    if not body.tools:
        return None
    try:
        lark = tool_calls.lark_grammar(body.tools, tool_choice(body))
    except ValueError as exc:
        raise InvalidRequest(str(exc), "tool_choice") from None
    return None if lark is None else grammar.from_lark(lark)


def max_new_tokens(
    requested: int | None,
    prompt_len: int,
    params: tuple[str, str],  # the names of the prompt and max-tokens fields, for errors
    settings: ApiSettings,
) -> int:
    prompt_param, max_tokens_param = params
    room = settings.max_model_len - prompt_len
    if room < 1:
        raise InvalidRequest(
            f"the prompt has {prompt_len} tokens; this model's context is "
            f"{settings.max_model_len} tokens, leaving no room to generate",
            prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        limit = settings.max_tokens_limit or settings.default_max_tokens
        return min(settings.default_max_tokens, limit, room)
    if settings.max_tokens_limit is not None and requested > settings.max_tokens_limit:
        raise InvalidRequest(
            f"{max_tokens_param} is {requested}; at most {settings.max_tokens_limit} are allowed",
            max_tokens_param,
        )
    if requested > room:
        raise InvalidRequest(
            f"this model's context is {settings.max_model_len} tokens; the prompt has "
            f"{prompt_len} and {requested} were requested",
            max_tokens_param,
            code="context_length_exceeded",
        )
    return requested


MAX_STOP_STRINGS = 4  # OpenAI's limit


def stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    found = [stop] if isinstance(stop, str) else stop
    if len(found) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"stop: at most {MAX_STOP_STRINGS} stop sequences, got {len(found)}", "stop"
        )
    return [checked_text(s, "stop") for s in found if s]


def checked_text(text: str, param: str) -> str:
    """Text that is valid Unicode: JSON can carry a lone surrogate ("\\ud800"), which no
    tokenizer can encode; that is the client's error (400), not the server's."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            f"{param}: not valid Unicode (a lone surrogate at position {exc.start})", param
        ) from None
    return text


# Below this a temperature is greedy, as in vLLM: logits / 1e-300 overflow to inf and the
# softmax of inf - inf is NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5


def sampling_params(body: SamplingFields, vocab_size: int) -> SamplingParams:
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
    temperature = 1.0 if body.temperature is None else body.temperature
    return SamplingParams(
        temperature=0.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature,
        top_k=top_k,
        top_p=1.0 if body.top_p is None else body.top_p,
        min_p=body.min_p or 0.0,
        logit_bias=logit_bias(body.logit_bias, vocab_size),
    )


def logit_bias(bias: dict[str, float] | None, vocab_size: int) -> LogitBias:
    """OpenAI's {"token id": bias} as sorted (id, bias) pairs; ids must be in the vocabulary."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias: {key!r} is not a token id", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise InvalidRequest(
                f"logit_bias: token id {token} is not in [0, {vocab_size})", "logit_bias"
            )
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))
