"""The cloud's measured forward cost and the prefill budget sized by it: exact hand cases."""

from __future__ import annotations

import math

import pytest

from cloud_verifier.forward_cost import ForwardCost, PrefillBudget


def cost_of(*points: tuple[int, float], half_life: float = 64.0) -> ForwardCost:
    cost = ForwardCost(half_life_forwards=half_life)
    for rows, seconds in points:
        cost.observe(rows, seconds)
    return cost


def test_nothing_measured_has_no_fit() -> None:
    assert ForwardCost().fit() is None
    assert cost_of((0, 0.01)).fit() is None  # a forward without rows says nothing per row


def test_two_row_counts_give_the_line_through_them() -> None:
    fitted = cost_of((10, 0.030), (20, 0.050), (10, 0.030), (20, 0.050)).fit()
    assert fitted is not None
    assert fitted == pytest.approx((0.010, 0.002))


def test_equal_row_counts_give_the_line_through_the_origin() -> None:
    """Base and slope cannot be told apart: the slope is overstated, never understated."""
    fitted = cost_of((64, 0.128), (64, 0.128)).fit()
    assert fitted == pytest.approx((0.0, 0.002))


def test_the_identified_fit_needs_varied_rows() -> None:
    """What the edge chooses γ by: never the origin line, which makes every row look dear."""
    assert ForwardCost().identified_fit() is None
    assert cost_of((64, 0.128), (64, 0.128)).identified_fit() is None
    varied = cost_of((10, 0.030), (20, 0.050), (10, 0.030), (20, 0.050))
    assert varied.identified_fit() == pytest.approx((0.010, 0.002))
    noise = cost_of((10, 0.050), (20, 0.030))  # more rows, less time: no cost per row to send
    assert noise.fit() is not None and noise.identified_fit() is None


def test_a_negative_intercept_is_clipped_to_zero() -> None:
    fitted = cost_of((10, 0.005), (20, 0.030)).fit()
    assert fitted is not None
    assert fitted[0] == 0.0 and fitted[1] == pytest.approx(0.0025)


def test_the_fit_follows_the_machine_within_a_few_half_lives() -> None:
    """Old forwards fade: after a change of thread count the new costs take over."""
    cost = cost_of(*[(10, 0.030), (20, 0.050)] * 50, half_life=4.0)
    for _ in range(40):
        cost.observe(10, 0.015)
        cost.observe(20, 0.025)
    fitted = cost.fit()
    assert fitted is not None
    assert fitted == pytest.approx((0.005, 0.001), rel=0.01)


def test_budget_alone_is_what_fits_in_the_round() -> None:
    budget = PrefillBudget(chunk_tokens=256, round_s=0.100, share=0.5)
    cost = cost_of((10, 0.030), (20, 0.050))  # base 10 ms, 2 ms a row
    assert budget.rows(cost, work_rows=0) == 45  # (100 - 10) / 2


def test_budget_beside_work_slows_it_by_the_share() -> None:
    budget = PrefillBudget(chunk_tokens=256, chunk_tokens_shared=32, round_s=0.1, share=0.5)
    cost = cost_of((10, 0.030), (20, 0.050))
    assert budget.rows(cost, work_rows=5) == 5  # half of 10 + 5 x 2 ms, at 2 ms a row
    assert budget.rows(cost, work_rows=80) == 32  # 85 would fit: the cap binds


def test_budget_always_moves_a_prompt() -> None:
    budget = PrefillBudget(round_s=0.001, share=0.01)
    cost = cost_of((10, 0.030), (20, 0.050))
    assert budget.rows(cost, work_rows=0) == 1  # the base alone is over the round's time
    assert budget.rows(cost, work_rows=1) == 1


def test_caps_alone_while_the_cost_is_unknown_or_rows_are_free() -> None:
    budget = PrefillBudget(chunk_tokens=64, chunk_tokens_shared=8, round_s=0.01, share=0.1)
    assert budget.rows(ForwardCost(), work_rows=0) == 64
    assert budget.rows(ForwardCost(), work_rows=3) == 8
    free = cost_of((10, 0.050), (20, 0.040))  # more rows took less time: noise, rows free
    assert budget.rows(free, work_rows=0) == 64
    assert budget.rows(free, work_rows=3) == 8


def test_without_time_limits_only_the_caps_apply() -> None:
    budget = PrefillBudget(chunk_tokens=64, chunk_tokens_shared=8)
    assert budget.round_s == budget.share == math.inf
    cost = cost_of((10, 0.030), (20, 0.050))
    assert budget.rows(cost, work_rows=0) == 64
    assert budget.rows(cost, work_rows=3) == 8


def test_the_shared_cap_never_exceeds_a_round_alone() -> None:
    assert PrefillBudget(chunk_tokens=16, chunk_tokens_shared=32).rows(ForwardCost(), 4) == 16


def tiles_of_16(rows: int) -> int:
    """An AMX engine's padding: every forward computes whole 16-row tiles."""
    return -(-rows // 16) * 16


def test_budget_beside_work_counts_the_rows_the_engine_pads_to() -> None:
    """A 1-row decode step computes 16 rows: 15 prompt rows ride in its padding (each at
    the slope), the 16th pads the round to 32, and those 16 more rows count at the slope
    too."""
    cost = cost_of((10, 0.040), (20, 0.050))  # base 30 ms, 1 ms a row
    budget = PrefillBudget(chunk_tokens=256, chunk_tokens_shared=64, share=1.0)
    assert budget.rows(cost, work_rows=1) == 31  # 31 ms beside a 31 ms step, unpadded
    assert budget.rows(cost, work_rows=1, padded_rows=tiles_of_16) == 15  # 16 + 16: 32 ms
    wider = PrefillBudget(chunk_tokens=256, chunk_tokens_shared=64, share=2.0)  # 62 ms
    assert wider.rows(cost, work_rows=1, padded_rows=tiles_of_16) == 31  # 31 + 16 padding
    # beside 16 rows (46 ms): 16 rows and 16 more in the frame; the 17th pads it to 48
    assert budget.rows(cost, work_rows=16, padded_rows=tiles_of_16) == 16
    tight = PrefillBudget(share=0.01)
    assert tight.rows(cost, work_rows=1, padded_rows=tiles_of_16) == 1  # a prompt moves


def test_short_prompts_alone_hold_the_long_chunk_beside_them_to_the_share() -> None:
    """No work but a short prompt prefilled whole: its user waits for this round, so the
    long prompt's chunk beside it adds at most the share of its rows, as beside work (and
    the round stays within what fits alone)."""
    cost = cost_of((10, 0.030), (20, 0.050))  # base 10 ms, 2 ms a row
    roomy = PrefillBudget(chunk_tokens=256, round_s=1.0, share=0.5, whole_tokens=100)
    assert roomy.plan([40, 1500], cost, work_rows=0) == [40, 22]  # half of 10 + 40 x 2 ms
    assert roomy.plan([1500], cost, work_rows=0) == [256]  # alone: the cap
    tight = PrefillBudget(chunk_tokens=256, round_s=0.1, share=0.5, whole_tokens=100)
    assert tight.plan([40, 1500], cost, work_rows=0) == [40, 5]  # 45 rows fit in 100 ms
    assert roomy.plan([40, 1500], cost, work_rows=5) == [40, 0]  # beside work, as before


def test_plan_takes_short_prompts_whole_and_chunks_the_long_one() -> None:
    """Beside 5 rows of work the time share allows 5 rows (base 10 ms, 2 ms a row, share
    0.5): the two short prompts go whole anyway, the long one waits for a round they leave
    room in."""
    budget = PrefillBudget(chunk_tokens=256, round_s=0.1, share=0.5, whole_tokens=100)
    cost = cost_of((10, 0.030), (20, 0.050))
    assert budget.plan([40, 90, 1500], cost, work_rows=5) == [40, 90, 0]
    assert budget.plan([3, 1500], cost, work_rows=5) == [3, 2]  # 5 rows in all
    assert budget.plan([1500], cost, work_rows=5) == [5]
    assert budget.plan([1500], cost, work_rows=0) == [45]  # alone: what fits in 100 ms


def test_plan_keeps_whole_prompts_within_a_round_alone() -> None:
    """More short prompts than a round holds: those that fit go whole, the next is chunked
    by the time share, the rest wait."""
    budget = PrefillBudget(chunk_tokens=256, round_s=0.1, share=0.5, whole_tokens=100)
    cost = cost_of((10, 0.030), (20, 0.050))
    assert budget.plan([100, 100, 100, 100], cost, work_rows=5) == [100, 100, 0, 0]
    assert budget.plan([100, 100], cost, work_rows=0) == [100, 100]


def test_plan_without_whole_prompts_shares_the_chunk() -> None:
    budget = PrefillBudget(chunk_tokens=64, chunk_tokens_shared=8)
    assert budget.plan([20, 300], ForwardCost(), work_rows=0) == [20, 44]
    assert budget.plan([20, 300], ForwardCost(), work_rows=2) == [8, 0]
    assert budget.plan([0, 300], ForwardCost(), work_rows=2) == [0, 8]


def keyed_cost(base: float, row_s: float, key_s: float) -> ForwardCost:
    """Forwards whose rows and attended keys vary apart (decode steps at short and long
    prefixes, prompt chunks), timed exactly by base + row_s rows + key_s keys."""
    cost = ForwardCost()
    for rows, keys in ((1, 100), (16, 2_000), (1, 1_500), (32, 40_000), (8, 800), (64, 3_000)):
        cost.observe(rows, base + row_s * rows + key_s * keys, keys)
    return cost


def test_rows_and_keys_that_vary_apart_give_both_costs() -> None:
    fitted = keyed_cost(0.010, 0.0005, 2e-7).fit_with_keys()
    assert fitted == pytest.approx((0.010, 0.0005, 2e-7), rel=1e-6)


def test_keys_are_not_told_apart_from_rows_that_move_with_them() -> None:
    """A steady batch whose rows each attend ~500 keys: keys are rows times 500, so the
    split between them is arbitrary; no keyed fit (and none without keys measured)."""
    cost = ForwardCost()
    for rows in (1, 16, 4, 32) * 3:
        cost.observe(rows, 0.01 + 0.001 * rows, 500 * rows)
    assert cost.fit() is not None and cost.fit_with_keys() is None
    assert cost_of((10, 0.040), (20, 0.050)).fit_with_keys() is None


def test_a_keyed_fit_with_a_negative_cost_is_noise() -> None:
    assert keyed_cost(0.010, 0.0005, -2e-7).fit_with_keys() is None
    assert keyed_cost(0.010, -0.0005, 2e-7).fit_with_keys() is None


def test_budget_beside_work_counts_the_keys_a_chunk_attends() -> None:
    """Beside a decode step a prompt's rows cost their attention over what is cached
    before them: deep into a long prompt fewer rows fit the share than at its start, and
    with no prefix given (or no keyed fit) the rows alone count, as before."""
    cost = keyed_cost(0.010, 0.0005, 2e-7)
    base_s, row_s = cost.fit() or (0.0, 0.0)
    budget = PrefillBudget(chunk_tokens=256, chunk_tokens_shared=64, share=0.3)
    budget_s = 0.3 * (base_s + row_s * 1)
    rows_only = budget.rows(cost, work_rows=1)
    assert rows_only == budget.rows(cost, work_rows=1, prefix=None)
    at_start = budget.rows(cost, work_rows=1, prefix=0)
    deep = budget.rows(cost, work_rows=1, prefix=2_000)
    assert 1 <= deep < at_start

    def added_s(rows: int, prefix: int) -> float:
        return 0.0005 * rows + 2e-7 * (rows * prefix + rows * (rows + 1) // 2)

    for take, prefix in ((deep, 2_000), (at_start, 0)):  # the most that fit the share
        assert added_s(take, prefix) <= budget_s + 1e-12
        assert take == 64 or added_s(take + 1, prefix) > budget_s
    plan = budget.plan([5_000], cost, work_rows=1, dones=[2_000])
    assert plan == [deep]
