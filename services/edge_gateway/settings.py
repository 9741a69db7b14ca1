"""Typed settings of the edge gateway, read from the environment (prefix ASYMSPEC_EDGE_;
the mode is the shared ASYMSPEC_MODE)."""

from __future__ import annotations

import enum
from typing import Annotated, Any, ClassVar

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from asymspec.correction import Ladder
from asymspec.modes import MODES, Mode, get_mode
from asymspec_engine.draft import DEFAULT_COPY_WEIGHT
from asymspec_engine.embedded import EMBEDDED_DRAFT
from asymspec_engine.hardware import Role
from asymspec_engine.runtime_settings import RuntimeSettings
from asymspec_engine.suffix import SuffixConfig

# The batch above which a colocated edge (make run, the compose stack: both models on one
# host's cores) lets the cloud decode alone; measured with make run on 2 cores (see the
# README's "Measured so far").
COLOCATED_SPECULATIVE_BATCH_LIMIT = 1


class DraftLength(enum.Enum):
    """How the edge picks γ for a block a request did not pin."""

    FIXED = "fixed"
    ADAPTIVE = "adaptive"  # per request, HF assisted generation's schedule
    GOODPUT = "goodput"  # edge-wide, edge_gateway.draft_length

    @property
    def adapts_per_request(self) -> bool:
        return self is DraftLength.ADAPTIVE

    @property
    def maximises_goodput(self) -> bool:
        return self is DraftLength.GOODPUT


class EdgeSettings(RuntimeSettings):
    role: ClassVar[Role] = "edge"

    model_config = SettingsConfigDict(env_prefix="ASYMSPEC_EDGE_", extra="ignore")

    mode: str = Field(
        "asymspec",
        validation_alias=AliasChoices("ASYMSPEC_MODE", "ASYMSPEC_EDGE_MODE", "mode"),
        description=f"Operating mode: {', '.join(MODES)}.",
    )
    draft_model: str = Field(
        EMBEDDED_DRAFT, description="Draft model: an embedded name, a local path or a hub id."
    )
    draft_head_vocab: bool = Field(
        True,
        description="Restrict the draft's LM head to the tokens its folder's "
        "head_vocab.json lists (q = 0 elsewhere; exact, and most of the head's cost saved); "
        "false = the whole vocabulary.",
    )
    served_model_name: str = Field(
        "asymspec", description="The model id clients use in /v1/models and requests."
    )
    cloud_urls: Annotated[tuple[str, ...], NoDecode] = Field(
        ("ws://127.0.0.1:8001/v1/channel",),
        min_length=1,
        validation_alias=AliasChoices("ASYMSPEC_EDGE_CLOUD_URL", "cloud_urls"),
        description="The cloud verifier's channel URL; comma-separated for several replicas "
        "(sessions go to the least-loaded connected one, and move when theirs is lost).",
    )
    shared_secret: str = Field(
        "", description="The secret every edge of the cloud shares (the one-edge mode)."
    )
    edge_id: str = Field(
        "edge",
        validation_alias=AliasChoices("ASYMSPEC_EDGE_ID", "edge_id"),
        description="This edge's name in the handshake (the id its own token is listed under).",
    )
    cloud_token: str = Field(
        "", description="This edge's own token (the cloud lists its hash under edge_id)."
    )
    cloud_ca_certs: str = Field(
        "",
        description="PEM CA(s) the cloud's certificate must chain to (wss://); "
        "empty = the system's roots.",
    )
    cloud_certfile: str = Field(
        "", description="PEM client certificate presented to the cloud (mutual TLS)."
    )
    cloud_keyfile: str = Field("", description="PEM private key of cloud_certfile.")
    allow_plaintext: bool = Field(
        False,
        description="Send credentials over ws:// to a host that is not loopback (a private, "
        "trusted network only; else the edge refuses to connect).",
    )
    coalesce_frames: bool = Field(
        True,
        description="Channel frames written in one turn of the event loop leave in one write "
        "(one TLS record, one TCP segment where they fit) instead of one each.",
    )
    ssl_certfile: str = Field("", description="PEM certificate chain: serve the API on https.")
    ssl_keyfile: str = Field("", description="PEM private key of ssl_certfile.")
    api_keys: Annotated[frozenset[str], NoDecode] = Field(
        frozenset(), description="Accepted API keys (comma-separated); empty = no auth."
    )
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest request body.")
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A request body not fully received within this many seconds gets 408; "
        "a request counts against max_concurrent_requests only once its body is in.",
    )
    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(8000, description="HTTP port of the OpenAI-compatible API.")
    num_draft_tokens: int = Field(4, ge=1, le=16, description="Default γ per block.")
    draft_copy_weight: float = Field(
        DEFAULT_COPY_WEIGHT,
        ge=0.0,
        lt=1.0,
        description="λ: draft mass moved to the token that followed the context's last "
        "n-gram before (prompt lookup mixed into q); 0 = the draft model's q alone.",
    )
    suffix_drafting: bool = Field(
        True,
        description="Suffix drafting (docs/agents.md): where the context's longest repeated "
        "suffix, or this edge's recent outputs, predict a continuation and the goodput rule "
        "says it pays, the block is that continuation with q one-hot, with no draft forward.",
    )
    suffix_max_tokens: int = Field(
        32, ge=1, le=64, description="Longest suffix block (draft tokens verified at once)."
    )
    suffix_max_match: int = Field(
        32, ge=1, le=256, description="Longest suffix of the context matched against a text."
    )
    suffix_min_match: int = Field(
        2, ge=1, description="Shortest suffix match that proposes anything."
    )
    suffix_spec_factor: float = Field(
        1.0,
        gt=0.0,
        description="A suffix proposal is at most this many times its match length "
        "(SuffixDecoding's max_spec_factor: a short match earns a short guess).",
    )
    suffix_min_token_prob: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="A suffix proposal ends where its estimated probability of being right "
        "so far (product of next-token frequencies) falls below this.",
    )
    suffix_min_expected_tokens: float = Field(
        2.0,
        ge=0.0,
        description="Until the verifier's cost and the acceptances are known: the expected "
        "accepted tokens a suffix proposal needs to be drafted without the model.",
    )
    suffix_store_bytes: int = Field(
        4 * 1024 * 1024,
        ge=0,
        description="Bytes of recent outputs (4 a token) the edge keeps for suffix matches "
        "across requests, least recently used out first; 0 = the request's own context only.",
    )
    paused_look_tokens: int = Field(
        16,
        ge=1,
        description="While speculation is paused, a request looks every this many tokens the "
        "cloud decodes whether to speculate again (the pause ended, a suffix block pays).",
    )
    draft_stop_confidence: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="τ: a block ends after a draft token the draft gave (untempered, copy "
        "mixed in) less than this probability; 0 = every block drafts its full γ.",
    )
    draft_length: DraftLength = Field(
        DraftLength.GOODPUT,
        description="How γ is chosen when a request does not pin it: fixed (num_draft_tokens), "
        "adaptive (per request: +2 after a fully accepted block, -1 after a rejection) or "
        "goodput (the most expected tokens per second from measured acceptance, draft cost "
        "and the verifier's fitted forward cost; num_draft_tokens until those are known).",
    )
    max_num_draft_tokens: int = Field(
        8, ge=1, le=16, description="Upper bound of an adaptive or goodput γ."
    )
    goodput_pause: bool = Field(
        True,
        description="With goodput γ in a pipelined mode: speculation pauses while the cloud "
        "decoding alone gives a request more tokens per second than speculating, as measured "
        "per batch size (edge_gateway.mode_rates; the goodput model until both are), as it "
        "does above speculative_disable_by_batch_size.",
    )
    fidelity_budget: float = Field(
        0.0, ge=0.0, le=1.0, description="Default ε_req per request; 0 = every correction exact."
    )
    topk_steps: Annotated[tuple[int, ...], NoDecode] = Field(
        (16, 256, 4096), description="Top-K ladder (comma-separated in the environment)."
    )
    num_proposals: int = Field(8, ge=1, description="Exact proposals per round.")
    proposal_rounds: int = Field(2, ge=0, description="Proposal rounds before the full row.")
    max_draft_batch: int = Field(32, ge=1, description="Most requests in one draft forward.")
    draft_prefill_chunk_tokens: int = Field(
        256,
        ge=1,
        description="A longer prompt is prefilled into the draft in chunks of this many "
        "tokens, with the other requests' drafting between them.",
    )
    speculative_disable_by_batch_size: int | None = Field(
        None,
        ge=1,
        description="Speculation pauses while more requests than this decode at once: each "
        "then lets the cloud decode it alone (as target-only mode does, in the same "
        "rounds), and speculates again once the batch is back at or under it (vLLM's "
        "option of the same name). Unset: "
        f"{COLOCATED_SPECULATIVE_BATCH_LIMIT} when ASYMSPEC_COLOCATED is set (one host's "
        "cores shared by both models: the cloud, on every core while it decodes alone, "
        "outruns speculation at large batches), else never.",
    )
    max_concurrent_requests: int = Field(256, ge=1, description="Requests served at once.")
    max_model_len: int = Field(2048, ge=16, description="Prompt + completion token limit.")
    max_tokens_limit: int = Field(1024, ge=1, description="Largest max_tokens accepted.")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request has none.")
    cloud_deadline_s: float = Field(
        30.0, gt=0, description="How long a request waits for an absent cloud before failing."
    )
    cloud_reply_timeout_s: float = Field(
        60.0,
        gt=0,
        description="How long one request to a connected cloud (open with its prefill, "
        "verify, correction) may go unanswered before the request fails with 504.",
    )

    @field_validator("topk_steps", "cloud_urls", "api_keys", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        """Comma-separated lists from the environment; pydantic then makes each item the
        field's type (ints for topk_steps) and the collection the field's (a frozenset)."""
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        return value

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, value: str) -> str:
        get_mode(value)
        return value

    @model_validator(mode="after")
    def _credentials(self) -> EdgeSettings:
        for name in ("shared_secret", "cloud_token"):
            if 0 < len(getattr(self, name)) < 8:
                raise ValueError(f"{name} must have at least 8 characters")
        needs_cloud = self.operating_mode.needs_cloud
        if needs_cloud and not (self.shared_secret or self.cloud_token or self.cloud_certfile):
            raise ValueError(
                "no credential for the cloud: set shared_secret, cloud_token (with edge_id) "
                "or cloud_certfile and cloud_keyfile (mutual TLS)"
            )
        for cert, key in (("cloud_certfile", "cloud_keyfile"), ("ssl_certfile", "ssl_keyfile")):
            if bool(getattr(self, cert)) != bool(getattr(self, key)):
                raise ValueError(f"{cert} and {key} go together")
        return self

    def tls_options(self) -> dict[str, Any]:
        if not self.ssl_certfile:
            return {}
        return {"ssl_certfile": self.ssl_certfile, "ssl_keyfile": self.ssl_keyfile}

    @property
    def operating_mode(self) -> Mode:
        return get_mode(self.mode)

    def edge_mode(self) -> Mode:
        return self.operating_mode

    def speculates_at(self, batch: int) -> bool:
        """Whether a request drafts its next block while ``batch`` requests decode here."""
        limit = self.speculative_disable_by_batch_size
        if limit is None and self.colocated:
            limit = COLOCATED_SPECULATIVE_BATCH_LIMIT
        return limit is None or batch <= limit

    def suffix_config(self) -> SuffixConfig:
        return SuffixConfig(
            max_match=self.suffix_max_match,
            min_match=min(self.suffix_min_match, self.suffix_max_match),
            max_tokens=self.suffix_max_tokens,
            spec_factor=self.suffix_spec_factor,
            min_token_prob=self.suffix_min_token_prob,
        )

    def ladder(self) -> Ladder:
        return Ladder(
            topk_steps=self.topk_steps,
            num_proposals=self.num_proposals,
            proposal_rounds=self.proposal_rounds,
            use_topk=self.operating_mode.uses_topk,
        )
