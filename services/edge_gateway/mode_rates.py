"""Whether requests speculate or let the cloud decode alone, from what each has measurably
given a request on this edge: one request's tokens per second, per batch size.

The goodput model (``draft_length``) prices a block from the verifier's fitted forward
cost. On a CPU that misprices a lone request three ways: serving work outside the forward
(the cloud's sampling and channel, the edge's Python) is not in it, and it is what a
decoded token pays most of (2-core EPYC, llama.cpp Q8_0: the forward alone is 6.5 ms, while
target-only streams a token every ~10 ms); rows do not cost linearly (1, 2, 5, 9 rows:
6.5, 14.4, 24.6, 30.6 ms); and a lone request's draft blocks all have one γ, so unless
suffix blocks vary them the verifier's fit never identifies a row's cost, and the model
never pauses (one 96-token chat at a time, T = 0.7: ~50-60 tokens/s speculating against
~130 decoding). A wall-clock rate measures all of it, a link's round trip too, and needs
none of it:

- a mode's rate at a batch size is a ratio of exponentially weighted sums, tokens over
  seconds, from the end of one of a request's outputs to the end of its next (so a switch's
  cost, such as the draft catching up, lands on the mode switched to);
- both modes' sums at a batch size fade with the tokens either produces there (half-life
  ``half_life_tokens``), so the mode not in use loses weight;
- a mode with less than ``min_tokens`` of weight is explored: requests at that batch size
  use it until it has twice that, then the faster mode wins. So the slower one is tried
  again for about ``min_tokens`` tokens every ``half_life_tokens`` (3 % of the tokens at
  the defaults);
- at a batch size neither mode has been measured at, the goodput model decides.

Batch sizes above four share a bucket per power of two (5-8, 9-16, ...): rates there move
slowly with the batch, and each bucket has to be measured before it decides.

``BlockTimes`` measures the other side of a suffix block's price the same way: what a
block of ``rows`` costs a request in wall-clock seconds, from its last output to the
block's verdict, as a line in the rows per batch bucket. The verifier's fit prices a row
from its forwards alone, and on a CPU whose rows cost far from a line that overprices long
blocks: on 2 cores of an AVX-512 EPYC (llama.cpp Q8_0, agent conversations, one at a
time) the verifier's line cut proposals whose every token the index was sure of to 6-9
tokens, 86 % of which were then accepted whole, while the blocks' own wall-clock time was
~20 ms + 1.9 ms a row (the link's round trip and both services' work are the base).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

HALF_LIFE_TOKENS = 512.0
MIN_TOKENS = 16.0


@dataclass(slots=True)
class _Rate:
    """One mode's weighted sums at one batch size."""

    tokens: float = 0.0
    seconds: float = 0.0
    exploring: bool = True  # below min_tokens of weight, until it has twice that

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0.0 else math.inf


@dataclass(slots=True)
class _BatchRates:
    speculating: _Rate = field(default_factory=_Rate)
    decoding: _Rate = field(default_factory=_Rate)
    suffix: _Rate = field(default_factory=_Rate)  # suffix blocks' (`suffix_pays`)

    def update_exploring(self, min_tokens: float) -> None:
        for rate in (self.speculating, self.decoding, self.suffix):
            if rate.tokens < min_tokens:
                rate.exploring = True
            elif rate.tokens >= 2.0 * min_tokens:
                rate.exploring = False


def batch_bucket(batch: int) -> int:
    """The batch size whose rates a batch of ``batch`` shares: itself up to 4, else the
    next power of two."""
    batch = max(1, batch)
    return batch if batch <= 4 else 1 << (batch - 1).bit_length()


@dataclass(slots=True)
class ModeRates:
    """Owned by the edge's engine; written as a request's tokens arrive, read as its next
    ones are asked for (both on the event loop)."""

    half_life_tokens: float = HALF_LIFE_TOKENS
    min_tokens: float = MIN_TOKENS
    _by_bucket: dict[int, _BatchRates] = field(default_factory=dict)

    def observe(self, batch: int, speculating: bool, n_tokens: int, seconds: float) -> float | None:
        """A request of ``batch`` decoding at once got ``n_tokens`` in ``seconds`` from a
        block of drafts (``speculating``) or from the cloud decoding alone. Returns that
        mode's rate there now (None: nothing to observe)."""
        if n_tokens <= 0 or seconds < 0.0:
            return None
        rates = self._by_bucket.setdefault(batch_bucket(batch), _BatchRates())
        observed = rates.speculating if speculating else rates.decoding
        fading = (rates.speculating, rates.decoding, rates.suffix)
        return self._add(rates, observed, fading, n_tokens, seconds)

    def observe_suffix(self, batch: int, n_tokens: int, seconds: float) -> float | None:
        """The same for a suffix block's tokens. They fade the suffix rate alone: it is no
        mode of the pause's, and it fades with the tokens either mode gives, so that it is
        explored again where suffix blocks stopped being taken."""
        if n_tokens <= 0 or seconds < 0.0:
            return None
        rates = self._by_bucket.setdefault(batch_bucket(batch), _BatchRates())
        return self._add(rates, rates.suffix, (rates.suffix,), n_tokens, seconds)

    def _add(
        self,
        rates: _BatchRates,
        observed: _Rate,
        fading: tuple[_Rate, ...],
        n_tokens: int,
        seconds: float,
    ) -> float:
        decay = 0.5 ** (n_tokens / self.half_life_tokens)
        for rate in fading:
            rate.tokens *= decay
            rate.seconds *= decay
        observed.tokens += n_tokens
        observed.seconds += seconds
        rates.update_exploring(self.min_tokens)
        return observed.tokens_per_s

    def suffix_pays(self, batch: int, speculating: bool) -> bool | None:
        """Whether suffix blocks gave requests at ``batch`` at least what the alternative
        did (the draft model's blocks, ``speculating``, or the cloud decoding alone), as
        measured; None while either is being explored."""
        rates = self._by_bucket.get(batch_bucket(batch))
        if rates is None:
            return None
        alternative = rates.speculating if speculating else rates.decoding
        if rates.suffix.exploring or alternative.exploring:
            return None
        return rates.suffix.tokens_per_s >= alternative.tokens_per_s

    def rate(self, batch: int, speculating: bool) -> float | None:
        """One mode's measured tokens per second for a request at ``batch``; None while
        it has too little weight there (it is being explored, or never was)."""
        rates = self._by_bucket.get(batch_bucket(batch))
        if rates is None:
            return None
        rate = rates.speculating if speculating else rates.decoding
        return None if rate.exploring else rate.tokens_per_s

    def speculates(self, batch: int, model_says: bool) -> bool:
        """Whether requests of ``batch`` decoding at once should speculate: the mode being
        explored, else the faster measured one; ``model_says`` where neither is measured."""
        rates = self._by_bucket.get(batch_bucket(batch))
        if rates is None:
            return model_says
        speculating, decoding = rates.speculating, rates.decoding
        if speculating.exploring and decoding.exploring:
            return model_says
        if speculating.exploring or decoding.exploring:
            return speculating.exploring
        return speculating.tokens_per_s >= decoding.tokens_per_s


MIN_BLOCKS = 8.0  # (weighted) blocks a line needs
MIN_ROWS_SPREAD = 1.0  # and this variance of their rows: else the slope is noise


@dataclass(slots=True)
class _Line:
    """Exponentially weighted sums for a least-squares line of seconds in rows."""

    n: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, rows: int, seconds: float, decay: float) -> None:
        self.n = self.n * decay + 1.0
        self.x = self.x * decay + rows
        self.y = self.y * decay + seconds
        self.xx = self.xx * decay + rows * rows
        self.xy = self.xy * decay + rows * seconds

    def fit(self) -> tuple[float, float] | None:
        """(base_s, row_s), neither negative; None until enough varied blocks."""
        if self.n < MIN_BLOCKS:
            return None
        mean_x, mean_y = self.x / self.n, self.y / self.n
        var_x = self.xx / self.n - mean_x * mean_x
        if var_x < MIN_ROWS_SPREAD:
            return None
        row_s = max(0.0, (self.xy / self.n - mean_x * mean_y) / var_x)
        base_s = mean_y - row_s * mean_x
        if base_s < 0.0:  # a line through the origin is the most a row can cost
            return 0.0, self.xy / self.xx
        return base_s, row_s


@dataclass(slots=True)
class BlockTimes:
    """What a block of speculated rows costs a request in wall-clock seconds, as a line in
    its rows per batch bucket. Owned by the edge's engine; written as verdicts arrive,
    read as blocks are sized (both on the event loop)."""

    half_life_blocks: float = 64.0
    _by_bucket: dict[int, _Line] = field(default_factory=dict)

    def observe(self, batch: int, rows: int, seconds: float) -> None:
        """A block of ``rows`` (drafts and the tail before them) came back ``seconds``
        after the request's previous output, with ``batch`` requests decoding."""
        if rows <= 0 or seconds < 0.0:
            return
        line = self._by_bucket.setdefault(batch_bucket(batch), _Line())
        line.add(rows, seconds, 0.5 ** (1.0 / self.half_life_blocks))

    def line(self, batch: int) -> tuple[float, float] | None:
        """(base_s, row_s) of a block's time at ``batch``, as measured; None until it is."""
        line = self._by_bucket.get(batch_bucket(batch))
        return None if line is None else line.fit()

    def seconds(self, batch: int, rows: int) -> float | None:
        """A block of ``rows``' time at ``batch``, as measured; None until it is."""
        fitted = self.line(batch)
        if fitted is None:
            return None
        base_s, row_s = fitted
        return base_s + row_s * rows
