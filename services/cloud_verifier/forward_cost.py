"""What a target forward costs as a function of the rows it scores, measured as it runs.

The batcher sizes prefill chunks by time, not by a fixed token count, because what a row
costs depends on the machine by two orders of magnitude: on a GPU or an AMX CPU a forward's
cost is its weight pass and 32 extra rows ride nearly free; on an AVX2 CPU the same 32 rows
triple a 16-session decode step. So the cost is fitted online, ``t(rows) = base + per_row ×
rows``, by exponentially weighted least squares over the recent forwards (their row counts
vary on their own: blocks of different γ, decode steps, prefill chunks), and the batcher
asks it how many rows fit in a time budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Below this spread of recent row counts (rows², weighted variance) the slope is noise.
_MIN_ROWS_VARIANCE = 1.0


@dataclass(slots=True)
class ForwardCost:
    """Exponentially weighted least squares of forward seconds on rows.

    Owned by the batcher; written after each forward (on the model thread) and read while
    the next round is planned (on the event loop), never both at once: the actor awaits
    the forward before it plans again.
    """

    half_life_forwards: float = 64.0
    _weight: float = 0.0
    _sum_rows: float = 0.0
    _sum_s: float = 0.0
    _sum_rows2: float = 0.0
    _sum_rows_s: float = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        decay = 0.5 ** (1.0 / self.half_life_forwards)
        self._weight = self._weight * decay + 1.0
        self._sum_rows = self._sum_rows * decay + rows
        self._sum_s = self._sum_s * decay + seconds
        self._sum_rows2 = self._sum_rows2 * decay + rows * rows
        self._sum_rows_s = self._sum_rows_s * decay + rows * seconds

    def identified_fit(self) -> tuple[float, float] | None:
        """``fit()`` only where the recent row counts varied enough to tell the base from
        the slope (the edge chooses γ with it, and a line through the origin would make
        every row look dear) and rows cost time (a slope ≤ 0 is noise); else None."""
        fitted = self.fit()
        if fitted is None or self._rows_variance() < _MIN_ROWS_VARIANCE:
            return None
        return fitted if fitted[1] > 0.0 else None

    def _rows_variance(self) -> float:
        """The weighted variance of recent row counts (call only with rows measured)."""
        mean_rows = self._sum_rows / self._weight
        return self._sum_rows2 / self._weight - mean_rows * mean_rows

    def fit(self) -> tuple[float, float] | None:
        """(base_s, per_row_s); None before any forward with rows.

        While the recent forwards all had about the same rows (a long prompt's equal chunks,
        a steady batch) base and slope cannot be told apart: then the line goes through the
        origin, which overstates the per-row cost. The budget it gives is smaller than the
        truth, and its smaller chunks vary the rows enough for the real fit.
        """
        if self._weight <= 0.0 or self._sum_rows <= 0.0:
            return None
        mean_rows = self._sum_rows / self._weight
        mean_s = self._sum_s / self._weight
        variance = self._rows_variance()
        if variance < _MIN_ROWS_VARIANCE:
            return 0.0, mean_s / mean_rows
        per_row_s = (self._sum_rows_s / self._weight - mean_rows * mean_s) / variance
        return max(0.0, mean_s - per_row_s * mean_rows), per_row_s


@dataclass(frozen=True, slots=True)
class PrefillBudget:
    """How many prompt rows one round may prefill (Sarathi-style chunks, sized by time).

    A prompt with at most ``whole_tokens`` left is prefilled whole in one round, beside
    others' work too, while the round's prefill stays within ``chunk_tokens``: its user
    waits for the first token, the others lose one slower step (vLLM's short and long
    prefills). Longer prompts go in chunks. A round alone takes up to ``chunk_tokens``
    rows, fewer where its forward would pass ``round_s`` (so a request arriving meanwhile
    waits at most about that long); a round that also verifies or decodes for other
    sessions up to ``chunk_tokens_shared``, fewer where they would add more than ``share``
    of that forward's own cost (so those steps slow by at most that fraction). At least
    one row either way: a long prompt always moves. While the cost is not known yet (the
    first forwards) the caps alone apply.
    """

    chunk_tokens: int = 256
    chunk_tokens_shared: int = 32
    round_s: float = math.inf
    share: float = math.inf
    whole_tokens: int = 0

    def plan(self, rests: Sequence[int], cost: ForwardCost, work_rows: int) -> list[int]:
        """This round's rows for each prompt, given the tokens each has left in the order
        they are served (the batcher's: fewest left first). ``work_rows``: the verify and
        decode rows in the round or, where it has none, those due any moment (sessions
        between two blocks), which its prefill must delay by no more than the share."""
        chunk_rows = self.rows(cost, work_rows)
        used, taken = 0, []
        for rest in rests:
            if rest <= self.whole_tokens and used + rest <= self.chunk_tokens:
                take = rest
            else:
                take = max(0, min(rest, chunk_rows - used))
            taken.append(take)
            used += take
        return taken

    def rows(self, cost: ForwardCost, work_rows: int) -> int:
        """The chunk rows a round may prefill beside ``work_rows`` rows of verify and
        decode work (the time limits; whole short prompts come on top)."""
        fitted = cost.fit()
        alone = work_rows == 0
        cap = self.chunk_tokens if alone else min(self.chunk_tokens_shared, self.chunk_tokens)
        if fitted is None or fitted[1] <= 0.0:
            return cap  # unknown yet, or rows look free
        base_s, per_row_s = fitted
        budget_s = self.round_s - base_s if alone else self.share * (base_s + per_row_s * work_rows)
        if math.isinf(budget_s):
            return cap
        # (the 1e-9: a budget of exactly n rows stays n through float rounding)
        return max(1, min(cap, math.floor(budget_s / per_row_s + 1e-9)))
