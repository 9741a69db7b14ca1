"""Seeded statistical tests: with the suffix drafter in q (a one-hot block where it proposes,
λ·onehot(c) + (1 - λ)·q_model per position otherwise), a block still commits exactly what
the target samples.

As in ``tests/shared/test_sampling_statistical.py``: toy models map a context to a fixed
random distribution; we decode blocks until LENGTH tokens are committed after a fixed
history that repeats itself (so the drafter proposes often), and compare the joint of
those tokens with the target's exact autoregressive probabilities by a chi-square test.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest

from asymspec.correction import Correction, Ladder, resolve_locally
from asymspec.fidelity import FidelityBudget
from asymspec.sampling import SamplingParams, accept_block, sample
from asymspec_engine.suffix import SuffixConfig, SuffixDrafter
from tests.shared.test_sampling_statistical import LENGTH, P_MIN, TRIALS, ToyModel, chi_square_p

pytestmark = pytest.mark.slow

VOCAB = 6
HISTORY = (1, 2, 3, 4, 1, 2, 3, 4, 5, 1, 2)  # "1 2" was followed by 3 twice: a proposal
WEIGHT = 0.6  # λ of the mixture


def _one_hot(token: int) -> np.ndarray:
    row = np.zeros(VOCAB, dtype=np.float32)
    row[token] = 1.0
    return row


def run_block(
    committed: tuple[int, ...],
    target: ToyModel,
    draft: ToyModel,
    drafter: SuffixDrafter,
    ladder: Ladder,
    edge_u: Callable[[], float],
    cloud_u: Callable[[], float],
    kinds: Counter[str],
) -> tuple[int, ...]:
    """One block as the edge drafts it: the suffix proposal (up to 4 tokens, q one-hot) if
    there is one, else 3 draft-model tokens with the drafter's next token mixed in."""
    context = (*HISTORY, *committed)
    proposal = drafter.propose(context, max_tokens=4)
    tokens: list[int] = []
    q_rows: list[np.ndarray] = []
    if proposal.tokens:
        kinds["suffix block"] += 1
        tokens = list(proposal.tokens)
        q_rows = [_one_hot(t) for t in tokens]
    else:
        for _ in range(3):
            q_row: np.ndarray = draft.row((*context, *tokens)).astype(np.float32)
            copy = drafter.propose((*context, *tokens), max_tokens=1).tokens
            if copy:
                kinds["mixed row"] += 1
                q_row = (1.0 - WEIGHT) * q_row + WEIGHT * _one_hot(copy[0])
            q_rows.append(q_row)
            tokens.append(sample(q_row, edge_u()))
    gamma = len(tokens)
    p_rows = np.stack([target.row((*context, *tokens[:i])) for i in range(gamma + 1)])
    q_of_x = np.array([q_rows[i][x] for i, x in enumerate(tokens)], dtype=np.float32)
    uniforms = np.array([cloud_u() for _ in range(gamma + 1)])
    outcome = accept_block(np.array(tokens), q_of_x, p_rows, uniforms)
    if outcome.bonus_token is not None:
        return (*tokens, outcome.bonus_token)
    i = outcome.n_accepted
    correction = Correction(ladder, q_rows[i], FidelityBudget(0.0), edge_u)
    recovered = resolve_locally(correction, p_rows[i], cloud_u)
    kinds[recovered.kind.label] += 1
    return (*tokens[:i], recovered.token)


def target_joint(target: ToyModel) -> dict[tuple[int, ...], float]:
    joint = {}
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        prob = 1.0
        for i, token in enumerate(seq):
            row = target.row((*HISTORY, *seq[:i])).astype(np.float64)
            prob *= row[token] / row.sum()
        joint[seq] = prob
    return joint


LADDERS = {
    "proposals": Ladder(use_topk=False, num_proposals=2, proposal_rounds=10_000),
    "full": Ladder(use_topk=False, proposal_rounds=0),
}


@pytest.mark.parametrize("path", sorted(LADDERS))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_blocks_with_the_suffix_drafter_commit_the_target_distribution(
    path: str, temperature: float
) -> None:
    params = SamplingParams(temperature=temperature)
    target = ToyModel(VOCAB, seed=11, scale=1.5, params=params)
    draft = ToyModel(VOCAB, seed=23, scale=1.5, params=params)
    # min_match 1 and a store holding an earlier output: both of the drafter's texts and
    # both kinds of q are exercised, on most blocks
    drafter = SuffixDrafter(SuffixConfig(min_match=2, spec_factor=2.0), store_bytes=1 << 10)
    drafter.remember([2, 0, 5, 5, 0, 2, 4])
    rng_edge, rng_cloud = np.random.default_rng([7, 1]), np.random.default_rng([7, 2])
    counts: Counter[tuple[int, ...]] = Counter()
    kinds: Counter[str] = Counter()
    for _ in range(TRIALS):
        committed: tuple[int, ...] = ()
        while len(committed) < LENGTH:
            committed += run_block(
                committed, target, draft, drafter, LADDERS[path],
                rng_edge.random, rng_cloud.random, kinds,
            )  # fmt: skip
        counts[committed[:LENGTH]] += 1
    assert kinds["suffix block"] > TRIALS // 2 and kinds["mixed row"] > 5_000, kinds
    assert kinds[path] > 5_000, kinds
    assert chi_square_p(counts, target_joint(target)) > P_MIN
