"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests ignore unknown fields, as OpenAI's own server tolerates them; None means "the
default", since clients send nulls. Extensions beside OpenAI's fields: `top_k`,
`stop_token_ids`, `ignore_eos`, `return_token_ids` (vLLM's) and `fidelity_budget`,
`num_draft_tokens` (ours).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# ---------------------------------------------------------------------------------------
# Request schemas (unknown fields are ignored, as OpenAI's own server tolerates them)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


# The count (at most 4, as OpenAI) is checked in api_requests.stop_strings, whose message
# names the limit; a max_length here made pydantic report the union's other arm instead.
StopStrings = list[str]


class SamplingFields(BaseModel):
    """Fields shared by both endpoints. None means "the default", as clients send nulls."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # default 1.0; 0 = greedy
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # extension; -1 or 0 disables
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # OpenAI's int64; uint64 too
    stop: str | StopStrings | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # extension (vLLM)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    fidelity_budget: float | None = Field(None, ge=0.0, le=1.0)  # extension: ε_req
    num_draft_tokens: int | None = Field(None, ge=1, le=16)  # extension: γ
    ignore_eos: bool = False  # extension (vLLM): only stop_token_ids end the generation
    return_token_ids: bool = False  # extension (vLLM): the generated ids beside the text


class CompletionRequest(SamplingFields):
    # A batch of one (["text"] or [[ids]]) is unwrapped; larger batches are refused.
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = Field(None, ge=1)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # wins over max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None


# ---------------------------------------------------------------------------------------
# Response schemas


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpecDecodingStats(BaseModel):
    """Per-request speculation (vLLM's ``metrics.speculative_decoding`` names where they
    exist; README "Per-request speculation stats" maps every field)."""

    num_drafts: int  # blocks verified (SGLang: spec_verify_ct)
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]
    corrections: dict[str, int]  # recovered tokens by how: topk / proposals / full / cloud
    max_topk_k: int
    fidelity_spent: float  # ε spent on bounded (top-K) corrections
    verify_round_trips: int
    correction_round_trips: int
    uplink_bytes: int
    downlink_bytes: int


class RequestMetrics(BaseModel):
    speculative_decoding: SpecDecodingStats


class Timings(BaseModel):
    """llama.cpp server's ``timings`` (draft_n / draft_n_accepted as in its speculative mode)."""

    prompt_n: int
    prompt_ms: float  # admission until the first generated token was ready
    predicted_n: int
    predicted_ms: float  # first generated token until the last
    draft_n: int
    draft_n_accepted: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None
    token_ids: list[int] | None = None  # only with return_token_ids (non-streaming)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    metrics: RequestMetrics | None = None  # final response / chunk only
    timings: Timings | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    metrics: RequestMetrics | None = None  # final response / chunk only
    timings: Timings | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, str]  # {"role"?, "content"?}: absent keys are left out, not null
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    metrics: RequestMetrics | None = None  # final response / chunk only
    timings: Timings | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "asymspec"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
