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

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

import cloud_verifier.app as cloud_app
import edge_gateway.app as edge_app
from asymspec.correction import Rung
from asymspec.model_thread import ModelThread
from asymspec.wire import BlockId, CorrectionKind, VerifyBlock
from cloud_verifier.batcher import Batcher
from cloud_verifier.metrics import CloudMetrics
from cloud_verifier.sessions import Session
from cloud_verifier.settings import CloudSettings
from edge_gateway.metrics import EdgeMetrics
from edge_gateway.settings import EdgeSettings
from loadtest.tiny_models import RecordingTarget, greedy_cloud_session, save_tiny_pair
from tests.engine.conftest import full_logits


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


class _NotingSession(Session):
    """A cloud session that notes the thread of every call that reads or changes its
    state."""

    calls: list[tuple[str, int]]

    def admit(self, msg: Any) -> Any:
        self.calls.append(("admit", threading.get_ident()))
        return super().admit(msg)

    def admit_generation(self, *args: Any) -> None:
        self.calls.append(("admit_generation", threading.get_ident()))
        super().admit_generation(*args)

    def decide(self, *args: Any) -> Any:
        self.calls.append(("decide", threading.get_ident()))
        return super().decide(*args)

    def correct(self, *args: Any) -> Any:
        self.calls.append(("correct", threading.get_ident()))
        return super().correct(*args)

    def decoded(self, *args: Any) -> Any:
        self.calls.append(("decoded", threading.get_ident()))
        return super().decoded(*args)

    def extend(self, tokens: list[int]) -> None:
        self.calls.append(("extend", threading.get_ident()))
        super().extend(tokens)

    def end_generation(self) -> None:
        self.calls.append(("end_generation", threading.get_ident()))
        super().end_generation()


def test_a_cloud_sessions_state_changes_only_on_the_model_thread() -> None:
    """A request's whole walk through the batcher (a rejected block, an escalation, the
    next block with the recovered token, a handed-over generation, one abandoned): every
    admission, verdict, correction and decode step runs on the model thread."""
    target = RecordingTarget()
    batcher = Batcher(target, 8, 0.0, CloudMetrics.create(CollectorRegistry()))
    template = greedy_cloud_session(1)
    session = _NotingSession(
        session_id=1,
        owner=1,
        config=template.config,
        first_rung=template.first_rung,
        confirmed=[4, 8, 15],
    )
    session.calls = []

    def block(seq: int, drafts: list[int], tail: list[int]) -> VerifyBlock:
        return VerifyBlock(
            BlockId(1, seq, len(session.confirmed) + len(tail), session.digest),
            np.asarray(drafts, dtype=np.uint32),
            np.ones(len(drafts), dtype=np.float32),
            np.asarray(tail, dtype=np.uint32),
        )

    async def run() -> int:
        batcher.start()
        await batcher.prefill(session)
        greedy = int(full_logits(target.lm.model, session.confirmed)[-1].argmax())  # type: ignore[attr-defined]
        rejected = await batcher.verify(session, block(1, [(greedy + 1) % target.vocab_size], []))
        assert rejected.correction is not None and rejected.next_token is None
        await batcher.correct(session, rejected.block, Rung(CorrectionKind.TOPK, 16), 1)
        tail = [int(rejected.correction.token_ids[0])]  # type: ignore[union-attr]
        accepted = await batcher.verify(session, block(2, [greedy], tail))
        assert accepted.next_token is not None
        tokens = [d.token async for d in batcher.generate(session, 3)]
        assert len(tokens) == 3
        async for _ in batcher.generate(session, 50):
            break  # its consumer goes away: the next round ends it in the session
        while session.generating:
            await asyncio.sleep(0.01)
        model_thread = await batcher.model_thread.run(threading.get_ident)
        await batcher.stop()
        return model_thread

    model_thread = asyncio.run(run())
    names = {name for name, _ in session.calls}
    assert {"admit", "decide", "correct", "admit_generation", "decoded", "end_generation"} <= names
    off_thread = [name for name, ident in session.calls if ident != model_thread]
    assert not off_thread and model_thread != threading.get_ident()
