"""Suffix drafting: hand cases, the walk against a slow definition, the store's byte bound."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asymspec_engine.suffix import (
    SuffixConfig,
    SuffixDrafter,
    SuffixStore,
    follow,
    longest_match,
    propose_from,
)


def _ids(tokens: list[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


@pytest.mark.parametrize(
    ("text", "pattern", "min_match", "expected"),
    [
        ([5, 6, 7, 1, 5, 6], [1, 5, 6], 2, (2, [1])),  # "5 6" ends at 1; the final 6 has no next
        ([1, 2, 3, 9, 2, 3, 8], [1, 2, 3], 2, (3, [2])),  # "1 2 3" beats "2 3" (also at 5)
        ([2, 3, 4, 2, 3, 5, 2, 3], [2, 3], 2, (2, [1, 4])),  # every occurrence, in order
        ([1, 2, 3, 4], [9, 4], 1, (0, [])),  # 4 is last: nothing after it
        ([1, 2, 3, 4], [9, 3], 2, (0, [])),  # "9 3" is not there; "3" alone is too short
        ([1, 2, 3, 4], [9, 3], 1, (1, [2])),
        ([7, 7, 7], [7, 7], 2, (2, [1])),  # overlapping: "7 7" at 0-1, then 7
    ],
)
def test_longest_match_hand_cases(
    text: list[int], pattern: list[int], min_match: int, expected: tuple[int, list[int]]
) -> None:
    k, ends = longest_match(_ids(text), _ids(pattern), min_match)
    assert (k, ends.tolist()) == expected


def test_follow_takes_the_most_frequent_next_token_with_its_frequency() -> None:
    # after "1": 2 (twice), 3 (once); after "1 2": 4 then 5 -> a tie, the latest (5) wins
    text = _ids([1, 2, 4, 0, 1, 3, 0, 1, 2, 5, 0, 1])
    ends = np.flatnonzero(text[:-1] == 1)
    tokens, probs = follow(text, ends, max_tokens=5, min_token_prob=0.0)
    assert tokens[:2] == [2, 5]
    assert probs[:2] == pytest.approx([2 / 3, 2 / 3 * 1 / 2])
    # a bar on the running probability stops the walk before the tie
    assert follow(text, ends, 5, min_token_prob=0.5) == ([2], [pytest.approx(2 / 3)])


def test_follow_stops_at_a_separator_and_the_end() -> None:
    text = _ids([3, 4, 5, -1, 3, 4])
    tokens, probs = follow(text, np.asarray([0, 4]), max_tokens=8, min_token_prob=0.0)
    # after 3: 4 twice; after "3 4": 5 (the second occurrence has nothing after it)
    assert tokens == [4, 5] and probs == [1.0, 1.0]


def _walk_by_definition(text: list[int], context: list[int], config: SuffixConfig) -> list[int]:
    """Slow reference: all start positions whose k tokens equal the suffix, largest k; then
    repeatedly the most frequent next token over the surviving occurrences."""
    pattern = context[-config.max_match :]
    for k in range(len(pattern), config.min_match - 1, -1):
        occ = [
            s + k - 1
            for s in range(len(text) - k)  # s + k <= len(text) - 1: a token follows
            if text[s : s + k] == pattern[len(pattern) - k :]
        ]
        if occ:
            break
    else:
        return []
    out: list[int] = []
    running = 1.0
    limit = min(config.max_tokens, int(config.spec_factor * k))
    while len(out) < limit:
        nexts = [(e + 1, text[e + 1]) for e in occ if e + 1 < len(text) and text[e + 1] != -1]
        if not nexts:
            break
        counts = Counter(t for _, t in nexts)
        best = max(counts.values())
        token = [t for _, t in nexts if counts[t] == best][-1]
        running *= best / len(nexts)
        if running < config.min_token_prob:
            break
        out.append(token)
        occ = [p for p, t in nexts if t == token]
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=0, max_size=50),
    st.integers(1, 4),
    st.sampled_from([0.0, 0.3]),
)
def test_a_proposal_matches_its_definition(
    context: list[int], min_match: int, min_prob: float
) -> None:
    config = SuffixConfig(max_match=6, min_match=min_match, max_tokens=10, min_token_prob=min_prob)
    ids = _ids(context)
    got = propose_from(ids, ids, config)
    assert got.tokens == _walk_by_definition(context, context, config)
    assert all(a >= b for a, b in zip(got.probs, got.probs[1:], strict=False))  # non-increasing
    assert all(min_prob <= p <= 1.0 for p in got.probs)
    assert len(got.tokens) <= config.spec_factor * max(got.match_len, 0)


def test_spec_factor_bounds_a_proposal_by_its_match() -> None:
    code = list(range(10, 40))
    context = [*code, 99, *code[:3]]  # the suffix "10 11 12" matched: 3 tokens
    short = propose_from(_ids(context), _ids(context), SuffixConfig(spec_factor=1.0))
    assert short.match_len == 3 and short.tokens == code[3:6]
    long = propose_from(_ids(context), _ids(context), SuffixConfig(spec_factor=8.0))
    assert long.tokens == code[3:27]  # 8 × 3 tokens
    longer = propose_from(_ids(context), _ids(context), SuffixConfig(spec_factor=16.0))
    assert longer.tokens == [*code[3:], 99, *code[:3]]  # on to where the context ends


def test_the_drafter_picks_the_store_when_it_knows_more() -> None:
    drafter = SuffixDrafter(SuffixConfig(spec_factor=4.0), store_bytes=1 << 12)
    earlier_output = [50, 51, 52, 53, 54, 55, 56, 57]
    drafter.remember(earlier_output)
    context = [1, 2, 3, 50, 51, 52]  # nothing repeats inside the context
    proposal = drafter.propose(context, max_tokens=4)
    assert proposal.tokens == [53, 54, 55, 56]
    assert proposal.probs == [1.0] * 4
    # the context's own repeat wins when it is longer and so expects more
    context = [7, 8, 9, 1, 2, 3, 4, 5, 6, 60, 7, 8, 9, 1, 2, 3, 4, 5, 50, 51, 52, 7, 8, 9, 1, 2]
    assert drafter.propose(context, max_tokens=3).tokens == [3, 4, 5]
    assert drafter.propose(context, max_tokens=0).tokens == []


def test_the_store_keeps_its_byte_bound_and_evicts_the_least_recently_used() -> None:
    store = SuffixStore(max_bytes=4 * 12)  # 12 int32 slots, separators included
    store.add([1, 2, 3])  # 4 slots
    store.add([4, 5, 6])  # 8
    store.add([7, 8, 9])  # 12: full
    assert store.stored_bytes == 48 and len(store) == 3
    config = SuffixConfig(min_match=1)
    first = store.propose(np.asarray([1], dtype=np.int32), config)
    assert first.tokens == [2]
    store.touch(first.end)  # [1 2 3] is used now: [4 5 6] is the least recently used
    store.add([10, 11])  # 15 slots > 12: evict until under the bound
    assert store.stored_bytes <= 48
    assert store.buffer.tolist() == [1, 2, 3, -1, 7, 8, 9, -1, 10, 11, -1]
    assert store.propose(np.asarray([4], dtype=np.int32), config).tokens == []
    store.add(list(range(100, 120)))  # alone over the bound: not stored, nothing evicted
    assert len(store) == 3
    for i in range(50):  # many adds never pass the bound
        store.add([200 + i, 300 + i])
        assert store.stored_bytes <= store.max_bytes
    assert store.buffer[-1] == -1 and store.doc_at(len(store.buffer) - 2) == store.doc_at(0) + 3


def test_a_match_never_crosses_documents() -> None:
    store = SuffixStore(max_bytes=1 << 10)
    store.add([1, 2])
    store.add([3, 4])
    # "2 3" would match across the boundary if the separator were not there
    assert store.propose(np.asarray([2], dtype=np.int32), SuffixConfig(min_match=1)).tokens == []
    assert store.propose(np.asarray([9, 2, 3], dtype=np.int32), SuffixConfig()).tokens == []


def test_invalid_configs_are_refused() -> None:
    with pytest.raises(ValueError):
        SuffixConfig(min_match=0)
    with pytest.raises(ValueError):
        SuffixConfig(max_match=2, min_match=3)
    with pytest.raises(ValueError):
        SuffixConfig(spec_factor=0.0)
