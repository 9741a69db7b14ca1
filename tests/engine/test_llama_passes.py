"""How llama.cpp splits a batch over KV streams, and the padding that makes it fewer passes:
exact hand cases of its ``split_equal(sequential=true)`` and of the plan."""

from __future__ import annotations

from asymspec_engine.llama_passes import NO_PADDING, PASS_ROWS, Padding, passes, plan

UBATCH = 512


def roomy(seq_id: int) -> int:
    return 1000


def test_one_pass_for_consecutive_ids_with_equal_tokens() -> None:
    assert passes([(i, 1) for i in range(16)], UBATCH) == 1
    assert passes([(i, 5) for i in range(3, 19)], UBATCH) == 1


def test_a_gap_in_the_ids_starts_another_pass() -> None:
    assert passes([(0, 1), (2, 1), (3, 1), (5, 1)], UBATCH) == 3


def test_ragged_tokens_take_a_pass_per_remaining_run() -> None:
    # ids 0, 1, 2 with 1, 3, 2 tokens: {0,1,2} x1, then {1,2} x1, then {1} x1
    assert passes([(0, 1), (1, 3), (2, 2)], UBATCH) == 3
    # once 1 is done, 0 and 2 are no longer consecutive: {0,1,2} x1, {0} x1, {2} x1
    assert passes([(0, 2), (1, 1), (2, 2)], UBATCH) == 3


def test_the_micro_batch_bounds_a_pass() -> None:
    assert passes([(0, 600)], UBATCH) == 2
    assert passes([(i, 40) for i in range(16)], UBATCH) == 2  # 32 tokens each per pass


def test_a_batch_in_one_pass_is_not_padded() -> None:
    assert plan([(i, 1) for i in range(4)], roomy, UBATCH, 2048) == NO_PADDING


def test_small_gaps_are_filled_with_throwaway_steps() -> None:
    padding = plan([(0, 1), (2, 1), (3, 1), (5, 1)], roomy, UBATCH, 2048)
    assert padding == Padding({1: 1, 4: 1})


def test_a_gap_dearer_than_a_pass_stays() -> None:
    items = [(0, 1), (PASS_ROWS + 2, 1)]  # PASS_ROWS + 1 streams between
    assert plan(items, roomy, UBATCH, 2048) == NO_PADDING


def test_ragged_blocks_are_padded_to_a_common_length_where_passes_cost_more() -> None:
    items = [(i, 1 + i % 5) for i in range(16)]  # 1..5 tokens: many passes
    padding = plan(items, roomy, UBATCH, 2048)
    runs = sorted(
        {**dict(items), **{k: dict(items)[k] + v for k, v in padding.tokens.items()}}.items()
    )
    assert passes(runs, UBATCH) < passes(items, UBATCH)
    assert all(seq_id in dict(items) for seq_id in padding.tokens)  # no gaps to fill


def test_a_full_stream_is_never_padded() -> None:
    def full_at_1(seq_id: int) -> int:
        return 0 if seq_id == 1 else 1000

    assert plan([(0, 1), (2, 1)], full_at_1, UBATCH, 2048) == NO_PADDING
    # item 0 cannot take the 2 throwaway tokens it would need to match item 1
    assert 0 not in plan([(0, 1), (1, 3)], lambda s: 1 if s == 0 else 1000, UBATCH, 2048).tokens


def test_padding_never_outgrows_the_batch() -> None:
    items = [(i, 1 + i % 5) for i in range(16)]
    assert plan(items, roomy, UBATCH, sum(n for _, n in items)) == NO_PADDING
