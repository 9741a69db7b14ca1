"""Typed settings of the cloud verifier, read from the environment (prefix ASYMSPEC_CLOUD_)."""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from asymspec_engine.embedded import EMBEDDED_TARGET
from asymspec_engine.hardware import ForwardThreads, Role, colocated_threads
from asymspec_engine.runtime_settings import RuntimeSettings
from cloud_verifier.forward_cost import PrefillBudget


class CloudSettings(RuntimeSettings):
    role: ClassVar[Role] = "cloud"

    model_config = SettingsConfigDict(env_prefix="ASYMSPEC_CLOUD_", extra="ignore")

    target_model: str = Field(
        EMBEDDED_TARGET, description="Target model: an embedded name, a local path or a hub id."
    )
    served_model_name: str = Field("", description="Name in /v1/models; default: target_model.")
    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(8001, description="HTTP and WebSocket port.")
    max_batch_size: int = Field(32, ge=1, description="Most blocks verified in one forward.")
    prefill_chunk_tokens: int = Field(
        256,
        ge=1,
        description="Most prompt tokens prefilled per forward; the rest of a long prompt "
        "goes in later forwards, beside other sessions' verify and decode work.",
    )
    prefill_chunk_tokens_shared: int = Field(
        32,
        ge=1,
        description="Most prompt tokens prefilled in a forward that also verifies or decodes "
        "for other sessions.",
    )
    prefill_whole_tokens: int = Field(
        256,
        ge=0,
        description="A prompt of at most this many tokens is prefilled whole in one forward "
        "(within prefill_chunk_tokens), beside others' work too: its first token comes "
        "one forward after it arrives. Longer prompts go in chunks.",
    )
    prefill_round_ms: float = Field(
        200.0,
        gt=0,
        description="A forward that only prefills takes fewer tokens than the chunk where it "
        "would run longer than this (by the forward cost measured as the target runs): "
        "a request arriving meanwhile waits about this long at most.",
    )
    prefill_share: float = Field(
        0.3,
        gt=0,
        description="Beside other sessions' work, prefill tokens may add at most this "
        "fraction to that forward's measured cost (their steps slow by at most as much).",
    )
    max_wait_ms: float = Field(
        1.0, ge=0, description="How long the batcher waits for more blocks after the first one."
    )
    shared_secret: str = Field(
        "",
        description="One secret every edge presents (the simplest mode, for one edge); also "
        "admits the control routes. Empty = edges need a certificate or their own token.",
    )
    coalesce_frames: bool = Field(
        True,
        description="Channel frames written in one turn of the event loop (the verdicts of "
        "one batch) leave in one write: one TLS record, one TCP segment where they fit.",
    )
    ssl_certfile: str = Field("", description="PEM certificate chain: serve https/wss.")
    ssl_keyfile: str = Field("", description="PEM private key of ssl_certfile.")
    ssl_ca_certs: str = Field(
        "",
        description="PEM CA(s) that sign edge certificates: the channel then admits only an "
        "edge presenting one (mutual TLS; its identity is the certificate's subject).",
    )
    edge_tokens_file: Path | None = Field(
        None,
        description="Per-edge tokens: lines of '<edge id> sha256:<hex of the token's "
        "SHA-256>'; re-read on SIGHUP.",
    )
    revoked_edges_file: Path | None = Field(
        None,
        description="Edge identities refused (one a line: a certificate subject such as "
        "CN=edge-a, or a token's edge id); re-read on SIGHUP, which cuts their channels.",
    )
    max_sessions_per_edge: int = Field(1024, ge=1, description="Open sessions one edge may hold.")
    max_frame_bytes: int = Field(8 * 1024 * 1024, description="Largest accepted channel frame.")
    handshake_timeout_s: float = Field(
        10.0, gt=0, description="How long a new channel connection may take to send its Hello."
    )
    max_context_tokens: int = Field(8192, ge=16, description="Longest prompt + generation.")

    @model_validator(mode="after")
    def _edges_authenticate(self) -> CloudSettings:
        if self.shared_secret and len(self.shared_secret) < 8:
            raise ValueError("shared_secret must have at least 8 characters")
        if not (self.shared_secret or self.ssl_ca_certs or self.edge_tokens_file):
            raise ValueError(
                "no way for an edge to authenticate: set shared_secret, ssl_ca_certs "
                "(client certificates) or edge_tokens_file"
            )
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("ssl_certfile and ssl_keyfile go together")
        if self.ssl_ca_certs and not self.ssl_certfile:
            raise ValueError("ssl_ca_certs (client certificates) needs ssl_certfile and keyfile")
        return self

    def tls_options(self) -> dict[str, Any]:
        if not self.ssl_certfile:
            return {}
        options: dict[str, Any] = {
            "ssl_certfile": self.ssl_certfile,
            "ssl_keyfile": self.ssl_keyfile,
        }
        if self.ssl_ca_certs:
            # Optional at the TLS layer, so that probes and Prometheus reach /health and
            # /metrics without one; a certificate that is presented must verify, and the
            # channel refuses an edge without one, with a reason it can report.
            options |= {"ssl_ca_certs": self.ssl_ca_certs, "ssl_cert_reqs": ssl.CERT_OPTIONAL}
        return options

    def prefill_budget(self) -> PrefillBudget:
        return PrefillBudget(
            chunk_tokens=self.prefill_chunk_tokens,
            chunk_tokens_shared=self.prefill_chunk_tokens_shared,
            round_s=self.prefill_round_ms / 1000,
            share=self.prefill_share,
            whole_tokens=self.prefill_whole_tokens,
        )

    def forward_threads(self) -> ForwardThreads | None:
        """Colocated with automatic threads: every core while one session is open, the
        colocated split otherwise; else None (the thread count never changes)."""
        if self.threads or not self.colocated:
            return None
        shared = colocated_threads(self.role, self.edge_mode())
        return ForwardThreads(shared=shared, solo=os.cpu_count() or shared)
