"""The cloud's chunked prefill: a round alone prefills a full chunk, a round beside other
sessions' work only a few rows, and the prompt with the fewest tokens left goes first."""

from __future__ import annotations

import asyncio
import dataclasses

from prometheus_client import CollectorRegistry

from asymspec.backends.target import TargetModel
from cloud_verifier.batcher import Batcher
from cloud_verifier.metrics import CloudMetrics
from cloud_verifier.sessions import Session
from tests.services.tiny_models import RecordingTarget, greedy_cloud_session


def session_with_prompt(session_id: int, length: int) -> Session:
    prompt = [(7 * i) % 90 + 3 for i in range(length)]
    return dataclasses.replace(greedy_cloud_session(session_id), confirmed=prompt)


def new_batcher(target: TargetModel) -> Batcher:
    metrics = CloudMetrics.create(CollectorRegistry())
    return Batcher(target, 8, 0.0, metrics, prefill_chunk_tokens=64, prefill_chunk_tokens_shared=8)


def test_a_round_alone_takes_a_full_chunk_and_one_beside_decodes_a_few_rows() -> None:
    target = RecordingTarget()
    batcher = new_batcher(target)
    decoding = session_with_prompt(1, 4)
    long = session_with_prompt(2, 301)  # 300 tokens to prefill (the last is a block's tail)

    async def run() -> None:
        batcher.start()
        await batcher.prefill(decoding)
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
