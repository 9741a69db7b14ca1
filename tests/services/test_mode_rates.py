"""The measured pause: exact hand cases for the rates, the exploring and the fading."""

from __future__ import annotations

import math

import pytest

from edge_gateway.mode_rates import BlockTimes, ModeRates, batch_bucket


def test_batch_sizes_share_a_bucket_per_power_of_two_above_four() -> None:
    assert [batch_bucket(b) for b in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17)] == [
        1, 1, 2, 3, 4, 8, 8, 16, 16, 32,
    ]  # fmt: skip


def test_the_model_decides_until_a_mode_is_measured() -> None:
    rates = ModeRates(half_life_tokens=math.inf, min_tokens=16)
    assert rates.speculates(1, model_says=True)
    assert not rates.speculates(1, model_says=False)
    rates.observe(1, speculating=True, n_tokens=15, seconds=1.0)
    assert not rates.speculates(1, model_says=False)  # 15 < 16: neither is measured
    assert rates.speculates(2, model_says=True)  # another batch size: its own rates


def test_each_mode_is_explored_to_twice_the_minimum_then_the_faster_wins() -> None:
    rates = ModeRates(half_life_tokens=math.inf, min_tokens=16)
    for _ in range(8):  # 32 tokens at 40 tokens/s
        assert rates.speculates(1, model_says=True)
        rates.observe(1, speculating=True, n_tokens=4, seconds=0.1)
    # speculating is measured; decoding is explored (whatever the model says) ...
    assert not rates.speculates(1, model_says=True)
    for _ in range(31):  # 100 tokens/s
        rates.observe(1, speculating=False, n_tokens=1, seconds=0.01)
    # ... past the minimum, and on to twice it
    assert not rates.speculates(1, model_says=True)
    rates.observe(1, speculating=False, n_tokens=1, seconds=0.01)
    assert not rates.speculates(1, model_says=True)  # 100 > 40: decoding wins
    rates.observe(1, speculating=True, n_tokens=100, seconds=0.5)  # now 132 / 1.3 = 101.5
    assert rates.speculates(1, model_says=False)


def test_the_mode_not_in_use_fades_and_is_tried_again() -> None:
    """Half-life 64 tokens: decoding's 32 tokens fall under 16 after 64 more tokens of
    speculating, so it is explored until it has 32 again, then loses again."""
    rates = ModeRates(half_life_tokens=64, min_tokens=16)
    rates.observe(4, speculating=False, n_tokens=32, seconds=0.32)
    rates.observe(4, speculating=True, n_tokens=32, seconds=0.16)
    decoding = 32 * 0.5 ** (32 / 64)  # 22.6: still measured, and slower
    assert rates.speculates(4, model_says=False)
    rates.observe(4, speculating=True, n_tokens=31, seconds=0.155)
    assert decoding * 0.5 ** (31 / 64) > 16
    assert rates.speculates(4, model_says=False)
    rates.observe(4, speculating=True, n_tokens=2, seconds=0.01)
    assert decoding * 0.5 ** (33 / 64) < 16
    assert not rates.speculates(4, model_says=True)
    explored = 0
    while not rates.speculates(4, model_says=False):
        rates.observe(4, speculating=False, n_tokens=1, seconds=0.01)
        explored += 1
    assert explored == 22  # from 15.8 back to 32: each token adds 1 and fades it by 2^(-1/64)


def test_the_rate_is_tokens_over_seconds_weighted_by_tokens() -> None:
    """Speculating: 10 tokens in 0.2 s and 30 in 0.2 s are 40 / 0.4 = 100 tokens/s, not the
    mean of 50 and 150; decoding at 99 tokens/s loses to it, at 101 wins."""
    for decoding_per_s, speculates in ((99.0, True), (101.0, False)):
        rates = ModeRates(half_life_tokens=math.inf, min_tokens=16)
        rates.observe(2, speculating=True, n_tokens=10, seconds=0.2)
        rates.observe(2, speculating=True, n_tokens=30, seconds=0.2)
        rates.observe(2, speculating=False, n_tokens=40, seconds=40 / decoding_per_s)
        assert rates.speculates(2, model_says=not speculates) is speculates


@pytest.mark.parametrize("n_tokens, seconds", [(0, 1.0), (4, -0.1)])
def test_nothing_or_a_clock_step_backwards_is_not_observed(n_tokens: int, seconds: float) -> None:
    rates = ModeRates(half_life_tokens=math.inf, min_tokens=1)
    rates.observe(1, speculating=False, n_tokens=n_tokens, seconds=seconds)
    assert rates.speculates(1, model_says=True)


def test_a_mode_has_a_rate_once_explored() -> None:
    rates = ModeRates(half_life_tokens=math.inf, min_tokens=16)
    assert rates.rate(1, speculating=False) is None
    rates.observe(1, speculating=False, n_tokens=20, seconds=0.2)
    assert rates.rate(1, speculating=False) is None  # under twice the minimum: exploring
    rates.observe(1, speculating=False, n_tokens=12, seconds=0.12)
    assert rates.rate(1, speculating=False) == pytest.approx(100.0)
    assert rates.rate(1, speculating=True) is None
    assert rates.rate(8, speculating=False) is None  # another bucket


# ---------------------------------------------------------------- block times


def test_block_times_are_a_line_in_the_rows_once_enough_varied_blocks_came() -> None:
    """Blocks of 3 and 11 rows at 20 ms + 2 ms a row: the line through them, exactly."""
    times = BlockTimes(half_life_blocks=math.inf)
    for i in range(7):
        rows = 3 if i % 2 else 11
        times.observe(1, rows, 0.020 + 0.002 * rows)
    assert times.seconds(1, 5) is None  # 7 blocks: not enough
    times.observe(1, 3, 0.026)
    assert times.seconds(1, 5) == pytest.approx(0.030)
    assert times.seconds(1, 33) == pytest.approx(0.086)
    assert times.seconds(2, 5) is None  # another bucket
    assert times.seconds(3, 5) is None


def test_block_times_need_varied_rows() -> None:
    """Eight blocks of one size say nothing of what a row costs."""
    times = BlockTimes(half_life_blocks=math.inf)
    for _ in range(8):
        times.observe(1, 9, 0.030)
    assert times.seconds(1, 9) is None
    times.observe(1, 17, 0.040)
    assert times.seconds(1, 9) is not None  # 9 blocks, rows variance 7.1


def test_block_times_never_go_below_zero() -> None:
    """Longer blocks measured faster (noise): the slope is 0 and the line their mean; a
    line crossing below zero at no rows goes through the origin instead."""
    times = BlockTimes(half_life_blocks=math.inf)
    for rows, seconds in [(3, 0.040), (11, 0.030)] * 4:
        times.observe(1, rows, seconds)
    assert times.seconds(1, 3) == pytest.approx(0.035)
    assert times.seconds(1, 30) == pytest.approx(0.035)
    steep = BlockTimes(half_life_blocks=math.inf)
    for rows, seconds in [(3, 0.001), (11, 0.030)] * 4:
        steep.observe(1, rows, seconds)
    slope = (3 * 0.001 + 11 * 0.030) / (3 * 3 + 11 * 11)  # least squares through the origin
    assert steep.seconds(1, 10) == pytest.approx(10 * slope)


def test_old_blocks_fade() -> None:
    """Half-life 8 blocks: after 64 blocks at the new cost the old ones keep 2^-8 of their
    weight, and the line is the new one within 1 %."""
    times = BlockTimes(half_life_blocks=8)
    for i in range(32):
        times.observe(1, 3 + 8 * (i % 2), 0.050)
    for i in range(64):
        rows = 3 + 8 * (i % 2)
        times.observe(1, rows, 0.010 + 0.001 * rows)
    assert times.seconds(1, 7) == pytest.approx(0.017, rel=0.01)


def test_suffix_blocks_pay_as_measured_once_both_rates_are() -> None:
    """Suffix blocks at 16.7 tokens/s against decoding at 18.2: they do not pay; their
    tokens fade only their own rate, and either mode's tokens fade it too."""
    rates = ModeRates(half_life_tokens=64, min_tokens=16)
    assert rates.suffix_pays(8, speculating=False) is None
    rates.observe(8, speculating=False, n_tokens=32, seconds=32 / 18.2)
    assert rates.suffix_pays(8, speculating=False) is None  # suffix blocks not measured
    rates.observe_suffix(8, n_tokens=32, seconds=32 / 16.7)
    assert rates.rate(8, speculating=False) == pytest.approx(18.2)  # untouched by them
    assert rates.suffix_pays(8, speculating=False) is False
    assert rates.suffix_pays(8, speculating=True) is None  # the draft model's: unmeasured
    assert rates.suffix_pays(4, speculating=False) is None  # another bucket
    rates.observe(8, speculating=False, n_tokens=32, seconds=32 / 18.2)
    assert rates.suffix_pays(8, speculating=False) is False  # 32 · 2^-0.5 = 22.6: measured
    rates.observe(8, speculating=False, n_tokens=40, seconds=40 / 18.2)
    assert rates.suffix_pays(8, speculating=False) is None  # 22.6 · 2^(-40/64) = 14.7: explored
    rates.observe_suffix(8, n_tokens=4, seconds=4 / 30.0)
    assert rates.suffix_pays(8, speculating=False) is None  # 18.7: until it has 32 again
    rates.observe_suffix(8, n_tokens=18, seconds=18 / 30.0)
    assert rates.suffix_pays(8, speculating=False) is True  # 32.9 tokens at 23.4/s
