"""A request's sampling settings, the one type for them on both sides of the wire: the
math (`asymspec.sampling`) transforms rows with it, and the wire's `SamplingConfig` carries
it with the request's seed. Plain numbers only, so the wire needs no torch for it."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The request's sampling transform. temperature 0 means greedy (a one-hot row)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1.0 disables top-p

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_truncated(self) -> bool:
        """The transformed row is zero outside a support (greedy, top-k or top-p), so a
        large enough top-K holds all of its mass."""
        return self.is_greedy or self.top_k > 0 or self.top_p < 1.0
