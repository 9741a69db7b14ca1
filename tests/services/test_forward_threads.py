"""The colocated cloud's torch threads follow its load: every core while at most one
session is open (the edge idles while it waits for that verdict) or a round only decodes
(the edge's requests all wait for the cloud's tokens), the split otherwise."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client import CollectorRegistry

from asymspec_engine.hardware import ForwardThreads
from asymspec_engine.loading import session_lm
from asymspec_engine.target import TargetModel
from cloud_verifier.batcher import Batcher
from cloud_verifier.metrics import CloudMetrics
from cloud_verifier.sessions import Session
from cloud_verifier.settings import CloudSettings
from loadtest.tiny_llama import build_tiny_llama
from loadtest.tiny_models import greedy_cloud_session


def test_the_batcher_takes_every_core_while_one_session_is_open() -> None:
    target = TargetModel(session_lm(build_tiny_llama(seed=0, hidden_size=32)))
    batcher = Batcher(
        target, 8, 0.001, CloudMetrics.create(CollectorRegistry()), threads=ForwardThreads(1, 2)
    )

    def worker_threads() -> int:
        return batcher.model_thread.call(torch.get_num_threads)

    async def run() -> list[int]:
        batcher.start()
        seen = []
        for session_id in (1, 2, 3):  # each round is set up before its prefill opens
            await batcher.prefill(greedy_cloud_session(session_id))
            seen.append(worker_threads())
        await batcher.stop()
        return seen

    assert asyncio.run(run()) == [2, 2, 1]  # 0, 1, then 2 sessions open at the round


def test_the_batcher_takes_every_core_for_rounds_that_only_decode() -> None:
    target = TargetModel(session_lm(build_tiny_llama(seed=0, hidden_size=32)))
    batcher = Batcher(
        target, 8, 0.001, CloudMetrics.create(CollectorRegistry()), threads=ForwardThreads(1, 2)
    )
    sessions = [greedy_cloud_session(i) for i in (1, 2, 3)]

    async def decode(session: Session) -> int:
        threads = []
        async for _ in batcher.generate(session, 3):
            threads.append(batcher.model_thread.call(torch.get_num_threads))
        return min(threads)

    async def run() -> tuple[int, list[int]]:
        batcher.start()
        for session in sessions:
            await batcher.prefill(session)
        after_prefills = batcher.model_thread.call(torch.get_num_threads)
        during = await asyncio.gather(*(decode(s) for s in sessions))
        await batcher.stop()
        return after_prefills, list(during)

    after_prefills, during = asyncio.run(run())
    assert after_prefills == 1  # three sessions open, no decoding: the edge may be drafting
    assert during == [2, 2, 2]


def test_cloud_settings_switch_threads_only_when_colocated_and_automatic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    secret = "s" * 16
    assert CloudSettings(shared_secret=secret).forward_threads() is None  # not colocated
    monkeypatch.setenv("ASYMSPEC_COLOCATED", "true")
    assert CloudSettings(shared_secret=secret).forward_threads() == ForwardThreads(3, 4)
    monkeypatch.setenv("ASYMSPEC_CLOUD_THREADS", "2")  # an explicit count is kept
    assert CloudSettings(shared_secret=secret).forward_threads() is None
    assert ForwardThreads(1, 2).for_round(0, cloud_decodes_alone=False) == 2
    assert ForwardThreads(1, 2).for_round(1, cloud_decodes_alone=False) == 2
    assert ForwardThreads(1, 2).for_round(5, cloud_decodes_alone=False) == 1
    assert ForwardThreads(1, 2).for_round(5, cloud_decodes_alone=True) == 2
