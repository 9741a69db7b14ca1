"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests refuse unknown fields (a 400 naming the field): a field this server ignored would
change what the client thinks was sampled. None means "the default", since clients send
nulls. Beside OpenAI's fields: vLLM's `top_k`, `min_p`, `repetition_penalty`,
`stop_token_ids`, `ignore_eos`, `return_token_ids`, `guided_*` and `structured_outputs`,
and ours, `fidelity_budget` and `num_draft_tokens`. docs/api.md lists every field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# ---------------------------------------------------------------------------------------
# Request schemas

_STRICT = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


# The count (at most 4, as OpenAI) is checked in api_requests.stop_strings, whose message
# names the limit; a max_length here made pydantic report the union's other arm instead.
StopStrings = list[str]


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT
    name: str
    description: str | None = None  # documentation for the model; not sampled from
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # enforced either way: the grammar is exact


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of its constraints."""

    model_config = _STRICT
    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(BaseModel):
    """Fields shared by both endpoints. None means "the default", as clients send nulls."""

    model_config = _STRICT

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # wins over max_tokens
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # default 1.0; 0 = greedy
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # extension; -1 or 0 disables
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # extension (vLLM); 0 disables
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # OpenAI's int64; uint64 too
    stop: str | StopStrings | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # extension (vLLM)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)  # extension (vLLM); 1 disables
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None  # extension (vLLM)
    guided_regex: str | None = None  # extension (vLLM)
    guided_choice: list[str] | None = None  # extension (vLLM)
    guided_grammar: str | None = None  # extension (vLLM; Lark syntax)
    structured_outputs: StructuredOutputs | None = None  # extension (vLLM)
    fidelity_budget: float | None = Field(None, ge=0.0, le=1.0)  # extension: ε_req
    num_draft_tokens: int | None = Field(None, ge=0, le=16)  # extension: γ; 0: no speculation
    ignore_eos: bool = False  # extension (vLLM): only stop_token_ids end the generation
    return_token_ids: bool = False  # extension (vLLM): the generated ids beside the text
    user: str | None = None  # OpenAI's end-user id: accepted, not used (docs/api.md)


class CompletionRequest(SamplingFields):
    # A batch of one (["text"] or [[ids]]) is unwrapped; larger batches are refused.
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = _STRICT
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers


class FunctionDefinition(BaseModel):
    model_config = _STRICT
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # enforced either way for required and named calls


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # at most one call per answer either way
    modalities: list[Literal["text"]] | None = None  # text is all this server writes
    # OpenAI's bookkeeping fields: accepted, not used (docs/api.md)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None


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
    # tokens the cloud decoded alone, by why the request did not speculate then
    # ("request": num_draft_tokens 0, "logprobs", "batch_size", "goodput",
    # "draft_catching_up"); {} if it always did
    paused_tokens: dict[str, int]
    # blocks shorter than a pinned num_draft_tokens, by why ("max_tokens", "draft_stopped")
    shortened_blocks: dict[str, int]


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


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs: per generated token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
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
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


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
    delta: dict[str, Any]  # {"role"?, "content"?, "tool_calls"?}: absent keys left out
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
