"""The edge's goodput γ: exact hand cases for the estimates and the choice."""

from __future__ import annotations

import math

import pytest

from asymspec.wire import TargetCost
from edge_gateway.draft_length import GoodputDraftLength
from edge_gateway.settings import DraftLength, EdgeSettings

# Measured on the AVX512-BF16 EPYC (loadtest/results/engine-avx512bf16/ in git history):
# ~15 ms a forward plus ~1.9 ms a row; on an AMX Xeon rows ride nearly free (35 ms + 0.3 ms a row).
COMPUTE_BOUND = TargetCost(base_s=0.015, row_s=0.0019)
ROWS_NEARLY_FREE = TargetCost(base_s=0.035, row_s=0.0003)


def seen(*blocks: tuple[int, int], draft_s_per_token: float = 0.004) -> GoodputDraftLength:
    policy = GoodputDraftLength(max_gamma=8, half_life_blocks=math.inf)  # no decay: exact sums
    for gamma, n_accepted in blocks:
        policy.observe_block(gamma, n_accepted, draft_s_per_token * gamma)
    return policy


def test_the_configured_gamma_stands_until_everything_is_known() -> None:
    policy = seen(*[(4, 2)] * 7)
    policy.target_cost = COMPUTE_BOUND
    assert policy.acceptance is None  # 7 blocks: too few
    assert policy.choose(open_requests=1, fallback=4) == 4
    policy.observe_block(4, 2, 0.016)
    assert policy.acceptance == pytest.approx(16 / (16 + 8))
    assert policy.choose(open_requests=1, fallback=4) != 4
    policy.target_cost = None  # no verifier has sent a fit yet
    assert policy.choose(open_requests=1, fallback=4) == 4
    runahead_only = GoodputDraftLength(max_gamma=8)
    for _ in range(10):
        runahead_only.observe_block(4, 4, None)
    runahead_only.target_cost = COMPUTE_BOUND
    assert runahead_only.draft_s_per_token is None
    assert runahead_only.choose(open_requests=1, fallback=3) == 3


def test_acceptance_counts_the_drafts_tested() -> None:
    """A block stops at its first rejection: 4 of 4 tests 4 drafts, 1 of 4 tests 2."""
    policy = seen(*[(4, 4)] * 4, *[(4, 1)] * 4)
    assert policy.acceptance == pytest.approx(20 / (20 + 4))
    assert policy.draft_s_per_token == pytest.approx(0.004)


def test_expensive_rows_want_short_blocks_and_free_rows_long_ones() -> None:
    policy = seen(*[(4, 1)] * 4, *[(4, 2)] * 4, *[(4, 0)] * 2)  # α = 12 / 22, about 0.55
    policy.target_cost = COMPUTE_BOUND
    # One chat: E(γ) / (0.015 + 0.0019 (γ + 1) + 0.004 γ): γ = 1 gives 1.545 / 0.0228 = 67.8
    # tokens/s, γ = 2 1.843 / 0.0327 = 56.4.
    assert policy.choose(open_requests=1, fallback=4) == 1
    assert policy.choose(open_requests=16, fallback=4) == 1
    policy.target_cost = ROWS_NEARLY_FREE
    # 0.035 + 0.0003 (γ + 1) + 0.004 γ: γ = 2 gives 1.843 / 0.0439 = 42.0, γ = 3 2.006 /
    # 0.0482 = 41.6, γ = 1 1.545 / 0.0396 = 39.0.
    assert policy.choose(open_requests=1, fallback=4) == 2
    # Sixteen chats overlap drafting with verifying, max(0.035 + 0.0048 (γ + 1), 0.004 γ):
    # γ = 2 gives 1.843 / 0.0494 = 37.3, γ = 3 2.006 / 0.0542 = 37.0, γ = 1 34.6.
    assert policy.choose(open_requests=16, fallback=4) == 2


def test_high_acceptance_drafts_up_to_the_bound() -> None:
    policy = seen(*[(4, 4)] * 20, draft_s_per_token=0.0005)
    policy.observe_block(4, 3, 0.002)
    policy.target_cost = ROWS_NEARLY_FREE
    assert policy.choose(open_requests=1, fallback=4) == 8


def test_old_blocks_fade_with_the_half_life() -> None:
    policy = GoodputDraftLength(max_gamma=8, half_life_blocks=8.0)
    for _ in range(40):
        policy.observe_block(4, 4, 0.01)
    for _ in range(200):  # 25 half-lives
        policy.observe_block(4, 0, 0.01)
    acceptance = policy.acceptance
    assert acceptance is not None and acceptance < 1e-4


def test_goodput_is_the_default_and_the_setting_reads_its_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ASYMSPEC_EDGE_SHARED_SECRET", "a long enough secret")
    assert EdgeSettings().draft_length is DraftLength.GOODPUT
    monkeypatch.setenv("ASYMSPEC_EDGE_DRAFT_LENGTH", "adaptive")
    assert EdgeSettings().draft_length.adapts_per_request
    assert not EdgeSettings().draft_length.maximises_goodput


def test_speculation_pauses_above_the_batch_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Apart, the edge always speculates unless told a limit; colocated (one host's cores
    for both models), it speculates only for a request alone, as measured there."""
    monkeypatch.delenv("ASYMSPEC_COLOCATED", raising=False)
    apart = EdgeSettings(shared_secret="s" * 16)
    assert all(apart.speculates_at(batch) for batch in (0, 1, 16, 256))
    monkeypatch.setenv("ASYMSPEC_EDGE_SPECULATIVE_DISABLE_BY_BATCH_SIZE", "8")
    limited = EdgeSettings(shared_secret="s" * 16)
    assert [limited.speculates_at(b) for b in (1, 8, 9)] == [True, True, False]
    monkeypatch.setenv("ASYMSPEC_COLOCATED", "true")  # an explicit limit wins
    assert EdgeSettings(shared_secret="s" * 16).speculates_at(8)
    monkeypatch.delenv("ASYMSPEC_EDGE_SPECULATIVE_DISABLE_BY_BATCH_SIZE")
    colocated = EdgeSettings(shared_secret="s" * 16)
    assert [colocated.speculates_at(b) for b in (1, 2, 16)] == [True, False, False]


def test_the_pipeline_verifies_a_batch_in_two_groups() -> None:
    """Pipelined, 16 chats take turns at the verifier in two groups of 8, so each request
    waits for two rounds: 2 (0.035 + 0.0003 × 8 (γ + 1)) while that beats drafting."""
    policy = seen(*[(4, 1)] * 4, *[(4, 2)] * 4, *[(4, 0)] * 2)  # α = 12 / 22
    policy.pipelined = True
    policy.target_cost = ROWS_NEARLY_FREE
    # γ = 3: 2.0053 / (2 × 0.0446) = 22.48 tokens/s; γ = 4 2.0938 / 0.094 = 22.27; γ = 2
    # 1.843 / 0.0844 = 21.84. (In one round of all 16, γ = 2 won: see above.)
    assert policy.choose(open_requests=16, fallback=4) == 3
    # Alone, nothing to take turns with: the same as unpipelined.
    assert policy.choose(open_requests=1, fallback=4) == 2


def test_drafting_longer_than_a_groups_round_sets_the_pipelines_cycle() -> None:
    """A slow draft (40 ms a token) outlasts the other group's round: the cycle is one
    group's round plus the drafting, 0.0362 + 0.04 at γ = 1 (1.5455 / 0.0762 = 20.3
    tokens/s), where γ = 2 gives 1.843 / (0.0365 + 0.08) = 15.8."""
    policy = seen(*[(4, 1)] * 4, *[(4, 2)] * 4, *[(4, 0)] * 2, draft_s_per_token=0.04)
    policy.pipelined = True
    policy.target_cost = ROWS_NEARLY_FREE
    assert policy.choose(open_requests=2, fallback=4) == 1


def test_speculation_pays_alone_and_not_in_a_pipelined_crowd() -> None:
    """α = 12 / 22 with rows nearly free. Alone the best block gives 42.0 tokens/s against
    1 / 0.0353 = 28.3 decoding; two chats in the pipeline 2.1684 / 0.0742 = 29.2 (γ = 6)
    against 1 / 0.0356 = 28.1; sixteen 22.5 against 1 / 0.0398 = 25.1: the cloud decoding
    alone gives more, so speculation pauses there."""
    policy = seen(*[(4, 1)] * 4, *[(4, 2)] * 4, *[(4, 0)] * 2)
    policy.pipelined = True
    assert policy.speculation_pays(16)  # no cost from a verifier yet
    policy.target_cost = ROWS_NEARLY_FREE
    assert [policy.speculation_pays(b) for b in (1, 2, 16)] == [True, True, False]
    # Synchronous rounds (not pipelined) verify all 16 at once: E(γ) / (0.035 + 0.0048 (γ
    # + 1)) = 37.3 at γ = 2 against 25.1.
    policy.pipelined = False
    assert policy.speculation_pays(16)
    # A draft that agrees 20 times in 21 pays in the pipelined crowd too.
    good = seen(*[(4, 4)] * 20, (4, 3))
    good.pipelined = True
    good.target_cost = ROWS_NEARLY_FREE
    assert good.speculation_pays(16)


def test_rows_at_full_price_never_pay_for_a_crowd() -> None:
    """Where the fit says a forward costs its rows alone, a block of γ + 1 rows costs γ + 1
    decode steps for fewer than γ + 1 expected tokens (pipelined)."""
    policy = seen(*[(4, 4)] * 20, (4, 3))
    policy.pipelined = True
    policy.target_cost = TargetCost(base_s=0.0, row_s=0.002)
    assert not policy.speculation_pays(16)


def test_measured_rates_overrule_the_model_once_both_modes_are_measured() -> None:
    """The model says rows at full price never pay for a crowd; measured at sixteen,
    speculating gave 160 tokens/s and decoding 80, so speculation goes on there (and the
    model still decides at eight, unmeasured)."""
    policy = seen(*[(4, 4)] * 20, (4, 3))
    policy.pipelined = True
    policy.target_cost = TargetCost(base_s=0.0, row_s=0.002)
    policy.measured.observe(16, speculating=True, n_tokens=32, seconds=0.2)
    assert not policy.speculation_pays(16)  # decoding is explored first
    policy.measured.observe(16, speculating=False, n_tokens=32, seconds=0.4)
    assert policy.speculation_pays(16)
    assert not policy.speculation_pays(8)


def test_the_goodput_pause_is_on_by_default_and_can_be_turned_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ASYMSPEC_EDGE_GOODPUT_PAUSE", raising=False)
    assert EdgeSettings(shared_secret="s" * 16).goodput_pause
    monkeypatch.setenv("ASYMSPEC_EDGE_GOODPUT_PAUSE", "false")
    assert not EdgeSettings(shared_secret="s" * 16).goodput_pause


# ---------------------------------------------------------------- suffix blocks


def test_a_suffix_block_needs_the_bar_until_it_can_be_priced() -> None:
    policy = GoodputDraftLength(max_gamma=8, min_suffix_expected=2.0)
    assert policy.suffix_tokens([], open_requests=1, speculating=True) == 0
    assert policy.suffix_tokens([0.9, 0.8, 0.5], 1, True) == 3  # 2.2 expected: over the bar
    assert policy.suffix_tokens([0.9, 0.6], 1, True) == 0  # 1.5: under it
    policy.target_cost = COMPUTE_BOUND  # priced now, but the draft's α is still unknown
    assert policy.suffix_tokens([0.9, 0.6], 1, True) == 0
    # k = 2 of [1.0, 1.0, 0.05]: 3 / (0.015 + 0.0019 × 3) = 144.9 tokens/s beats k = 3's
    # 3.05 / 0.0226 = 135.0: the bar passes, and the rule cuts the doubtful third token
    assert policy.suffix_tokens([1.0, 1.0, 0.05], 1, True) == 2


def test_a_suffix_block_is_priced_against_the_draft_model_and_the_cloud() -> None:
    policy = seen(*[(4, 1)] * 4, *[(4, 2)] * 4, *[(4, 0)] * 2)  # α ≈ 0.55, best γ = 1
    policy.target_cost = COMPUTE_BOUND
    # The draft model's best: γ = 1, 1.545 / 0.0228 = 67.8 tokens/s. A sure 16-token copy:
    # 17 / (0.015 + 0.0019 × 17) = 360 tokens/s; a coin flip on one token: 1.5 / 0.0188 = 79.8.
    assert policy.suffix_tokens([1.0] * 16, 1, speculating=True) == 16
    assert policy.suffix_tokens([0.5], 1, speculating=True) == 1
    assert policy.suffix_tokens([0.2], 1, speculating=True) == 0  # 1.2 / 0.0188 = 63.8
    # Paused, the cloud alone makes 1 / (0.015 + 0.0019) = 59.2 tokens/s: 0.2 then pays.
    assert policy.suffix_tokens([0.2], 1, speculating=False) == 1
    assert policy.suffix_tokens([0.1], 1, speculating=False) == 0  # 1.1 / 0.0188 = 58.5


def test_a_lone_requests_suffix_block_is_priced_as_measured_once_it_is() -> None:
    """α_s = 7/8. By the verifier's line (15 ms + 1.9 ms a row) a sure 32-token copy is
    best cut to 8 tokens, and the cloud alone makes 59 tokens/s. Once both are measured for
    a request alone, the blocks' wall-clock line (20 ms + 0.5 ms a row, a round trip in the
    base) makes 15 the best, and the cloud alone measured at 100 tokens/s beats a single
    0.4 token. Beside other requests the model still prices both."""
    policy = GoodputDraftLength(max_gamma=8, half_life_blocks=math.inf)
    for _ in range(8):
        policy.observe_suffix_block(8, 7)  # 56 accepted, 8 rejections: α_s = 0.875
    policy.target_cost = COMPUTE_BOUND
    assert policy.suffix_tokens([1.0] * 32, 1, speculating=False) == 8
    assert policy.suffix_tokens([0.4], 1, speculating=False) == 1  # 1.35 / 0.0188 = 71.8
    for i in range(8):
        rows = 5 if i % 2 else 17
        for batch in (1, 4):
            policy.block_times.observe(batch, rows, 0.020 + 0.0005 * rows)
    assert policy.suffix_tokens([1.0] * 32, 1, speculating=False) == 8  # one side measured
    for batch in (1, 4):
        policy.measured.observe(batch, speculating=False, n_tokens=32, seconds=0.32)
    assert policy.suffix_tokens([1.0] * 32, 1, speculating=False) == 15  # 252 tokens/s
    assert policy.suffix_tokens([0.4], 1, speculating=False) == 0  # 1.35 / 0.021 = 64.3
    # beside three others the model prices it for the batch (``_paused_suffix_tokens``)
    assert policy.suffix_tokens([1.0] * 32, 4, speculating=False) == 7


def test_what_suffix_blocks_gave_requests_overrules_the_models_price() -> None:
    """Beside other requests the model prices a block; where suffix blocks have measurably
    given requests there less than the cloud decoding alone, none is taken."""
    policy = GoodputDraftLength(max_gamma=8, half_life_blocks=math.inf)
    policy.target_cost = COMPUTE_BOUND
    assert policy.suffix_tokens([1.0] * 8, 4, speculating=False) == 8  # the model takes it
    policy.measured.observe(4, speculating=False, n_tokens=32, seconds=32 / 40.0)
    policy.measured.observe_suffix(4, n_tokens=32, seconds=32 / 30.0)
    assert policy.suffix_tokens([1.0] * 8, 4, speculating=False) == 0
    assert policy.suffix_tokens([1.0] * 8, 2, speculating=False) > 0  # not measured there


def test_suffix_acceptance_discounts_the_frequency_estimates() -> None:
    policy = GoodputDraftLength(max_gamma=8, half_life_blocks=math.inf)
    for _ in range(8):
        policy.observe_suffix_block(8, 2)  # 2 of 8 each time: α_s = 16 / (16 + 8)
    assert policy.suffix_acceptance == pytest.approx(2 / 3)
    assert policy.acceptance is None  # the draft model's α is apart
    # [1, 1]: discounted to [2/3, 4/9], 1.11 expected, under the bar of 2
    assert policy.suffix_tokens([1.0, 1.0], 1, speculating=True) == 0
    assert policy.suffix_tokens([1.0] * 8, 1, speculating=True) == 0  # Σ (2/3)^i = 1.92
    policy.min_suffix_expected = 1.5
    assert policy.suffix_tokens([1.0] * 8, 1, speculating=True) == 8


def test_a_paused_requests_suffix_block_beside_others_is_priced_for_the_batch() -> None:
    """Eight requests the cloud decodes at 0.015 + 0.0019 × 8 s a round: 265 tokens/s.
    A doubtful two-token block would give its own request 2.4 tokens in a round of 0.0357 s
    beside the others' steps (more than its 33 tokens/s alone), but its rows lengthen the
    round all eight wait for, and its generation's stop and restart leave it out of two
    rounds: the batch gets 23.4 tokens in 0.0906 s, 258 tokens/s, so it is not taken. A
    sure sixteen-token copy gives the batch 38 tokens in 0.1172 s, 324 tokens/s."""
    policy = GoodputDraftLength(max_gamma=8, half_life_blocks=math.inf)
    policy.target_cost = COMPUTE_BOUND
    assert policy.suffix_tokens([0.9, 0.5], 8, speculating=False) == 0
    assert policy.suffix_tokens([1.0] * 16, 8, speculating=False) == 16
    assert policy.suffix_tokens([0.9, 0.5], 1, speculating=False) == 2  # alone it pays
