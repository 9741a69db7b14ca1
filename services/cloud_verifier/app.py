"""The cloud verifier's FastAPI app: target model, per-session KV caches, the batcher, the
edge channel (WebSocket /v1/channel) and REST for health, models and metrics.

The target loads in the background after start-up, so /health can say 503 with a reason
until it is ready (as vLLM and TGI do) instead of the port staying closed. SIGHUP re-reads
the edge tokens and revocations, and cuts the channels of edges no longer admitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Header, WebSocket
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry

from asymspec.constraint import ConstraintBuilder
from asymspec.model_thread import ModelThread
from asymspec_engine.feature_draft import FeatureLM
from asymspec_engine.target import TargetModel
from cloud_verifier.batcher import Batcher
from cloud_verifier.channel import ChannelServer
from cloud_verifier.identities import EdgeIdentities
from cloud_verifier.metrics import CloudMetrics, metrics_router
from cloud_verifier.settings import CloudSettings

log = logging.getLogger("asymspec.cloud")


@dataclass
class CloudState:
    settings: CloudSettings
    metrics: CloudMetrics
    registry: CollectorRegistry
    identities: EdgeIdentities = field(default_factory=EdgeIdentities)  # admits no edge
    channel: ChannelServer | None = None
    batcher: Batcher | None = None
    error: str | None = None
    started_s: float = field(default_factory=time.time)

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name or self.settings.target_model


def load_target(settings: CloudSettings) -> tuple[TargetModel, ConstraintBuilder]:
    """The target, and what builds its sessions' constraints (grammars need its tokenizer)."""
    lm, tokenizer = settings.load(settings.target_model)
    if isinstance(lm, FeatureLM):
        raise ValueError(f"{settings.target_model} is a feature draft, not a target model")
    target = TargetModel(lm)
    return target, ConstraintBuilder(tokenizer, target.vocab_size)


async def _load(state: CloudState) -> None:
    # Loaded on the thread that will run its forwards: see asymspec.model_thread for why.
    model_thread = ModelThread("target")
    try:
        target, constraints = await model_thread.run(load_target, state.settings)
    except Exception as exc:
        model_thread.shutdown()
        log.exception("loading the target failed")
        state.error = f"{type(exc).__name__}: {exc}"
        return
    s = state.settings
    state.batcher = Batcher(
        target,
        s.max_batch_size,
        s.max_wait_ms / 1000,
        state.metrics,
        s.prefill_budget(),
        threads=s.forward_threads(),
        model_thread=model_thread,
    )
    state.batcher.start()
    state.channel = ChannelServer(s, state.batcher, state.metrics, state.identities, constraints)
    channel = state.channel
    state.metrics.sessions.set_function(lambda: channel.session_count)
    log.info("target %s ready", s.target_model)


def create_app(settings: CloudSettings | None = None) -> FastAPI:
    settings = settings or CloudSettings()
    registry = CollectorRegistry()
    state = CloudState(
        settings,
        CloudMetrics.create(
            registry, model_name=settings.served_model_name or settings.target_model
        ),
        registry,
        EdgeIdentities(
            settings.shared_secret,
            require_cert=bool(settings.ssl_ca_certs),
            tokens_file=settings.edge_tokens_file,
            revoked_file=settings.revoked_edges_file,
        ),
    )
    revoking: set[asyncio.Task[int]] = set()

    def reload_identities() -> None:
        state.identities.reload()
        if state.channel is not None:
            task = asyncio.create_task(state.channel.revoke())
            revoking.add(task)
            task.add_done_callback(revoking.discard)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(_load(state))
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):  # no SIGHUP off Unix
            loop.add_signal_handler(signal.SIGHUP, reload_identities)
        yield
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGHUP)
        loading.cancel()
        if state.batcher is not None:
            await state.batcher.stop()

    app = FastAPI(title="asymspec cloud verifier", lifespan=lifespan)
    app.state.cloud = state
    app.include_router(metrics_router(registry))

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.error:
            return JSONResponse({"status": "error", "reason": state.error}, status_code=503)
        if state.batcher is not None and state.batcher.actor.failure:
            reason = state.batcher.actor.failure
            return JSONResponse({"status": "error", "reason": reason}, status_code=503)
        if state.channel is None:
            return JSONResponse(
                {"status": "loading", "reason": "target model is loading"}, status_code=503
            )
        return JSONResponse({"status": "ok", "model": state.model_name})

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        card = {
            "id": state.model_name,
            "object": "model",
            "created": int(state.started_s),
            "owned_by": "asymspec",
        }
        return {"object": "list", "data": [card]}

    @app.get("/v1/sessions")
    async def sessions(authorization: str = Header("")) -> JSONResponse:
        """Control route: open sessions per connected edge (the shared secret or an edge's
        token as the bearer)."""
        scheme, _, token = authorization.partition(" ")
        if scheme != "Bearer" or not state.identities.admits_bearer(token):
            state.metrics.channel_auth_failures.inc()
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        edges = [] if state.channel is None else state.channel.describe()
        return JSONResponse({"sessions": sum(e["sessions"] for e in edges), "edges": edges})

    @app.websocket("/v1/channel")
    async def channel(ws: WebSocket) -> None:
        if state.channel is None:
            await ws.close(code=1013, reason="target model is not ready")
            return
        await state.channel.serve(ws)

    return app
