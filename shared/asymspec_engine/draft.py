"""The edge's draft model: proposes a block of γ tokens per request, batched across requests.

Cache convention (the same as the target's): a session's cache lags its committed sequence
by at least one token. The committed tokens from ``length(session)`` on are *pending*; they
go into the next request, and the row after the last of them is q_1. After proposing, the
cache holds the pending tokens and x_1 .. x_{γ-1} (x_γ is sampled, never fed). After the
verdict the caller rolls back to the confirmed prefix and sends the newly committed tokens
(accepted tail, recovered or bonus) as the next pending tokens.

Copying from the context (``copy_weight`` λ > 0): much of what a code model writes repeats
its context (names, signatures, its own earlier lines), and a small draft copies badly. So
when the context's last n tokens (the longest n of 8 .. 2) occurred before, the token that
followed their latest earlier occurrence gets λ of the draft's mass:
q' = (1 - λ) q + λ·[v = copy] (for greedy requests, q' is one-hot at the argmax of that
mixture, i.e. the copy when λ > 1/2). This is prompt-lookup drafting mixed into the model's
distribution. q' is the draft distribution from then on, for the uplink and every
correction, so speculative decoding stays exact: any q is allowed, as long as both tests
use the same one.

Ending a block early (``stop_confidence`` τ > 0): a block ends after the first draft token
the draft itself was unsure of, its probability under the draft's untempered distribution
(the copy mixed in as above) below τ. Positions after an unsure token are rarely accepted,
yet each costs a draft step and a verify row. The block's length then depends only on the
draft's side (its prefix and its own tokens), so speculative sampling stays exact: each
verified position is still accepted with min(1, p/q) and recovered from the residual, and
a shorter block just ends with the target's bonus token sooner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from asymspec.sampling import SamplingParams, draft_rows_from_half, sample_rows, transform_rows
from asymspec_engine.engine import SessionLM, draw_uniform
from asymspec_engine.feature_draft import FeatureLM
from asymspec_engine.llama import LlamaEngine, RestrictedHead


@dataclass(frozen=True)
class DraftRequest:
    session_id: str
    pending_tokens: Sequence[int]  # committed tokens the draft's cache has not seen (>= 1)
    num_draft_tokens: int  # γ for this block (>= 1)
    params: SamplingParams
    generator: torch.Generator  # CPU; one uniform per draft token comes from it
    # Full-upload modes send q rows as float16: sample from exactly the rows the cloud will
    # reconstruct (sampling.draft_rows_from_half) so both sides test acceptance on one q.
    quantize_half: bool = False
    # Roll the cache back to this many tokens before feeding pending_tokens (the last
    # verdict's confirmed prefix; the drafts it rejected go): the rollback rides this
    # request's turn on the model thread instead of queueing behind other requests'
    # drafting as a call of its own. None: the cache is kept as it is.
    rollback_to: int | None = None
    # A feature draft's inputs beside pending_tokens: for each x_s, the target's h_{s-1}
    # [len(pending_tokens), hidden] (``FeatureLog.before``). None for a token draft, and
    # for a feature draft's runahead (it goes on from its own ĥ).
    prev_features: torch.Tensor | None = None


@dataclass(frozen=True)
class Draft:
    """One proposed block. ``rows`` stays at the edge: the certificate and recovery need q."""

    tokens: npt.NDArray[np.uint32]  # [γ] x_1 .. x_γ
    probs: npt.NDArray[np.float32]  # [γ] q_i(x_i) == rows[i, tokens[i]]
    rows: torch.Tensor  # [γ, V] float32 on the CPU: q_1 .. q_γ after the sampling transform
    half_rows: npt.NDArray[np.float16] | None = None  # [γ, V] as uploaded (quantize_half)


# Suffix lengths tried for a copy (the longest repeated one predicts best). On held-out
# HumanEval prompts 20-32 with the embedded pair (teacher-forced on the target's greedy
# text), up to 8 instead of up to 3 raised greedy agreement 0.647 -> 0.661 and the T = 0.7
# acceptance probability sum(min(p, q')) 0.620 -> 0.630 at λ = 0.7.
COPY_MIN_SUFFIX, COPY_MAX_SUFFIX = 2, 8
# λ of the edge (and of the reference measurements). Same prompts and measure: λ 0.7 -> 0.9
# raised sum(min(p, q')) 0.630 -> 0.644 (0.95: 0.646); λ > 1/2 makes greedy drafts copy.
DEFAULT_COPY_WEIGHT = 0.9


def copy_candidate(context: npt.NDArray[np.int64]) -> int | None:
    """The token after the latest earlier occurrence of the context's longest repeated
    suffix of COPY_MIN_SUFFIX .. COPY_MAX_SUFFIX tokens, or None.  context: [L] token ids.

    One vector compare finds the earlier occurrences of the last token; each further step
    keeps those that also match one more token back, so the rest costs little."""
    length = len(context)
    if length <= COPY_MIN_SUFFIX:  # no room for the suffix, an earlier occurrence and its next
        return None
    ends = np.flatnonzero(context[: length - 1] == context[length - 1])  # e <= L-2: e+1 exists
    best: int | None = None
    for back in range(1, COPY_MAX_SUFFIX):  # the occurrences now match back + 1 tokens
        ends = ends[ends >= back]
        ends = ends[context[ends - back] == context[length - 1 - back]]
        if ends.size == 0:
            break
        if back + 1 >= COPY_MIN_SUFFIX:
            best = int(ends[-1])
    return None if best is None else int(context[best + 1])


def mix_copy(q: torch.Tensor, copy: int, weight: float, greedy: bool) -> torch.Tensor:
    """q' = (1 - λ) q + λ·[v = copy]; for a greedy request, one-hot at its argmax."""
    mixed = q * (1.0 - weight)
    mixed[copy] += weight
    if greedy:
        return torch.nn.functional.one_hot(mixed.argmax(), q.shape[-1]).to(q.dtype)
    return mixed


class DraftModel:
    """Owns the draft LM's per-session caches; one batched forward per draft step."""

    def __init__(
        self, lm: SessionLM | FeatureLM, copy_weight: float = 0.0, stop_confidence: float = 0.0
    ) -> None:
        if not 0.0 <= copy_weight < 1.0:
            raise ValueError(f"copy_weight must be in [0, 1), got {copy_weight}")
        if not 0.0 <= stop_confidence < 1.0:
            raise ValueError(f"stop_confidence must be in [0, 1), got {stop_confidence}")
        self.lm = lm
        self.copy_weight = copy_weight  # λ; 0 = the model's own q
        self.stop_confidence = stop_confidence  # τ; 0 = every block drafts its full γ

    @property
    def needs_features(self) -> bool:
        """A feature draft: every token fed needs the target's h of the position before it,
        so the cloud sends them, the draft opens once the prompt's have come, and after a
        verdict the accepted drafts are fed again with the target's h in place of the
        draft's own guesses (``asymspec_engine.feature_draft``)."""
        return isinstance(self.lm, FeatureLM)

    @property
    def hidden_size(self) -> int:
        """The width of the target features a feature draft reads (0 for a token draft)."""
        return self.lm.hidden_size if isinstance(self.lm, FeatureLM) else 0

    def open(
        self,
        session_id: str,
        prompt_ids: Sequence[int],
        prev_features: torch.Tensor | None = None,
    ) -> None:
        """Prefill all but the last prompt token, which stays pending for the first block.
        A feature draft needs their ``prev_features`` [len(prompt) - 1, hidden]."""
        if not prompt_ids:
            raise ValueError("a prompt needs at least one token")
        if isinstance(self.lm, FeatureLM):
            self.lm.open(session_id, prompt_ids[:-1], prev_features)
        else:
            self.lm.open(session_id, prompt_ids[:-1])

    def start(self, session_id: str) -> None:
        """Open an empty session, for a prompt fed in chunks (`prefill`)."""
        self.lm.open(session_id, [])

    def prefill(
        self,
        session_id: str,
        token_ids: Sequence[int],
        prev_features: torch.Tensor | None = None,
    ) -> None:
        """Feed prompt tokens into a started session's cache (no logits: none are needed).
        Together the chunks are all of the prompt but its last token, as `open` feeds."""
        self._forward([(session_id, token_ids)], [0], [prev_features])

    def _forward(
        self,
        batch: Sequence[tuple[str, Sequence[int]]],
        keep_rows: Sequence[int],
        prev_features: Sequence[torch.Tensor | None],
        head_only: bool = False,
    ) -> list[torch.Tensor]:
        if isinstance(self.lm, FeatureLM):
            return self.lm.forward_new(batch, keep_rows, prev_features, head_only=head_only)
        if head_only:  # only a LlamaEngine restricts its head (restricted_head)
            assert isinstance(self.lm, LlamaEngine)
            return self.lm.forward_new(batch, keep_rows=keep_rows, head_only=True)
        return self.lm.forward_new(batch, keep_rows=keep_rows)

    def restricted_head(self) -> RestrictedHead | None:
        """The engine's restricted head (``LlamaEngine.restrict_head``); None for a head
        over the whole vocabulary."""
        engine = self.lm.engine if isinstance(self.lm, FeatureLM) else self.lm
        return engine.restricted_head if isinstance(engine, LlamaEngine) else None

    def close(self, session_id: str) -> None:
        self.lm.close(session_id)

    def length(self, session_id: str) -> int:
        return self.lm.length(session_id)

    def rollback(self, session_id: str, confirmed_len: int) -> None:
        """Drop cached draft positions past the confirmed prefix (never recomputes it)."""
        self.lm.truncate(session_id, min(confirmed_len, self.lm.length(session_id)))

    def propose(self, batch: Sequence[DraftRequest]) -> list[Draft]:
        """γ_r draft tokens for every request; step k forwards every request with γ_r > k."""
        for request in batch:
            if request.num_draft_tokens < 1 or not request.pending_tokens:
                raise ValueError(f"{request.session_id!r}: need γ >= 1 and >= 1 pending token")
        for request in batch:
            if request.rollback_to is not None:
                self.rollback(request.session_id, request.rollback_to)
        tokens: list[list[int]] = [[] for _ in batch]
        rows: list[list[torch.Tensor]] = [[] for _ in batch]
        halves: list[list[np.ndarray]] = [[] for _ in batch]  # float16 rows, full-upload only
        lengths = [r.num_draft_tokens for r in batch]  # γ_r, cut short by an unsure token
        head = self.restricted_head()
        for step in range(max(lengths, default=0)):
            active = [i for i, length in enumerate(lengths) if length > step]
            if not active:  # every block ended early
                break
            inputs = [batch[i].pending_tokens if step == 0 else [tokens[i][-1]] for i in active]
            # after the first step a feature draft reads its own ĥ (None: the session's last)
            features = [batch[i].prev_features if step == 0 else None for i in active]
            logits = torch.cat(  # [A, V], or [A, K] over a restricted head's K tokens
                self._forward(
                    [(batch[i].session_id, ids) for i, ids in zip(active, inputs, strict=True)],
                    [1] * len(active),
                    features,
                    head_only=head is not None,
                )
            )
            # One transform and one sampling pass for the whole step (a Python loop over
            # 49k-wide rows was a fifth of the edge's time under load).
            scored = transform_rows(logits, [batch[i].params for i in active]).cpu()
            copies = [self._copy(batch[i]) for i in active]
            q_rows, on_head = self._rows([batch[i] for i in active], scored, copies, head)
            for j, i in enumerate(active):
                if not on_head[j]:
                    q_rows[j] = self._finish_row(q_rows[j], copies[j], batch[i], halves[i])
                rows[i].append(q_rows[j])
            uniforms = [draw_uniform(batch[i].generator) for i in active]
            drawn = _draw(q_rows, scored, on_head, head, uniforms)
            for i, token in zip(active, drawn, strict=True):
                tokens[i].append(token)
            if self.stop_confidence > 0.0:
                columns = None if head is None else head.columns
                sure = confidence(logits, drawn, copies, self.copy_weight, columns)
                sure_enough = (sure >= self.stop_confidence).tolist()
                for i, keep_going in zip(active, sure_enough, strict=True):
                    if not keep_going:
                        lengths[i] = step + 1
        return [_as_draft(*parts) for parts in zip(tokens, rows, halves, strict=True)]

    def _rows(
        self,
        requests: Sequence[DraftRequest],
        scored: torch.Tensor,
        copies: Sequence[int | None],
        head: RestrictedHead | None,
    ) -> tuple[torch.Tensor, list[bool]]:
        """q over the whole vocabulary [A, V] from a step's transformed rows ``scored``, and
        per row whether it is final already and ``scored`` holds it on the head's columns.

        With a restricted head q is 0 off its K tokens, so a row whose copy (if any) is one
        of them is mixed and later drawn on its K columns (``_draw``), and only scattered
        into V. On the embedded draft (K = 16,384 of 49,152) that made a γ = 3 propose of
        16 requests 0.82x as long (``scripts/propose_cost.py``). A row whose copy lies off
        the head, or that goes on the wire as float16, is finished on the whole vocabulary
        instead (``_finish_row``)."""
        if head is None:
            return scored, [False] * len(requests)
        on_head = [
            not request.quantize_half and (copy is None or int(head.columns[copy]) >= 0)
            for request, copy in zip(requests, copies, strict=True)
        ]
        for j, (request, copy) in enumerate(zip(requests, copies, strict=True)):
            if on_head[j] and copy is not None:
                column = int(head.columns[copy])
                scored[j] = mix_copy(scored[j], column, self.copy_weight, request.params.is_greedy)
        q_rows = scored.new_zeros((len(requests), self.lm.vocab_size))
        return q_rows.index_copy_(1, head.ids.cpu(), scored), on_head

    def _finish_row(
        self, q: torch.Tensor, copy: int | None, request: DraftRequest, halves: list[np.ndarray]
    ) -> torch.Tensor:
        """A q row [V] with the copy mixed in, and as float16 travels for full-upload."""
        if copy is not None:
            q = mix_copy(q, copy, self.copy_weight, request.params.is_greedy)
        if request.quantize_half:
            half = q.half().numpy()  # [V] exactly what goes on the wire
            halves.append(half)
            q = torch.from_numpy(draft_rows_from_half(half[None])[0])
        return q

    def _copy(self, request: DraftRequest) -> int | None:
        """The copier's token for this step of the request, or None (no copier, no match)."""
        if self.copy_weight == 0.0:
            return None
        # The cache holds everything fed so far, this step's input last: the context.
        return copy_candidate(np.asarray(self.lm.token_ids(request.session_id), dtype=np.int64))


def confidence(
    logits: torch.Tensor,
    tokens: Sequence[int],
    copies: Sequence[int | None],
    weight: float,
    columns: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B] the probability of each drawn token under the draft's untempered distribution,
    the copy mixed in with weight λ: the stop rule's measure of how sure the draft was. The
    request's own q cannot serve, as a greedy q is one-hot (always sure).

    ``logits`` [B, V], or [B, K] over a restricted head's tokens with ``columns`` [V] each
    token's column (-1 off the head, where the model's probability is 0)."""
    logits = logits.float()
    index = torch.tensor(tokens, device=logits.device)
    if columns is not None:
        index = columns.to(logits.device)[index]
    picked = logits.gather(1, index.clamp(min=0)[:, None])[:, 0]
    model = torch.exp(picked - torch.logsumexp(logits, dim=-1))
    model = torch.where(index >= 0, model, torch.zeros_like(model)).cpu()
    copied = torch.tensor([c is not None and c == t for c, t in zip(copies, tokens, strict=True)])
    has_copy = torch.tensor([c is not None for c in copies])
    return torch.where(has_copy, (1.0 - weight) * model + weight * copied.float(), model)


def _draw(
    q_rows: torch.Tensor,
    scored: torch.Tensor,
    on_head: Sequence[bool],
    head: RestrictedHead | None,
    uniforms: Sequence[float],
) -> list[int]:
    """One token per row of ``q_rows`` [A, V] with its uniform; rows on the head are drawn
    from their K columns of ``scored``. The same token either way: a row is 0 off the head,
    and the float64 inverse CDF over the K columns in token order has the values the whole
    row's has at them (adding 0 is exact), so it is crossed at the same token."""
    drawn = [0] * len(uniforms)
    on = [j for j, flag in enumerate(on_head) if flag]
    off = [j for j, flag in enumerate(on_head) if not flag]
    if on:
        assert head is not None
        rows = scored if len(on) == len(drawn) else scored[on]
        columns = sample_rows(rows, [uniforms[j] for j in on])
        for j, token in zip(on, head.ids.cpu()[columns].tolist(), strict=True):
            drawn[j] = int(token)
    if off:
        rows = q_rows if len(off) == len(drawn) else q_rows[off]
        for j, token in zip(off, sample_rows(rows, [uniforms[j] for j in off]), strict=True):
            drawn[j] = token
    return drawn


def _as_draft(tokens: list[int], rows: list[torch.Tensor], halves: list[np.ndarray]) -> Draft:
    q_rows = torch.stack(rows)  # [γ, V]
    ids = np.asarray(tokens, dtype=np.uint32)  # [γ]
    probs = q_rows[torch.arange(len(tokens)), torch.as_tensor(tokens)].numpy()  # [γ]
    half = np.stack(halves) if halves else None  # [γ, V] float16
    return Draft(tokens=ids, probs=probs.astype(np.float32), rows=q_rows, half_rows=half)
