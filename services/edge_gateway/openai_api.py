"""The OpenAI-compatible HTTP API of the edge: /v1/completions, /v1/chat/completions,
/v1/models, with OpenAI's request fields, response objects, SSE streaming and error bodies.

Request translation lives in ``api_requests``, error bodies in ``api_errors``, SSE in
``sse``. The app factory wires it up (no module globals; everything is injected)::

    app.include_router(build_router(lambda: state.engine, lambda: state.tokenizer,
                                    ApiSettings(served_model_name=..., max_model_len=...),
                                    metrics))
    install_error_handlers(app)

Compatibility notes (docs/api.md has every field):
- ``model`` must be the served model's id (or absent): another is a 404 ``model_not_found``.
- Every request field is honoured or refused with a 400 naming it; unknown fields too.
  Only ``n = 1``, a single prompt, text-only chat content.
- Structured output (``response_format``, vLLM's ``guided_*`` and ``structured_outputs``)
  and tool calls (``tools``) become one grammar that masks both sides' rows.
- ``logprobs``: the target's raw log-probabilities, reported by the cloud (which then
  samples every token of the request); not with ``stream``.
- Extensions: ``top_k`` (-1 or 0 disables), ``min_p``, ``repetition_penalty``,
  ``stop_token_ids`` (vLLM's), ``fidelity_budget`` (ε in [0, 1]) and ``num_draft_tokens``
  (γ in 0..16; 0 turns speculation off for the request).
- ``usage.completion_tokens`` counts every token the engine committed to the answer, a
  stop token included, up to the token that completed a stop string.
- Errors raised by the engine after a stream has started arrive as a final
  ``data: {"error": {...}}`` event followed by ``data: [DONE]``, as vLLM sends them.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from asymspec.grammar import GrammarCompiler, GrammarError
from edge_gateway import tool_calls
from edge_gateway.api_errors import InvalidRequest, error_body
from edge_gateway.api_requests import (
    ApiSettings,
    chat_prompt_ids,
    check_model,
    completion_prompt_ids,
    logprobs,
    max_new_tokens,
    output_grammar,
    penalties,
    refuse_unsupported,
    sampling_params,
    stop_strings,
    tool_choice,
    tools_grammar,
)
from edge_gateway.engine_api import Engine, GenerationError, GenerationRequest, TokenLogprobs
from edge_gateway.metrics import EdgeMetrics, RequestTimer
from edge_gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    RequestMetrics,
    SamplingFields,
    SpecDecodingStats,
    Timings,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
)
from edge_gateway.sse import SSE_DONE, EventStream, close_shielded, sse_event
from edge_gateway.text import IncrementalDetokenizer, stop_token_ids

logger = logging.getLogger(__name__)

EngineProvider = Callable[[], Engine | None]  # None: not loaded yet (503)
TokenizerProvider = Callable[[], PreTrainedTokenizerBase | None]
StreamChunk = CompletionResponse | ChatCompletionChunk


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
    started_s: float = 0.0  # the engine was asked
    first_token_s: float | None = None  # the first generated token was ready
    finished_s: float | None = None

    def metrics(self) -> RequestMetrics:
        s = self.request.stats
        return RequestMetrics(
            speculative_decoding=SpecDecodingStats(
                num_drafts=s.blocks,
                num_draft_tokens=s.draft_tokens,
                num_accepted_tokens=s.accepted_tokens,
                num_accepted_tokens_per_pos=list(s.accepted_per_position),
                corrections=dict(s.corrections),
                max_topk_k=s.max_topk_k,
                fidelity_spent=s.fidelity_spent,
                verify_round_trips=s.verify_round_trips,
                correction_round_trips=s.correction_round_trips,
                uplink_bytes=s.uplink_bytes,
                downlink_bytes=s.downlink_bytes,
                paused_tokens=dict(s.paused_tokens),
                shortened_blocks=dict(s.shortened_blocks),
            )
        )

    def timings(self) -> Timings:
        first = self.first_token_s if self.first_token_s is not None else self.started_s
        finished = self.finished_s if self.finished_s is not None else first
        return Timings(
            prompt_n=len(self.request.prompt_ids),
            prompt_ms=round(1e3 * (first - self.started_s), 3),
            predicted_n=self.completion_tokens,
            predicted_ms=round(1e3 * (finished - first), 3),
            draft_n=self.request.stats.draft_tokens,
            draft_n_accepted=self.request.stats.accepted_tokens,
        )

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
        # checks that a request's grammar compiles (a 400 rather than a failed stream)
        self._grammars: dict[int, GrammarCompiler | None] = {}  # by id(tokenizer)

    # -- routes --------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest) -> Response:
        arrival_s = time.perf_counter()
        check_model(body, self.settings)
        refuse_unsupported(body)
        engine, tokenizer = self._ready()
        prompt_ids = completion_prompt_ids(body, tokenizer)
        grammar = output_grammar(body, self._grammar_compiler(tokenizer))
        job = self._job("cmpl", body, prompt_ids, grammar, tokenizer, arrival_s)
        deltas = self._text_deltas(engine, tokenizer, job)
        if body.stream:
            return EventStream(self._completion_events(job, deltas))
        text = await self._collect(deltas)
        choice = CompletionChoice(
            text=text,
            finish_reason=job.finish_reason,
            token_ids=job.token_ids if body.return_token_ids else None,
            logprobs=None if body.logprobs is None else completion_logprobs(job, tokenizer),
        )
        return JSONResponse(
            CompletionResponse(
                id=job.response_id,
                created=job.created,
                model=job.model,
                choices=[choice],
                usage=job.usage(),
                metrics=job.metrics(),
                timings=job.timings(),
            ).model_dump()
        )

    async def chat_completions(self, body: ChatCompletionRequest) -> Response:
        arrival_s = time.perf_counter()
        check_model(body, self.settings)
        refuse_unsupported(body)
        engine, tokenizer = self._ready()
        prompt_ids = chat_prompt_ids(body, tokenizer)
        compiler = self._grammar_compiler(tokenizer)
        grammar = output_grammar(body, compiler, tools_grammar(body))
        job = self._job("chatcmpl", body, prompt_ids, grammar, tokenizer, arrival_s)
        calls_tools = tool_choice(body) != "none"
        deltas = self._text_deltas(engine, tokenizer, job)
        if body.stream:
            return EventStream(self._chat_events(job, deltas, calls_tools))
        text = await self._collect(deltas)
        call = tool_calls.parse_call(text) if calls_tools else None
        if call is not None:
            message = AssistantMessage(content=None, tool_calls=[call.as_tool_call()])
            job.finish_reason = "tool_calls"
        else:
            message = AssistantMessage(content=text)
        choice = ChatChoice(
            message=message,
            finish_reason=job.finish_reason,
            logprobs=chat_logprobs(job, tokenizer) if body.logprobs else None,
        )
        return JSONResponse(
            ChatCompletionResponse(
                id=job.response_id,
                created=job.created,
                model=job.model,
                choices=[choice],
                usage=job.usage(),
                metrics=job.metrics(),
                timings=job.timings(),
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
        # Loaded is enough: an engine that needs the cloud waits for it (up to its deadline)
        # rather than refusing a request the moment the link is down.
        if engine is None or tokenizer is None:
            raise GenerationError("the model is still loading", 503, "service_unavailable_error")
        return engine, tokenizer

    def _grammar_compiler(self, tokenizer: PreTrainedTokenizerBase) -> GrammarCompiler | None:
        key = id(tokenizer)
        if key not in self._grammars:
            try:
                compiler: GrammarCompiler | None = GrammarCompiler(tokenizer, len(tokenizer))
            except GrammarError:
                compiler = None  # not a fast tokenizer: grammars are refused with a 400
            self._grammars = {key: compiler}
        return self._grammars[key]

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
        grammar: str,
        tokenizer: PreTrainedTokenizerBase,
        arrival_s: float,
    ) -> _Job:
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        max_tokens = (
            (body.max_completion_tokens, "max_completion_tokens")
            if body.max_completion_tokens is not None
            else (body.max_tokens, "max_tokens")
        )
        request = GenerationRequest(
            request_id=response_id,
            prompt_ids=prompt_ids,
            max_new_tokens=max_new_tokens(
                max_tokens[0],
                len(prompt_ids),
                ("messages" if prefix == "chatcmpl" else "prompt", max_tokens[1]),
                self.settings,
            ),
            params=sampling_params(body, len(tokenizer)),
            seed=body.seed,
            stop_token_ids=(frozenset() if body.ignore_eos else self._stop_token_ids(tokenizer))
            | frozenset(body.stop_token_ids or ()),
            num_draft_tokens=body.num_draft_tokens,
            fidelity_budget=body.fidelity_budget,
            penalties=penalties(body),
            grammar=grammar,
            logprobs=logprobs(body),
        )
        return _Job(
            response_id=response_id,
            created=int(time.time()),
            model=self.settings.served_model_name,
            request=request,
            stop_strings=stop_strings(body.stop),
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
        job.started_s = time.perf_counter()
        try:
            chunks = engine.generate(request)
            async for ids in chunks:
                if not ids:
                    continue
                if job.first_token_s is None:
                    job.first_token_s = time.perf_counter()
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
                await close_shielded(chunks)  # the engine's stats are final after this
            job.finished_s = time.perf_counter()

    @staticmethod
    async def _collect(deltas: AsyncIterator[str]) -> str:
        try:
            return "".join([delta async for delta in deltas])
        finally:
            await close_shielded(deltas)

    @staticmethod
    async def _events(
        job: _Job,
        deltas: AsyncIterator[Any],
        chunk: Callable[[Any, str | None], StreamChunk],
        usage_chunk: Callable[[Usage], StreamChunk],
    ) -> AsyncIterator[str]:
        """Text deltas as SSE events: ``chunk(text, None)`` per delta, ``chunk(None,
        finish_reason)`` at the end, the usage chunk if asked for, then [DONE]. The last
        data chunk carries the request's speculation stats and timings."""
        try:
            async for delta in deltas:
                yield sse_event(chunk(delta, None))
            final = chunk(None, job.finish_reason)
            if job.include_usage:
                yield sse_event(final)
                final = usage_chunk(job.usage())
            final.metrics, final.timings = job.metrics(), job.timings()
            yield sse_event(final)
        except GenerationError as exc:
            yield sse_event(error_body(exc.message, exc.error_type, code=str(exc.status_code)))
        finally:
            await close_shielded(deltas)
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

    async def _chat_events(
        self, job: _Job, deltas: AsyncIterator[str], calls_tools: bool
    ) -> AsyncIterator[str]:
        def chunk(item: str | ToolCall | None, finish_reason: str | None) -> ChatCompletionChunk:
            delta: dict[str, Any] = {}
            if isinstance(item, str):
                delta = {"content": item}
            elif item is not None:  # OpenAI streams a call with its index in the answer
                delta = {"tool_calls": [{"index": 0, **item.model_dump()}]}
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
        yield sse_event(
            ChatCompletionChunk(
                id=job.response_id, created=job.created, model=job.model, choices=[role]
            )
        )
        items = _tool_call_items(job, deltas) if calls_tools else deltas
        events = self._events(job, items, chunk, usage_chunk)
        try:
            async for event in events:
                yield event
        finally:
            await close_shielded(events)


def _token_text(tokenizer: PreTrainedTokenizerBase, token: int) -> str:
    return str(tokenizer.decode([token]))


def _reported(job: _Job) -> list[tuple[int, TokenLogprobs]]:
    """Each generated token with what the cloud reported of it (the target's raw
    log-probabilities), in order; a stop token counted in the answer included."""
    return list(zip(job.token_ids, job.request.token_logprobs, strict=False))


def completion_logprobs(job: _Job, tokenizer: PreTrainedTokenizerBase) -> CompletionLogprobs:
    tokens, offsets, offset = [], [], 0
    for token, _ in _reported(job):
        tokens.append(_token_text(tokenizer, token))
        offsets.append(offset)
        offset += len(tokens[-1])
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[lp for _, (lp, _, _) in _reported(job)],
        top_logprobs=[
            {_token_text(tokenizer, t): v for t, v in zip(ids, values, strict=True)}
            for _, (_, ids, values) in _reported(job)
        ],
        text_offset=offsets,
    )


def chat_logprobs(job: _Job, tokenizer: PreTrainedTokenizerBase) -> ChatLogprobs:
    def top(token: int, logprob: float) -> TopLogprob:
        text = _token_text(tokenizer, token)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    content = []
    for token, (logprob, ids, values) in _reported(job):
        alternatives = [top(t, v) for t, v in zip(ids, values, strict=True)]
        content.append(TokenLogprob(**top(token, logprob).model_dump(), top_logprobs=alternatives))
    return ChatLogprobs(content=content)


async def _tool_call_items(job: _Job, deltas: AsyncIterator[str]) -> AsyncIterator[str | ToolCall]:
    """A tool-calling answer's stream: text streams as it comes, unless the answer begins
    with "<" (the tool grammar's call, which text may not begin with): then it is held
    until complete and goes out as one ``tool_calls`` delta."""
    held: list[str] = []
    holding = False
    started = False  # whether the answer's first text has come (and so what it is)
    try:
        async for delta in deltas:
            if not started and delta:
                started = True
                holding = delta.startswith("<")
            if started and holding:
                held.append(delta)
            else:
                yield delta
        if held:
            text = "".join(held)
            call = tool_calls.parse_call(text)
            if call is None:
                yield text  # an unfinished call (the token budget ran out): its text
            else:
                job.finish_reason = "tool_calls"
                yield call.as_tool_call()
    finally:
        await close_shielded(deltas)


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
