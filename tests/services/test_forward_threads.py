"""The colocated cloud's torch threads follow its load: every core while at most one
session is open (the edge idles while it waits for that verdict), the split otherwise."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client import CollectorRegistry

from asymspec.backends.hardware import ForwardThreads
from asymspec.backends.loading import session_lm
from asymspec.backends.target import TargetModel
from cloud_verifier.batcher import Batcher
from cloud_verifier.metrics import CloudMetrics
from cloud_verifier.settings import CloudSettings
from tests.backends.conftest import build_tiny_llama
from tests.services.tiny_models import greedy_cloud_session


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


def test_cloud_settings_switch_threads_only_when_colocated_and_automatic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    secret = "s" * 16
    assert CloudSettings(shared_secret=secret).forward_threads() is None  # not colocated
    monkeypatch.setenv("ASYMSPEC_COLOCATED", "true")
    assert CloudSettings(shared_secret=secret).forward_threads() == ForwardThreads(3, 4)
    monkeypatch.setenv("ASYMSPEC_CLOUD_TORCH_THREADS", "2")  # an explicit count is kept
    assert CloudSettings(shared_secret=secret).forward_threads() is None
    assert ForwardThreads(1, 2).for_sessions(0) == 2
    assert ForwardThreads(1, 2).for_sessions(5) == 1
