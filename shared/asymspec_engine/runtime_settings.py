"""The settings both services share (device, dtype, torch threads; the HTTP head timeout),
as a base class: each service's settings class adds its own env prefix and fields.

``load`` is the one place a service turns these into a loaded engine, so the edge and
the cloud apply threads, device and dtype the same way and log what they got.
"""

from __future__ import annotations

import logging
from typing import ClassVar, Literal

import torch
from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from asymspec_engine.engine import SessionLM
from asymspec_engine.feature_draft import FeatureLM
from asymspec_engine.hardware import Role, colocated_threads, pick_device, resolve_precision
from asymspec_engine.loading import load_session_lm
from asymspec.modes import Mode, get_mode

log = logging.getLogger("asymspec.runtime")


class RuntimeSettings(BaseSettings):
    role: ClassVar[Role]  # which share of a colocated host's cores this service takes

    device: str = Field("", description="torch device; empty = CUDA when present, else CPU.")
    torch_threads: int = Field(
        0,
        ge=0,
        description="torch intra-op threads; 0 = automatic: a share of the cores when "
        "ASYMSPEC_COLOCATED is set (edge and cloud on one host), else torch's default.",
    )
    colocated: bool = Field(
        False,
        validation_alias=AliasChoices("ASYMSPEC_COLOCATED", "colocated"),
        description="The edge and the cloud share this host (make run, compose): split the "
        "cores between them instead of both taking all.",
    )
    colocated_mode: str = Field(
        "asymspec",
        validation_alias=AliasChoices("ASYMSPEC_MODE", "colocated_mode"),
        description="The edge's operating mode (the shared ASYMSPEC_MODE). Colocated, it "
        "decides the split: target-only gives the cloud every core, draft-only the edge.",
    )
    dtype: Literal["auto", "bfloat16", "float32", "float16-weights"] = Field(
        "auto",
        description="Model precision: auto = bf16 on CUDA and on CPUs with AMX-BF16 or "
        "AVX512-BF16, float16-weights (float32 activations, FBGEMM fp16 weights) on other "
        "x86 CPUs with AVX2, else float32; float32 keeps greedy output identical to the "
        "target's.",
    )

    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A connection whose request head (request line and headers) is not in "
        "within this many seconds is closed (slowloris).",
    )

    def resolved_torch_threads(self) -> int | None:
        """The thread count to set, or None to keep torch's default."""
        if self.torch_threads:
            return self.torch_threads
        if not self.colocated:
            return None
        return colocated_threads(self.role, self.edge_mode())

    def edge_mode(self) -> Mode:
        """The mode the (colocated) edge runs; the edge's own settings know it first-hand."""
        return get_mode(self.colocated_mode)

    def load(self, name_or_path: str) -> tuple[SessionLM | FeatureLM, PreTrainedTokenizerBase]:
        """Set the threads, then load the model on the resolved device and dtype."""
        threads = self.resolved_torch_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        device = self.device or pick_device()
        precision = resolve_precision(self.dtype, device)
        log.info(
            "%s model %s on %s in %s, %d torch threads",
            self.role,
            name_or_path,
            device,
            precision,
            torch.get_num_threads(),
        )
        return load_session_lm(name_or_path, device, precision)
