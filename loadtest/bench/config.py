"""The benchmark's configuration and the model pair it serves.

Two pairs: ``embedded`` (the real default pair, prepared by ``make models``) and ``tiny``
(the tests' random-weight pair, written on the fly: seconds to build, for a smoke run of the
harness, not for figures).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from asymspec.links import PROFILES
from asymspec.modes import MODES
from asymspec_engine.embedded import EMBEDDED_DRAFT, EMBEDDED_TARGET, embedded_path
from loadtest.bench.workload import WORKLOADS, Sampling

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "loadtest" / "results"
DEFAULT_PROFILES = ("weak", "medium", "strong")
ModelsChoice = Literal["tiny", "embedded"]
# The tiny Llama has 1024 positions; the longest held-out prompt is 819 of its tokens.
_TINY_MAX_MODEL_LEN = 1024


@dataclass(frozen=True)
class ModelPair:
    kind: ModelsChoice
    target: str  # an embedded name or a checkpoint folder
    draft: str
    max_model_len: int | None = None  # None: the edge's default


@dataclass(frozen=True)
class BenchConfig:
    modes: tuple[str, ...] = tuple(MODES)
    profiles: tuple[str, ...] = DEFAULT_PROFILES
    requests: int = 16
    concurrency: int = 8
    warmup: int = 2
    sampling: Sampling = field(default_factory=Sampling)
    models: ModelsChoice = "embedded"
    out: Path = RESULTS_DIR / "latest"
    seed: int = 0
    rate_check_s: float = 3.0  # per direction and profile
    cell_timeout_s: float = 1800.0  # one (mode, profile) cell, start-up included
    # The edge's goodput pause (speculation paused where the cloud decoding alone gives
    # more). Off: the table compares the modes' mechanisms, each speculating throughout.
    goodput_pause: bool = False
    # What a cell sends: HumanEval requests, or (agent) multi-round agent conversations,
    # `requests` of them, each of three rounds replayed with the model's own answers
    workload: str = "humaneval"

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; choose from {WORKLOADS}")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise ValueError(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
        bad = [p for p in self.profiles if p not in PROFILES]
        if bad:
            raise ValueError(f"unknown profiles {bad}; choose from {', '.join(PROFILES)}")
        if self.requests < 1 or self.concurrency < 1 or self.warmup < 0:
            raise ValueError("need requests >= 1, concurrency >= 1, warmup >= 0")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["out"] = str(self.out)
        return out


def default_run_dir(models: ModelsChoice, now: float | None = None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return RESULTS_DIR / f"{models}-{stamp}"


def parse_list(value: str, allowed: Sequence[str]) -> tuple[str, ...]:
    """A comma-separated CLI list; ``all`` means every allowed value."""
    if value.strip() == "all":
        return tuple(allowed)
    return tuple(v.strip() for v in value.split(",") if v.strip())


def prepare_pair(models: ModelsChoice, work_dir: Path) -> ModelPair:
    """The pair to serve: checks that the embedded one is prepared, or writes the tiny one."""
    if models == "embedded":
        embedded_path(EMBEDDED_TARGET)  # raises ModelNotPrepared with "run `make models`"
        embedded_path(EMBEDDED_DRAFT)
        return ModelPair("embedded", EMBEDDED_TARGET, EMBEDDED_DRAFT)
    # The tests' own pair (reused, not copied): imported here so the embedded path does not
    # depend on the test tree.
    from loadtest.tiny_models import save_tiny_pair

    target, draft = save_tiny_pair(work_dir / "tiny-pair")
    return ModelPair("tiny", str(target), str(draft), _TINY_MAX_MODEL_LEN)
