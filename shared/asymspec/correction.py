"""Progressive correction after a rejection: the escalation ladder (AsymSpec §IV-B2, §IV-B3).

After the first rejection the cloud answers with a target top-K. The edge, which keeps the
draft row q of the rejected position, checks the certificate against the request's budget
and either draws the recovered token or asks for the next rung of the ladder: a larger K of
the same ordered support, then rounds of N exact proposals, then the full target row. The
cloud answers every rung from the one target row it retained for that position; it never
re-samples the block.

`Correction` is the edge's state machine for one rejected position; `answer` is the cloud's
side. Both are pure apart from the uniforms passed in, so services and tests share them.
The rungs and answers are the wire's own types (`CorrectionKind`, `TopK`, `Proposals`,
`FullRow`): what the cloud computes is what travels, and what arrives is what the edge uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from asymspec.fidelity import FidelityBudget
from asymspec.sampling import (
    as_float32,
    certificate,
    draw_proposals,
    first_accepted_proposal,
    residual,
    sample,
    sample_on_support,
    topk_support,
)
from asymspec.wire import CorrectionKind, FullRow, Payload, Proposals, TopK

Row = npt.NDArray[np.floating] | torch.Tensor


@dataclass(frozen=True, slots=True)
class Rung:
    """One step of the ladder: what the edge asks the cloud for."""

    kind: CorrectionKind
    size: int  # K for topk, N for proposals, 0 for full


@dataclass(frozen=True, slots=True)
class Ladder:
    """The escalation policy. use_topk=False is the `exact` correction mode (no top-K)."""

    topk_steps: tuple[int, ...] = (16, 256, 4096)
    num_proposals: int = 8
    proposal_rounds: int = 2
    use_topk: bool = True

    def __post_init__(self) -> None:
        if list(self.topk_steps) != sorted(set(self.topk_steps)) or not all(
            k > 0 for k in self.topk_steps
        ):
            raise ValueError(f"topk_steps must be positive and increasing, got {self.topk_steps}")
        if self.num_proposals < 1 or self.proposal_rounds < 0:
            raise ValueError("num_proposals must be >= 1 and proposal_rounds >= 0")

    def first_rung(self, topk_hopeless: bool) -> int:
        """The index where a rejection's ladder starts: rung 0, or past every top-K rung when
        none can certify (see `topk_hopeless`), which saves a downlink round trip each time."""
        return len(self.topk_steps) if topk_hopeless and self.use_topk else 0

    def rungs(self) -> tuple[Rung, ...]:
        topk = [Rung(CorrectionKind.TOPK, k) for k in self.topk_steps] if self.use_topk else []
        proposals = [Rung(CorrectionKind.PROPOSALS, self.num_proposals)] * self.proposal_rounds
        return (*topk, *proposals, Rung(CorrectionKind.FULL, 0))


def topk_hopeless(budget_remaining: float, truncated_target: bool) -> bool:
    """No top-K can ever be used: a bounded draw spends eps_K > 0 whenever delta_p > 0, and
    an untruncated target row (no top-k / top-p, temperature > 0) has delta_p > 0 at every
    K < |V|. A budget only shrinks, so this holds for the rest of the request."""
    return budget_remaining <= 0 and not truncated_target


@dataclass(frozen=True, slots=True)
class Recovered:
    """The recovered token and how it was obtained (for metrics and the budget)."""

    token: int
    kind: CorrectionKind
    size: int  # K reached, proposals seen, or 0 for the full row
    eps: float  # budget spent; 0 for exact paths


@dataclass(slots=True)
class Correction:
    """Edge side: resolve one rejected position, walking the ladder as responses arrive."""

    ladder: Ladder
    draft_row: Row  # [V] the retained q of the rejected position
    budget: FidelityBudget
    uniform: Callable[[], float]  # the request's source of u in [0, 1)
    # Whether p can have an empty tail short of the whole vocabulary (top-k / top-p / greedy
    # truncate it). If not, delta_p > 0 at every K < |V|, so no larger K can ever certify
    # within a spent budget, and those rungs would only cost downlink round trips.
    truncated_target: bool = True
    rung_index: int = 0
    proposals_seen: int = 0
    _rungs: tuple[Rung, ...] = field(init=False)

    def __post_init__(self) -> None:
        self._rungs = self.ladder.rungs()
        self.draft_row = as_float32(self.draft_row)

    @property
    def rung(self) -> Rung:
        """What the edge is waiting for (the first rung arrives with the verify result)."""
        return self._rungs[self.rung_index]

    def _advance(self) -> Rung:
        self.rung_index += 1
        return self.rung

    def _q(self, ids: npt.NDArray[np.integer]) -> npt.NDArray[np.floating]:
        return np.asarray(self.draft_row)[np.asarray(ids, dtype=np.int64)]

    def on_topk(
        self, ids: npt.NDArray[np.integer], probs: npt.NDArray[np.floating], delta_p: float
    ) -> Recovered | Rung:
        cert = certificate(probs, self._q(ids), delta_p)
        if cert.drawable and self.budget.fits(cert.eps):
            self.budget.spend(cert.eps)
            token = sample_on_support(ids, probs, self._q(ids), self.uniform())
            return Recovered(token, CorrectionKind.TOPK, len(ids), cert.eps)
        if topk_hopeless(self.budget.remaining, self.truncated_target) and delta_p > 0:
            return self._skip_topk()
        return self._advance()

    def _skip_topk(self) -> Rung:
        """Jump past the remaining top-K rungs to the first exact one."""
        while self._advance().kind is CorrectionKind.TOPK:
            pass
        return self.rung

    def on_proposals(
        self, ids: npt.NDArray[np.integer], probs: npt.NDArray[np.floating]
    ) -> Recovered | Rung:
        self.proposals_seen += len(ids)
        uniforms = np.array([self.uniform() for _ in range(len(ids))])
        token = first_accepted_proposal(ids, probs, self._q(ids), uniforms)
        if token is not None:
            return Recovered(token, CorrectionKind.PROPOSALS, self.proposals_seen, 0.0)
        return self._advance()

    def on_full(self, target_row: Row) -> Recovered:
        token = sample(residual(target_row, self.draft_row), self.uniform())
        return Recovered(token, CorrectionKind.FULL, 0, 0.0)

    def on_payload(self, payload: Payload) -> Recovered | Rung:
        """The cloud's answer to the rung this correction is waiting for."""
        if isinstance(payload, TopK):
            return self.on_topk(payload.token_ids, payload.probs, float(payload.delta_p))
        if isinstance(payload, Proposals):
            return self.on_proposals(payload.token_ids, payload.probs)
        return self.on_full(payload.probs)


def answer(rung: Rung, target_row: Row, uniform: Callable[[], float]) -> Payload:
    """Cloud side: answer one rung from the retained target row p of the rejected position."""
    if rung.kind is CorrectionKind.TOPK:
        return TopK(*topk_support(target_row, rung.size))
    if rung.kind is CorrectionKind.PROPOSALS:
        uniforms = np.array([uniform() for _ in range(rung.size)])
        return Proposals(*draw_proposals(target_row, uniforms))
    return FullRow(as_float32(target_row))


def resolve_locally(
    correction: Correction, target_row: Row, cloud_uniform: Callable[[], float]
) -> Recovered:
    """Run the whole ladder in-process (reference decoder and tests): ask, answer, repeat."""
    while True:
        outcome = correction.on_payload(answer(correction.rung, target_row, cloud_uniform))
        if isinstance(outcome, Recovered):
            return outcome
