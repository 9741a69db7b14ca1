"""The operating modes: one switch so every baseline and ablation runs on the same services
and models (the README's "Modes" table).

Three knobs: the uplink (`compact` = token + q(token); `full` = the whole q row per position
in float16), the correction (`progressive` = top-K certificate -> proposals -> full row;
`exact` = proposals -> full row; `cloud` = the cloud samples the exact residual from the
uploaded q) and the scheduling (`pipeline`, `sync`, `runahead`, `stop-and-wait`). Two modes
skip speculation: `target-only` (the cloud decodes alone) and `draft-only` (the edge does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Uplink = Literal["compact", "full", "none"]
CorrectionMode = Literal["progressive", "exact", "cloud", "none"]
Scheduling = Literal["pipeline", "sync", "runahead", "stop-and-wait", "target", "draft"]


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    uplink: Uplink
    correction: CorrectionMode
    scheduling: Scheduling
    stands_for: str

    # Behaviour switches, named once here instead of string comparisons at every use.

    @property
    def speculative(self) -> bool:
        return self.scheduling not in ("target", "draft")

    @property
    def needs_cloud(self) -> bool:
        """Everything but draft-only talks to the cloud verifier."""
        return self.scheduling != "draft"

    @property
    def is_target_only(self) -> bool:
        return self.scheduling == "target"

    @property
    def is_draft_only(self) -> bool:
        return self.scheduling == "draft"

    @property
    def uploads_full_rows(self) -> bool:
        """The whole q row per draft position goes up (float16), as in the baselines."""
        return self.uplink == "full"

    @property
    def uses_topk(self) -> bool:
        """Corrections start with a top-K certificate (the progressive ladder)."""
        return self.correction == "progressive"

    @property
    def waits_alone(self) -> bool:
        """Stop-and-wait: each request drafts and waits alone, no cross-request batching."""
        return self.scheduling == "stop-and-wait"

    @property
    def runs_ahead(self) -> bool:
        """Drafts the next block from the unconfirmed prefix while one is out (PipeInfer)."""
        return self.scheduling == "runahead"

    @property
    def pipelines(self) -> bool:
        """The confirmed-prefix pipeline: a request drafts as soon as its verdict is back,
        while other requests' blocks are verified."""
        return self.scheduling == "pipeline"

    @property
    def first_token_from_prefill(self) -> bool:
        """The cloud samples a speculating request's first token from its prompt's last
        row, sent down behind the open, so the first token costs one trip to the cloud, as
        target-only's does; the first block drafts from it. The system and its ablations;
        the baselines draft their first token as the systems they stand for do."""
        return self.uplink == "compact"

    @property
    def drafts_in_rounds(self) -> bool:
        """Synchronous rounds: draft every active request, send, wait for all results."""
        return self.scheduling in ("sync", "runahead")


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("asymspec", "compact", "progressive", "pipeline", "the system (Table II Full)"),
        Mode("no-topk", "compact", "exact", "pipeline", "ablation: No top-K"),
        Mode("no-pipeline", "compact", "progressive", "sync", "ablation: No pipeline"),
        Mode("runahead", "compact", "progressive", "runahead", "ablation: No pipeline + runahead"),
        Mode("full-upload", "full", "cloud", "pipeline", "No asymmetric correction; CoSine-like"),
        Mode("pipeinfer", "full", "cloud", "runahead", "PipeInfer-like baseline"),
        Mode("standard", "full", "cloud", "stop-and-wait", "Standard Spec; SPADE's system"),
        Mode("target-only", "none", "none", "target", "SPADE Target: the cloud decodes alone"),
        Mode("draft-only", "none", "none", "draft", "SPADE Draft: the edge decodes alone"),
    )
}
BASELINES = ("standard", "full-upload", "pipeinfer")


def get_mode(name: str) -> Mode:
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"unknown mode {name!r}; choose one of {', '.join(MODES)}") from None
