"""The contract between the OpenAI-compatible API layer and the decoding engine.

The API layer turns an HTTP request into a `GenerationRequest` (token ids, limits, sampling)
and consumes the engine's stream of committed token ids; it owns text: tokenization, chat
templates, detokenization, stop strings, SSE and OpenAI error bodies. The engine (the
scheduler in speculative modes, or a draft-only / target-only decoder) owns tokens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from asymspec.sampling import SamplingParams
from asymspec.sampling_params import NO_PENALTIES, Penalties


@dataclass(slots=True)
class SpecStats:
    """One request's speculation, counted where the edge's Prometheus counters are (so the
    two always agree): returned with the response as vLLM's per-request spec-decode
    metrics and llama.cpp's ``timings``. Engines fill it in; the API only reads it."""

    blocks: int = 0  # vLLM num_drafts; SGLang spec_verify_ct
    draft_tokens: int = 0  # vLLM num_draft_tokens; llama.cpp draft_n
    accepted_tokens: int = 0  # vLLM num_accepted_tokens; llama.cpp draft_n_accepted
    accepted_per_position: list[int] = field(default_factory=list)
    corrections: dict[str, int] = field(default_factory=dict)  # topk / proposals / full / cloud
    max_topk_k: int = 0  # the largest K a top-K certificate was granted at
    fidelity_spent: float = 0.0  # ε spent by bounded corrections
    verify_round_trips: int = 0  # verify frames answered (correction rounds not included)
    correction_round_trips: int = 0
    uplink_bytes: int = 0  # this request's frames, as asymspec_link_bytes_total counts them
    downlink_bytes: int = 0
    # Tokens the cloud decoded alone for the request, by why it did not speculate then:
    # "request" (num_draft_tokens 0), "logprobs" (asked for the target's log-probabilities),
    # "batch_size" (speculative_disable_by_batch_size),
    # "goodput" (the goodput rule's pause), "draft_catching_up" (the draft being fed what it
    # missed while the request did not draft). Empty: the request speculated throughout (its
    # first token may still be the cloud's, sampled from the prefill: no pause).
    paused_tokens: dict[str, int] = field(default_factory=dict)
    # Why a block held fewer drafts than the request pinned, in blocks: "max_tokens" (the
    # tokens left), "draft_stopped" (the draft ended it early: stop_confidence or a stop token)
    shortened_blocks: dict[str, int] = field(default_factory=dict)

    def record_block(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.blocks += 1
        self.draft_tokens += num_draft_tokens
        self.accepted_tokens += num_accepted
        while len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.append(0)
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def record_correction(self, kind: str, size: int = 0, eps: float = 0.0) -> None:
        self.corrections[kind] = self.corrections.get(kind, 0) + 1
        if kind == "topk":
            self.max_topk_k = max(self.max_topk_k, size)
        self.fidelity_spent += eps

    def record_paused(self, reason: str, tokens: int) -> None:
        self.paused_tokens[reason] = self.paused_tokens.get(reason, 0) + tokens

    def record_shortened(self, reason: str) -> None:
        self.shortened_blocks[reason] = self.shortened_blocks.get(reason, 0) + 1


TokenLogprobs = tuple[float, list[int], list[float]]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int  # >= 1
    params: SamplingParams
    seed: int | None = None  # None: the engine picks one
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)  # EOS and friends
    num_draft_tokens: int | None = None  # γ; None = the server's default; 0: no speculation
    penalties: Penalties = NO_PENALTIES  # read the tokens before each row (both sides)
    grammar: str = ""  # an asymspec.grammar text constraining the output; "" for none
    # the target's log-probabilities of each token and of this many top alternatives
    # (None: not asked); the cloud samples every token of such a request
    logprobs: int | None = None
    # what the engine received of them, one per generated token: (logprob, top ids, top
    # logprobs); filled by the engine as tokens come
    token_logprobs: list[TokenLogprobs] = field(default_factory=list, compare=False)
    fidelity_budget: float | None = None  # ε_req; None = the server's default
    stats: SpecStats = field(default_factory=SpecStats, compare=False)  # filled by the engine


class GenerationError(Exception):
    """A failure the API layer reports as an OpenAI error body (also mid-stream)."""

    def __init__(
        self,
        message: str,
        status_code: int = 500,
        error_type: str = "server_error",
        retry_after_s: int | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.error_type = error_type
        self.retry_after_s = retry_after_s  # sent as Retry-After (429, 503)


class Engine(Protocol):
    def generate(self, request: GenerationRequest) -> AsyncIterator[list[int]]:
        """Yield committed token ids in order (one chunk per block or step) until a stop
        token (included as the last id) or max_new_tokens; raise GenerationError on failure.
        Closing the iterator early (client gone, stop string) cancels the request and frees
        its state on both sides."""
        ...
