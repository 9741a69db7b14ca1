"""The cloud's target model: scores draft blocks for many sessions in one forward.

Cache convention (the same as the draft's): a session's cache lags its committed sequence
by at least one token. The committed tokens from ``length(session)`` on are the committed
*tail* (usually the one recovered or bonus token of the last block); a score request sends
the tail followed by the γ draft tokens, and the last γ+1 rows of that forward are
p_1 .. p_γ (predicting x_1 .. x_γ) and p_{γ+1} (the bonus position). After the verdict
``commit`` keeps the tail and the accepted drafts and drops the rejected positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from asymspec.sampling import SamplingParams, sample_rows, transform_rows
from asymspec_engine.engine import SessionLM, draw_uniform
from asymspec_engine.llama import LlamaEngine


@dataclass(frozen=True)
class ScoreRequest:
    session_id: str
    new_tokens: Sequence[int]  # committed tail (>= 1 token) + the γ draft tokens
    num_draft_tokens: int  # γ: how many of new_tokens are drafts (the rest is the tail)
    wants_features: bool = False  # also h of the γ+1 scored rows (a feature draft's input)


@dataclass(frozen=True)
class PrefillChunk:
    """The next prompt tokens of a session being prefilled in chunks (logits not needed)."""

    session_id: str
    token_ids: Sequence[int]
    wants_features: bool = False  # h of every chunk position (a feature draft's input)


@dataclass(frozen=True)
class Round:
    """What one forward gave: per ScoreRequest the logits [γ+1, V] of p_1 .. p_{γ+1} (and
    its rows' h, [γ+1, hidden], where asked), per StepRequest a sampled token, per
    PrefillChunk its positions' h where asked ([len(chunk), hidden]; else None)."""

    score_logits: list[torch.Tensor]
    tokens: list[int]
    score_features: list[torch.Tensor | None]
    prefill_features: list[torch.Tensor | None]


@dataclass(frozen=True)
class StepRequest:
    """One target-only decoding step: feed the pending tokens, sample the next token."""

    session_id: str
    pending_tokens: Sequence[int]  # committed tokens the target's cache has not seen (>= 1)
    params: SamplingParams
    generator: torch.Generator  # CPU; one uniform per step


def fed_rows(
    prefills: Sequence[PrefillChunk], scores: Sequence[ScoreRequest], steps: Sequence[StepRequest]
) -> int:
    """The positions one `TargetModel.round` feeds the model: what its cost grows with."""
    fed = sum(len(c.token_ids) for c in prefills) + sum(len(r.new_tokens) for r in scores)
    return fed + sum(len(r.pending_tokens) for r in steps)


def attended_keys(length: int, new: int) -> int:
    """The keys ``new`` rows attend after ``length`` cached positions: row i sees
    length + i + 1 positions (itself included), what its attention's cost grows with."""
    return new * length + new * (new + 1) // 2


def fed_keys(
    prefills: Sequence[PrefillChunk],
    scores: Sequence[ScoreRequest],
    steps: Sequence[StepRequest],
    length: Callable[[str], int],
) -> int:
    """The keys one `TargetModel.round`'s rows attend (its attention's cost grows with
    them), given each session's cached ``length`` before the round."""
    news = [(c.session_id, len(c.token_ids)) for c in prefills]
    news += [(r.session_id, len(r.new_tokens)) for r in scores]
    news += [(r.session_id, len(r.pending_tokens)) for r in steps]
    return sum(attended_keys(length(sid), n) for sid, n in news)


class TargetModel:
    """Owns the target LM's per-session caches; one forward per batch of blocks."""

    def __init__(self, lm: SessionLM) -> None:
        self.lm = lm

    @property
    def forward_calls(self) -> int:
        """Target forwards so far, prefills included (SPADE's "target model calls")."""
        return self.lm.forward_calls

    @property
    def vocab_size(self) -> int:
        return self.lm.vocab_size

    @property
    def hidden_size(self) -> int:
        """The width of the features it provides (0 for an engine that provides none)."""
        return self.lm.hidden_size

    @property
    def provides_features(self) -> bool:
        """Whether its engine returns hidden states (the torch ``LlamaEngine`` does)."""
        return self.hidden_size > 0

    @property
    def max_sessions(self) -> int | None:
        """The sessions its engine holds at once (None: no bound)."""
        return self.lm.max_sessions

    def open(self, session_id: str, prompt_ids: Sequence[int]) -> None:
        """Prefill all but the last prompt token, which is the first block's tail."""
        if not prompt_ids:
            raise ValueError("a prompt needs at least one token")
        self.lm.open(session_id, prompt_ids[:-1])

    def start(self, session_id: str, prompt_ids: Sequence[int] = (), scope: str = "") -> int:
        """Open a session to be prefilled by ``PrefillChunk``s in later rounds, from a closed
        session's cache in ``scope`` where the engine keeps one that shares a prefix with
        ``prompt_ids``; how many prompt tokens are already in the cache."""
        self.lm.open(session_id, [], scope)
        return self.lm.adopt_prefix(session_id, prompt_ids) if prompt_ids else 0

    def close(self, session_id: str) -> None:
        self.lm.close(session_id)

    def length(self, session_id: str) -> int:
        return self.lm.length(session_id)

    def score(self, batch: Sequence[ScoreRequest]) -> list[torch.Tensor]:
        """Per request the float32 logits [γ+1, V] of p_1 .. p_{γ+1}, in one forward."""
        return self.round([], batch, []).score_logits

    def commit(self, session_id: str, kept_len: int) -> None:
        """Keep the first ``kept_len`` cached tokens (tail + accepted drafts); drop the rest."""
        self.lm.truncate(session_id, kept_len)

    def next_logits(self, batch: Sequence[tuple[str, Sequence[int]]]) -> list[torch.Tensor]:
        """Per (session_id, pending tokens) the float32 logits [V] after the last of them."""
        return [rows[-1] for rows in self.lm.forward_new(batch, keep_rows=[1] * len(batch))]

    def generate_step(self, batch: Sequence[StepRequest]) -> list[int]:
        """Target-only decoding: one batched forward, one sampled token per request."""
        return self.round([], [], batch).tokens

    def round(
        self,
        prefills: Sequence[PrefillChunk],
        scores: Sequence[ScoreRequest],
        steps: Sequence[StepRequest],
    ) -> Round:
        """Prefill chunks, verify blocks and decode steps in **one** forward (Sarathi-style
        chunked prefill: a long prompt shares forwards instead of stalling everyone)."""
        for request in scores:
            if not 0 <= request.num_draft_tokens < len(request.new_tokens):
                raise ValueError(f"{request.session_id!r}: need a tail of >= 1 token before γ")
        batch = [
            *((c.session_id, c.token_ids) for c in prefills),
            *((r.session_id, r.new_tokens) for r in scores),
            *((r.session_id, r.pending_tokens) for r in steps),
        ]
        keep = [0] * len(prefills)  # a prefill chunk's rows are never needed
        keep += [r.num_draft_tokens + 1 for r in scores]  # the tail's earlier rows: unused
        keep += [1] * len(steps)
        wanted = [len(c.token_ids) if c.wants_features else 0 for c in prefills]
        wanted += [r.num_draft_tokens + 1 if r.wants_features else 0 for r in scores]
        wanted += [0] * len(steps)
        features: list[torch.Tensor | None] = [None] * len(batch)
        if any(wanted):
            if not self.provides_features:
                raise ValueError(f"the {self.lm.name} engine returns no hidden states")
            lm = cast(LlamaEngine, self.lm)  # the one engine with hidden_size > 0
            logits, hidden = lm.forward_features(batch, keep, wanted)
            features = [h if n else None for h, n in zip(hidden, wanted, strict=True)]
        else:
            logits = self.lm.forward_new(batch, keep_rows=keep)
        n_pre, n_score = len(prefills), len(scores)
        tokens: list[int] = []
        if steps:
            step_rows = logits[n_pre + n_score :]
            probs = transform_rows(torch.cat(step_rows), [r.params for r in steps])  # [B, V]
            tokens = sample_rows(probs, [draw_uniform(r.generator) for r in steps])
        return Round(
            score_logits=logits[n_pre : n_pre + n_score],
            tokens=tokens,
            score_features=features[n_pre : n_pre + n_score],
            prefill_features=features[:n_pre],
        )
