"""Speculative-sampling math in the paper's notation (AsymSpec §II-B, §IV-B).

Notation, used only in this module:
    p      target distribution at one position, *after* the request's sampling transform
           (logit bias, temperature, top-k, top-p, min-p; penalties and a grammar mask are
           applied to the logits first, in ``asymspec.constraint``)
    q      draft distribution at the same position, after the same transform
    x_i    the i-th draft token of a block (i = 0 .. gamma-1 here, 1-based in the paper)
    a_i    acceptance probability min(1, p_i(x_i) / q_i(x_i))
    r      residual [p - q]+ / Z with Z = sum [p - q]+
    S      the K most probable target tokens, ordered; delta_p = 1 - sum_S p (the tail mass)
    Z_S    sum_S [p - q]+;  eps_K = delta_p / (Z_S + delta_p), the TV certificate

Glossary (vLLM's): a block proposes *draft* tokens; a prefix of them is *accepted*; the
first rejection is replaced by a *recovered* token drawn from r; when all are accepted the
target's next row yields a *bonus* token. Output per block = accepted + (recovered | bonus).

Randomness is always passed in as uniforms u in [0, 1), so every function here is pure
and a retransmitted message can be answered with the same outcome.

Float semantics: rows are float32, as `transform` returns them and as the wire carries
them bit-exactly. A row is treated as the distribution row / sum(row): draws use a float64
inverse CDF scaled by the float64 sum, so a float32 row that sums to 1 +- 1e-7 is sampled
exactly proportionally to its stored values. Acceptance tests compare in float64 without
dividing (u * q < p), so no ratio is ever rounded and q(x) = 0 never produces a NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from asymspec.sampling_params import LogitBias
from asymspec.sampling_params import SamplingParams as SamplingParams  # re-exported

FloatRow = npt.NDArray[np.floating]


def transform(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., V] -> float32 probabilities [..., V] that are exactly what gets sampled.

    Both the draft and the target call this, so acceptance is exact for the transformed
    distributions. Greedy returns the one-hot row of the argmax (first index on ties).
    """
    logits = logits.float()
    if params.logit_bias:
        logits = add_logit_bias(logits, params.logit_bias)
    if params.is_greedy:
        one_hot = torch.zeros_like(logits)
        return one_hot.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # Keep a token while the mass ranked above it is still short of top_p; the top
        # token always survives because the mass above it is 0.
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.min_p > 0.0:
        # vLLM's min-p: drop what is below min_p x the row's top probability; the top token
        # always survives (min_p <= 1), so the row keeps mass.
        floor = params.min_p * probs.amax(dim=-1, keepdim=True)  # [..., 1]
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def add_logit_bias(logits: torch.Tensor, bias: LogitBias) -> torch.Tensor:
    """logits [..., V] plus OpenAI's logit_bias (ids past V are the caller's error)."""
    ids = torch.tensor([token for token, _ in bias], device=logits.device)
    values = torch.tensor([value for _, value in bias], dtype=logits.dtype, device=logits.device)
    return logits.index_add(-1, ids, values.expand(*logits.shape[:-1], len(bias)))


def as_float32(row: FloatRow | torch.Tensor) -> npt.NDArray[np.float32]:
    """A row as float32 numpy on the CPU: the canonical values that travel on the wire."""
    if isinstance(row, torch.Tensor):
        return row.detach().to("cpu", torch.float32).numpy()
    return np.asarray(row, dtype=np.float32)


def _as_float64(row: FloatRow | torch.Tensor) -> npt.NDArray[np.float64]:
    return as_float32(row).astype(np.float64)


def transform_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``transform`` of each row [B, V] with its own params; rows that share params go
    through one call, so a batch of requests costs a few tensor ops, not B."""
    if len(set(params)) == 1:
        return transform(logits, params[0])
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    groups: dict[SamplingParams, list[int]] = {}
    for index, p in enumerate(params):
        groups.setdefault(p, []).append(index)
    for p, indices in groups.items():
        rows = torch.tensor(indices, device=logits.device)
        out[rows] = transform(logits[rows], p)
    return out


def sample_rows(probs: torch.Tensor, uniforms: list[float]) -> list[int]:
    """``sample(probs[b], uniforms[b])`` for every row of probs [B, V], in one pass: the
    same float64 inverse CDF (sequential cumsum, side="right", last token with mass)."""
    weights = probs.detach().to("cpu", torch.float32).double()  # [B, V] as sample() sees it
    cdf = torch.cumsum(weights, dim=-1)  # [B, V]
    total = cdf[:, -1:]  # [B, 1]
    if not bool((total > 0.0).all()):
        raise ValueError("cannot sample from a row with no positive mass")
    u = torch.tensor(uniforms, dtype=torch.float64)[:, None]  # [B, 1]
    vocab = weights.shape[-1]
    index = torch.searchsorted(cdf, u * total, right=True)[:, 0]  # [B]
    # side="right" lands on a token with mass, except when u * total rounds up to total
    # (index == V): then take the row's last token with mass, as sample() does. Only those
    # rare rows are searched, which keeps this off the edge's profile.
    for row in torch.nonzero(index >= vocab).flatten().tolist():
        index[row] = int(torch.nonzero(weights[row] > 0).max())
    return index.tolist()


def sample(probs: FloatRow | torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from a row of non-negative weights (normalised here) with u in [0, 1)."""
    return int(sample_many(probs, np.array([u], dtype=np.float64))[0])


def sample_many(probs: FloatRow | torch.Tensor, uniforms: FloatRow) -> npt.NDArray[np.int64]:
    """One inverse-CDF draw per uniform from the same row: ``sample`` for each, one cumsum."""
    weights = _as_float64(probs)  # [V]
    cdf = np.cumsum(weights)
    total = cdf[-1]
    if not total > 0.0:
        raise ValueError("cannot sample from a row with no positive mass")
    # side="right" skips zero-weight tokens: their cdf step is flat, so they own no interval.
    index = np.searchsorted(cdf, np.asarray(uniforms, dtype=np.float64) * total, side="right")
    # u * total can round up to total for u just below 1: fall back to the last token with mass.
    return np.minimum(index, int(np.flatnonzero(weights)[-1])).astype(np.int64)


@dataclass(frozen=True, slots=True)
class BlockOutcome:
    """What verifying one block decided. bonus_token is set only when all gamma accepted."""

    n_accepted: int
    bonus_token: int | None

    @property
    def rejected(self) -> bool:
        return self.bonus_token is None


def acceptance_probability(p_x: float, q_x: float) -> float:
    """a = min(1, p(x)/q(x)) for a draft token with q(x) > 0 (for metrics and tests)."""
    return min(1.0, float(p_x) / float(q_x))


def accept_token(p_x: float, q_x: float, u: float) -> bool:
    """Accept x with probability a = min(1, p(x)/q(x)), i.e. iff u < p/q, i.e. u*q < p."""
    if not q_x > 0.0:
        # A draft token was sampled from q, so q(x) > 0; anything else is a protocol error
        # (and dividing by it would turn the test into a NaN comparison).
        raise ValueError(f"draft probability must be > 0, got {q_x}")
    return float(u) * float(q_x) < float(p_x)


def accept_block(
    draft_tokens: npt.NDArray[np.integer],  # [gamma]
    draft_probs: FloatRow,  # [gamma]      q_i(x_i)
    target_probs: FloatRow | torch.Tensor,  # [gamma+1, V] p_1 .. p_{gamma+1}
    uniforms: FloatRow,  # [gamma+1]    the last one draws the bonus token
) -> BlockOutcome:
    """Left-to-right acceptance; the first rejection ends the block (AsymSpec eq. 1)."""
    gamma = len(draft_tokens)
    if len(draft_probs) != gamma or len(target_probs) != gamma + 1 or len(uniforms) < gamma + 1:
        raise ValueError("block shapes disagree: need gamma tokens, gamma q's, gamma+1 p rows")
    for i in range(gamma):
        p_x = float(target_probs[i][int(draft_tokens[i])])
        if not accept_token(p_x, float(draft_probs[i]), float(uniforms[i])):
            return BlockOutcome(n_accepted=i, bonus_token=None)
    return BlockOutcome(n_accepted=gamma, bonus_token=sample(target_probs[gamma], uniforms[gamma]))


def residual(target_row: FloatRow | torch.Tensor, draft_row: FloatRow | torch.Tensor) -> FloatRow:
    """r = [p - q]+ / Z over the whole vocabulary (the exact correction distribution).

    If Z = 0 then p = q and a rejection had probability zero; it can only be reached through
    float rounding, so we fall back to p, which is then the same distribution.
    """
    p = _as_float64(target_row)
    positive = np.maximum(p - _as_float64(draft_row), 0.0)
    z = positive.sum()
    return positive / z if z > 0.0 else p / p.sum()


def topk_support(
    target_row: FloatRow | torch.Tensor, k: int
) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.float32], np.float32]:
    """Cloud side: S = the K most probable target tokens and delta_p = the mass outside S.

    The order is by probability descending, ties by token id, so a larger K extends the
    same ordered support. The paper's delta_p = 1 - sum_S p assumes a row that sums to 1
    exactly; a float32 row is off by ~1e-7, which would make a zero tail look non-zero (and
    an exact greedy correction look inexact). So delta_p is the tail mass itself, summed
    in float64 over the tokens outside S and rounded *up* to float32: it upper-bounds the
    tail, which is all the certificate needs, and is exactly 0 when the tail is empty.
    """
    p32 = as_float32(target_row)
    vocab = p32.shape[0]
    k = max(1, min(int(k), vocab))
    # Select S without sorting the whole row (a full sort of 49,152 floats cost ~7 ms, on
    # the cloud's critical path): all tokens above the k-th largest value, then the tied ones
    # with the smallest ids; then order just those k.
    kth = np.partition(p32, vocab - k)[vocab - k]
    above = np.flatnonzero(p32 > kth)
    tied = np.flatnonzero(p32 == kth)[: k - len(above)]
    chosen = np.concatenate([above, tied])
    order = chosen[np.lexsort((chosen, -p32[chosen].astype(np.float64)))]
    outside = np.ones(vocab, dtype=bool)
    outside[order] = False
    tail = float(p32[outside].astype(np.float64).sum())
    delta_p = np.float32(tail)
    if float(delta_p) < tail:
        delta_p = np.nextafter(delta_p, np.float32(np.inf))
    return order.astype(np.uint32), p32[order], np.float32(delta_p)


@dataclass(frozen=True, slots=True)
class Certificate:
    """The residual-distribution TV certificate of one top-K response (§IV-B2)."""

    eps: float  # eps_K = delta_p / (Z_S + delta_p): bounds TV(r, r restricted to S)
    z_s: float  # Z_S = sum_S [p - q]+

    @property
    def drawable(self) -> bool:
        """A bounded draw on S needs positive residual mass inside S."""
        return self.z_s > 0.0


def certificate(topk_probs: FloatRow, q_on_support: FloatRow, delta_p: float) -> Certificate:
    """eps_K from the target's top-K probabilities, the draft's q on the same ids, delta_p."""
    z_s = float(np.maximum(_as_float64(topk_probs) - _as_float64(q_on_support), 0.0).sum())
    delta = float(delta_p)
    if z_s <= 0.0:
        return Certificate(eps=1.0, z_s=0.0)
    return Certificate(eps=delta / (z_s + delta), z_s=z_s)


def sample_on_support(
    topk_ids: npt.NDArray[np.integer], topk_probs: FloatRow, q_on_support: FloatRow, u: float
) -> int:
    """The bounded draw: r restricted to S, i.e. [p - q]+ / Z_S over the K ids."""
    weights = np.maximum(_as_float64(topk_probs) - _as_float64(q_on_support), 0.0)
    return int(topk_ids[sample(weights, u)])


def draw_proposals(
    target_row: FloatRow | torch.Tensor, uniforms: FloatRow
) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.float32]]:
    """Cloud side of exact recovery (§IV-B3): N draws Y ~ p and their p(Y), one per uniform."""
    p32 = as_float32(target_row)
    ids = sample_many(p32, uniforms).astype(np.uint32)
    return ids, p32[ids].astype(np.float32)


def accept_proposal(p_y: float, q_y: float, u: float) -> bool:
    """Accept Y with probability b(Y) = [1 - q(Y)/p(Y)]+, i.e. iff u*p < p - q.

    Then P(Y = v, accept) = p(v) b(v) = [p(v) - q(v)]+, so the first accepted proposal is
    distributed exactly as r.
    """
    p, q = float(p_y), float(q_y)
    return p > 0.0 and float(u) * p < p - q


def first_accepted_proposal(
    proposal_ids: npt.NDArray[np.integer],
    proposal_probs: FloatRow,  # p(Y) as the cloud sent it
    q_on_proposals: FloatRow,  # the edge's retained q at the same ids
    uniforms: FloatRow,
) -> int | None:
    """The first accepted proposal's token id, or None when every proposal was refused."""
    for y, p_y, q_y, u in zip(proposal_ids, proposal_probs, q_on_proposals, uniforms, strict=False):
        if accept_proposal(float(p_y), float(q_y), float(u)):
            return int(y)
    return None


def draft_rows_from_half(rows_f16: npt.NDArray[np.float16]) -> npt.NDArray[np.float32]:
    """The canonical q rows of the full-upload modes: float16 as sent, renormalised in float32.

    The edge samples its draft tokens from exactly these rows and the cloud tests acceptance
    against exactly these rows, so quantising q to float16 for the uplink changes which q
    is used but never makes the two sides disagree about it.
    """
    rows = np.asarray(rows_f16, dtype=np.float16).astype(np.float32)  # [gamma, V]
    return rows / rows.sum(axis=-1, keepdims=True, dtype=np.float32)
