"""The settings both services share (engine, device, dtype, threads, session capacity; the
HTTP head timeout), as a base class: each service's settings class adds its own env prefix
and fields.

``load`` is the one place a service turns these into a loaded engine, so the edge and
the cloud pick the engine and apply threads, device and dtype the same way and log what
they got.
"""

from __future__ import annotations

import logging
import os
from typing import ClassVar, Literal

import torch
from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from asymspec.modes import Mode, get_mode
from asymspec_engine.engine import SessionLM
from asymspec_engine.feature_draft import FeatureLM
from asymspec_engine.hardware import Role, colocated_threads, pick_device, resolve_precision
from asymspec_engine.loading import EngineName, EngineOptions, load_session_lm

log = logging.getLogger("asymspec.runtime")


class RuntimeSettings(BaseSettings):
    role: ClassVar[Role]  # which share of a colocated host's cores this service takes

    engine: EngineName = Field(
        "auto",
        description="Inference engine: auto = llama.cpp on a CPU for a model with a GGUF "
        "file (the embedded pair has one), else torch; llama.cpp; torch (the exact float32 "
        "reference on CPUs, and the CUDA path).",
    )
    device: str = Field("", description="torch device; empty = CUDA when present, else CPU.")
    threads: int = Field(
        0,
        ge=0,
        description="Engine threads; 0 = automatic: a share of the cores when "
        "ASYMSPEC_COLOCATED is set (edge and cloud on one host), else every core.",
    )
    max_sessions: int = Field(
        16,
        ge=1,
        le=256,
        description="llama.cpp: sessions (requests) the engine holds at once, each its own "
        "KV stream; more wait for a free one.",
    )
    session_tokens: int = Field(
        4096,
        ge=16,
        description="llama.cpp: the most tokens (prompt + output) one session holds; KV "
        "memory is max_sessions x session_tokens cells.",
    )
    prefix_reuse: bool = Field(
        True,
        description="llama.cpp: keep closed sessions' KV streams, so that a new session "
        "sharing one's prefix (an agent's next round) is prefilled only past it.",
    )
    prefix_cache_mib: int = Field(
        2048,
        ge=0,
        description="llama.cpp: host memory (MiB) for closed sessions' KV cells once their "
        "streams go to new sessions, as llama-server's --cache-ram; 0 = off.",
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
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto",
        description="torch engine precision: auto = bf16 on CUDA, float32 on CPUs (the "
        "exact mode: greedy output identical to the target's).",
    )

    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A connection whose request head (request line and headers) is not in "
        "within this many seconds is closed (slowloris).",
    )

    def resolved_threads(self) -> int | None:
        """The thread count to set, or None for the engine's default (every core)."""
        if self.threads:
            return self.threads
        if not self.colocated:
            return None
        return colocated_threads(self.role, self.edge_mode())

    def edge_mode(self) -> Mode:
        """The mode the (colocated) edge runs; the edge's own settings know it first-hand."""
        return get_mode(self.colocated_mode)

    def load(self, name_or_path: str) -> tuple[SessionLM | FeatureLM, PreTrainedTokenizerBase]:
        """Set the threads, then load the model on the chosen engine, device and dtype."""
        threads = self.resolved_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        device = self.device or pick_device()
        precision = resolve_precision(self.dtype, device)
        options = EngineOptions(
            engine=self.engine,
            device=device,
            precision=precision,
            threads=threads or os.cpu_count() or 1,
            max_sessions=self.max_sessions,
            session_tokens=self.session_tokens,
            prefix_reuse=self.prefix_reuse,
            prefix_cache_bytes=self.prefix_cache_mib << 20,
        )
        # the engine this resolves to is logged with its reason when it loads
        log.info(
            "%s model %s: engine setting %s, %d threads (%s on %s if the torch engine runs it)",
            self.role,
            name_or_path,
            self.engine,
            options.threads,
            precision,
            device,
        )
        return load_session_lm(name_or_path, options)
