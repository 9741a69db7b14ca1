"""Exact hand cases and invariants for asymspec.sampling (p = target, q = draft)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asymspec.sampling import (
    SamplingParams,
    accept_block,
    accept_proposal,
    accept_token,
    acceptance_probability,
    certificate,
    residual,
    sample,
    sample_on_support,
    sample_rows,
    topk_support,
    transform,
    transform_rows,
)

# ---------------------------------------------------------------- sampling transform


def test_greedy_transform_is_one_hot_of_first_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0]])
    probs = transform(logits, SamplingParams(temperature=0.0))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]  # tie 1 vs 2 -> first index


def test_temperature_scales_logits_before_softmax() -> None:
    logits = torch.tensor([0.0, 1.0])
    probs = transform(logits, SamplingParams(temperature=0.5))
    expected = torch.softmax(torch.tensor([0.0, 2.0]), dim=-1)
    assert torch.allclose(probs, expected)
    assert probs.dtype == torch.float32


def test_top_k_keeps_k_largest() -> None:
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    probs = transform(logits, SamplingParams(top_k=2))
    assert probs[0] == 0 and probs[3] == 0  # only ids 1 and 2 survive
    assert torch.allclose(probs[1:3], torch.softmax(torch.tensor([4.0, 3.0]), dim=-1))


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    probs = transform(probs_in.log(), SamplingParams(top_p=0.8))
    # mass above: 0, 0.5, 0.8, 0.95 -> ids 0 and 1 kept (0.8 >= 0.8 drops id 2)
    assert probs[2] == 0 and probs[3] == 0
    assert torch.allclose(probs[:2], torch.tensor([0.5, 0.3]) / 0.8)


def test_top_p_always_keeps_the_top_token() -> None:
    probs = transform(torch.tensor([5.0, 0.0, 0.0]), SamplingParams(top_p=0.01))
    assert probs.tolist() == [1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}]
)
def test_invalid_sampling_params_raise(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------- inverse-CDF draw


def test_sample_never_picks_zero_weight_tokens() -> None:
    row = np.array([0.0, 0.25, 0.0, 0.75, 0.0], dtype=np.float32)
    assert sample(row, 0.0) == 1  # u = 0 -> first token with mass
    assert sample(row, 0.2499) == 1
    assert sample(row, 0.25) == 3  # exactly on the boundary belongs to the next token
    assert sample(row, np.nextafter(1.0, 0.0)) == 3  # u just below 1 -> last with mass


def test_sample_normalises_unnormalised_weights() -> None:
    assert sample(np.array([2.0, 6.0]), 0.2) == 0  # 0.2 * 8 = 1.6 < 2
    assert sample(np.array([2.0, 6.0]), 0.3) == 1


def test_sample_rejects_an_empty_row() -> None:
    with pytest.raises(ValueError):
        sample(np.zeros(3), 0.5)
    with pytest.raises(ValueError):
        sample_rows(torch.tensor([[0.5, 0.5], [0.0, 0.0]]), [0.1, 0.2])


def test_sample_rows_hand_cases() -> None:
    rows = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0], [2.0, 6.0, 0.0, 0.0, 0.0]])
    assert sample_rows(rows, [0.25, 0.2]) == [3, 0]  # boundary -> next token; 0.2 * 8 < 2
    assert sample_rows(rows, [float(np.nextafter(1.0, 0.0)), 0.3]) == [3, 1]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=6),
    st.sampled_from([0.0, 0.5, 1.0]),
)
def test_sample_rows_equals_sample_per_row(seeds: list[int], zero_share: float) -> None:
    """The vectorized draw is the scalar definition, row by row (same uniforms, same ids)."""
    rows, uniforms = [], []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        row = torch.rand(300, generator=g)
        row[torch.rand(300, generator=g) < zero_share * 0.9] = 0.0  # sparse rows, like top-k
        row[int(torch.randint(0, 300, (), generator=g))] += 0.1  # never all zero
        rows.append(row / row.sum())
        uniforms.append(float(torch.rand((), generator=g, dtype=torch.float64)))
    got = sample_rows(torch.stack(rows), uniforms)
    assert got == [sample(row, u) for row, u in zip(rows, uniforms, strict=True)]


def test_transform_rows_applies_each_rows_params() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.9),
    ]
    got = transform_rows(logits, params)
    for row, p, out in zip(logits, params, got, strict=True):
        assert torch.equal(out, transform(row, p))


# ---------------------------------------------------------------- block acceptance


def _rows(*rows: list[float]) -> np.ndarray:
    return np.array(rows, dtype=np.float32)


def test_all_accepted_then_bonus() -> None:
    tokens = np.array([1, 2, 3])
    q = np.array([0.5, 0.5, 0.5], dtype=np.float32)
    p = _rows(
        [0.0, 0.6, 0.2, 0.2],  # p(1) = 0.6 >= q -> accept for any u
        [0.1, 0.1, 0.7, 0.1],  # p(2) = 0.7 >= q -> accept
        [0.0, 0.0, 0.0, 1.0],  # p(3) = 1.0 -> accept
        [0.0, 0.0, 1.0, 0.0],  # bonus row: all mass on token 2
    )
    outcome = accept_block(tokens, q, p, np.array([0.99, 0.99, 0.99, 0.3]))
    assert outcome.n_accepted == 3 and outcome.bonus_token == 2 and not outcome.rejected


@pytest.mark.parametrize("reject_at", [0, 1, 2])
def test_reject_at_each_position(reject_at: int) -> None:
    tokens = np.array([0, 1, 2])
    q = np.array([0.5, 0.5, 0.5], dtype=np.float32)
    p = np.full((4, 3), 1 / 3, dtype=np.float32)
    p[reject_at, tokens[reject_at]] = 0.0  # p(x) = 0 -> rejected whatever u is
    outcome = accept_block(tokens, q, p, np.zeros(4))
    assert outcome.n_accepted == reject_at and outcome.rejected and outcome.bonus_token is None


def test_acceptance_threshold_is_p_over_q() -> None:
    # a = p/q = 0.2/0.4 = 0.5: u = 0.4999 accepts, u = 0.5 rejects
    assert accept_token(0.2, 0.4, 0.4999)
    assert not accept_token(0.2, 0.4, 0.5)
    assert acceptance_probability(0.2, 0.4) == 0.5
    assert acceptance_probability(0.9, 0.4) == 1.0


def test_zero_draft_probability_is_a_protocol_error() -> None:
    with pytest.raises(ValueError):
        accept_token(0.5, 0.0, 0.1)


def test_greedy_block_accepts_matching_argmax_and_rejects_the_rest() -> None:
    greedy = SamplingParams(temperature=0.0)
    target_logits = torch.tensor([[0.0, 9.0, 0.0], [9.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    p = transform(target_logits, greedy).numpy()
    tokens = np.array([1, 2])  # first matches the target argmax (1), second does not (0)
    outcome = accept_block(tokens, np.ones(2, dtype=np.float32), p, np.full(3, 0.999))
    assert outcome.n_accepted == 1 and outcome.rejected


def test_block_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError):
        accept_block(np.array([0, 1]), np.ones(2), np.ones((2, 3)), np.zeros(3))


# ---------------------------------------------------------------- residual and certificate


def test_residual_hand_case() -> None:
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.6, 0.1, 0.3])
    assert np.allclose(residual(p, q), [0.0, 1.0, 0.0])  # only id 1 has p > q


def test_residual_falls_back_to_p_when_p_equals_q() -> None:
    p = np.array([0.25, 0.75])
    assert np.allclose(residual(p, p), p)


def test_topk_support_orders_by_probability_then_id() -> None:
    p = np.array([0.1, 0.3, 0.3, 0.2, 0.1], dtype=np.float32)
    ids, probs, delta_p = topk_support(p, 3)
    assert ids.tolist() == [1, 2, 3]  # tie 1/2 broken by id
    assert probs.tolist() == pytest.approx([0.3, 0.3, 0.2])
    assert delta_p >= np.float32(0.2)  # rounded up, never below the true tail


def test_topk_support_greedy_has_zero_tail() -> None:
    ids, probs, delta_p = topk_support(np.array([0.0, 1.0, 0.0], dtype=np.float32), 1)
    assert ids.tolist() == [1] and probs.tolist() == [1.0] and delta_p == 0.0


def test_certificate_hand_case() -> None:
    # p = [0.5, 0.3, 0.2], q = [0.6, 0.1, 0.3], S = {0, 1}: delta_p = 0.2,
    # Z_S = [0.5-0.6]+ + [0.3-0.1]+ = 0.2, eps = 0.2 / (0.2 + 0.2) = 0.5
    cert = certificate(np.array([0.5, 0.3]), np.array([0.6, 0.1]), 0.2)
    assert cert.z_s == pytest.approx(0.2) and cert.eps == pytest.approx(0.5)
    assert cert.drawable


def test_certificate_without_residual_on_support_is_not_drawable() -> None:
    # p and q agree on the head; all of [p - q]+ is hidden in the tail.
    cert = certificate(np.array([0.5, 0.3]), np.array([0.5, 0.4]), 0.2)
    assert not cert.drawable


def test_bounded_draw_uses_only_positive_residual_on_support() -> None:
    ids = np.array([7, 3, 5])
    p_s = np.array([0.4, 0.3, 0.2])
    q_s = np.array([0.5, 0.1, 0.1])  # residual on S: [0, 0.2, 0.1]
    assert sample_on_support(ids, p_s, q_s, 0.0) == 3
    assert sample_on_support(ids, p_s, q_s, 0.7) == 5  # 0.7 * 0.3 = 0.21 > 0.2


def test_accept_proposal_probability_is_one_minus_q_over_p() -> None:
    # b = 1 - 0.1/0.4 = 0.75
    assert accept_proposal(0.4, 0.1, 0.7499)
    assert not accept_proposal(0.4, 0.1, 0.75)
    assert not accept_proposal(0.3, 0.5, 0.0)  # q >= p -> never
    assert not accept_proposal(0.0, 0.0, 0.0)  # p = 0 -> never


# ---------------------------------------------------------------- invariants (hypothesis)


def _distribution(draw: st.DrawFn, size: int, zero_fraction: float = 0.3) -> np.ndarray:
    raw = np.array(draw(st.lists(st.floats(0.0, 1.0), min_size=size, max_size=size)))
    mask = np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size)))
    raw = np.where(mask & (raw < zero_fraction), 0.0, raw)
    if raw.sum() == 0:
        raw[draw(st.integers(0, size - 1))] = 1.0
    return (raw / raw.sum()).astype(np.float32)


@st.composite
def pq_pairs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    size = draw(st.integers(2, 24))
    p = _distribution(draw, size)
    if draw(st.booleans()):
        q = _distribution(draw, size)
    else:
        # Adversarial: q matches p on p's head and undershoots on the tail, so the whole
        # residual [p - q]+ hides where the top-K does not look.
        order = np.argsort(-p, kind="stable")
        head = order[: draw(st.integers(1, size))]
        q = np.zeros_like(p)
        q[head] = p[head]
        tail = np.setdiff1d(np.arange(size), head)
        spare = 1.0 - q.sum()
        if len(tail) and spare > 0:
            q[tail] = p[tail] * draw(st.floats(0.0, 0.5))
            q[head[0]] += 1.0 - q.sum()
        q = (q / q.sum()).astype(np.float32)
    return p, q


def _true_tv(p: np.ndarray, q: np.ndarray, k: int) -> float | None:
    """TV between the exact residual and its restriction to the top-K support."""
    exact = residual(p, q)
    ids, p_s, _ = topk_support(p, k)
    weights = np.maximum(p_s.astype(np.float64) - q[ids].astype(np.float64), 0.0)
    if weights.sum() <= 0:
        return None
    restricted = np.zeros_like(exact)
    restricted[ids] = weights / weights.sum()
    return 0.5 * float(np.abs(exact - restricted).sum())


@settings(max_examples=300, deadline=None)
@given(pq_pairs(), st.integers(1, 24))
def test_certificate_bounds_true_tv(pq: tuple[np.ndarray, np.ndarray], k: int) -> None:
    p, q = pq
    ids, p_s, delta_p = topk_support(p, k)
    cert = certificate(p_s, q[ids], float(delta_p))
    tv = _true_tv(p, q, k)
    if residual(p, q).sum() > 0 and np.maximum(p - q, 0).sum() > 0 and tv is not None:
        assert cert.drawable
        assert tv <= cert.eps + 1e-6


@settings(max_examples=300, deadline=None)
@given(pq_pairs(), st.integers(1, 23))
def test_larger_k_never_loosens_the_bound(pq: tuple[np.ndarray, np.ndarray], k: int) -> None:
    p, q = pq
    small = certificate(*_support_q(p, q, k))
    large = certificate(*_support_q(p, q, k + 1))
    assert large.eps <= small.eps + 1e-6
    assert large.z_s >= small.z_s - 1e-9


def _support_q(p: np.ndarray, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, float]:
    ids, p_s, delta_p = topk_support(p, k)
    return p_s, q[ids], float(delta_p)


@settings(max_examples=300, deadline=None)
@given(pq_pairs())
def test_residual_is_a_distribution(pq: tuple[np.ndarray, np.ndarray]) -> None:
    r = residual(*pq)
    assert np.all(r >= 0) and r.sum() == pytest.approx(1.0, abs=1e-9)


@settings(max_examples=300, deadline=None)
@given(st.floats(0.0, 1.0), st.floats(1e-30, 1.0), st.floats(0.0, 1.0, exclude_max=True))
def test_acceptance_is_a_probability_and_matches_the_test(p_x: float, q_x: float, u: float) -> None:
    a = acceptance_probability(p_x, q_x)
    assert 0.0 <= a <= 1.0
    # accept iff u < a, up to the rounding of the division we deliberately avoid
    if abs(u - a) > 1e-12:
        assert accept_token(p_x, q_x, u) == (u < a)
