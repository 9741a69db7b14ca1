"""From a validated OpenAI request body to what the engine needs: prompt ids, the token
budget, stop strings and sampling parameters; unsupported fields are refused with a 400
rather than silently ignored, as they would change what is sampled."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from asymspec.sampling import SamplingParams
from edge_gateway.api_errors import InvalidRequest
from edge_gateway.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
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


def refuse_unsupported(body: SamplingFields) -> None:
    if body.n is not None and body.n > 1:
        raise InvalidRequest("only n=1 is supported", "n")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise InvalidRequest(f"{name} is not supported (must be 0)", name)
    if body.logit_bias:
        raise InvalidRequest("logit_bias is not supported", "logit_bias")
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise InvalidRequest("echo is not supported", "echo")
        if body.best_of is not None and body.best_of > 1:
            raise InvalidRequest("only best_of=1 is supported", "best_of")
    if isinstance(body, CompletionRequest | ChatCompletionRequest) and body.logprobs:
        raise InvalidRequest("logprobs are not supported", "logprobs")
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs:
        raise InvalidRequest("top_logprobs is not supported", "top_logprobs")


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
    if message.content is None:
        # OpenAI allows a missing content only on assistant turns (e.g. tool calls).
        if message.role != "assistant":
            raise InvalidRequest(f"a {message.role!r} message needs content", "messages")
        return ""
    if isinstance(message.content, str):
        return checked_text(message.content, "messages")
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise InvalidRequest(f"unsupported content part type {part.type!r}", "messages")
        texts.append(checked_text(part.text, "messages"))
    return "\n".join(texts)  # vLLM joins text parts with a newline too


def chat_prompt_ids(body: ChatCompletionRequest, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    messages = [{"role": m.role, "content": _message_text(m)} for m in body.messages]
    try:
        ids = render_chat(tokenizer, messages)
    except Exception as exc:  # a template may reject a conversation (e.g. role order)
        raise InvalidRequest(f"cannot apply the chat template: {exc}", "messages") from exc
    if not ids:
        raise InvalidRequest("the chat template produced an empty prompt", "messages")
    return ids


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


def sampling_params(body: SamplingFields) -> SamplingParams:
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
    temperature = 1.0 if body.temperature is None else body.temperature
    return SamplingParams(
        temperature=0.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature,
        top_k=top_k,
        top_p=1.0 if body.top_p is None else body.top_p,
    )
