"""The cloud's per-request sessions: the confirmed prefix, block admission and the verdict.

A session mirrors what the edge has committed for one request. Its KV cache lives in the
target backend (owned by the batcher); this module owns the protocol state around it:

- the confirmed prefix (prompt + committed tokens) and the block sequence number;
- admission: a block must extend exactly the confirmed prefix (base_len), carry the next
  sequence number and the session's sampling digest; a retransmitted block gets the cached
  verdict, anything stale gets a typed error and never a commit;
- the verdict: acceptance left to right, the bonus token, or on a rejection the retained
  target row p of that position and the answers given from it (cached per rung, so a
  retransmitted correction request replays the same random draws);
- the cloud's own decoding: how many tokens its generation has left, and what it reports
  of each token.

One owner: the channel builds a session and hands it to the batcher, and from then on
every call that reads or changes its state (admission, the verdict, a correction, a
decode step, the close) runs on the batcher's model thread, in the order the rounds run
them, beside the KV cache the state mirrors. The event loop reads only what never changes
after construction (ids, the sampling config, the prompt's length).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np
import torch

from asymspec.constraint import Constraint
from asymspec.correction import Rung, answer
from asymspec.sampling import (
    SamplingParams,
    accept_block,
    draft_rows_from_half,
    residual,
    sample,
    transform,
)
from asymspec.wire import (
    BlockId,
    ErrorCode,
    Logprobs,
    Payload,
    SamplingConfig,
    TokenIds,
    VerifyBlock,
    VerifyBlockFull,
    VerifyResult,
    WireError,
    config_digest,
)
from asymspec_engine.engine import draw_uniform
from asymspec_engine.feature_draft import features_to_wire

AnyBlock: TypeAlias = VerifyBlock | VerifyBlockFull


@dataclass(frozen=True, slots=True)
class Decoded:
    """A token of the cloud's own decoding, as its frame carries it."""

    token: int
    logprobs: Logprobs | None  # where the session asked for them
    last: bool  # the generation ends with it: a stop token, or its last


@dataclass(slots=True)
class Session:
    session_id: int
    owner: int  # the channel connection that opened it
    config: SamplingConfig
    first_rung: Rung  # what a rejection's verdict carries (rung 0 of the edge's ladder)
    confirmed: list[int]  # prompt + committed tokens
    wants_features: bool = False  # the edge drafts from the target's h (a feature draft)
    # penalties and a grammar: the transform's rows read the tokens before them (None: not)
    constraint: Constraint | None = None
    params: SamplingParams = field(init=False)
    prompt_len: int = field(init=False)
    digest: int = field(init=False)
    rng: np.random.Generator = field(init=False)  # the cloud's uniforms for this request
    generator: torch.Generator = field(init=False)  # the tokens it samples alone
    last_seq: int = 0
    last_block: BlockId | None = None
    last_result: VerifyResult | None = None
    open_block: bool = False  # a block is being verified (confirmed-prefix invariant)
    # the cloud decodes it alone (GenerateRequest): tokens left, and the tokens that end it
    generation_left: int = 0
    generation_stops: frozenset[int] = frozenset()
    awaiting_recovery: bool = False  # rejected: the edge commits the recovered token
    retained_row: torch.Tensor | None = None  # [V] p at the rejected position
    answers: dict[int, Payload] = field(default_factory=dict)  # rung index -> answer
    closed: bool = False

    def __post_init__(self) -> None:
        c = self.config
        self.params = c.params
        self.prompt_len = len(self.confirmed)
        self.digest = config_digest(c)
        self.rng = np.random.default_rng([c.seed, 1])
        # Not the seed itself: the edge draws its drafts and acceptances from a generator
        # seeded with it, and a request that goes on from the cloud's tokens to blocks
        # would draw them with the uniforms that picked its earlier tokens.
        state = np.random.SeedSequence([c.seed, 2]).generate_state(1, np.uint64)
        self.generator = torch.Generator().manual_seed(int(state[0]) % 2**63)

    @property
    def key(self) -> str:
        """The session's id in the target backend: edges number their sessions on their own,
        so the cloud's key is (connection, the edge's id) and edges never collide."""
        return f"{self.owner}:{self.session_id}"

    # ------------------------------------------------------------------ admission

    def admit(self, msg: AnyBlock) -> VerifyResult | None:
        """Check a block against the confirmed prefix; None = verify it, else a cached verdict.

        Raises WireError(STALE_BLOCK | DUPLICATE) for a block that must not be verified.
        """
        block = msg.block
        if block == self.last_block and self.last_result is not None:
            return self.last_result  # a retransmission: same verdict, same random outcomes
        if block == self.last_block or self.open_block:
            raise WireError(ErrorCode.DUPLICATE, f"block {block.seq} is already being verified")
        if self.generating:
            raise WireError(ErrorCode.STALE_BLOCK, "the session is being decoded by the cloud")
        if block.config_digest != self.digest:
            raise WireError(ErrorCode.STALE_BLOCK, "block sampling config differs from session")
        if block.seq != self.last_seq + 1:
            raise WireError(
                ErrorCode.STALE_BLOCK, f"block seq {block.seq}, expected {self.last_seq + 1}"
            )
        tail = self._tail(msg.committed_tail)
        if block.base_len != len(self.confirmed) + len(tail):
            raise WireError(
                ErrorCode.STALE_BLOCK,
                f"block extends a prefix of {block.base_len} tokens; confirmed is "
                f"{len(self.confirmed) + len(tail)}",
            )
        self.commit_recovered(tail)
        self.open_block = True
        return None

    def admit_generation(
        self, committed_tail: TokenIds, max_tokens: int, stop_ids: frozenset[int]
    ) -> None:
        """The edge hands the session to the cloud's own decoding (target-only mode, or
        speculation paused) for up to ``max_tokens`` tokens: no block or generation may be
        under way, and the edge's recovered token, where one is awaited, comes with it."""
        if self.open_block or self.generating:
            raise WireError(ErrorCode.DUPLICATE, "a block or a generation is under way")
        self.commit_recovered(self._tail(committed_tail))
        self.generation_left, self.generation_stops = max_tokens, stop_ids

    @property
    def generating(self) -> bool:
        return self.generation_left > 0

    def stop_generation(self) -> None:
        """Its edge wants to speculate again: the generation's next token is its last."""
        if self.generating:
            self.generation_left = 1

    def end_generation(self) -> None:
        """The generation stops early: its requester went away, or its round failed."""
        self.generation_left = 0

    def _tail(self, committed_tail: TokenIds) -> list[int]:
        """The recovered token a rejection left the edge to commit: exactly one if the
        session awaits it, else none."""
        tail = [int(t) for t in committed_tail]
        if len(tail) != int(self.awaiting_recovery):
            raise WireError(
                ErrorCode.STALE_BLOCK,
                f"committed tail of {len(tail)} tokens; expected {int(self.awaiting_recovery)}",
            )
        return tail

    def commit_recovered(self, tail: list[int]) -> None:
        """The edge's recovered token (from the next block's tail) joins the prefix."""
        self.extend(tail)
        if tail:
            self.awaiting_recovery = False
            self.retained_row = None
            self.answers.clear()

    def extend(self, tokens: list[int]) -> None:
        """Generated tokens join the confirmed prefix (and advance the constraint)."""
        self.confirmed.extend(tokens)
        if self.constraint is not None:
            self.constraint.commit(tokens)

    @property
    def decodes_here(self) -> bool:
        """Whether the cloud's own decoding samples this session here (``decode_next``)
        rather than inside the target's step: a transform that reads the tokens before
        the row, or log-probabilities to report."""
        return self.constraint is not None or self.config.logprobs is not None

    def decode_next(self, logits: torch.Tensor) -> Decoded:
        """The cloud decodes alone: sample the next token from the transformed row after
        the confirmed prefix (logits [V]), confirm it, with its log-probabilities if the
        session asked. (Other sessions are sampled inside the target's step, from the same
        transform, and confirmed by ``decoded``.)"""
        if self.constraint is not None:
            row = self.constraint.rows(logits[None], [])[0]
        else:
            row = transform(logits[None], self.params)[0]
        token = sample(row, draw_uniform(self.generator))
        logprobs = None
        if self.config.logprobs is not None:
            # raw: the target's own log-softmax, before the request's transform (vLLM's
            # default), as float32
            all_logprobs = torch.log_softmax(logits.float(), dim=-1)  # [V]
            top = torch.topk(all_logprobs, self.config.logprobs)
            logprobs = Logprobs(
                np.array([float(all_logprobs[token])], np.float32),
                top.indices.numpy().astype(np.uint32),
                top.values.numpy().astype(np.float32),
            )
        return self.decoded(token, logprobs)

    def decoded(self, token: int, logprobs: Logprobs | None = None) -> Decoded:
        """A token of the generation joins the confirmed prefix; the last one ends it."""
        self.extend([token])
        self.generation_left -= 1
        if token in self.generation_stops:
            self.generation_left = 0
        return Decoded(token, logprobs, last=not self.generating)

    def pending_tokens(self, cached_len: int) -> list[int]:
        """Confirmed tokens the target's cache has not seen (>= 1 by the cache convention)."""
        return self.confirmed[cached_len:]

    # ------------------------------------------------------------------ verdict

    def decide(
        self, msg: AnyBlock, logits: torch.Tensor, features: torch.Tensor | None = None
    ) -> tuple[VerifyResult, int]:
        """The verdict for a scored block, and how many drafted positions to keep cached.

        logits [γ+1, V] are the target's rows p_1 .. p_{γ+1} before the sampling transform;
        features [γ+1, hidden] their h, when the edge asked (the verdict carries the
        confirmed ones: the tail's and the accepted drafts').
        """
        tokens = msg.draft_tokens
        if self.constraint is None:
            p_rows = transform(logits, self.params)  # [γ+1, V] float32
        else:  # row i reads the confirmed prefix and the drafts before it
            p_rows = self.constraint.rows(logits, [int(t) for t in tokens])
        gamma = len(tokens)
        if isinstance(msg, VerifyBlockFull):
            q_rows = draft_rows_from_half(msg.draft_rows)  # [γ, V] as the edge sampled them
            q_of_x = q_rows[np.arange(gamma), tokens.astype(np.int64)]
        else:
            q_rows, q_of_x = None, msg.draft_probs
        outcome = accept_block(tokens, q_of_x, p_rows, self.rng.random(gamma + 1))
        n = outcome.n_accepted
        self.extend([int(t) for t in tokens[:n]])
        h = None if features is None else features_to_wire(features[: n + 1])
        if outcome.bonus_token is not None:
            self.extend([outcome.bonus_token])
            result = VerifyResult(msg.block, n, outcome.bonus_token, None, h)
        elif q_rows is not None:
            # Full-upload modes: the cloud holds q, so it samples the exact residual itself.
            token = sample(residual(p_rows[n], q_rows[n]), float(self.rng.random()))
            self.extend([token])
            result = VerifyResult(msg.block, n, token, None, h)
        else:
            self.retained_row = p_rows[n].clone()
            self.awaiting_recovery = True
            first = answer(self.first_rung, self.retained_row, self.rng.random)
            self.answers[0] = first
            result = VerifyResult(msg.block, n, None, first, h)
        self.last_seq, self.last_block, self.last_result = msg.block.seq, msg.block, result
        self.open_block = False
        return result, n

    def correct(self, block: BlockId, rung: Rung, rung_index: int) -> Payload:
        """Answer an escalation from the retained row; replays the cached answer if repeated."""
        if block != self.last_block or not self.awaiting_recovery or self.retained_row is None:
            raise WireError(ErrorCode.STALE_BLOCK, f"no correction pending for block {block.seq}")
        if rung_index not in self.answers:
            self.answers[rung_index] = answer(rung, self.retained_row, self.rng.random)
        return self.answers[rung_index]
