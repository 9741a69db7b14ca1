"""The in-process reference speculative decoder: the yardstick the services are held to.

No services, no network: one draft and one target backend in this process, one request at
a time. ``speculative_generate`` is standard speculative sampling with exact recovery from
the full residual; ``target_generate`` is target-only autoregressive decoding with the same
sampling transform and seeding conventions. At temperature 0 the two are token-identical.

Glossary (vLLM's; ``asymspec.sampling`` uses the same words):

- **draft** tokens: the γ tokens x_1 .. x_γ the draft model proposes for one block.
- **accepted** tokens: the prefix of the drafts that passes u_i * q_i(x_i) < p_i(x_i).
- **recovered** token: after the first rejection, the correction drawn from the residual
  r = [p - q]+ / Z at the rejected position.
- **bonus** token: when all γ drafts are accepted, the token drawn from p_{γ+1}.

Output = accepted + recovered + bonus, and each block emits one recovered or one bonus
token unless the output was cut at ``max_new_tokens`` or at the end-of-sequence token.

Seeding: ``seed`` seeds the edge's torch generator (draft tokens, recovered tokens) and
``seed + 1`` the cloud's (acceptance uniforms, bonus tokens); ``target_generate`` draws one
uniform per token from a generator seeded with ``seed``. Same seed, same output.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from asymspec.sampling import SamplingParams, accept_block, residual, sample, transform
from asymspec_engine.draft import Draft, DraftModel, DraftRequest
from asymspec_engine.engine import draw_uniform
from asymspec_engine.feature_draft import FeatureLog
from asymspec_engine.target import PrefillChunk, ScoreRequest, StepRequest, TargetModel


@dataclass
class GenerationStats:
    """Raw counters of one generation; ratios are derived, never stored."""

    blocks: int = 0
    draft_tokens: int = 0  # proposed, including drafts past a rejection
    accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)  # [γ] blocks drafting i
    accepted_per_position: list[int] = field(default_factory=list)  # [γ] emitted accepts at i
    recovered_tokens: int = 0
    bonus_tokens: int = 0
    target_forward_calls: int = 0  # prefill included
    draft_forward_calls: int = 0  # prefill included

    @property
    def output_tokens(self) -> int:
        return self.accepted_tokens + self.recovered_tokens + self.bonus_tokens

    @property
    def mean_accepted_per_block(self) -> float:
        return self.accepted_tokens / self.blocks if self.blocks else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def acceptance_per_position(self) -> list[float]:
        """P(draft i accepted) over the blocks that drafted position i."""
        return [
            accepted / drafted if drafted else 0.0
            for accepted, drafted in zip(
                self.accepted_per_position, self.drafted_per_position, strict=True
            )
        ]


@dataclass
class GenerationResult:
    tokens: list[int]  # generated tokens only (the prompt excluded)
    stats: GenerationStats


@dataclass(frozen=True)
class _BlockVerdict:
    draft: Draft
    n_accepted: int
    next_token: int  # the recovered token, or the bonus token when all γ were accepted
    is_bonus: bool


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _new_session_id() -> str:
    return f"reference-{uuid.uuid4().hex}"


def _run_block(
    target: TargetModel,
    draft: DraftModel,
    session_id: str,
    committed: list[int],  # prompt + output so far
    num_draft_tokens: int,
    params: SamplingParams,
    edge: torch.Generator,
    cloud: torch.Generator,
    features: FeatureLog | None = None,
) -> _BlockVerdict:
    """Draft γ tokens, score them in one target forward, accept, recover; roll both back."""
    base = len(committed)
    cached = draft.length(session_id)
    pending = committed[cached:]
    prev = None if features is None else features.before(cached, base)
    request = DraftRequest(session_id, pending, num_draft_tokens, params, edge, prev_features=prev)
    proposal = draft.propose([request])[0]
    gamma = len(proposal.tokens)  # the draft may end its block early (stop_confidence)
    tail = committed[target.length(session_id) :]
    new_tokens = tail + proposal.tokens.tolist()
    score = ScoreRequest(session_id, new_tokens, gamma, wants_features=features is not None)
    scored = target.round([], [score], [])
    p = transform(scored.score_logits[0], params).cpu()  # [γ+1, V] p_1 .. p_{γ+1}
    uniforms = np.array([draw_uniform(cloud) for _ in range(gamma + 1)])  # [γ+1]
    outcome = accept_block(proposal.tokens, proposal.probs, p.numpy(), uniforms)
    n = outcome.n_accepted
    target.commit(session_id, base + n)  # drops the rejected drafts' positions
    if features is None:
        draft.rollback(session_id, base + n)
    else:
        # h of positions base - 1 .. base + n - 1; the draft fed its block's tokens with its
        # own ĥ, so from base on they go in again with the target's h
        block_h = scored.score_features[0]
        assert block_h is not None
        features.extend(base - 1, block_h[: n + 1])
        draft.rollback(session_id, base)
    if outcome.bonus_token is not None:
        return _BlockVerdict(proposal, n, outcome.bonus_token, is_bonus=True)
    recovered = sample(residual(p[n], proposal.rows[n]), draw_uniform(edge))
    return _BlockVerdict(proposal, n, recovered, is_bonus=False)


def _emit(
    verdict: _BlockVerdict, room: int, eos_token_id: int | None, stats: GenerationStats
) -> list[int]:
    """The block's output cut at ``room`` tokens and after EOS; counts what was emitted."""
    tokens = [*verdict.draft.tokens[: verdict.n_accepted].tolist(), verdict.next_token][:room]
    if eos_token_id is not None and eos_token_id in tokens:
        tokens = tokens[: tokens.index(eos_token_id) + 1]
    accepted = min(len(tokens), verdict.n_accepted)
    stats.blocks += 1
    stats.draft_tokens += len(verdict.draft.tokens)
    stats.accepted_tokens += accepted
    for i in range(len(verdict.draft.tokens)):
        stats.drafted_per_position[i] += 1
    for i in range(accepted):
        stats.accepted_per_position[i] += 1
    if len(tokens) > verdict.n_accepted:  # the block's last token made it out
        if verdict.is_bonus:
            stats.bonus_tokens += 1
        else:
            stats.recovered_tokens += 1
    return tokens


def _finished(output: list[int], max_new_tokens: int, eos_token_id: int | None) -> bool:
    ended = eos_token_id is not None and bool(output) and output[-1] == eos_token_id
    return ended or len(output) >= max_new_tokens


def speculative_generate(
    target: TargetModel,
    draft: DraftModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    num_draft_tokens: int,
    params: SamplingParams,
    seed: int,
    eos_token_id: int | None = None,
) -> GenerationResult:
    """Speculative sampling: output distributed exactly as target-only sampling."""
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    session_id, committed = _new_session_id(), list(prompt_ids)
    edge, cloud = _generator(seed), _generator(seed + 1)
    stats = GenerationStats(
        drafted_per_position=[0] * num_draft_tokens, accepted_per_position=[0] * num_draft_tokens
    )
    target_calls, draft_calls = target.forward_calls, draft.lm.forward_calls
    output: list[int] = []
    # A feature draft reads the target's h of each position before a token it feeds: the
    # prompt's from the target's prefill, then each verdict's (asymspec_engine.feature_draft)
    features = FeatureLog(draft.hidden_size) if draft.needs_features else None
    if features is None:
        target.open(session_id, committed)
        draft.open(session_id, committed)
    else:
        target.start(session_id)
        prompt_h = None
        if len(committed) > 1:
            chunk = PrefillChunk(session_id, committed[:-1], wants_features=True)
            h = target.round([chunk], [], []).prefill_features[0]
            assert h is not None  # asked for
            features.extend(0, h)
            prompt_h = features.before(0, len(committed) - 1)
        draft.open(session_id, committed, prompt_h)
    try:
        while not _finished(output, max_new_tokens, eos_token_id):
            # The last block drafts no further than the output can go.
            gamma = min(num_draft_tokens, max_new_tokens - len(output))
            verdict = _run_block(
                target, draft, session_id, committed, gamma, params, edge, cloud, features
            )
            emitted = _emit(verdict, max_new_tokens - len(output), eos_token_id, stats)
            output += emitted
            committed += emitted
    finally:
        target.close(session_id)
        draft.close(session_id)
    stats.target_forward_calls = target.forward_calls - target_calls
    stats.draft_forward_calls = draft.lm.forward_calls - draft_calls
    return GenerationResult(tokens=output, stats=stats)


def target_generate(
    target: TargetModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    params: SamplingParams,
    seed: int,
    eos_token_id: int | None = None,
) -> GenerationResult:
    """Target-only autoregressive decoding: one target forward per token."""
    session_id, committed = _new_session_id(), list(prompt_ids)
    generator = _generator(seed)
    calls_before = target.forward_calls
    output: list[int] = []
    target.open(session_id, committed)
    try:
        while not _finished(output, max_new_tokens, eos_token_id):
            pending = committed[target.length(session_id) :]
            step = StepRequest(session_id, pending, params, generator)
            token = target.generate_step([step])[0]
            output.append(token)
            committed.append(token)
    finally:
        target.close(session_id)
    stats = GenerationStats(target_forward_calls=target.forward_calls - calls_before)
    return GenerationResult(tokens=output, stats=stats)
