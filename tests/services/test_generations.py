"""The cloud batcher's target-only generations (continuous batching): a generation stays in
every round until it stops, so concurrent generations share each forward; its tokens are
the target's own greedy chain; a stop token, a consumer that leaves or a dead actor ends it."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, Collection
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from asymspec.actors import ActorDied
from asymspec.wire import BlockId, ErrorCode, VerifyBlock, WireError
from asymspec_engine.loading import session_lm
from asymspec_engine.target import Round, TargetModel
from cloud_verifier.batcher import Batcher, SessionClosed
from cloud_verifier.metrics import CloudMetrics
from cloud_verifier.sessions import Decoded, Session
from loadtest.tiny_llama import build_tiny_llama
from loadtest.tiny_models import RecordingTarget, greedy_cloud_session
from tests.engine.conftest import full_logits


def new_batcher(target: TargetModel, max_wait_s: float = 0.0) -> Batcher:
    return Batcher(target, 8, max_wait_s, CloudMetrics.create(CollectorRegistry()))


def session_with_prompt(session_id: int, prompt: list[int]) -> Session:
    return dataclasses.replace(greedy_cloud_session(session_id), confirmed=list(prompt))


def greedy_next(target: RecordingTarget, chain: list[int]) -> int:
    """The target's most likely token after ``chain``, by full recompute."""
    model = target.lm.model  # type: ignore[attr-defined]
    return int(full_logits(model, chain)[-1].argmax())


async def collect(
    batcher: Batcher,
    session: Session,
    n: int,
    stop: Collection[int] = (),
    send_s: float = 0.0,
) -> list[int]:
    """The session's tokens; each one's send to the edge takes ``send_s`` (a slow socket)."""
    tokens = []
    async for decoded in batcher.generate(session, n, stop):
        tokens.append(decoded.token)
        assert decoded.last == (len(tokens) == n or decoded.token in stop)
        await asyncio.sleep(send_s)
    return tokens


def test_concurrent_generations_share_every_round_and_follow_the_greedy_chain() -> None:
    target = RecordingTarget()
    batcher = new_batcher(target, max_wait_s=0.0)  # no waiting: only residency batches them
    prompts = [[4, 8, 15], [16, 23], [42, 7, 7, 9]]
    sessions = [session_with_prompt(i + 1, p) for i, p in enumerate(prompts)]

    async def run() -> list[list[int]]:
        batcher.start()
        for s in sessions:
            await batcher.prefill(s)
        target.rounds.clear()
        # each consumer's send takes a while, longer than a round: its next token is
        # decoded while it is still sending, in the same rounds as the others'
        sends_s = [0.05, 0.01, 0.03]
        outs = await asyncio.gather(
            *(collect(batcher, s, 6, send_s=t) for s, t in zip(sessions, sends_s, strict=True))
        )
        await batcher.stop()
        return outs

    outs = asyncio.run(run())
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out) == 6
        chain = list(prompt)
        for token in out:  # each token is the argmax after the prompt and the tokens before
            assert token == greedy_next(target, chain)
            chain.append(token)
    rows = [others for _, others in target.rounds]
    # submitted in one event-loop turn, the three share all six rounds, one row each, however
    # slowly each consumer takes its tokens
    assert rows == [3] * 6


class SlowTarget(RecordingTarget):
    """Each round takes a few milliseconds, as a real forward does."""

    def round(self, *args: Any, **kwargs: Any) -> Round:
        time.sleep(0.005)
        return super().round(*args, **kwargs)


def test_a_lone_generation_decodes_back_to_back_and_yields_to_work_that_arrives() -> None:
    """A generation with nothing else to run takes its steps one after another on the model
    thread (the event loop only receives its tokens); a prompt sent meanwhile joins the
    next round, beside the generation's step, and the chain is unchanged."""
    target = SlowTarget()
    batcher = new_batcher(target)
    a, b = session_with_prompt(1, [4, 8, 15]), session_with_prompt(2, [16, 23])
    calls = 0
    real_execute_rounds = batcher._execute_rounds

    def counted(*args: Any) -> list[tuple[bool, Any]]:
        nonlocal calls
        calls += 1
        return real_execute_rounds(*args)

    batcher._execute_rounds = counted  # type: ignore[method-assign,assignment]

    async def run() -> list[int]:
        batcher.start()
        await batcher.prefill(a)
        target.rounds.clear()
        got: list[int] = []
        prefill_b: asyncio.Task[Any] | None = None
        async for decoded in batcher.generate(a, 80):
            got.append(decoded.token)
            if len(got) == 10:
                prefill_b = asyncio.ensure_future(batcher.prefill(b))
        assert prefill_b is not None
        await prefill_b
        await batcher.stop()
        return got

    before = calls
    got = asyncio.run(run())
    chain = [4, 8, 15]
    for token in got:
        assert token == greedy_next(target, chain)
        chain.append(token)
    joined = [i for i, (chunks, _) in enumerate(target.rounds) if chunks]
    assert len(joined) == 1 and target.rounds[joined[0]][1] == 1  # b's prompt, a's step
    assert 10 <= joined[0] < 79  # after the token that sent it, before a's end
    assert calls - before <= 4  # its 80 steps took a few hand-overs, not 80


def test_a_stop_token_ends_its_generation_after_the_token() -> None:
    prompt = [4, 8, 15]
    target = RecordingTarget()
    batcher = new_batcher(target)

    async def run() -> tuple[list[int], list[int], list[int]]:
        batcher.start()
        free_s, a, b = (session_with_prompt(i, prompt) for i in (1, 2, 3))
        for s in (free_s, a, b):
            await batcher.prefill(s)
        free = await collect(batcher, free_s, 5)
        target.rounds.clear()
        stopped, other = await asyncio.gather(
            collect(batcher, a, 5, {free[2]}), collect(batcher, b, 5)
        )
        await batcher.stop()
        return free, stopped, other

    free, stopped, other = asyncio.run(run())
    first = free.index(free[2])  # the stop token's first occurrence ends it, included
    assert stopped == free[: first + 1]
    assert other == free  # the other generation goes on, unchanged
    rows = [others for _, others in target.rounds]
    assert rows == [2] * (first + 1) + [1] * (5 - first - 1)


def test_a_consumer_that_leaves_drops_its_generation_from_the_rounds() -> None:
    target = RecordingTarget()
    batcher = new_batcher(target)
    a, b = session_with_prompt(1, [4, 8, 15]), session_with_prompt(2, [16, 23])

    async def run() -> None:
        batcher.start()
        await batcher.prefill(a)
        await batcher.prefill(b)
        target.rounds.clear()

        async def leave_after_two() -> None:
            generation = batcher.generate(a, 100)
            for _ in range(2):
                await anext(generation)
            await generation.aclose()

        await asyncio.gather(leave_after_two(), collect(batcher, b, 12))
        await batcher.stop()

    asyncio.run(run())
    rows = [others for _, others in target.rounds]
    assert len(rows) == 12 and rows[-1] == 1  # a left the batch; b ran its 12 rounds
    assert sum(r == 2 for r in rows) <= 3  # at most one round past its second token


def test_a_dead_batcher_fails_its_generations() -> None:
    target = TargetModel(session_lm(build_tiny_llama(seed=0, hidden_size=32)))
    batcher = new_batcher(target)
    session = session_with_prompt(1, [4, 8, 15])
    real_collect, calls = batcher._collect, 0

    async def breaks_on_the_third(wait: bool) -> list[object]:
        nonlocal calls
        calls += 1
        if calls == 3:  # round 1 prefilled, round 2 decoded a token
            raise RuntimeError("a bug in the loop")
        return await real_collect(wait)  # type: ignore[return-value]

    batcher._collect = breaks_on_the_third  # type: ignore[method-assign,assignment]
    # one decode step per round, so that the loop collects between the generation's tokens
    batcher._decodes_on = lambda *_: False  # type: ignore[method-assign]

    async def run() -> list[int]:
        batcher.start()
        await batcher.prefill(session)
        got: list[int] = []
        with pytest.raises(ActorDied):
            async for decoded in batcher.generate(session, 10):
                got.append(decoded.token)
        await batcher.stop()
        return got

    assert len(asyncio.run(run())) == 1


def test_closing_its_session_ends_a_generation_quietly() -> None:
    """The edge closes a session whose request went away: its generation ends without an
    error (nobody waits for one), and later work for that session fails as UNKNOWN_SESSION."""
    target = RecordingTarget()
    batcher = new_batcher(target)
    session = session_with_prompt(1, [4, 8, 15])

    async def run() -> tuple[list[int], BaseException | None]:
        batcher.start()
        await batcher.prefill(session)
        got: list[int] = []
        async for decoded in batcher.generate(session, 100):
            got.append(decoded.token)
            if len(got) == 2:
                await batcher.close(session)
        error = None
        block = VerifyBlock(
            BlockId(1, 1, len(session.confirmed), session.digest),
            np.asarray([5], dtype=np.uint32),
            np.ones(1, dtype=np.float32),
            np.zeros(0, dtype=np.uint32),
        )
        try:
            await batcher.verify(session, block)
        except WireError as exc:
            error = exc
        await batcher.stop()
        return got, error

    got, error = asyncio.run(run())
    # it ended (of 100) without raising; the round under way when the close was queued and
    # the round that runs the close (after its forward) may still decode a token each
    assert 2 <= len(got) <= 4
    assert isinstance(error, SessionClosed) and error.code is ErrorCode.UNKNOWN_SESSION


def test_a_stopped_generation_ends_within_two_rounds_and_the_session_takes_blocks() -> None:
    """A paused edge that wants to speculate again stops its generation: the round under
    way (if any) and one more give their tokens, the last marked as such, all on the greedy
    chain; then the session verifies blocks again. A stop with no generation does nothing."""
    target = RecordingTarget()
    batcher = new_batcher(target)
    session = session_with_prompt(1, [4, 8, 15])

    async def run() -> tuple[list[Decoded], int, int, int]:
        batcher.start()
        await batcher.prefill(session)
        batcher.stop_generation(session)  # none under way: moot
        generation = batcher.generate(session, 200)
        decoded = [await anext(generation)]
        rounds_at_stop = len(target.rounds)
        batcher.stop_generation(session)
        decoded += [d async for d in generation]
        rounds = len(target.rounds)
        right = greedy_next(target, session.confirmed)
        accepted = await batcher.verify(session, block_of(session, 1, [right], []))
        await batcher.stop()
        return decoded, rounds_at_stop, rounds, accepted.n_accepted

    decoded, rounds_at_stop, rounds, n_accepted = asyncio.run(run())
    assert rounds <= rounds_at_stop + 2 and len(decoded) < 200
    assert [d.last for d in decoded] == [False] * (len(decoded) - 1) + [True]
    chain = [4, 8, 15]
    for d in decoded:
        assert d.token == greedy_next(target, chain)
        chain.append(d.token)
    assert n_accepted == 1 and not session.generating


def block_of(session: Session, seq: int, drafts: list[int], tail: list[int]) -> VerifyBlock:
    return VerifyBlock(
        BlockId(1, seq, len(session.confirmed) + len(tail), session.digest),
        np.asarray(drafts, dtype=np.uint32),
        np.ones(len(drafts), dtype=np.float32),
        np.asarray(tail, dtype=np.uint32),
    )


def test_a_speculative_session_goes_to_the_clouds_decoding_and_back() -> None:
    """Speculation paused at the edge: after a rejected block, the session is handed to
    the cloud's decoding with the edge's recovered token, decodes the greedy chain from
    there, and then takes blocks again from the prefix the generation left."""
    target = RecordingTarget()
    batcher = new_batcher(target)
    session = session_with_prompt(1, [4, 8, 15])

    async def first_of(generation: AsyncGenerator[Decoded, None]) -> Decoded:
        return await anext(generation)

    async def run() -> tuple[int, list[int], int]:
        batcher.start()
        await batcher.prefill(session)
        wrong = (greedy_next(target, session.confirmed) + 1) % target.vocab_size
        first = block_of(session, 1, [wrong], [])
        rejected = await batcher.verify(session, first)
        recovered = greedy_next(target, session.confirmed)  # what the edge recovers (greedy p)
        with pytest.raises(WireError) as no_tail:
            await first_of(batcher.generate(session, 4))
        assert no_tail.value.code is ErrorCode.STALE_BLOCK
        generation = batcher.generate(session, 8, (), np.asarray([recovered], dtype=np.uint32))
        decoded = [(await first_of(generation)).token]
        with pytest.raises(WireError) as during:  # no block while the cloud decodes it
            await batcher.verify(session, block_of(session, 2, [1], []))
        assert during.value.code is ErrorCode.STALE_BLOCK
        with pytest.raises(WireError) as twice:
            await first_of(batcher.generate(session, 4))
        assert twice.value.code is ErrorCode.DUPLICATE
        decoded += [d.token async for d in generation]
        assert len(decoded) == 8 and not session.generating
        right = greedy_next(target, session.confirmed)
        accepted = await batcher.verify(session, block_of(session, 2, [right], []))
        await batcher.stop()
        return rejected.n_accepted, [recovered, *decoded], accepted.n_accepted

    n_rejected, tokens, n_accepted = asyncio.run(run())
    assert n_rejected == 0 and n_accepted == 1
    chain = [4, 8, 15]
    for token in tokens:  # the recovered token, then the cloud's greedy chain after it
        assert token == greedy_next(target, chain)
        chain.append(token)
    assert session.confirmed[: len(chain)] == chain
