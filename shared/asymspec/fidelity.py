"""The per-request fidelity budget ledger (AsymSpec §IV-B2, eq. sum_j eps_j <= eps_req).

Every bounded (top-K) correction spends its certificate eps_K; exact corrections spend 0.
The ledger is the only owner of a request's spent budget and refuses any spend that would
take the total past eps_req, so eps_req = 0 admits only exact corrections.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class FidelityBudget:
    epsilon_req: float  # the request's total TV budget; 0 = every correction exact
    spent: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.epsilon_req <= 1.0:
            raise ValueError(f"fidelity budget must be in [0, 1], got {self.epsilon_req}")

    @property
    def remaining(self) -> float:
        return self.epsilon_req - self.spent

    def fits(self, eps: float) -> bool:
        """Whether spending eps keeps the total within eps_req (checked on the sum we'd store)."""
        return eps >= 0.0 and (eps == 0.0 or self.spent + eps <= self.epsilon_req)

    def spend(self, eps: float) -> None:
        if not self.fits(eps):
            raise ValueError(f"spending {eps} would exceed the budget ({self.remaining} left)")
        self.spent += eps
