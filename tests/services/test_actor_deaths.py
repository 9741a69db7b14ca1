"""The actors every request depends on, dying with work in hand: the edge's draft scheduler
and the cloud's batcher, real ones over a tiny model, with a fault injected into their loop.
What waited on them fails with the reason, new work is refused at once, and the owner's
/health has the reason to report (`actor.failure`)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client import CollectorRegistry

from asymspec.actors import ActorDied
from asymspec.backends.draft import DraftModel, DraftRequest
from asymspec.backends.loading import session_lm
from asymspec.backends.target import TargetModel
from asymspec.correction import Rung
from asymspec.modes import get_mode
from asymspec.sampling import SamplingParams
from asymspec.wire import CorrectionKind, SamplingConfig
from cloud_verifier.batcher import Batcher
from cloud_verifier.metrics import CloudMetrics
from cloud_verifier.sessions import Session
from edge_gateway.metrics import EdgeMetrics
from edge_gateway.scheduler import DraftScheduler
from tests.backends.conftest import build_tiny_llama


def test_a_dead_scheduler_fails_its_waiting_requests_and_refuses_new_ones() -> None:
    draft = DraftModel(session_lm(build_tiny_llama(seed=0, hidden_size=32)))
    metrics = EdgeMetrics.create(CollectorRegistry())

    async def run() -> tuple[str | None, BaseException | None]:
        scheduler = DraftScheduler(draft, get_mode("asymspec"), 8, metrics)
        scheduler._batch_ready = lambda: 1 / 0  # type: ignore[method-assign,assignment]
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

    def session(session_id: int) -> Session:
        return Session(
            session_id=session_id,
            owner=1,
            config=SamplingConfig(SamplingParams(0.0, 0, 1.0), 7),
            first_rung=Rung(CorrectionKind.TOPK, 4),
            confirmed=[1, 2, 3],
        )

    async def run() -> tuple[str | None, BaseException | None]:
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
