"""The cloud's chunked prefill: a round alone prefills a full chunk, a round beside other
sessions' work only a few rows, and the prompt with the fewest tokens left goes first; with
time limits, the chunks follow what the target's forwards are measured to cost."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Sequence

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from asymspec.wire import BlockId, VerifyBlock
from asymspec_engine.target import (
    PrefillChunk,
    Round,
    ScoreRequest,
    StepRequest,
    TargetModel,
    fed_rows,
)
from cloud_verifier import batcher as batcher_module
from cloud_verifier.batcher import Batcher
from cloud_verifier.forward_cost import PrefillBudget
from cloud_verifier.metrics import CloudMetrics
from cloud_verifier.sessions import Session
from loadtest.tiny_models import RecordingTarget, greedy_cloud_session


def session_with_prompt(session_id: int, length: int) -> Session:
    prompt = [(7 * i) % 90 + 3 for i in range(length)]
    return dataclasses.replace(greedy_cloud_session(session_id), confirmed=prompt)


@pytest.fixture
def quiet_edges(monkeypatch: pytest.MonkeyPatch) -> float:
    """Sessions whose edge sends nothing for 10 ms are no longer due (the batcher stops
    holding other prompts' rounds to the share beside them): what to sleep for that."""
    monkeypatch.setattr(batcher_module, "NEXT_BLOCK_WITHIN_S", 0.010)
    return 0.020


def new_batcher(target: TargetModel) -> Batcher:
    metrics = CloudMetrics.create(CollectorRegistry())
    return Batcher(target, 8, 0.0, metrics, PrefillBudget(chunk_tokens=64, chunk_tokens_shared=8))


def test_a_round_alone_takes_a_full_chunk_and_one_beside_decodes_a_few_rows(
    quiet_edges: float,
) -> None:
    target = RecordingTarget()
    batcher = new_batcher(target)
    decoding = session_with_prompt(1, 4)
    long = session_with_prompt(2, 301)  # 300 tokens to prefill (the last is a block's tail)

    async def run() -> None:
        batcher.start()
        await batcher.prefill(decoding)
        await asyncio.sleep(quiet_edges)  # its edge is quiet: the rounds after are alone
        await batcher.prefill(long)  # alone: 64-token chunks
        opening = asyncio.create_task(batcher.prefill(session_with_prompt(3, 301)))
        async for _ in batcher.generate(decoding, 6):  # beside decode steps: 8-token chunks
            pass
        await opening
        await batcher.stop()

    asyncio.run(run())
    alone = [chunks["1:2"] for chunks, others in target.rounds if "1:2" in chunks]
    assert alone == [64, 64, 64, 64, 44]
    beside = [chunks["1:3"] for chunks, others in target.rounds if "1:3" in chunks and others]
    assert len(beside) >= 5 and set(beside) == {8}
    assert sum(chunks.get("1:3", 0) for chunks, _ in target.rounds) == 300


def test_a_short_prompt_is_prefilled_before_a_long_one_that_came_first() -> None:
    target = RecordingTarget()
    batcher = new_batcher(target)
    long, short = session_with_prompt(1, 301), session_with_prompt(2, 21)

    async def run() -> list[str]:
        batcher.start()
        done: list[str] = []

        async def prefill(name: str, session: Session) -> None:
            await batcher.prefill(session)
            done.append(name)

        first = asyncio.create_task(prefill("long", long))
        await asyncio.sleep(0)  # the long prompt is queued first
        await asyncio.gather(first, prefill("short", short))
        await batcher.stop()
        return done

    assert asyncio.run(run()) == ["short", "long"]
    short_rounds = [i for i, (chunks, _) in enumerate(target.rounds) if "1:2" in chunks]
    assert len(short_rounds) == 1  # its 20 tokens in one round
    assert target.rounds[short_rounds[0]][0]["1:2"] == 20


class PerRowCostTarget(RecordingTarget):
    """The real tiny target, each forward held to what a compute-bound CPU's costs: a fixed
    part plus a part per row (the tiny model itself costs about the same at any rows); a
    prompt row costs ``PROMPT_ROW_S`` (None: the same as a verify or decode row)."""

    BASE_S, PER_ROW_S = 0.010, 0.003
    PROMPT_ROW_S: float | None = None

    def round(
        self,
        prefills: Sequence[PrefillChunk],
        scores: Sequence[ScoreRequest],
        steps: Sequence[StepRequest],
    ) -> Round:
        prompt_row_s = self.PER_ROW_S if self.PROMPT_ROW_S is None else self.PROMPT_ROW_S
        cost_s = (
            self.BASE_S
            + self.PER_ROW_S * fed_rows([], scores, steps)
            + prompt_row_s * fed_rows(prefills, [], [])
        )
        started = time.perf_counter()
        out = super().round(prefills, scores, steps)
        time.sleep(max(0.0, cost_s - (time.perf_counter() - started)))
        return out


def test_chunks_follow_the_measured_forward_cost(quiet_edges: float) -> None:
    """Alone, a round takes what fits in 100 ms (30 rows at 10 ms + 3 ms a row), not the
    128-row cap; beside a one-row decode step, what adds at most its own 13 ms (4 rows),
    not the 64-row cap."""
    target = PerRowCostTarget()
    budget = PrefillBudget(chunk_tokens=128, chunk_tokens_shared=64, round_s=0.100, share=1.0)
    metrics = CloudMetrics.create(CollectorRegistry())
    batcher = Batcher(target, 8, 0.0, metrics, budget)
    decoding = session_with_prompt(1, 4)
    long = session_with_prompt(2, 301)
    row_gauge = "asymspec_target_forward_row_seconds"
    before = metrics.registry.get_sample_value(row_gauge, {"model_name": ""})
    assert before is not None and math.isnan(before)  # no forward yet

    async def run() -> None:
        batcher.start()
        await batcher.prefill(decoding)
        await asyncio.sleep(quiet_edges)
        await batcher.prefill(long)
        opening = asyncio.create_task(batcher.prefill(session_with_prompt(3, 301)))
        async for _ in batcher.generate(decoding, 12):
            pass
        await opening
        await batcher.stop()

    asyncio.run(run())
    alone = [chunks["1:2"] for chunks, _ in target.rounds if "1:2" in chunks]
    assert sum(alone) == 300
    # the first from the decoding prompt's 3-row prefill alone (a line through the origin,
    # so fewer rows than the truth); from then on the fitted line's
    assert alone[0] < 30 and all(24 <= rows <= 36 for rows in alone[1:-1]), alone
    beside = [chunks["1:3"] for chunks, others in target.rounds if "1:3" in chunks and others]
    assert len(beside) >= 8
    assert all(2 <= rows <= 7 for rows in beside[2:]), beside
    assert sum(chunks.get("1:3", 0) for chunks, _ in target.rounds) == 300
    # the fit the chunks followed is on /metrics
    assert metrics.registry.get_sample_value(row_gauge, {"model_name": ""}) == pytest.approx(
        target.PER_ROW_S, rel=0.2
    )


def test_a_session_between_blocks_keeps_the_long_prompt_in_small_chunks() -> None:
    """A session whose next block is due (its edge drafts it for 30 ms after each verdict)
    counts as work: the rounds that prefill meanwhile take what delays its 2-row block by
    the share (16 ms: 5 rows), not a full 100 ms round alone (30 rows)."""
    target = PerRowCostTarget()
    budget = PrefillBudget(chunk_tokens=128, chunk_tokens_shared=64, round_s=0.100, share=1.0)
    batcher = Batcher(target, 8, 0.0, CloudMetrics.create(CollectorRegistry()), budget)
    verifying, long = session_with_prompt(1, 4), session_with_prompt(2, 401)

    async def run() -> None:
        batcher.start()
        await batcher.prefill(verifying)
        await batcher.prefill(session_with_prompt(3, 61))  # alone: the cost is measured
        opening = asyncio.create_task(batcher.prefill(long))
        tail: list[int] = []  # the edge's recovered token after a rejection
        for seq in range(1, 13):
            block = VerifyBlock(
                BlockId(1, seq, len(verifying.confirmed) + len(tail), verifying.digest),
                np.asarray([5], dtype=np.uint32),
                np.ones(1, dtype=np.float32),
                np.asarray(tail, dtype=np.uint32),
            )
            result = await batcher.verify(verifying, block)
            recovered = result.correction is not None and result.next_token is None
            tail = [int(result.correction.token_ids[0])] if recovered else []  # type: ignore[union-attr]
            await asyncio.sleep(0.030)  # the edge drafts the next block
        await batcher.close(verifying)
        await opening
        await batcher.stop()

    asyncio.run(run())
    chunks = [(chunks["1:2"], others) for chunks, others in target.rounds if "1:2" in chunks]
    while_verifying = [rows for rows, _ in chunks[:20]]
    assert all(rows <= 7 for rows in while_verifying), chunks
    assert sum(rows for rows, _ in chunks) == 400
    assert max(rows for rows, _ in chunks[-3:]) >= 24  # alone again once it closed


def test_a_session_about_to_ask_keeps_the_long_prompt_in_small_chunks() -> None:
    """A short prompt prefilled beside a long one: its edge asks for decode steps a moment
    later (200 ms here), and again 200 ms after that generation ended (a paused speculative
    request asks for a few tokens at a time). Meanwhile its next ask is due, so the long
    prompt's rounds take what delays it by the share (13 ms: 4 rows), not full 100 ms
    rounds alone (30 rows) that the ask would then wait behind."""
    target = PerRowCostTarget()
    budget = PrefillBudget(chunk_tokens=128, chunk_tokens_shared=64, round_s=0.100, share=1.0)
    batcher = Batcher(target, 8, 0.0, CloudMetrics.create(CollectorRegistry()), budget)
    measured, short, long = (session_with_prompt(i, n) for i, n in ((1, 61), (2, 5), (3, 801)))
    waits: list[tuple[int, int]] = []  # the rounds while the short prompt's ask was due

    async def asks_after(pause_s: float, tokens: int) -> None:
        ended = len(target.rounds)
        await asyncio.sleep(pause_s)  # its edge's round trip
        waits.append((ended, len(target.rounds)))
        async for _ in batcher.generate(short, tokens):
            pass

    async def run() -> None:
        batcher.start()
        await batcher.prefill(measured)  # alone: the cost is measured
        await batcher.close(measured)
        opening = asyncio.create_task(batcher.prefill(long))
        await asyncio.sleep(0.05)  # the long prompt's rounds are under way, alone
        await batcher.prefill(short)
        await asks_after(0.2, 2)  # its first decode steps
        await asks_after(0.2, 2)  # the next ones
        await batcher.close(short)
        await opening
        await batcher.stop()

    asyncio.run(run())
    long_chunks = [chunks.get("1:3", 0) for chunks, _ in target.rounds]
    assert max(long_chunks[: waits[0][0]]) >= 24, long_chunks  # alone, before the short one
    for start, stop in waits:
        waiting = long_chunks[start:stop]
        assert len(waiting) >= 4 and max(waiting) <= 5, (start, long_chunks)
    assert max(long_chunks[waits[-1][1] :]) >= 24  # alone again once it closed
    assert sum(long_chunks) == 800


class PromptRowsCheapTarget(PerRowCostTarget):
    """A CPU whose prompt rows, many to a forward, cost a fraction of a decode row's (its
    products change kernels with the rows), so forward cost is far from one line."""

    BASE_S, PER_ROW_S, PROMPT_ROW_S = 0.002, 0.006, 0.0005


def test_edges_get_the_cost_of_rounds_without_prompt_chunks() -> None:
    """The cost an edge chooses γ and the pause by comes from verify and decode rounds
    only: prompt chunks, cheap per row here, would make every row look cheap."""
    target = PromptRowsCheapTarget()
    metrics = CloudMetrics.create(CollectorRegistry())
    batcher = Batcher(target, 8, 0.0, metrics, PrefillBudget(chunk_tokens=64))
    sessions = [session_with_prompt(i, 4) for i in range(1, 5)]

    async def decode(session: Session, tokens: int) -> None:
        async for _ in batcher.generate(session, tokens):
            pass

    async def run() -> None:
        batcher.start()
        for session in sessions:
            await batcher.prefill(session)
        for i in range(3):  # prompt rounds between decode rounds of one and of four rows
            await batcher.prefill(session_with_prompt(10 + i, 200))
            await decode(sessions[0], 6)
            await asyncio.gather(*(decode(session, 6) for session in sessions))
        await batcher.stop()

    asyncio.run(run())
    assert any(chunks for chunks, _ in target.rounds)  # prompt chunks did run
    cost = batcher.target_cost()
    assert cost is not None
    assert cost.row_s == pytest.approx(target.PER_ROW_S, rel=0.35)
    every_forward = batcher.cost.fit()
    assert every_forward is not None and every_forward[1] < 0.5 * target.PER_ROW_S
