"""The edge gateway's FastAPI app: the OpenAI-compatible API in front of the decoding engine.

The lifespan loads the draft model (and the tokenizer) in the background, starts the
scheduler and the cloud channel; /health answers 503 with a reason until the draft is loaded
and, in the modes that need it, the cloud is connected.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry

from asymspec.constraint import ConstraintBuilder
from asymspec.model_thread import ModelThread
from asymspec_engine.draft import DraftModel
from asymspec_engine.loading import restrict_draft_head
from edge_gateway.admission import Admission
from edge_gateway.api_errors import install_error_handlers
from edge_gateway.api_requests import ApiSettings
from edge_gateway.credentials import CloudCredentials
from edge_gateway.decoding import DraftOnlyEngine, SpeculativeEngine, TargetOnlyEngine
from edge_gateway.engine_api import Engine
from edge_gateway.metrics import EdgeMetrics, metrics_router
from edge_gateway.openai_api import build_router
from edge_gateway.replicas import CloudReplicas
from edge_gateway.scheduler import DraftScheduler
from edge_gateway.settings import EdgeSettings

log = logging.getLogger("asymspec.edge")


@dataclass
class EdgeState:
    settings: EdgeSettings
    metrics: EdgeMetrics
    engine: Engine | None = None
    tokenizer: Any = None
    cloud: CloudReplicas | None = None
    scheduler: DraftScheduler | None = None
    error: str | None = None

    def not_ready_reason(self) -> str | None:
        if self.error:
            return self.error
        if self.engine is None:
            return "draft model is loading"
        if self.scheduler is not None and self.scheduler.actor.failure:
            return self.scheduler.actor.failure
        if self.cloud is not None:
            return self.cloud.not_ready_reason()
        return None


def load_draft(settings: EdgeSettings) -> tuple[DraftModel, Any]:
    lm, tokenizer = settings.load(settings.draft_model)
    if settings.draft_head_vocab:
        restrict_draft_head(lm, settings.draft_model)
    draft = DraftModel(
        lm,
        copy_weight=settings.draft_copy_weight,
        stop_confidence=settings.draft_stop_confidence,
    )
    return draft, tokenizer


async def _start(state: EdgeState) -> None:
    s, mode = state.settings, state.settings.operating_mode
    if mode.needs_cloud:
        state.cloud = CloudReplicas(
            s.cloud_urls,
            CloudCredentials.from_settings(s),
            state.metrics,
            reply_timeout_s=s.cloud_reply_timeout_s,
            coalesce_frames=s.coalesce_frames,
        )
        state.cloud.start()
    # Loaded on the thread that will run its forwards: see asymspec.model_thread for why.
    model_thread = ModelThread("draft")
    try:
        draft, state.tokenizer = await model_thread.run(load_draft, s)
    except Exception as exc:
        model_thread.shutdown()
        log.exception("loading the draft failed")
        state.error = f"{type(exc).__name__}: {exc}"
        return
    if mode.is_draft_only and draft.needs_features:
        model_thread.shutdown()
        state.error = (
            f"draft-only mode needs a token draft: {s.draft_model} is a feature draft, which "
            "drafts from the target's hidden states (set ASYMSPEC_EDGE_DRAFT_MODEL)"
        )
        log.error(state.error)
        return
    if mode.is_target_only:
        model_thread.shutdown()
        assert state.cloud is not None
        state.engine = TargetOnlyEngine(state.cloud, s.cloud_deadline_s)
        return
    state.scheduler = DraftScheduler(
        draft,
        mode,
        s.max_draft_batch,
        state.metrics,
        model_thread=model_thread,
        prefill_chunk_tokens=s.draft_prefill_chunk_tokens,
    )
    state.scheduler.start()
    constraints = ConstraintBuilder(state.tokenizer, draft.lm.vocab_size)
    if mode.is_draft_only:
        state.engine = DraftOnlyEngine(state.scheduler, constraints)
    else:
        assert state.cloud is not None
        state.engine = SpeculativeEngine(
            s, mode, state.scheduler, state.cloud, state.metrics, constraints
        )
    log.info("edge ready: mode %s, draft %s", mode.name, s.draft_model)


def create_app(settings: EdgeSettings | None = None) -> FastAPI:
    settings = settings or EdgeSettings()
    registry = CollectorRegistry()
    metrics = EdgeMetrics.create(
        registry, model_name=settings.served_model_name, mode=settings.mode
    )
    state = EdgeState(settings, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        starting = asyncio.create_task(_start(state))
        yield
        starting.cancel()
        for part in (state.scheduler, state.cloud):
            if part is not None:
                await part.stop()

    app = FastAPI(title="asymspec edge gateway", lifespan=lifespan)
    app.state.edge = state
    install_error_handlers(app)
    api_settings = ApiSettings(
        served_model_name=settings.served_model_name,
        max_model_len=settings.max_model_len,
        default_max_tokens=settings.default_max_tokens,
        max_tokens_limit=settings.max_tokens_limit,
    )
    app.include_router(
        build_router(lambda: state.engine, lambda: state.tokenizer, api_settings, metrics)
    )
    app.include_router(metrics_router(registry))
    app.add_middleware(
        Admission,
        api_keys=settings.api_keys,
        max_concurrent=settings.max_concurrent_requests,
        max_body_bytes=settings.max_body_bytes,
        body_timeout_s=settings.body_timeout_s,
        metrics=metrics,
    )

    @app.get("/health")
    async def health() -> JSONResponse:
        reason = state.not_ready_reason()
        if reason is not None:
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok", "mode": settings.mode})

    return app
