"""What a target forward costs as a function of the rows it scores, measured as it runs.

The batcher sizes prefill chunks by time, not by a fixed token count, because what a row
costs depends on the machine by two orders of magnitude: on a GPU or an AMX CPU a forward's
cost is its weight pass and 32 extra rows ride nearly free; on an AVX2 CPU the same 32 rows
triple a 16-session decode step. So the cost is fitted online, ``t(rows) = base + per_row ×
rows``, by exponentially weighted least squares over the recent forwards (their row counts
vary on their own: blocks of different γ, decode steps, prefill chunks), and the batcher
asks it how many rows fit in a time budget. Beside that line it fits the keys the rows
attend as a second regressor (``fit_with_keys``): a prompt row deep into a long prompt
reads every position before it, which the rows alone do not show.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from asymspec_engine.target import attended_keys

# Below this spread of recent row counts (rows², weighted variance) the slope is noise.
_MIN_ROWS_VARIANCE = 1.0
# Rows and attended keys tell their costs apart only where they did not move together: the
# squared correlation of the recent forwards' rows and keys must stay under this.
_MAX_ROWS_KEYS_R2 = 0.95


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
    # the attended keys (``attended_keys``) as a second regressor (``fit_with_keys``)
    _sum_keys: float = 0.0
    _sum_keys2: float = 0.0
    _sum_rows_keys: float = 0.0
    _sum_keys_s: float = 0.0

    def observe(self, rows: int, seconds: float, keys: int = 0) -> None:
        """One forward: the rows it was fed, its seconds, and the keys its rows attended
        (the sum of ``attended_keys`` over its sessions; 0 where not known)."""
        decay = 0.5 ** (1.0 / self.half_life_forwards)
        self._weight = self._weight * decay + 1.0
        self._sum_rows = self._sum_rows * decay + rows
        self._sum_s = self._sum_s * decay + seconds
        self._sum_rows2 = self._sum_rows2 * decay + rows * rows
        self._sum_rows_s = self._sum_rows_s * decay + rows * seconds
        # (keys in thousands: squares of a few million keys stay well inside a float)
        k = keys / 1000.0
        self._sum_keys = self._sum_keys * decay + k
        self._sum_keys2 = self._sum_keys2 * decay + k * k
        self._sum_rows_keys = self._sum_rows_keys * decay + rows * k
        self._sum_keys_s = self._sum_keys_s * decay + k * seconds

    def fit_with_keys(self) -> tuple[float, float, float] | None:
        """(base_s, per_row_s, per_key_s) of ``t = base + per_row × rows + per_key ×
        keys``, or None where rows and keys did not vary apart enough to tell their costs
        apart (a steady batch, one prompt's equal chunks) or a cost came out negative
        (noise).

        Why keys: a prompt row's attention reads every position before it. Beside a
        one-row decode step on an AMX CPU (2 threads, 11.7 ms alone), 15 rows of a prompt
        1,000 tokens in cost +60 %, where the rows-only fit, made mostly of decode and
        verify rows that attend short prefixes, said a few percent
        (``loadtest/results/prefill-keys/`` in git history)."""
        w = self._weight
        if w <= 0.0:
            return None
        mean_r, mean_k, mean_s = self._sum_rows / w, self._sum_keys / w, self._sum_s / w
        var_r = self._sum_rows2 / w - mean_r * mean_r
        var_k = self._sum_keys2 / w - mean_k * mean_k
        cov_rk = self._sum_rows_keys / w - mean_r * mean_k
        cov_rs = self._sum_rows_s / w - mean_r * mean_s
        cov_ks = self._sum_keys_s / w - mean_k * mean_s
        if var_r < _MIN_ROWS_VARIANCE or var_k <= 0.0:
            return None
        if cov_rk * cov_rk >= _MAX_ROWS_KEYS_R2 * var_r * var_k:
            return None
        det = var_r * var_k - cov_rk * cov_rk
        per_row = (cov_rs * var_k - cov_ks * cov_rk) / det
        per_key = (cov_ks * var_r - cov_rs * cov_rk) / det  # per thousand keys
        base = mean_s - per_row * mean_r - per_key * mean_k
        if per_row <= 0.0 or per_key <= 0.0 or base < 0.0:
            return None
        return base, per_row, per_key / 1000.0

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
    of that forward's own cost (so those steps slow by at most that fraction). A round
    with no such work that prefills short prompts whole is their users' first-token wait:
    a long prompt's chunk beside them is held to the share of their rows, as beside work.
    At least one row either way: a long prompt always moves. While the cost is not known
    yet (the first forwards) the caps alone apply.

    Beside work on an engine that pads its products' rows (``padded_rows``: the rows a
    forward fed n positions computes), each row the padded frame grows by counts at the
    slope too, on top of each prompt row. A CPU computing 16-row tiles runs a 1-row decode
    step as 16 rows: 15 prompt rows ride in its padding, at the cost of their attention;
    the 16th pads the round to 32, and those 16 rows cost products. Measured on an AMX
    CPU, 2 threads, a 1-row step beside chunks of a 1,000-token prompt (33 ms alone, fitted
    slope ~0.6 ms): 15 rows added 8 ms, 16 rows 18 ms, 23 rows 25 ms, 31 rows 28 ms; the
    slope alone said 9, 10, 14 and 19 ms, and let 22 rows beside a step that the share
    allowed 30 % slow it by 75 % (``loadtest/results/prefill-tiles/`` in git history).
    """

    chunk_tokens: int = 256
    chunk_tokens_shared: int = 32
    round_s: float = math.inf
    share: float = math.inf
    whole_tokens: int = 0

    def plan(
        self,
        rests: Sequence[int],
        cost: ForwardCost,
        work_rows: int,
        padded_rows: Callable[[int], int] | None = None,
        dones: Sequence[int] | None = None,
    ) -> list[int]:
        """This round's rows for each prompt, given the tokens each has left in the order
        they are served (the batcher's: fewest left first). ``work_rows``: the verify and
        decode rows in the round or, where it has none, those due any moment (sessions
        between two blocks, or about to ask for their first), which its prefill must delay
        by no more than the share. ``padded_rows``: the rows a forward fed n positions
        computes, where the engine pads them (None: exactly n). ``dones``: the tokens each
        prompt has in the cache already, which its chunk's rows attend (None: unknown)."""
        taken = [0] * len(rests)
        whole_rows = 0
        for i, rest in enumerate(rests):
            if rest > self.whole_tokens or whole_rows + rest > self.chunk_tokens:
                continue
            taken[i] = rest
            whole_rows += rest
        chunked = [i for i in range(len(rests)) if taken[i] == 0 and rests[i] > 0]
        prefix = None if dones is None or not chunked else dones[chunked[0]]
        chunk_rows = self.rows(cost, work_rows, padded_rows, prefix)
        if work_rows == 0 and whole_rows > 0:  # the whole prompts are the work it is beside
            beside = self.rows(cost, whole_rows, padded_rows, prefix)
            chunk_rows = min(chunk_rows, whole_rows + beside)
        used = whole_rows  # the whole prompts take their rows of the chunk
        for i in range(len(rests)):
            if taken[i] == 0 and rests[i] > 0:
                taken[i] = max(0, min(rests[i], chunk_rows - used))
                used += taken[i]
        return taken

    def rows(
        self,
        cost: ForwardCost,
        work_rows: int,
        padded_rows: Callable[[int], int] | None = None,
        prefix: int | None = None,
    ) -> int:
        """The chunk rows a round may prefill beside ``work_rows`` rows of verify and
        decode work (the time limits; whole short prompts come on top). ``prefix``: the
        positions cached before the chunk, which its rows attend: where the forward cost
        tells attended keys apart (``ForwardCost.fit_with_keys``), beside work each row
        costs its keys too (None: rows alone)."""
        fitted = cost.fit()
        alone = work_rows == 0
        cap = self.chunk_tokens if alone else min(self.chunk_tokens_shared, self.chunk_tokens)
        if fitted is None or fitted[1] <= 0.0:
            return cap  # unknown yet, or rows look free
        base_s, per_row_s = fitted
        if alone:
            budget_s = self.round_s - base_s
            if math.isinf(budget_s):
                return cap
            # (the 1e-9: a budget of exactly n rows stays n through float rounding)
            return max(1, min(cap, math.floor(budget_s / per_row_s + 1e-9)))
        budget_rows = self.share * (base_s / per_row_s + work_rows)  # in rows at the slope
        if math.isinf(budget_rows):
            return cap
        with_keys = None if prefix is None else cost.fit_with_keys()

        def added_rows(take: int) -> float:
            """What ``take`` prompt rows add to the round, in rows at the slope: each row,
            the rows the padded frame grows by, and (where known) the keys they attend."""
            rows = take
            if padded_rows is not None:
                rows += padded_rows(work_rows + take) - padded_rows(work_rows)
            if with_keys is None or prefix is None:
                return rows
            _, row_s, key_s = with_keys
            return (rows * row_s + attended_keys(prefix, take) * key_s) / per_row_s

        take = min(cap, math.floor(budget_rows + 1e-9))
        while take > 1 and added_rows(take) > budget_rows + 1e-9:
            take -= 1
        return max(1, take)
