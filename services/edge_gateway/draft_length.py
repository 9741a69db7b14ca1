"""γ for goodput: the draft length that maximises expected tokens per second of a block
cycle, from what this edge measures and what the verifier says its forwards cost, and
whether speculating beats letting the cloud decode alone at all.

Whether drafting more tokens per block pays depends on the machine by an order of
magnitude. On a GPU or an AMX CPU a verify row rides nearly free, so long blocks win. On a
CPU whose products are compute-bound from a few rows on (AVX512-BF16 alone, AVX2) every
draft row costs the verifier time, and so does every draft step at the edge. There one
draft token per block beat four by 22 % at one chat and 16 % at sixteen
(``loadtest/results/engine-avx512bf16/`` in git history). This is SmartSpec's rule (Liu et
al., 2024, "Optimizing speculative decoding for serving large language models using
goodput"), with the cost split between the two machines:

- expected tokens of a block of γ, per-token acceptance α (i.i.d.): ``E(γ) = Σ_{i=0..γ} α^i``
  (the accepted drafts and the bonus or recovered token);
- the verifier's time for a round of ``n`` blocks: ``base + row × n (γ + 1)``
  (``TargetCost``, the verifier's own online fit);
- the edge's drafting: ``draft_s × γ`` per block (measured per draft token);
- one request alone waits for both in turn;
- several in the confirmed-prefix pipeline (``pipelined``) settle into two groups that
  take turns: while one group's blocks are verified the other's are drafted, and the
  cloud takes whatever has arrived when its round ends, which is the other group. So each
  request waits for two rounds of half the batch (or for its group's round and its
  drafting, where drafting is the longer). Measured on a 2-core AMX Xeon, one core each,
  16 chats: ~7 blocks a round, each request verified every other round
  (``loadtest/results/full-20261206-layers/`` and ``goodput-pause/`` in git history);
- several in synchronous rounds overlap drafting with verifying as well as they can: the
  longer of the two.

SmartSpec's γ = 0 is the pause (``speculation_pays``): the cloud decoding a request alone,
one token in each of its rounds of ``base + row × batch``, against the best γ's tokens per
cycle. A round of half the batch costs a little more than a decode step of all of it
where rows ride nearly free, so in the pipeline a block has to average somewhat more than
two tokens to win. The embedded draft's average 1.8-2.2 on that machine, and there
asymspec made 0.82-1.01× target-only at 16 chats (median 0.89), and
with the pause 0.90-1.10× (median 0.96).

Where both are measured, the pause follows what speculating and the cloud decoding alone
have actually given requests at a batch size (``mode_rates``): this model leaves out
serving work outside the forward and rows that do not cost linearly, and a lone request
never gives the verifier's fit the varied rows it needs. γ stays this model's.

α and the draft's time per token are exponentially weighted over recent blocks of every
request on this edge; until the verifier has sent a cost and a few blocks have been seen,
the configured γ stands and speculation goes on.

Suffix blocks (``asymspec_engine.suffix``) cost the edge nothing: a proposal of n tokens
whose prefixes are right with probability P_1 >= .. >= P_n earns ``1 + Σ_{i<=k} P_i`` tokens
for a block of its first k, in a cycle of verifying k + 1 rows. ``suffix_tokens`` picks the
k with the most tokens per second, and takes the suffix block only where that beats the
alternative: the draft model's blocks while speculating, the cloud decoding alone while
paused. For a request alone both sides are priced as measured once they are: a block's
cycle by the wall-clock line of suffix blocks' times in their rows
(``mode_rates.BlockTimes``), the alternative by the rate requests got from it
(``mode_rates.ModeRates``). Otherwise, and beside other requests (whose rounds a block's
rows slow too, which its own time does not show), by the formulas above (``draft_s = 0``),
unless suffix blocks have measurably given requests at that batch size less than the
alternative did (``ModeRates.suffix_pays``). A paused request beside others that the
cloud decodes prices its block for the batch (``_paused_suffix_tokens``): the others'
tokens in the longer round count too, and so does the switch it makes (the cloud stops
its generation, verifies the block, starts another). Priced for the request alone, eight
greedy agent conversations on 2 cores took 149 suffix blocks of 3.97 tokens and made
0.67× target-only; priced for the batch, 27 of 7.63 tokens and 0.83×.
The P_i are the suffix index's frequency estimates (a context seen once says 1.0) scaled
per position by α_s^i, the acceptance measured on suffix blocks, so that a rule fed by
optimistic counts learns what they are worth.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from asymspec.wire import TargetCost
from edge_gateway.mode_rates import BlockTimes, ModeRates

_MIN_BLOCKS = 8.0  # (weighted) blocks seen before α is trusted


# Rounds a paused request goes without a token when it takes a suffix block beside others:
# its generation's stop, and its next one's start (each about a round).
SWITCH_ROUNDS = 2


@dataclass(slots=True)
class GoodputDraftLength:
    """Owned by the edge's engine; written as blocks finish, read as blocks start (both
    on the event loop)."""

    max_gamma: int
    half_life_blocks: float = 64.0
    pipelined: bool = False  # the confirmed-prefix pipeline: batches verify in two groups
    target_cost: TargetCost | None = None  # the latest a verifier sent (SessionOpened)
    _blocks: float = 0.0
    _accepted: float = 0.0
    _rejected: float = 0.0
    _draft_tokens: float = 0.0
    _draft_s: float = 0.0
    min_suffix_expected: float = 2.0  # a suffix block's bar while its rule cannot price it
    _suffix_blocks: float = 0.0
    _suffix_accepted: float = 0.0
    _suffix_rejected: float = 0.0
    measured: ModeRates = field(default_factory=ModeRates)  # the pause's, once measured
    block_times: BlockTimes = field(default_factory=BlockTimes)  # suffix blocks', measured

    def __post_init__(self) -> None:
        self.block_times.half_life_blocks = self.half_life_blocks  # as α's

    def observe_block(self, gamma: int, n_accepted: int, draft_s: float | None) -> None:
        """A verdict: ``n_accepted`` of ``gamma`` drafts, drafted in ``draft_s`` (None: a
        runahead block, drafted while an earlier one was out)."""
        decay = 0.5 ** (1.0 / self.half_life_blocks)
        self._blocks = self._blocks * decay + 1.0
        self._accepted = self._accepted * decay + n_accepted
        self._rejected = self._rejected * decay + (1.0 if n_accepted < gamma else 0.0)
        if draft_s is not None:
            self._draft_tokens = self._draft_tokens * decay + gamma
            self._draft_s = self._draft_s * decay + draft_s

    def observe_suffix_block(self, gamma: int, n_accepted: int) -> None:
        """A suffix block's verdict (kept apart from the draft model's α)."""
        decay = 0.5 ** (1.0 / self.half_life_blocks)
        self._suffix_blocks = self._suffix_blocks * decay + 1.0
        self._suffix_accepted = self._suffix_accepted * decay + n_accepted
        self._suffix_rejected = self._suffix_rejected * decay + (n_accepted < gamma)

    @property
    def suffix_acceptance(self) -> float | None:
        """α_s: accepted suffix tokens over suffix tokens tested."""
        tested = self._suffix_accepted + self._suffix_rejected
        if self._suffix_blocks < _MIN_BLOCKS or tested <= 0.0:
            return None
        return self._suffix_accepted / tested

    def suffix_tokens(self, probs: Sequence[float], open_requests: int, speculating: bool) -> int:
        """How many of a suffix proposal's tokens to verify as a block without the draft
        model, 0 for none. ``probs`` [n]: P(the first i tokens are right), non-increasing;
        ``speculating``: whether the draft model would draft the block otherwise (else the
        cloud decodes alone)."""
        if not probs:
            return 0
        alpha_s, batch = self.suffix_acceptance, max(1, open_requests)
        if alpha_s is not None:
            probs = [p * alpha_s**i for i, p in enumerate(probs, start=1)]
        clears_bar = sum(probs) >= self.min_suffix_expected  # while it cannot be priced
        alternative: float | None
        measured = self._measured_suffix_prices(batch, len(probs), speculating)
        if measured is not None:
            cycles_s, alternative = measured
        elif self.target_cost is None:
            return len(probs) if clears_bar else 0
        elif self.measured.suffix_pays(batch, speculating) is False:
            return 0  # the model's price, overruled by what suffix blocks gave requests here
        elif batch > 1 and not speculating:
            return _paused_suffix_tokens(self.target_cost, batch, probs)
        else:
            cost = self.target_cost
            cycles_s = [self._cycle_s(cost, batch, k, 0.0) for k in range(1, len(probs) + 1)]
            alternative = self._model_alternative(cost, batch, speculating)
        expected, rates = 1.0, []
        for p, cycle_s in zip(probs, cycles_s, strict=True):
            expected += p
            rates.append(expected / cycle_s if cycle_s > 0.0 else math.inf)
        best = max(range(len(rates)), key=rates.__getitem__)
        if alternative is None:  # the draft's α is not known yet
            return best + 1 if clears_bar else 0
        return best + 1 if rates[best] >= alternative else 0

    def _measured_suffix_prices(
        self, batch: int, n: int, speculating: bool
    ) -> tuple[list[float], float] | None:
        """Suffix blocks of 1 .. n drafts' cycles and the alternative's tokens per second,
        both as measured (wall-clock, the same serving work in both), for a request alone;
        None where either is not measured yet. Beside other requests a block's rows also
        slow theirs, which its own time does not show: there the model prices both."""
        if batch != 1:
            return None
        alternative, line = self.measured.rate(batch, speculating), self.block_times.line(batch)
        if alternative is None or line is None:
            return None
        base_s, row_s = line
        return [base_s + row_s * (gamma + 1) for gamma in range(1, n + 1)], alternative

    def _model_alternative(self, cost: TargetCost, batch: int, speculating: bool) -> float | None:
        """A request's tokens per second without the suffix block, as the model says: the
        draft model's best γ (None while its α is not known), or the cloud decoding alone."""
        if speculating:
            model = self._rates(batch)
            return None if model is None else max(model)
        return 1.0 / (cost.base_s + cost.row_s * batch)

    @property
    def acceptance(self) -> float | None:
        """α: accepted drafts over drafts tested (a block stops at its first rejection)."""
        if self._blocks < _MIN_BLOCKS or self._accepted + self._rejected <= 0.0:
            return None
        return self._accepted / (self._accepted + self._rejected)

    @property
    def draft_s_per_token(self) -> float | None:
        return None if self._draft_tokens <= 0.0 else self._draft_s / self._draft_tokens

    def choose(self, open_requests: int, fallback: int) -> int:
        """γ in 1 .. max_gamma with the most expected tokens per second of a cycle for
        ``open_requests`` decoding at once; ``fallback`` while anything is unknown."""
        rates = self._rates(max(1, open_requests))
        if rates is None:
            return fallback
        return max(range(1, self.max_gamma + 1), key=lambda gamma: rates[gamma - 1])

    def speculation_pays(self, open_requests: int) -> bool:
        """Whether speculating gives a request more tokens per second than the cloud
        decoding it alone, with ``open_requests`` decoding: as measured (``measured``), or
        where neither is yet, as the model says (`model_says_speculation_pays`)."""
        model_says = self.model_says_speculation_pays(open_requests)
        return self.measured.speculates(open_requests, model_says)

    def model_says_speculation_pays(self, open_requests: int) -> bool:
        """Whether the best γ's expected tokens per second for a request beat the cloud
        decoding it alone in rounds of ``open_requests`` (SmartSpec's γ = 0); True while
        anything is unknown."""
        batch = max(1, open_requests)
        rates, cost = self._rates(batch), self.target_cost
        if rates is None or cost is None:
            return True
        decode_s = cost.base_s + cost.row_s * batch
        return max(rates) * decode_s >= 1.0

    def _rates(self, batch: int) -> list[float] | None:
        """Expected tokens per second of one request for γ = 1 .. max_gamma, or None."""
        alpha, draft_s, cost = self.acceptance, self.draft_s_per_token, self.target_cost
        if alpha is None or draft_s is None or cost is None:
            return None
        rates = []
        for gamma in range(1, self.max_gamma + 1):
            tokens = sum(alpha**i for i in range(gamma + 1))
            cycle_s = self._cycle_s(cost, batch, gamma, draft_s * gamma)
            rates.append(tokens / cycle_s if cycle_s > 0.0 else math.inf)
        return rates

    def _cycle_s(self, cost: TargetCost, batch: int, gamma: int, drafting_s: float) -> float:
        """One request's block cycle: γ drafts (``drafting_s`` at the edge) verified as
        γ + 1 rows, with ``batch`` requests decoding (see the module docstring)."""
        if batch == 1:
            return cost.base_s + cost.row_s * (gamma + 1) + drafting_s
        if self.pipelined:  # two groups take turns at the verifier
            group = math.ceil(batch / 2)
            verify_s = cost.base_s + cost.row_s * group * (gamma + 1)
            return verify_s + max(verify_s, drafting_s)
        return max(cost.base_s + cost.row_s * batch * (gamma + 1), drafting_s)


def _paused_suffix_tokens(cost: TargetCost, batch: int, probs: Sequence[float]) -> int:
    """A paused request's suffix block beside ``batch - 1`` requests that the cloud decodes:
    the first k of its proposal where that gives the batch the most tokens per second, 0
    where the cloud decoding all of them gives more. The batch, not the request: the
    block's k + 1 rows lengthen the round every other request waits for, which the
    request's own rate does not show. The request's generation stops for the block and
    starts again after it: ``SWITCH_ROUNDS`` rounds in which only the others get a token."""
    others = batch - 1
    decode_s = cost.base_s + cost.row_s * batch
    switch_s = SWITCH_ROUNDS * (cost.base_s + cost.row_s * others)
    alternative = batch / decode_s
    expected, best_k, best_rate = 1.0, 0, alternative
    for k, p in enumerate(probs, start=1):
        expected += p
        tokens = others + expected + SWITCH_ROUNDS * others
        rate = tokens / (cost.base_s + cost.row_s * (batch + k) + switch_s)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k
