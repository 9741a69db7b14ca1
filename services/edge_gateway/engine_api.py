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


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int  # >= 1
    params: SamplingParams
    seed: int | None = None  # None: the engine picks one
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)  # EOS and friends
    num_draft_tokens: int | None = None  # γ; None = the server's default
    fidelity_budget: float | None = None  # ε_req; None = the server's default


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

    @property
    def ready(self) -> bool: ...
