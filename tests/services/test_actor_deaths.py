"""The actors every request depends on, dying with work in hand: the edge's draft scheduler
and cloud channel and the cloud's batcher, real ones over a tiny model, with a fault
injected into their loop. What waited on them fails with the reason, new work is refused at
once, and the edge's /health reason names the dead actor."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client import CollectorRegistry

from asymspec.actors import ActorDied
from asymspec.modes import get_mode
from asymspec.sampling import SamplingParams
from asymspec_engine.draft import DraftModel, DraftRequest
from asymspec_engine.loading import session_lm
from asymspec_engine.target import TargetModel
from cloud_verifier.batcher import Batcher
from cloud_verifier.metrics import CloudMetrics
from edge_gateway.app import EdgeState
from edge_gateway.credentials import CloudCredentials
from edge_gateway.decoding import DraftOnlyEngine
from edge_gateway.metrics import EdgeMetrics
from edge_gateway.replicas import CloudReplicas
from edge_gateway.scheduler import DraftScheduler
from edge_gateway.settings import EdgeSettings
from loadtest.tiny_llama import build_tiny_llama
from loadtest.tiny_models import greedy_cloud_session


def test_a_dead_scheduler_fails_its_waiting_requests_and_refuses_new_ones() -> None:
    draft = DraftModel(session_lm(build_tiny_llama(seed=0, hidden_size=32)))
    metrics = EdgeMetrics.create(CollectorRegistry())

    async def run() -> tuple[str | None, object]:
        scheduler = DraftScheduler(draft, get_mode("asymspec"), 8, metrics)
        scheduler._batch_ready = lambda: 1 / 0  # type: ignore[method-assign,assignment,return-value]
        scheduler.start()
        await scheduler.open("1", [1, 2, 3])
        request = DraftRequest("1", [3], 4, SamplingParams(temperature=0.0), torch.Generator())
        waiting = await asyncio.gather(scheduler.propose(request), return_exceptions=True)
        with pytest.raises(ActorDied):
            await scheduler.propose(request)
        failure = scheduler.actor.failure
        await scheduler.stop()
        return failure, waiting[0]

    failure, waited = asyncio.run(run())
    assert failure == "the draft scheduler stopped (ZeroDivisionError: division by zero)"
    assert isinstance(waited, ActorDied) and str(waited) == failure


def test_a_dead_batcher_fails_queued_jobs_and_refuses_new_ones() -> None:
    target = TargetModel(session_lm(build_tiny_llama(seed=0, hidden_size=32)))
    metrics = CloudMetrics.create(CollectorRegistry())

    session = greedy_cloud_session

    async def run() -> tuple[str | None, object]:
        batcher = Batcher(target, 8, 0.001, metrics)

        async def broken(wait: bool) -> list[object]:
            await asyncio.sleep(0.05)  # the job below is queued by then
            raise RuntimeError("a bug in the loop")

        batcher._collect = broken  # type: ignore[method-assign,assignment]
        batcher.start()
        queued = await asyncio.gather(batcher.prefill(session(1)), return_exceptions=True)
        with pytest.raises(ActorDied):
            await batcher.prefill(session(2))
        failure = batcher.actor.failure
        await batcher.stop()
        return failure, queued[0]

    failure, queued = asyncio.run(run())
    assert failure == "the batcher stopped (RuntimeError: a bug in the loop)"
    assert isinstance(queued, ActorDied)


def test_health_reports_a_dead_scheduler_and_a_dead_channel() -> None:
    """What /health says (``EdgeState.not_ready_reason``) once an actor has died."""
    draft = DraftModel(session_lm(build_tiny_llama(seed=0, hidden_size=32)))
    metrics = EdgeMetrics.create(CollectorRegistry())
    settings = EdgeSettings(shared_secret="s3cret-s3cret", cloud_urls="ws://127.0.0.1:9/x")

    async def run() -> tuple[str | None, str | None]:
        state = EdgeState(settings, metrics)
        state.cloud = CloudReplicas(
            settings.cloud_urls, CloudCredentials.from_settings(settings), metrics
        )
        channel = state.cloud.channels[0]
        channel._run = broken_loop  # type: ignore[method-assign]
        state.cloud.start()
        state.scheduler = DraftScheduler(draft, get_mode("asymspec"), 8, metrics)
        state.engine = DraftOnlyEngine(state.scheduler)
        await asyncio.sleep(0.05)
        channel_reason = state.not_ready_reason()
        state.scheduler._batch_ready = lambda: 1 / 0  # type: ignore[method-assign,assignment,return-value]
        state.scheduler.start()
        await state.scheduler.open("1", [1, 2])
        request = DraftRequest("1", [2], 1, SamplingParams(temperature=0.0), torch.Generator())
        await asyncio.gather(state.scheduler.propose(request), return_exceptions=True)
        scheduler_reason = state.not_ready_reason()
        await state.scheduler.stop()
        await state.cloud.stop()
        return channel_reason, scheduler_reason

    async def broken_loop() -> None:
        raise OSError("the channel loop broke")

    channel_reason, scheduler_reason = asyncio.run(run())
    assert channel_reason is not None and "the channel loop broke" in channel_reason
    assert scheduler_reason is not None and "draft scheduler stopped" in scheduler_reason
