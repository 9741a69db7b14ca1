"""How llama.cpp splits one batch over per-session KV streams into passes over the weights,
and the padding that makes a round fewer passes.

With a KV stream per sequence (``kv_unified = false``) ``llama_decode`` cuts a batch into
micro-batches by ``split_equal(sequential=true)``: each holds a run of *consecutive*
sequence ids that all add the *same* number of tokens (so that each stream's attention is
one view). Every micro-batch is a pass over the weights. A round of decode steps whose
sessions hold ids 0, 2, 3, 5 is then three passes, not one; a verify round whose blocks
are 1 to 5 tokens long is up to five. On 2 cores of an EPYC (the embedded target in Q8_0,
``loadtest/results/forward-cost/``): ten one-token steps on streams with gaps between took
73.5 ms as they were and 38.4 ms padded (sixteen on consecutive streams: 35.8 ms), and
sixteen blocks of 1 to 5 tokens (46 rows) 242.0 ms as they were and 158.0 ms padded.

A pass costs about as much as ``PASS_ROWS`` rows, so a round is cheaper padded: the shorter
items get throwaway tokens up to a common length, and the streams between the round's
sessions (free, closed, or open but not in this round) a throwaway run of that length, all
without logits and rolled back right after the decode. The keys and values the real
tokens write are the same: each stream attends to its own cells, and a throwaway token
comes after every real token of its stream.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# What one more pass over the weights costs, in rows: on 2 EPYC cores one decode step took
# 6.5 ms and sixteen in one pass 35.8 ms (a pass ~4.5 ms, a row ~1.9 ms); steps split over
# runs of streams cost more than that (73.5 ms for ten in seven passes). Three rows leans to
# fewer passes.
PASS_ROWS = 3


@dataclass(frozen=True, slots=True)
class Padding:
    """Throwaway tokens per sequence id, appended after its real ones (for a batch item)
    or from its stream's end (for a stream between the round's sessions)."""

    tokens: dict[int, int]

    @property
    def rows(self) -> int:
        return sum(self.tokens.values())


NO_PADDING = Padding({})


def passes(runs: Sequence[tuple[int, int]], micro_batch_tokens: int) -> int:
    """How many micro-batches llama.cpp's ``split_equal(sequential=true)`` makes of a batch
    laid out in sequence-id order: ``runs`` holds (sequence id, tokens) per sequence,
    ascending ids. Each micro-batch starts at the lowest sequence with tokens left, takes the
    run of consecutive ids after it that still have tokens, and as many tokens from each as
    the shortest has left (at most what fits ``micro_batch_tokens``)."""
    left = [tokens for _, tokens in runs]
    ids = [seq_id for seq_id, _ in runs]
    count = 0
    while True:
        members: list[int] = []
        for i, tokens in enumerate(left):
            if tokens == 0:
                continue
            if members and ids[i] != ids[members[-1]] + 1:
                continue  # not the next id: a later micro-batch takes it
            members.append(i)
        if not members:
            return count
        steps = min(min(left[i] for i in members), max(1, micro_batch_tokens // len(members)))
        for i in members:
            left[i] -= steps
        count += 1


def plan(
    items: Sequence[tuple[int, int]],
    room: Callable[[int], int],
    micro_batch_tokens: int,
    batch_tokens: int,
) -> Padding:
    """The padding that makes a batch cheapest: ``items`` holds (sequence id, new tokens)
    in ascending ids; ``room(seq_id)`` how many more tokens a stream holds (after an item's
    own). Each candidate pads the items to one of their lengths and fills the gaps between
    them (all, or those cheaper than a pass) with runs of that length; the cheapest by
    ``passes * PASS_ROWS + rows`` wins, no padding where that is as cheap."""
    real_rows = sum(tokens for _, tokens in items)
    best, best_cost = NO_PADDING, passes(items, micro_batch_tokens) * PASS_ROWS + real_rows
    if best_cost == PASS_ROWS + real_rows:
        return best  # one pass already
    lengths = sorted({tokens for _, tokens in items})
    for length in lengths:
        for fill_all in (False, True):
            padding = _candidate(items, length, fill_all, room)
            if padding is None or real_rows + padding.rows > batch_tokens:
                continue
            runs = _padded(items, padding)
            cost = passes(runs, micro_batch_tokens) * PASS_ROWS + real_rows + padding.rows
            if cost < best_cost:
                best, best_cost = padding, cost
    return best


def _candidate(
    items: Sequence[tuple[int, int]], length: int, fill_all: bool, room: Callable[[int], int]
) -> Padding | None:
    tokens: dict[int, int] = {}
    for seq_id, n in items:
        if n < length:
            if room(seq_id) < length - n:
                return None
            tokens[seq_id] = length - n
    for (before, _), (after, _) in itertools.pairwise(items):
        gap = range(before + 1, after)
        if not gap or (not fill_all and len(gap) * length > PASS_ROWS):
            continue
        if any(room(seq_id) < length for seq_id in gap):
            continue  # a full stream in the gap: the gap stays
        tokens.update({seq_id: length for seq_id in gap})
    return Padding(tokens)


def _padded(items: Sequence[tuple[int, int]], padding: Padding) -> list[tuple[int, int]]:
    """The runs llama.cpp sees: the items' tokens plus their padding, and the gap streams'
    throwaway runs, in ascending ids."""
    sizes = dict(items)
    for seq_id, extra in padding.tokens.items():
        sizes[seq_id] = sizes.get(seq_id, 0) + extra
    return sorted(sizes.items())
