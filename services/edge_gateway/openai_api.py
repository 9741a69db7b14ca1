"""The OpenAI-compatible HTTP API of the edge: /v1/completions, /v1/chat/completions,
/v1/models, with OpenAI's request fields, response objects, SSE streaming and error bodies.

The app factory wires it up (no module globals; everything is injected)::

    app.include_router(build_router(lambda: state.engine, lambda: state.tokenizer,
                                    ApiSettings(served_model_name=..., max_model_len=...),
                                    metrics))
    install_error_handlers(app)

Compatibility notes:
- Any ``model`` string is accepted and answered by the one served model (clients often
  hard-code a name); ``GET /v1/models/{model}`` is strict.
- Only ``n = 1``, a single prompt, text-only chat content; ``logprobs``, ``echo``,
  ``best_of`` > 1, penalties and ``logit_bias`` are refused with a 400 rather than
  silently ignored, as they would change what is sampled. Other unknown fields are ignored.
- Extensions: ``top_k`` (-1 or 0 disables), ``stop_token_ids`` (vLLM's),
  ``fidelity_budget`` (ε in [0, 1]) and ``num_draft_tokens`` (γ in 1..16).
- ``usage.completion_tokens`` counts every token the engine committed to the answer, a
  stop token included, up to the token that completed a stop string.
- Errors raised by the engine after a stream has started arrive as a final
  ``data: {"error": {...}}`` event followed by ``data: [DONE]``, as vLLM sends them.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from asymspec.sampling import SamplingParams
from edge_gateway.engine_api import Engine, GenerationError, GenerationRequest
from edge_gateway.metrics import EdgeMetrics, RequestTimer
from edge_gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    SamplingFields,
    Usage,
)
from edge_gateway.text import IncrementalDetokenizer, encode_prompt, render_chat, stop_token_ids

logger = logging.getLogger(__name__)

EngineProvider = Callable[[], Engine | None]  # None: not loaded yet (503)
TokenizerProvider = Callable[[], PreTrainedTokenizerBase | None]


@dataclass(frozen=True)
class ApiSettings:
    """What the API layer needs to know about the served model and its limits."""

    served_model_name: str  # the id in /v1/models and in every response's ``model``
    max_model_len: int  # most prompt + generated tokens of one request
    default_max_tokens: int = 256  # when a request gives no max_tokens (capped by the room left)
    max_tokens_limit: int | None = None  # most tokens one request may ask for; None: no cap
    extra_stop_token_ids: frozenset[int] = frozenset()  # e.g. the generation config's eos
    created: int = field(default_factory=lambda: int(time.time()))  # /v1/models' timestamp


# ---------------------------------------------------------------------------------------
# Errors


class InvalidRequest(Exception):
    """A request the API refuses before it reaches the engine (400 unless told)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status_code: int = 400,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status_code, self.code = message, param, status_code, code


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(
    status_code: int,
    message: str,
    error_type: str,
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, param, code), status_code=status_code)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """pydantic's first error as (message, param): OpenAI names one offending field."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "could not parse the request body as JSON", None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid value"))
    return (f"{param}: {message}" if param else message), param


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    message, param = _validation_message(exc)
    return error_response(400, message, "invalid_request_error", param)


async def _on_invalid_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, InvalidRequest)
    return error_response(
        exc.status_code, exc.message, "invalid_request_error", exc.param, exc.code
    )


async def _on_generation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GenerationError)
    return error_response(exc.status_code, exc.message, exc.error_type)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return error_response(exc.status_code, str(exc.detail), error_type)


async def _on_unexpected_error(request: Request, exc: Exception) -> Response:
    return error_response(500, "internal server error", "server_error")


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI error bodies for every failure: FastAPI's 422 ``{"detail": ...}`` (malformed
    JSON included) becomes a 400 ``invalid_request_error``; 404/405 get the same shape."""
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(InvalidRequest, _on_invalid_request)
    app.add_exception_handler(GenerationError, _on_generation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected_error)


# ---------------------------------------------------------------------------------------
# From a validated request to a GenerationRequest


def _refuse_unsupported(body: SamplingFields) -> None:
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


def _completion_prompt_ids(
    body: CompletionRequest, tokenizer: PreTrainedTokenizerBase
) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise InvalidRequest("only a single prompt is supported, not a batch", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt must not be empty", "prompt")
        return encode_prompt(tokenizer, prompt)
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
        return message.content
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise InvalidRequest(f"unsupported content part type {part.type!r}", "messages")
        texts.append(part.text)
    return "\n".join(texts)  # vLLM joins text parts with a newline too


def _chat_prompt_ids(body: ChatCompletionRequest, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    messages = [{"role": m.role, "content": _message_text(m)} for m in body.messages]
    try:
        ids = render_chat(tokenizer, messages)
    except Exception as exc:  # a template may reject a conversation (e.g. role order)
        raise InvalidRequest(f"cannot apply the chat template: {exc}", "messages") from exc
    if not ids:
        raise InvalidRequest("the chat template produced an empty prompt", "messages")
    return ids


def _max_new_tokens(
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


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


# Below this a temperature is greedy, as in vLLM: logits / 1e-300 overflow to inf and the
# softmax of inf - inf is NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5


def _sampling_params(body: SamplingFields) -> SamplingParams:
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
    temperature = 1.0 if body.temperature is None else body.temperature
    return SamplingParams(
        temperature=0.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature,
        top_k=top_k,
        top_p=1.0 if body.top_p is None else body.top_p,
    )


# ---------------------------------------------------------------------------------------
# Streaming


async def _close(iterator: AsyncIterator[Any]) -> None:
    """Close an async iterator even inside a cancelled scope (client gone): the close is
    what tells the engine to cancel the request and free its state on both sides."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


def _sse(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """An SSE response that notices a client leaving and closes its event iterator.

    Starlette watches for ``http.disconnect`` only under ASGI spec < 2.4 (uvicorn says
    2.3); under 2.4 it learns of a disconnect only when a send fails, and then leaves the
    iterator to the garbage collector. An engine waiting on a stalled cloud sends nothing,
    so the request would live on. Here the watch runs whatever the server's spec version,
    and the iterator is closed at once, which cancels the engine's request.
    """

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client went away during a send
                    except Exception:  # headers are sent: there is no one to answer now
                        logger.exception("event stream failed")
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            await _close(self.events)


# ---------------------------------------------------------------------------------------
# One request through the engine


@dataclass
class _Job:
    """A request ready for the engine, and what its responses need to say."""

    response_id: str
    created: int
    model: str
    request: GenerationRequest
    stop_strings: list[str]
    include_usage: bool
    arrival_s: float
    completion_tokens: int = 0
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)  # the generated ids counted so far

    def usage(self) -> Usage:
        prompt_tokens = len(self.request.prompt_ids)
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=prompt_tokens + self.completion_tokens,
        )


def _split_at_stop_token(ids: Sequence[int], stop_ids: frozenset[int]) -> tuple[list[int], bool]:
    """(the ids before the first stop token, whether there was one): the stop token ends
    the answer and is counted but never shown."""
    for i, token_id in enumerate(ids):
        if token_id in stop_ids:
            return list(ids[:i]), True
    return list(ids), False


class OpenAIApi:
    """The route handlers; state is only what was injected."""

    def __init__(
        self,
        engine_provider: EngineProvider,
        tokenizer_provider: TokenizerProvider,
        settings: ApiSettings,
        metrics: EdgeMetrics,
    ) -> None:
        self.engine_provider = engine_provider
        self.tokenizer_provider = tokenizer_provider
        self.settings = settings
        self.metrics = metrics
        self._stop_ids: dict[int, frozenset[int]] = {}  # by id(tokenizer): computed once

    # -- routes --------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest) -> Response:
        arrival_s = time.perf_counter()
        _refuse_unsupported(body)
        engine, tokenizer = self._ready()
        prompt_ids = _completion_prompt_ids(body, tokenizer)
        max_tokens = (body.max_tokens, "max_tokens")
        job = self._job("cmpl", body, prompt_ids, max_tokens, tokenizer, arrival_s)
        deltas = self._text_deltas(engine, tokenizer, job)
        if body.stream:
            return EventStream(self._completion_events(job, deltas))
        text = await self._collect(deltas)
        choice = CompletionChoice(
            text=text,
            finish_reason=job.finish_reason,
            token_ids=job.token_ids if body.return_token_ids else None,
        )
        return JSONResponse(
            CompletionResponse(
                id=job.response_id,
                created=job.created,
                model=job.model,
                choices=[choice],
                usage=job.usage(),
            ).model_dump()
        )

    async def chat_completions(self, body: ChatCompletionRequest) -> Response:
        arrival_s = time.perf_counter()
        _refuse_unsupported(body)
        engine, tokenizer = self._ready()
        prompt_ids = _chat_prompt_ids(body, tokenizer)
        max_tokens = (
            (body.max_completion_tokens, "max_completion_tokens")
            if body.max_completion_tokens is not None
            else (body.max_tokens, "max_tokens")
        )
        job = self._job("chatcmpl", body, prompt_ids, max_tokens, tokenizer, arrival_s)
        deltas = self._text_deltas(engine, tokenizer, job)
        if body.stream:
            return EventStream(self._chat_events(job, deltas))
        text = await self._collect(deltas)
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=job.finish_reason)
        return JSONResponse(
            ChatCompletionResponse(
                id=job.response_id,
                created=job.created,
                model=job.model,
                choices=[choice],
                usage=job.usage(),
            ).model_dump()
        )

    async def models(self) -> ModelList:
        return ModelList(data=[self._model_card()])

    async def model(self, model: str) -> ModelCard:
        if model != self.settings.served_model_name:
            raise InvalidRequest(
                f"the model {model!r} does not exist", "model", 404, "model_not_found"
            )
        return self._model_card()

    # -- helpers -------------------------------------------------------------------------

    def _model_card(self) -> ModelCard:
        return ModelCard(
            id=self.settings.served_model_name,
            created=self.settings.created,
            max_model_len=self.settings.max_model_len,
        )

    def _ready(self) -> tuple[Engine, PreTrainedTokenizerBase]:
        engine, tokenizer = self.engine_provider(), self.tokenizer_provider()
        if engine is None or tokenizer is None or not engine.ready:
            raise GenerationError("the engine is not ready", 503, "service_unavailable_error")
        return engine, tokenizer

    def _stop_token_ids(self, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
        key = id(tokenizer)
        if key not in self._stop_ids:
            self._stop_ids = {key: stop_token_ids(tokenizer) | self.settings.extra_stop_token_ids}
        return self._stop_ids[key]

    def _job(
        self,
        prefix: str,
        body: SamplingFields,
        prompt_ids: list[int],
        max_tokens: tuple[int | None, str],  # (the value, the field it came from)
        tokenizer: PreTrainedTokenizerBase,
        arrival_s: float,
    ) -> _Job:
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        request = GenerationRequest(
            request_id=response_id,
            prompt_ids=prompt_ids,
            max_new_tokens=_max_new_tokens(
                max_tokens[0],
                len(prompt_ids),
                ("messages" if prefix == "chatcmpl" else "prompt", max_tokens[1]),
                self.settings,
            ),
            params=_sampling_params(body),
            seed=body.seed,
            stop_token_ids=(frozenset() if body.ignore_eos else self._stop_token_ids(tokenizer))
            | frozenset(body.stop_token_ids or ()),
            num_draft_tokens=body.num_draft_tokens,
            fidelity_budget=body.fidelity_budget,
        )
        return _Job(
            response_id=response_id,
            created=int(time.time()),
            model=self.settings.served_model_name,
            request=request,
            stop_strings=_stop_strings(body.stop),
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            arrival_s=arrival_s,
        )

    async def _text_deltas(
        self, engine: Engine, tokenizer: PreTrainedTokenizerBase, job: _Job
    ) -> AsyncIterator[str]:
        """The engine's token chunks as text deltas; sets the job's finish reason and token
        count, records the request's metrics, and closes the engine's iterator however the
        request ends (finished, stop string, engine error, client gone)."""
        request = job.request
        detokenizer = IncrementalDetokenizer(tokenizer, job.stop_strings, request.prompt_ids)
        timer = RequestTimer(self.metrics, job.arrival_s)
        chunks: AsyncIterator[list[int]] | None = None
        failure = "abort"  # until it finishes or fails: the client left, the task was cancelled
        timer.started(len(request.prompt_ids))
        try:
            chunks = engine.generate(request)
            async for ids in chunks:
                if not ids:
                    continue
                shown, stop_token = _split_at_stop_token(ids, request.stop_token_ids)
                before = detokenizer.num_tokens
                delta = detokenizer.add(shown)
                counted = detokenizer.num_tokens - before
                counted += int(stop_token and not detokenizer.stopped)  # the stop token itself
                job.completion_tokens += counted
                job.token_ids.extend(ids[:counted])
                timer.tokens(counted)
                if delta:
                    yield delta
                if stop_token or detokenizer.stopped:
                    job.finish_reason = "stop"
                    break  # a stop string: closing the iterator below cancels the rest
            tail = detokenizer.finish()
            if tail:
                yield tail
            if detokenizer.stopped:  # a stop string can also complete in the flushed tail
                job.finish_reason = "stop"
            job.finish_reason = job.finish_reason or "length"
            failure = ""
            timer.finished(job.finish_reason)
        except GenerationError:
            failure = "error"
            raise
        except Exception as exc:  # a bug in the engine: still an OpenAI error for the client
            failure = "error"
            logger.exception("engine failure on %s", request.request_id)
            raise GenerationError(f"engine failure: {exc}") from exc
        finally:
            if failure:
                timer.failed(failure)
            if chunks is not None:
                await _close(chunks)

    @staticmethod
    async def _collect(deltas: AsyncIterator[str]) -> str:
        try:
            return "".join([delta async for delta in deltas])
        finally:
            await _close(deltas)

    @staticmethod
    async def _events(
        job: _Job,
        deltas: AsyncIterator[str],
        chunk: Callable[[str | None, str | None], BaseModel],
        usage_chunk: Callable[[Usage], BaseModel],
    ) -> AsyncIterator[str]:
        """Text deltas as SSE events: ``chunk(text, None)`` per delta, ``chunk(None,
        finish_reason)`` at the end, the usage chunk if asked for, then [DONE]."""
        try:
            async for delta in deltas:
                yield _sse(chunk(delta, None))
            yield _sse(chunk(None, job.finish_reason))
            if job.include_usage:
                yield _sse(usage_chunk(job.usage()))
        except GenerationError as exc:
            yield _sse(error_body(exc.message, exc.error_type, code=str(exc.status_code)))
        finally:
            await _close(deltas)
        yield SSE_DONE

    def _completion_events(self, job: _Job, deltas: AsyncIterator[str]) -> AsyncIterator[str]:
        def chunk(text: str | None, finish_reason: str | None) -> CompletionResponse:
            choice = CompletionChoice(text=text or "", finish_reason=finish_reason)
            return CompletionResponse(
                id=job.response_id, created=job.created, model=job.model, choices=[choice]
            )

        def usage_chunk(usage: Usage) -> CompletionResponse:
            return CompletionResponse(
                id=job.response_id, created=job.created, model=job.model, choices=[], usage=usage
            )

        return self._events(job, deltas, chunk, usage_chunk)

    async def _chat_events(self, job: _Job, deltas: AsyncIterator[str]) -> AsyncIterator[str]:
        def chunk(text: str | None, finish_reason: str | None) -> ChatCompletionChunk:
            delta = {} if text is None else {"content": text}
            choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
            return ChatCompletionChunk(
                id=job.response_id, created=job.created, model=job.model, choices=[choice]
            )

        def usage_chunk(usage: Usage) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=job.response_id, created=job.created, model=job.model, choices=[], usage=usage
            )

        # OpenAI opens every chat stream with the role, before any content.
        role = ChatChunkChoice(delta={"role": "assistant", "content": ""})
        yield _sse(
            ChatCompletionChunk(
                id=job.response_id, created=job.created, model=job.model, choices=[role]
            )
        )
        events = self._events(job, deltas, chunk, usage_chunk)
        try:
            async for event in events:
                yield event
        finally:
            await _close(events)


def build_router(
    engine_provider: EngineProvider,
    tokenizer_provider: TokenizerProvider,
    settings: ApiSettings,
    metrics: EdgeMetrics,
) -> APIRouter:
    """The /v1 routes. The providers are called per request, so the app can load the
    engine and tokenizer in its lifespan (a provider returning None answers 503)."""
    api = OpenAIApi(engine_provider, tokenizer_provider, settings, metrics)
    router = APIRouter()
    router.add_api_route(
        "/v1/completions",
        api.completions,
        methods=["POST"],
        response_model=None,
        responses={200: {"model": CompletionResponse}},
    )
    router.add_api_route(
        "/v1/chat/completions",
        api.chat_completions,
        methods=["POST"],
        response_model=None,
        responses={200: {"model": ChatCompletionResponse}},
    )
    router.add_api_route("/v1/models", api.models, methods=["GET"], response_model=ModelList)
    router.add_api_route(
        "/v1/models/{model:path}", api.model, methods=["GET"], response_model=ModelCard
    )
    return router
