"""The escalation ladder and the fidelity ledger: hand cases and invariants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asymspec.correction import (
    Correction,
    Ladder,
    Recovered,
    Rung,
    answer,
    resolve_locally,
    topk_hopeless,
)
from asymspec.fidelity import FidelityBudget
from asymspec.wire import CorrectionKind, FullRow, Proposals, TopK


def _fixed(*values: float):
    """A uniform source that returns the given values in order (then repeats the last)."""
    queue = list(values)

    def draw() -> float:
        return queue.pop(0) if len(queue) > 1 else queue[0]

    return draw


def test_ladder_rungs_in_order() -> None:
    ladder = Ladder(topk_steps=(4, 64), num_proposals=3, proposal_rounds=2)
    assert ladder.rungs() == (
        Rung(CorrectionKind.TOPK, 4),
        Rung(CorrectionKind.TOPK, 64),
        Rung(CorrectionKind.PROPOSALS, 3),
        Rung(CorrectionKind.PROPOSALS, 3),
        Rung(CorrectionKind.FULL, 0),
    )
    assert Ladder(use_topk=False, proposal_rounds=1).rungs()[0] == Rung(CorrectionKind.PROPOSALS, 8)


@pytest.mark.parametrize("steps", [(64, 4), (0, 4), (4, 4)])
def test_ladder_rejects_bad_steps(steps: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        Ladder(topk_steps=steps)


def test_exact_topk_with_zero_tail_spends_nothing() -> None:
    # Greedy: the target is one-hot on 2, the draft one-hot on 0 -> top-1 certifies exactly.
    p = np.array([0.0, 0.0, 1.0], dtype=np.float32)
    q = np.array([1.0, 0.0, 0.0], dtype=np.float32)
    budget = FidelityBudget(0.0)
    correction = Correction(Ladder(topk_steps=(1,)), q, budget, _fixed(0.5))
    outcome = resolve_locally(correction, p, _fixed(0.5))
    assert outcome == Recovered(token=2, kind=CorrectionKind.TOPK, size=1, eps=0.0)
    assert budget.spent == 0.0


def test_loose_certificate_escalates_k_then_draws() -> None:
    # p = [0.4, 0.3, 0.2, 0.1], q = [0.5, 0.0, 0.5, 0.0]; residual [0, 0.3, 0, 0.1] / 0.4.
    p = np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float32)
    q = np.array([0.5, 0.0, 0.5, 0.0], dtype=np.float32)
    budget = FidelityBudget(0.05)
    correction = Correction(Ladder(topk_steps=(2, 4)), q, budget, _fixed(0.9))
    # K=2: S = {0, 1}, delta_p = 0.3, Z_S = 0.3 -> eps = 0.5 > 0.05 -> ask for K=4
    first = correction.on_topk(*_topk(p, 2))
    assert first == Rung(CorrectionKind.TOPK, 4)
    # K=4 covers everything: delta_p = 0 -> exact draw; u = 0.9 -> 0.36 of 0.4 -> id 3
    outcome = correction.on_topk(*_topk(p, 4))
    assert outcome == Recovered(token=3, kind=CorrectionKind.TOPK, size=4, eps=0.0)


def _topk(p: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, float]:
    reply = answer(Rung(CorrectionKind.TOPK, k), p, _fixed(0.0))
    assert isinstance(reply, TopK)
    return reply.token_ids, reply.probs, float(reply.delta_p)


def test_budget_admits_bounded_draw_and_records_eps() -> None:
    p = np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float32)
    q = np.array([0.5, 0.0, 0.5, 0.0], dtype=np.float32)
    budget = FidelityBudget(0.6)
    correction = Correction(Ladder(topk_steps=(2, 4)), q, budget, _fixed(0.0))
    outcome = correction.on_topk(*_topk(p, 2))
    assert isinstance(outcome, Recovered) and outcome.token == 1
    assert outcome.eps == pytest.approx(0.5, abs=1e-6) and budget.spent == outcome.eps


def test_hidden_tail_residual_skips_to_proposals_then_full() -> None:
    # p and q agree on the head {0}; the whole residual sits in the tail {1, 2}.
    p = np.array([0.6, 0.3, 0.1], dtype=np.float32)
    q = np.array([0.6, 0.0, 0.4], dtype=np.float32)
    correction = Correction(
        Ladder(topk_steps=(1,), num_proposals=2, proposal_rounds=1),
        q,
        FidelityBudget(1.0),
        _fixed(0.5),
    )
    assert correction.on_topk(*_topk(p, 1)) == Rung(
        CorrectionKind.PROPOSALS, 2
    )  # Z_S = 0: not drawable
    # Proposals 0 and 2 both have q >= p, so b = 0 and both are refused.
    reply = answer(Rung(CorrectionKind.PROPOSALS, 2), p, _fixed(0.1, 0.95))
    assert isinstance(reply, Proposals) and reply.token_ids.tolist() == [0, 2]
    assert correction.on_proposals(reply.token_ids, reply.probs) == Rung(CorrectionKind.FULL, 0)
    full = answer(Rung(CorrectionKind.FULL, 0), p, _fixed(0.0))
    assert isinstance(full, FullRow)
    assert correction.on_full(full.probs) == Recovered(
        token=1, kind=CorrectionKind.FULL, size=0, eps=0.0
    )


def test_proposal_accepted_with_one_minus_q_over_p() -> None:
    q = np.array([0.9, 0.1], dtype=np.float32)
    correction = Correction(
        Ladder(use_topk=False, num_proposals=2), q, FidelityBudget(0), _fixed(0.5)
    )
    # proposal 0: b = [1 - 0.9/0.5]+ = 0 -> refused; proposal 1: b = 0.8 > 0.5 -> accepted
    outcome = correction.on_proposals(np.array([0, 1]), np.array([0.5, 0.5], dtype=np.float32))
    assert outcome == Recovered(token=1, kind=CorrectionKind.PROPOSALS, size=2, eps=0.0)


def test_answer_never_resamples_the_row() -> None:
    p = np.array([0.1, 0.2, 0.7], dtype=np.float32)
    reply = answer(Rung(CorrectionKind.FULL, 0), p, _fixed(0.0))
    assert (
        isinstance(reply, FullRow)
        and reply.probs.view(np.uint32).tolist() == p.view(np.uint32).tolist()
    )


# ---------------------------------------------------------------- the ledger


def test_zero_budget_admits_only_exact() -> None:
    budget = FidelityBudget(0.0)
    assert budget.fits(0.0) and not budget.fits(1e-12)
    with pytest.raises(ValueError):
        budget.spend(1e-9)


@settings(max_examples=300, deadline=None)
@given(st.floats(0.0, 1.0), st.lists(st.floats(0.0, 1.0), max_size=50))
def test_ledger_never_overspends(epsilon_req: float, attempts: list[float]) -> None:
    budget = FidelityBudget(epsilon_req)
    for eps in attempts:
        if budget.fits(eps):
            budget.spend(eps)
        assert budget.spent <= epsilon_req


def test_exhausted_budget_on_untruncated_target_skips_larger_k() -> None:
    # Softmax over the whole vocabulary: delta_p > 0 at every K < |V|, so with no budget
    # left the ladder goes straight to proposals instead of asking for K = 64, 512.
    p = np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float32)
    q = np.array([0.5, 0.0, 0.5, 0.0], dtype=np.float32)
    correction = Correction(
        Ladder(topk_steps=(2, 64, 512)), q, FidelityBudget(0.0), _fixed(0.5),
        truncated_target=False,
    )  # fmt: skip
    assert correction.on_topk(*_topk(p, 2)) == Rung(CorrectionKind.PROPOSALS, 8)
    walking = Correction(Ladder(topk_steps=(2, 64, 512)), q, FidelityBudget(0.0), _fixed(0.5))
    assert walking.on_topk(*_topk(p, 2)) == Rung(
        CorrectionKind.TOPK, 64
    )  # truncated: K may cover all


def test_hopeless_topk_starts_the_ladder_at_proposals() -> None:
    # No budget and an untruncated target: no top-K rung can certify, so a rejection's
    # verdict should already carry proposals (rung 3 of topk 16 / 256 / 4096, proposals ...).
    ladder = Ladder(topk_steps=(16, 256, 4096), num_proposals=8, proposal_rounds=2)
    assert topk_hopeless(0.0, truncated_target=False)
    assert not topk_hopeless(0.0, truncated_target=True)  # greedy / top-k: top-K may cover p
    assert not topk_hopeless(0.05, truncated_target=False)  # a budget can pay for eps_K
    start = ladder.first_rung(topk_hopeless=True)
    assert ladder.rungs()[start] == Rung(CorrectionKind.PROPOSALS, 8)
    assert ladder.first_rung(topk_hopeless=False) == 0
    assert Ladder(use_topk=False).first_rung(topk_hopeless=True) == 0  # already exact-only
    # A correction started there walks the rest of the ladder as usual.
    p = np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float32)
    q = np.array([0.5, 0.0, 0.5, 0.0], dtype=np.float32)
    correction = Correction(ladder, q, FidelityBudget(0.0), _fixed(0.99), rung_index=start)
    refused = correction.on_proposals(np.array([0], dtype=np.uint32), p[[0]])  # q > p: refused
    assert refused == Rung(CorrectionKind.PROPOSALS, 8)
    assert correction.on_proposals(np.array([0], dtype=np.uint32), p[[0]]) == Rung(
        CorrectionKind.FULL, 0
    )
