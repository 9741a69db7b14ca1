"""The measured pause: exact hand cases for the rates, the exploring and the fading."""

from __future__ import annotations

import math

import pytest

from edge_gateway.mode_rates import ModeRates, batch_bucket


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
