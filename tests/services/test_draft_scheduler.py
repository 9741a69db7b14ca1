"""The edge's draft scheduler opening sessions: a long prompt goes into the draft's cache in
chunks, with the other requests' drafting between them; the chunked cache drafts exactly
what one prefill would; a chunk that fails leaves no session behind. A real tiny draft."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from asymspec.modes import get_mode
from asymspec.sampling import SamplingParams
from asymspec_engine.draft import Draft, DraftModel, DraftRequest
from asymspec_engine.hardware import resolve_precision
from asymspec_engine.loading import EngineOptions, load_session_lm, session_lm
from edge_gateway.metrics import EdgeMetrics
from edge_gateway.scheduler import DraftScheduler
from loadtest.tiny_llama import build_tiny_llama
from loadtest.tiny_models import save_tiny_feature_draft, save_tiny_pair

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [(7 * i) % 90 + 3 for i in range(81)]  # 80 tokens to prefill, the last pending


class RecordingDraft(DraftModel):
    """The real tiny draft, logging each call the scheduler makes on its model thread."""

    def __init__(self, fail_on_chunk: int | None = None) -> None:
        super().__init__(session_lm(build_tiny_llama(seed=0, hidden_size=32)))
        self.calls: list[str] = []
        self.fail_on_chunk = fail_on_chunk

    def prefill(
        self,
        session_id: str,
        token_ids: Sequence[int],
        prev_features: torch.Tensor | None = None,
    ) -> None:
        self.calls.append(f"prefill {session_id} {len(token_ids)}")
        if self.fail_on_chunk == sum(c.startswith("prefill") for c in self.calls):
            raise RuntimeError("out of memory")
        super().prefill(session_id, token_ids, prev_features)

    def propose(self, batch: Sequence[DraftRequest]) -> list[Draft]:
        self.calls.append("propose " + ",".join(r.session_id for r in batch))
        return super().propose(batch)


def new_scheduler(draft: DraftModel, chunk_tokens: int) -> DraftScheduler:
    metrics = EdgeMetrics.create(CollectorRegistry())
    return DraftScheduler(
        draft, get_mode("asymspec"), 8, metrics, prefill_chunk_tokens=chunk_tokens
    )


def greedy_block(session_id: str) -> DraftRequest:
    return DraftRequest(session_id, [PROMPT[-1]], 4, GREEDY, torch.Generator().manual_seed(1))


def test_a_chunked_prefill_drafts_what_one_prefill_does() -> None:
    async def run(chunk_tokens: int) -> tuple[list[int], int, list[str]]:
        draft = RecordingDraft()
        scheduler = new_scheduler(draft, chunk_tokens)
        scheduler.start()
        await scheduler.open("1", PROMPT)
        length = draft.length("1")
        block = await scheduler.propose(greedy_block("1"))
        await scheduler.stop()
        return [int(t) for t in block.tokens], length, draft.calls

    whole, whole_length, whole_calls = asyncio.run(run(256))
    chunked, chunked_length, chunked_calls = asyncio.run(run(16))
    assert whole_length == chunked_length == 80
    assert chunked == whole
    assert not any(c.startswith("prefill") for c in whole_calls)  # one open, as before
    assert [c for c in chunked_calls if c.startswith("prefill")] == ["prefill 1 16"] * 5


def test_a_feature_drafts_chunks_read_their_slices_of_the_prompts_features(
    tmp_path: Path,
) -> None:
    """Chunked or whole, a feature draft's prompt goes in with the same h_{s-1} per token,
    so the first block's greedy draft (and its q) is the same."""
    target, _ = save_tiny_pair(tmp_path / "pair")
    folder = save_tiny_feature_draft(target, tmp_path / "feature-draft")
    precision = resolve_precision("float32", "cpu")
    generator = torch.Generator().manual_seed(3)
    features = torch.randn((80, 64), generator=generator)  # h_{s-1} of x_0 .. x_79
    pending_features = torch.randn((1, 64), generator=generator)  # h_79, for x_80

    async def run(chunk_tokens: int) -> Draft:
        lm, _ = load_session_lm(
            str(folder), EngineOptions(engine="torch", device="cpu", precision=precision)
        )
        draft = DraftModel(lm)
        assert draft.needs_features
        scheduler = new_scheduler(draft, chunk_tokens)
        scheduler.start()
        await scheduler.open("1", PROMPT, features)
        request = replace(greedy_block("1"), prev_features=pending_features)
        block = await scheduler.propose(request)
        await scheduler.stop()
        return block

    whole, chunked = asyncio.run(run(256)), asyncio.run(run(16))
    assert [int(t) for t in chunked.tokens] == [int(t) for t in whole.tokens]
    torch.testing.assert_close(chunked.rows, whole.rows, rtol=1e-4, atol=1e-5)


def test_other_requests_draft_between_a_long_prompts_chunks() -> None:
    draft = RecordingDraft()
    scheduler = new_scheduler(draft, 8)

    async def run() -> None:
        scheduler.start()
        await scheduler.open("short", PROMPT[:5])
        opening = asyncio.create_task(scheduler.open("long", PROMPT))
        generator = torch.Generator().manual_seed(2)
        while not opening.done():  # each block drafted afresh from the 4 cached tokens
            await scheduler.propose(
                DraftRequest("short", [PROMPT[4]], 4, GREEDY, generator, rollback_to=4)
            )
        await opening
        await scheduler.stop()

    asyncio.run(run())
    chunks = [i for i, c in enumerate(draft.calls) if c.startswith("prefill long")]
    assert len(chunks) == 10  # 80 tokens, 8 at a time
    between = draft.calls[chunks[0] : chunks[-1]]
    assert sum(c == "propose short" for c in between) >= 5, draft.calls


def test_a_failed_chunk_leaves_no_session() -> None:
    draft = RecordingDraft(fail_on_chunk=3)
    scheduler = new_scheduler(draft, 16)

    async def run() -> None:
        scheduler.start()
        try:
            with pytest.raises(RuntimeError, match="out of memory"):
                await scheduler.open("1", PROMPT)
            with pytest.raises(KeyError):
                draft.length("1")
            draft.fail_on_chunk = None
            await scheduler.open("1", PROMPT)  # the id is free again
            assert draft.length("1") == 80
        finally:
            await scheduler.stop()

    asyncio.run(run())
