"""Each service loads its model on the thread that then runs every forward (the batcher's and
the draft scheduler's model thread), never on a throwaway thread: libgomp keeps an OpenMP
team per thread that has run a parallel region, and two teams on a host with few cores put
it in its throttled, sleep-after-every-region mode (see asymspec.model_thread). Real
services' start-up over tiny saved checkpoints; the load function is wrapped only to note
which thread it ran on."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import cloud_verifier.app as cloud_app
import edge_gateway.app as edge_app
from asymspec.model_thread import ModelThread
from cloud_verifier.metrics import CloudMetrics
from cloud_verifier.settings import CloudSettings
from edge_gateway.metrics import EdgeMetrics
from edge_gateway.settings import EdgeSettings
from loadtest.tiny_models import greedy_cloud_session, save_tiny_pair


def _noting_thread(load: Callable[..., Any], seen: list[int]) -> Callable[..., Any]:
    def wrapped(*args: Any) -> Any:
        seen.append(threading.get_ident())
        return load(*args)

    return wrapped


def test_a_model_thread_runs_every_call_on_one_thread() -> None:
    thread = ModelThread("model")

    async def idents() -> list[int]:
        return [await thread.run(threading.get_ident) for _ in range(3)]

    seen = [*asyncio.run(idents()), thread.call(threading.get_ident)]
    thread.shutdown()
    assert len(set(seen)) == 1 and seen[0] != threading.get_ident()


def test_the_cloud_verifies_on_the_thread_that_loaded_its_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target_dir, _ = save_tiny_pair(tmp_path)
    loaded_on: list[int] = []
    monkeypatch.setattr(cloud_app, "load_target", _noting_thread(cloud_app.load_target, loaded_on))
    settings = CloudSettings(shared_secret="s" * 16, target_model=str(target_dir), threads=1)
    registry = CollectorRegistry()
    state = cloud_app.CloudState(settings, CloudMetrics.create(registry), registry)

    async def run() -> tuple[int, int]:
        await cloud_app._load(state)
        assert state.batcher is not None, state.error
        batcher = state.batcher
        ran_on: list[int] = []
        monkeypatch.setattr(
            batcher, "_execute", _noting_thread(batcher._execute, ran_on), raising=True
        )
        await batcher.prefill(greedy_cloud_session(1))  # a real prefill forward
        await batcher.stop()
        return loaded_on[0], ran_on[0]

    loaded, forwarded = asyncio.run(run())
    assert loaded == forwarded != threading.get_ident()


def test_the_edge_drafts_on_the_thread_that_loaded_its_draft(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, draft_dir = save_tiny_pair(tmp_path)
    loaded_on: list[int] = []
    monkeypatch.setattr(edge_app, "load_draft", _noting_thread(edge_app.load_draft, loaded_on))
    settings = EdgeSettings(
        shared_secret="s" * 16,
        draft_model=str(draft_dir),
        mode="draft-only",  # no cloud needed
        draft_head_vocab=False,
        threads=1,
    )
    state = edge_app.EdgeState(settings, EdgeMetrics.create(CollectorRegistry()))

    async def run() -> tuple[int, int]:
        await edge_app._start(state)
        assert state.scheduler is not None, state.error
        scheduler = state.scheduler
        drafted_on = await scheduler.model_thread.run(threading.get_ident)
        await scheduler.open("1", [1, 2, 3])  # a real draft-model call, on that thread
        await scheduler.stop()
        return loaded_on[0], drafted_on

    loaded, drafted = asyncio.run(run())
    assert loaded == drafted != threading.get_ident()
