"""The operating modes (DESIGN.md §4): one switch so every baseline and ablation runs on the
same services and models.

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

    @property
    def speculative(self) -> bool:
        return self.scheduling not in ("target", "draft")


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
