"""A request's sampling settings, the one type for them on both sides of the wire: the
math (`asymspec.sampling`) transforms rows with it, and the wire's `SamplingConfig` carries
it with the request's seed. Plain numbers only, so the wire needs no torch for it.

`SamplingParams` is the position-independent part of the transform (a row's result depends
on its logits alone); `Penalties` is the part that also reads the tokens before the row
(`asymspec.constraint` applies it, with a grammar, on both sides from the same tokens)."""

from __future__ import annotations

import math
from dataclasses import dataclass

LogitBias = tuple[tuple[int, float], ...]  # (token id, bias) sorted by id: hashable, canonical


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The request's sampling transform. temperature 0 means greedy (a one-hot row)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1.0 disables top-p
    min_p: float = 0.0  # 0 disables min-p: drop tokens below min_p x the top probability
    logit_bias: LogitBias = ()  # added to the logits before anything else (OpenAI's)

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        ids = [token for token, _ in self.logit_bias]
        if ids != sorted(set(ids)) or any(token < 0 for token in ids):
            raise ValueError("logit_bias must hold distinct token ids >= 0, sorted")
        if not all(math.isfinite(bias) for _, bias in self.logit_bias):
            raise ValueError("logit_bias values must be finite")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_truncated(self) -> bool:
        """The transformed row is zero outside a support (greedy, top-k, top-p or min-p), so
        a large enough top-K holds all of its mass."""
        return self.is_greedy or self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


@dataclass(frozen=True, slots=True)
class Penalties:
    """vLLM's penalties, which read the tokens before each row: ``repetition`` (HF/CTRL's,
    over prompt and output: a seen token's positive logit is divided by it, a negative one
    multiplied), ``presence`` and ``frequency`` (OpenAI's, over the output only: minus
    presence once a token appeared, minus frequency per appearance)."""

    repetition: float = 1.0  # 1 disables
    presence: float = 0.0
    frequency: float = 0.0

    def __post_init__(self) -> None:
        if not (self.repetition > 0.0 and math.isfinite(self.repetition)):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition}"
            )
        for name, value in (("presence", self.presence), ("frequency", self.frequency)):
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name}_penalty must be in [-2, 2], got {value}")

    @property
    def active(self) -> bool:
        return self.repetition != 1.0 or self.presence != 0.0 or self.frequency != 0.0


NO_PENALTIES = Penalties()
