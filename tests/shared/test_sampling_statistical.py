"""Seeded statistical tests: one speculative block commits exactly what the target samples.

Toy "models" map a context (tuple of token ids) to a fixed random distribution over a small
vocabulary. We decode with blocks of gamma draft tokens until at least LENGTH tokens are
committed and compare the joint distribution of the first LENGTH tokens with the target's
exact autoregressive probabilities (computed, not sampled) by a chi-square test. Each
correction path is forced in turn through the ladder configuration.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from functools import cache

import numpy as np
import pytest
import torch
from scipy import stats

from asymspec.correction import Correction, Ladder, Recovered, resolve_locally
from asymspec.fidelity import FidelityBudget
from asymspec.sampling import (
    SamplingParams,
    accept_block,
    residual,
    sample,
    topk_support,
    transform,
)
from asymspec.wire import CorrectionKind

pytestmark = pytest.mark.slow

TRIALS = 50_000
LENGTH = 3  # tokens of the joint distribution under test
P_MIN = 0.001


class ToyModel:
    """A context -> distribution table, built lazily from a seed (logits ~ N(0, scale^2))."""

    def __init__(self, vocab: int, seed: int, scale: float, params: SamplingParams) -> None:
        self.vocab, self.seed, self.scale, self.params = vocab, seed, scale, params
        self.row = cache(self._row)

    def _row(self, context: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng([self.seed, len(context), *context])
        logits = torch.from_numpy(rng.normal(0.0, self.scale, self.vocab))
        return transform(logits, self.params).numpy()


def run_block(
    context: tuple[int, ...],
    gamma: int,
    target: ToyModel,
    draft: ToyModel,
    ladder: Ladder,
    budget: FidelityBudget,
    edge_u: Callable[[], float],
    cloud_u: Callable[[], float],
    kinds: Counter[str],
) -> tuple[int, ...]:
    """Draft gamma tokens, verify them, correct a rejection; returns the committed tokens."""
    tokens: list[int] = []
    q_rows = []
    for _ in range(gamma):
        q_row = draft.row((*context, *tokens))
        q_rows.append(q_row)
        tokens.append(sample(q_row, edge_u()))
    p_rows = np.stack([target.row((*context, *tokens[:i])) for i in range(gamma + 1)])
    q_of_x = np.array([q_rows[i][x] for i, x in enumerate(tokens)], dtype=np.float32)
    uniforms = np.array([cloud_u() for _ in range(gamma + 1)])
    outcome = accept_block(np.array(tokens), q_of_x, p_rows, uniforms)
    if outcome.bonus_token is not None:
        kinds["bonus"] += 1
        return (*tokens, outcome.bonus_token)
    i = outcome.n_accepted
    recovered = resolve_locally(Correction(ladder, q_rows[i], budget, edge_u), p_rows[i], cloud_u)
    kinds[recovered.kind.label] += 1
    return (*tokens[:i], recovered.token)


def speculative_counts(
    gamma: int, target: ToyModel, draft: ToyModel, ladder: Ladder, seed: int
) -> tuple[Counter[tuple[int, ...]], Counter[str]]:
    rng_edge, rng_cloud = np.random.default_rng([seed, 1]), np.random.default_rng([seed, 2])
    counts: Counter[tuple[int, ...]] = Counter()
    kinds: Counter[str] = Counter()
    for _ in range(TRIALS):
        committed: tuple[int, ...] = ()
        while len(committed) < LENGTH:
            committed += run_block(
                committed, gamma, target, draft, ladder, FidelityBudget(0.0),
                rng_edge.random, rng_cloud.random, kinds,
            )  # fmt: skip
        counts[committed[:LENGTH]] += 1
    return counts, kinds


def target_joint(target: ToyModel) -> dict[tuple[int, ...], float]:
    joint = {}
    for seq in itertools.product(range(target.vocab), repeat=LENGTH):
        prob = 1.0
        for i, token in enumerate(seq):
            row = target.row(seq[:i]).astype(np.float64)
            prob *= row[token] / row.sum()
        joint[seq] = prob
    return joint


def chi_square_p(counts: Counter[tuple[int, ...]], joint: dict[tuple[int, ...], float]) -> float:
    """Chi-square goodness of fit; cells expecting < 5 are pooled so the test stays valid."""
    observed: list[float] = []
    expected: list[float] = []
    pooled_obs, pooled_exp = 0.0, 0.0
    for seq, prob in joint.items():
        if prob * TRIALS >= 5:
            observed.append(counts.get(seq, 0))
            expected.append(prob * TRIALS)
        else:
            pooled_obs += counts.get(seq, 0)
            pooled_exp += prob * TRIALS
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    assert sum(counts.values()) == TRIALS
    assert set(counts) <= set(joint)
    return float(stats.chisquare(observed, np.array(expected) * TRIALS / sum(expected)).pvalue)


PATHS = {
    # Target and draft both restricted to top-4 of 12 tokens: every tail is empty, so the
    # first top-4 response always certifies eps = 0 and the bounded draw is exact.
    "topk": (12, SamplingParams(temperature=1.0, top_k=4), Ladder(topk_steps=(4,))),
    # No top-K and enough proposal rounds that the full row is (practically) never needed.
    "proposals": (
        8,
        SamplingParams(temperature=1.0),
        Ladder(use_topk=False, num_proposals=2, proposal_rounds=10_000),
    ),
    "full": (8, SamplingParams(temperature=0.8), Ladder(use_topk=False, proposal_rounds=0)),
}


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_block_commits_the_target_distribution(path: str, gamma: int) -> None:
    vocab, params, ladder = PATHS[path]
    target = ToyModel(vocab, seed=11, scale=1.5, params=params)
    draft = ToyModel(vocab, seed=23, scale=1.5, params=params)
    counts, kinds = speculative_counts(gamma, target, draft, ladder, seed=gamma)
    # The forced path really was the one taken, and it was exercised a lot.
    assert set(kinds) == {"bonus", path}, kinds
    assert kinds[path] > 5_000
    assert chi_square_p(counts, target_joint(target)) > P_MIN


def test_greedy_blocks_reproduce_target_argmax_chain() -> None:
    greedy = SamplingParams(temperature=0.0)
    target = ToyModel(16, seed=5, scale=1.0, params=greedy)
    draft = ToyModel(16, seed=6, scale=1.0, params=greedy)
    rng = np.random.default_rng(0)
    committed: tuple[int, ...] = ()
    kinds: Counter[str] = Counter()
    while len(committed) < 40:
        committed += run_block(
            committed, 3, target, draft, Ladder(topk_steps=(1,)), FidelityBudget(0.0),
            rng.random, rng.random, kinds,
        )  # fmt: skip
    expected: tuple[int, ...] = ()
    while len(expected) < len(committed):
        expected += (int(np.argmax(target.row(expected))),)
    assert committed == expected
    assert set(kinds) <= {"bonus", "topk"}  # top-1 with delta_p = 0 certifies greedy exactly


@pytest.mark.parametrize("k", [2, 4, 8])
def test_bounded_topk_tv_stays_within_certificate(k: int) -> None:
    """With eps_req > 0 the top-K path's measured TV from the exact residual is <= eps_K."""
    vocab, n = 16, TRIALS
    p = ToyModel(vocab, seed=3, scale=1.2, params=SamplingParams()).row(())
    q = ToyModel(vocab, seed=4, scale=1.2, params=SamplingParams()).row(())
    exact = residual(p, q)
    rng = np.random.default_rng(k)
    counts = np.zeros(vocab)
    eps_spent = set()
    for _ in range(n):
        budget = FidelityBudget(1.0)
        outcome = resolve_locally(
            Correction(Ladder(topk_steps=(k,)), q, budget, rng.random), p, rng.random
        )
        assert isinstance(outcome, Recovered) and outcome.kind is CorrectionKind.TOPK
        counts[outcome.token] += 1
        eps_spent.add(outcome.eps)
    (eps,) = eps_spent  # the same position always yields the same certificate
    measured_tv = 0.5 * float(np.abs(counts / n - exact).sum())
    noise = 0.5 * float(np.sqrt(exact * (1 - exact) / n).sum()) * 4  # ~4 sigma per cell
    assert measured_tv <= eps + noise
    # and the draw really is the truncated residual: nothing outside S was ever drawn
    ids, _, _ = topk_support(p, k)
    assert counts[np.setdiff1d(np.arange(vocab), ids)].sum() == 0
