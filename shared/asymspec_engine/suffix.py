"""Suffix drafting (SuffixDecoding, Oliaro et al., 2024): continue the context the way its
own longest repeated suffix went on before, without a model.

Agents resend their conversation every round, and much of what the model writes repeats
what is already there: code it edits, observations it quotes, plans it restates. There a
block of 16-32 tokens copied from the context is often accepted whole, and proposing it
costs the edge a few vector compares instead of a draft forward per token.

Two texts are searched, as SuffixDecoding's two trees are: the request's own context
(prompt and output so far) and an edge-wide store of recent outputs (``SuffixStore``,
bounded in bytes, least recently used out first). In each, the occurrences of the
context's longest suffix (up to ``max_match`` tokens, at least ``min_match``) are found,
then followed forward one token at a time: the next token is the most frequent one after
the surviving occurrences (ties: the latest occurrence's), and its probability estimate
is the product of the frequency ratios so far (a walk down the suffix tree, done lazily on
the occurrences). The walk stops below ``min_token_prob`` or at ``spec_factor`` × the match
length (SuffixDecoding's ``max_spec_factor``: a short match earns a short guess). Of the
two texts' proposals the one with more expected accepted tokens wins.

What the proposal becomes in ``q`` is the caller's business (``edge_gateway.decoding``:
a one-hot block replacing the draft model where it pays); this module only counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

# Stored tokens are int32; documents in the store's buffer are separated by this value,
# which no token id equals, so no match or walk crosses from one document into the next.
_SEPARATOR = -1
_TOKEN_BYTES = 4


@dataclass(frozen=True)
class SuffixProposal:
    """A continuation c_1 .. c_n and, per position, the estimated probability that the
    proposal is right up to and including it (non-increasing)."""

    tokens: list[int]
    probs: list[float]
    match_len: int  # tokens of the context's suffix the continuation was matched on
    end: int = -1  # where in the searched text the latest matched occurrence ends

    @property
    def expected_tokens(self) -> float:
        """Expected accepted tokens if every position is tested: Σ_i P(c_1 .. c_i right)."""
        return float(sum(self.probs))

    def cut(self, n: int) -> SuffixProposal:
        return SuffixProposal(self.tokens[:n], self.probs[:n], self.match_len, self.end)


NO_PROPOSAL = SuffixProposal([], [], 0)


def longest_match(
    text: npt.NDArray[np.int32], pattern: npt.NDArray[np.int32], min_match: int
) -> tuple[int, npt.NDArray[np.int64]]:
    """(k, ends): the largest k (min_match <= k <= len(pattern)) such that pattern's last k
    tokens occur in ``text`` ending at positions ``ends`` with a token after them, or
    (0, []) when not even min_match do. text: [T], pattern: [m] (no separators).

    One vector compare finds the occurrences of the last token; each further step keeps
    those that also match one more token back (as ``draft.copy_candidate`` does)."""
    none = (0, np.zeros(0, dtype=np.int64))
    if len(pattern) < max(1, min_match) or len(text) < 2:
        return none
    ends = np.flatnonzero(text[:-1] == pattern[-1])  # e <= T - 2: text[e + 1] exists
    best = none
    matched = 1  # the occurrences in `ends` match this many tokens
    while ends.size:
        if matched >= min_match:
            best = (matched, ends)
        if matched == len(pattern):
            break
        ends = ends[ends >= matched]
        ends = ends[text[ends - matched] == pattern[-1 - matched]]
        matched += 1
    return best


def follow(
    text: npt.NDArray[np.int32],
    ends: npt.NDArray[np.int64],
    max_tokens: int,
    min_token_prob: float,
) -> tuple[list[int], list[float]]:
    """Walk forward from the occurrences ending at ``ends``: each step the most frequent
    next token (ties: the one after the latest occurrence), its probability the running
    product of count / occurrences. Stops below ``min_token_prob``, at ``max_tokens``, or
    where no occurrence goes on."""
    tokens: list[int] = []
    probs: list[float] = []
    running = 1.0
    while len(tokens) < max_tokens:
        after = ends + 1
        after = after[after < len(text)]
        nexts = text[after]
        keep = nexts != _SEPARATOR
        after, nexts = after[keep], nexts[keep]
        if nexts.size == 0:
            break
        values, counts = np.unique(nexts, return_counts=True)
        top = counts == counts.max()
        if top.sum() == 1:
            token = int(values[top][0])
        else:  # a tie: the token after the latest tied occurrence
            tied = np.isin(nexts, values[top])
            token = int(nexts[np.flatnonzero(tied)[-1]])
        running *= float(counts[values == token][0]) / nexts.size
        if running < min_token_prob:
            break
        tokens.append(token)
        probs.append(running)
        ends = after[nexts == token]
    return tokens, probs


@dataclass(frozen=True)
class SuffixConfig:
    """How far matches and proposals go; SuffixDecoding's knobs."""

    max_match: int = 32  # longest suffix of the context matched
    min_match: int = 2  # shorter matches propose nothing
    max_tokens: int = 32  # longest proposal
    spec_factor: float = 1.0  # a proposal is at most spec_factor × match length tokens
    min_token_prob: float = 0.1  # the walk stops where its running probability falls below

    def __post_init__(self) -> None:
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {self}")
        if self.max_tokens < 1 or self.spec_factor <= 0.0 or not 0 <= self.min_token_prob <= 1:
            raise ValueError(
                f"need max_tokens >= 1, spec_factor > 0, min_token_prob in [0, 1]: {self}"
            )


def propose_from(
    text: npt.NDArray[np.int32], context: npt.NDArray[np.int32], config: SuffixConfig
) -> SuffixProposal:
    """The proposal ``text`` makes for what follows ``context`` (text may be the context)."""
    pattern = context[-config.max_match :]
    match_len, ends = longest_match(text, pattern, config.min_match)
    if match_len == 0:
        return NO_PROPOSAL
    limit = min(config.max_tokens, int(config.spec_factor * match_len))
    tokens, probs = follow(text, ends, limit, config.min_token_prob)
    return SuffixProposal(tokens, probs, match_len, int(ends[-1])) if tokens else NO_PROPOSAL


@dataclass
class SuffixStore:
    """Recent outputs of an edge's requests, searchable as one buffer: documents laid end
    to end with a separator after each, least recently used first out once their bytes
    pass ``max_bytes`` (4 bytes a token, separators included). A document counts as used
    when it is added and when its proposal wins the drafter's choice (``touch``).

    One owner writes (the edge's event loop). ``buffer`` is replaced, never changed in
    place, so a reader that took it once searches a consistent snapshot."""

    max_bytes: int
    buffer: npt.NDArray[np.int32] = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    _docs: dict[int, npt.NDArray[np.int32]] = field(default_factory=dict)  # id -> tokens
    _used: dict[int, int] = field(default_factory=dict)  # id -> last-use tick
    _starts: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    _order: list[int] = field(default_factory=list)  # document ids in buffer order
    _next_id: int = 0
    _tick: int = 0

    @property
    def stored_bytes(self) -> int:
        return int(self.buffer.nbytes)

    def __len__(self) -> int:
        return len(self._docs)

    def add(self, tokens: Sequence[int]) -> None:
        """Store one output; a document alone over the bound is not stored."""
        doc = np.asarray(tokens, dtype=np.int32)
        if doc.size == 0 or (doc.size + 1) * _TOKEN_BYTES > self.max_bytes:
            return
        doc_id, self._next_id = self._next_id, self._next_id + 1
        self._docs[doc_id] = doc
        self._used[doc_id] = self._bump()
        self._order.append(doc_id)
        self._starts = np.append(self._starts, len(self.buffer))
        self.buffer = np.concatenate([self.buffer, doc, [_SEPARATOR]]).astype(np.int32)
        if self.stored_bytes > self.max_bytes:
            self._evict()

    def doc_at(self, position: int) -> int:
        """The id of the document holding buffer ``position``."""
        return self._order[int(np.searchsorted(self._starts, position, side="right")) - 1]

    def touch(self, position: int) -> None:
        """Mark the document at ``position`` used (its proposal was taken)."""
        if 0 <= position < len(self.buffer):
            self._used[self.doc_at(position)] = self._bump()

    def propose(self, context: npt.NDArray[np.int32], config: SuffixConfig) -> SuffixProposal:
        return propose_from(self.buffer, context, config)

    def _bump(self) -> int:
        self._tick += 1
        return self._tick

    def _evict(self) -> None:
        """Drop least recently used documents until under the bound, then rebuild once."""
        total = self.stored_bytes
        for doc_id in sorted(self._docs, key=self._used.__getitem__):
            if total <= self.max_bytes:
                break
            total -= (self._docs.pop(doc_id).size + 1) * _TOKEN_BYTES
            del self._used[doc_id]
        self._order = [d for d in self._order if d in self._docs]
        docs = [self._docs[d] for d in self._order]
        sizes = np.asarray([d.size + 1 for d in docs], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        pieces = [np.append(d, np.int32(_SEPARATOR)) for d in docs]
        self.buffer = np.concatenate(pieces).astype(np.int32) if pieces else self.buffer[:0]


class SuffixDrafter:
    """Proposals from a request's context and the edge's store of recent outputs."""

    def __init__(self, config: SuffixConfig, store_bytes: int) -> None:
        self.config = config
        self.store = SuffixStore(store_bytes)

    def propose(
        self, context: Sequence[int], max_tokens: int, use_store: bool = True
    ) -> SuffixProposal:
        """The better of the context's own proposal and the store's (more expected accepted
        tokens), at most ``max_tokens`` long; the context's alone without ``use_store``."""
        if max_tokens < 1:
            return NO_PROPOSAL
        ids = np.asarray(context, dtype=np.int32)
        own = propose_from(ids, ids, self.config)
        if not use_store:
            return own.cut(max_tokens)
        stored = self.store.propose(ids, self.config)
        if stored.expected_tokens > own.expected_tokens:
            self.store.touch(stored.end)
            return stored.cut(max_tokens)
        return own.cut(max_tokens)

    def remember(self, output: Sequence[int]) -> None:
        """A finished request's output joins the store."""
        self.store.add(output)
