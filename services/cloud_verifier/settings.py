"""Typed settings of the cloud verifier, read from the environment (prefix ASYMSPEC_CLOUD_)."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from asymspec.backends.embedded import EMBEDDED_TARGET
from asymspec.backends.hardware import colocated_threads


class CloudSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ASYMSPEC_CLOUD_", extra="ignore")

    target_model: str = Field(
        EMBEDDED_TARGET, description="Target model: an embedded name, a local path or a hub id."
    )
    served_model_name: str = Field("", description="Name in /v1/models; default: target_model.")
    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(8001, description="HTTP and WebSocket port.")
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
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto",
        description="Model dtype: auto = bf16 on CUDA and on CPUs with AMX-BF16 or "
        "AVX512-BF16, else float32; float32 keeps greedy output identical to the target's.",
    )
    max_batch_size: int = Field(32, ge=1, description="Most blocks verified in one forward.")
    prefill_chunk_tokens: int = Field(
        256,
        ge=1,
        description="Most prompt tokens prefilled per forward; the rest of a long prompt "
        "goes in later forwards, beside other sessions' verify and decode work.",
    )
    max_wait_ms: float = Field(
        1.0, ge=0, description="How long the batcher waits for more blocks after the first one."
    )
    shared_secret: str = Field(
        min_length=8,
        description="Edge<->cloud secret checked on the channel and control routes (required).",
    )
    max_sessions_per_edge: int = Field(1024, ge=1, description="Open sessions one edge may hold.")
    max_frame_bytes: int = Field(8 * 1024 * 1024, description="Largest accepted channel frame.")
    max_context_tokens: int = Field(8192, ge=16, description="Longest prompt + generation.")

    def resolved_torch_threads(self) -> int | None:
        """The thread count to set, or None to keep torch's default."""
        if self.torch_threads:
            return self.torch_threads
        return colocated_threads("cloud") if self.colocated else None
