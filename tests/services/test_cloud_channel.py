"""The cloud verifier's channel through a real uvicorn process and the edge's real client.

Greedy sessions make every verdict checkable against the target's own argmax chain,
computed here by recomputing the saved tiny target without any cache.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import websockets
from prometheus_client import CollectorRegistry
from transformers import AutoModelForCausalLM

from asymspec.sampling_params import SamplingParams
from asymspec.wire import (
    BlockId,
    CloseSession,
    CorrectionKind,
    CorrectionRequest,
    ErrorCode,
    GenerateRequest,
    GenerateTokens,
    OpenSession,
    SamplingConfig,
    SessionOpened,
    StopGeneration,
    TopK,
    VerifyBlock,
    VerifyResult,
    config_digest,
)
from asymspec_engine.feature_draft import features_from_wire
from edge_gateway.channel import CloudChannel, CloudError
from edge_gateway.credentials import CloudCredentials
from edge_gateway.metrics import EdgeMetrics
from loadtest.processes import Service, cloud_env, free_port, running
from loadtest.tiny_models import save_tiny_pair
from tests.engine.conftest import full_logits

GREEDY = SamplingConfig(SamplingParams(0.0, 0, 1.0), 7)
PROMPT = [5, 17, 42, 99, 3]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def cloud(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    port = free_port()
    env = cloud_env(
        pair[0], port, shared_secret="s3cret-s3cret", max_wait_ms="5", handshake_timeout_s="1"
    )
    with running("cloud_verifier", port, env, tmp_path_factory.mktemp("logs")) as service:
        yield service


@pytest.fixture(scope="module")
def greedy_chain(pair: tuple[Path, Path]) -> list[int]:
    """The target's greedy continuation of PROMPT (20 tokens), by full recompute."""
    model = AutoModelForCausalLM.from_pretrained(pair[0]).eval()
    tokens = list(PROMPT)
    for _ in range(20):
        tokens.append(int(full_logits(model, tokens)[-1].argmax()))
    return tokens[len(PROMPT) :]


def with_channel(
    cloud: Service,
    body: Callable[[CloudChannel], Awaitable[Any]],
    secret: str = "s3cret-s3cret",
    connect_timeout_s: float = 10,
) -> Any:
    async def run() -> Any:
        channel = CloudChannel(
            f"ws://127.0.0.1:{cloud.port}/v1/channel",
            CloudCredentials(secret),
            EdgeMetrics.create(CollectorRegistry()),
        )
        channel.start()
        try:
            await channel.wait_connected(connect_timeout_s)
            return await body(channel)
        finally:
            await channel.stop()

    return asyncio.run(run())


def block_msg(
    session_id: int, seq: int, base_len: int, tokens: list[int], tail: tuple[int, ...] = ()
) -> VerifyBlock:
    return VerifyBlock(
        BlockId(session_id, seq, base_len, config_digest(GREEDY)),
        np.asarray(tokens, dtype=np.uint32),
        np.ones(len(tokens), dtype=np.float32),  # greedy drafts are one-hot: q(x) = 1
        np.asarray(tail, dtype=np.uint32),
    )


def metric(cloud: Service, name: str) -> float:
    text = httpx.get(f"{cloud.url}/metrics").text
    match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert match, f"{name} not exported"
    return float(match.group(1))


async def open_greedy(channel: CloudChannel, session_id: int) -> None:
    prompt = np.asarray(PROMPT, dtype=np.uint32)
    opened = await channel.open_session(
        OpenSession(session_id, prompt, GREEDY, CorrectionKind.TOPK, 4)
    )
    assert opened.prefix_len == len(PROMPT)


def test_accepts_matching_drafts_and_returns_bonus(cloud: Service, greedy_chain: list[int]) -> None:
    async def body(channel: CloudChannel) -> VerifyResult:
        await open_greedy(channel, 1)
        return await channel.verify(block_msg(1, 1, len(PROMPT), greedy_chain[:4]))

    result = with_channel(cloud, body)
    assert result.n_accepted == 4 and result.next_token == greedy_chain[4]  # all + bonus


def test_rejection_carries_exact_top1_and_retransmission_replays(
    cloud: Service, greedy_chain: list[int]
) -> None:
    wrong = (greedy_chain[2] + 1) % 300
    drafts = [*greedy_chain[:2], wrong, greedy_chain[3]]  # rejects at position 2

    async def body(channel: CloudChannel) -> tuple[VerifyResult, VerifyResult, Any]:
        await open_greedy(channel, 2)
        first = await channel.verify(block_msg(2, 1, len(PROMPT), drafts))
        again = await channel.verify(block_msg(2, 1, len(PROMPT), drafts))  # duplicate frame
        more = await channel.correct(
            CorrectionRequest(first.block, CorrectionKind.TOPK, 16, rung=1)
        )
        return first, again, more

    first, again, more = with_channel(cloud, body)
    assert first.n_accepted == 2 and first.next_token is None
    assert isinstance(first.correction, TopK)
    assert first.correction.token_ids[0] == greedy_chain[2]  # the target's argmax
    assert first.correction.delta_p == 0.0  # greedy: top-1 certifies exactly
    assert again == first  # the cached verdict, bit for bit
    assert isinstance(more.payload, TopK) and len(more.payload.token_ids) == 16


def test_next_block_commits_the_recovered_token(cloud: Service, greedy_chain: list[int]) -> None:
    async def body(channel: CloudChannel) -> VerifyResult:
        await open_greedy(channel, 3)
        bad = (greedy_chain[0] + 1) % 300
        first = await channel.verify(block_msg(3, 1, len(PROMPT), [bad]))
        assert first.n_accepted == 0
        # The edge recovered greedy_chain[0]; it travels as the next block's tail.
        base = len(PROMPT) + 1
        return await channel.verify(block_msg(3, 2, base, greedy_chain[1:4], (greedy_chain[0],)))

    result = with_channel(cloud, body)
    assert result.n_accepted == 3 and result.next_token == greedy_chain[4]


@pytest.mark.parametrize(
    "seq, base_len, tail, code",
    [
        (2, len(PROMPT), (), ErrorCode.STALE_BLOCK),  # skipped a sequence number
        (1, len(PROMPT) - 1, (), ErrorCode.STALE_BLOCK),  # extends an older prefix
        (1, len(PROMPT) + 1, (9,), ErrorCode.STALE_BLOCK),  # a tail nobody asked for
    ],
)
def test_stale_blocks_get_typed_errors_and_the_session_survives(
    cloud: Service,
    greedy_chain: list[int],
    seq: int,
    base_len: int,
    tail: tuple[int, ...],
    code: ErrorCode,
) -> None:
    async def body(channel: CloudChannel) -> VerifyResult:
        await open_greedy(channel, 4)
        with pytest.raises(CloudError) as info:
            await channel.verify(block_msg(4, seq, base_len, greedy_chain[:2], tail))
        assert info.value.code == code
        return await channel.verify(block_msg(4, 1, len(PROMPT), greedy_chain[:2]))

    assert with_channel(cloud, body).n_accepted == 2


def test_unknown_session_is_a_typed_error(cloud: Service) -> None:
    async def body(channel: CloudChannel) -> None:
        with pytest.raises(CloudError) as info:
            await channel.verify(block_msg(999, 1, 5, [1]))
        assert info.value.code == ErrorCode.UNKNOWN_SESSION

    with_channel(cloud, body)


def test_sessions_are_freed_on_close_and_on_disconnect(cloud: Service) -> None:
    async def body(channel: CloudChannel) -> None:
        for sid in (10, 11, 12):
            await open_greedy(channel, sid)
        assert metric(cloud, "asymspec_cloud_sessions") >= 3
        await channel.send(CloseSession(10))
        await asyncio.sleep(0.3)

    with_channel(cloud, body)  # leaving closes the socket with 11 and 12 still open
    for _ in range(50):
        if metric(cloud, "asymspec_cloud_sessions") == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert metric(cloud, "asymspec_cloud_sessions") == 0


def test_wrong_secret_is_refused_and_counted(cloud: Service) -> None:
    before = metric(cloud, "asymspec_channel_auth_failures_total")

    async def body(channel: CloudChannel) -> None:
        return None

    with pytest.raises(Exception):  # noqa: B017 - never connects, so wait_connected fails
        with_channel(cloud, body, secret="wrong", connect_timeout_s=2)
    assert metric(cloud, "asymspec_channel_auth_failures_total") > before


def test_a_text_frame_is_closed_with_1003(cloud: Service) -> None:
    async def run() -> int | None:
        url = f"ws://127.0.0.1:{cloud.port}/v1/channel"
        async with websockets.connect(url) as ws:
            await ws.send("hello as text")
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    await ws.recv()  # the MALFORMED error frame, then the close
            return ws.close_code

    assert asyncio.run(run()) == 1003


def test_a_connection_without_hello_is_closed_after_the_handshake_timeout(
    cloud: Service,
) -> None:
    async def run() -> tuple[float, int | None]:
        url = f"ws://127.0.0.1:{cloud.port}/v1/channel"
        started = time.monotonic()
        async with websockets.connect(url) as ws:
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 10)  # says nothing; the cloud hangs up
            return time.monotonic() - started, ws.close_code

    waited_s, code = asyncio.run(run())
    assert code == 1008 and 0.5 < waited_s < 5  # the fixture's 1 s timeout, not forever


def test_two_edges_may_use_the_same_session_ids(cloud: Service, greedy_chain: list[int]) -> None:
    """Edges number their sessions on their own; the cloud keys them per connection."""

    async def body(first: CloudChannel) -> list[VerifyResult]:
        second = CloudChannel(
            f"ws://127.0.0.1:{cloud.port}/v1/channel",
            CloudCredentials("s3cret-s3cret"),
            EdgeMetrics.create(CollectorRegistry()),
        )
        second.start()
        try:
            await second.wait_connected(10)
            await asyncio.gather(open_greedy(first, 20), open_greedy(second, 20))
            return list(
                await asyncio.gather(
                    first.verify(block_msg(20, 1, len(PROMPT), greedy_chain[:4])),
                    second.verify(block_msg(20, 1, len(PROMPT), greedy_chain[:3])),
                )
            )
        finally:
            await second.stop()

    one, two = with_channel(cloud, body)
    assert one.n_accepted == 4 and one.next_token == greedy_chain[4]
    assert two.n_accepted == 3 and two.next_token == greedy_chain[3]


def test_a_generation_sent_behind_its_open_starts_once_the_prompt_is_in(
    cloud: Service, greedy_chain: list[int]
) -> None:
    """Target-only's first token in one trip: the generation goes right behind the open,
    and the cloud decodes the target's own greedy chain once the prompt is in. Behind an
    open the cloud refuses, the generation fails too, and no session stays open."""
    none = np.zeros(0, dtype=np.uint32)

    async def body(channel: CloudChannel) -> list[int]:
        stream = channel.stream(40)
        prompt = np.asarray(PROMPT, dtype=np.uint32)
        opened = await channel.open_session(
            OpenSession(40, prompt, GREEDY, CorrectionKind.TOPK, 4),
            then=GenerateRequest(40, 8, none, none),
        )
        assert opened.prefix_len == len(PROMPT)
        tokens: list[int] = []
        while len(tokens) < 8:
            frame = await asyncio.wait_for(stream.get(), 30)
            assert isinstance(frame, GenerateTokens), frame
            tokens += [int(t) for t in frame.tokens]

        before = metric(cloud, "asymspec_cloud_sessions")  # session 40 is still open
        refused = channel.stream(41)
        bad = np.asarray([5, 17, 10**6], dtype=np.uint32)
        with pytest.raises(CloudError):
            await channel.open_session(
                OpenSession(41, bad, GREEDY, CorrectionKind.TOPK, 4),
                then=GenerateRequest(41, 4, none, none),
            )
        assert isinstance(await asyncio.wait_for(refused.get(), 30), CloudError)
        assert metric(cloud, "asymspec_cloud_sessions") == before
        return tokens

    assert with_channel(cloud, body) == greedy_chain[:8]


def test_a_stop_ends_a_generation_and_a_stop_without_one_is_dropped(
    cloud: Service, greedy_chain: list[int]
) -> None:
    """A paused edge asks for all its remaining tokens and sends StopGeneration when it
    wants to speculate again: the generation ends soon after, marked done, on the greedy
    chain. A stop for a session without a generation, or for no open session, is moot: no
    error comes back, and the session's next generation runs its full length."""
    none = np.zeros(0, dtype=np.uint32)

    async def body(channel: CloudChannel) -> tuple[list[int], list[int]]:
        stream, unknown = channel.stream(42), channel.stream(99)
        await open_greedy(channel, 42)
        await channel.send(StopGeneration(42))  # no generation under way
        await channel.send(StopGeneration(99))  # no such session
        await channel.send(GenerateRequest(42, 400, none, none))
        stopped: list[int] = []
        done = False
        while not done:
            frame = await asyncio.wait_for(stream.get(), 30)
            assert isinstance(frame, GenerateTokens), frame
            if not stopped:
                await channel.send(StopGeneration(42))
            stopped += [int(t) for t in frame.tokens]
            done = frame.done
        await channel.send(GenerateRequest(42, 3, none, none))
        after: list[int] = []
        done = False
        while len(after) < 3:
            frame = await asyncio.wait_for(stream.get(), 30)
            assert isinstance(frame, GenerateTokens), frame
            after += [int(t) for t in frame.tokens]
            done = frame.done
        assert done and unknown.empty()
        return stopped, after

    stopped, after = with_channel(cloud, body)
    assert 1 <= len(stopped) < 400
    chain = stopped + after
    assert chain[:20] == greedy_chain[: len(chain[:20])]


def test_out_of_vocabulary_prompt_is_refused_and_not_counted(cloud: Service) -> None:
    async def body(channel: CloudChannel) -> None:
        before = metric(cloud, "asymspec_cloud_sessions")
        prompt = np.asarray([5, 17, 10**6], dtype=np.uint32)
        with pytest.raises(CloudError) as info:
            await channel.open_session(OpenSession(30, prompt, GREEDY, CorrectionKind.TOPK, 4))
        assert info.value.code == ErrorCode.MALFORMED
        assert metric(cloud, "asymspec_cloud_sessions") == before
        await open_greedy(channel, 30)  # the id is free: nothing half-open stayed behind

    with_channel(cloud, body)


def test_a_long_prompt_is_prefilled_in_chunks_beside_verification(
    pair: tuple[Path, Path], tmp_path: Path, greedy_chain: list[int]
) -> None:
    """With 16-token chunks a 300-token prompt needs ~19 forwards; a short session's blocks
    are verified meanwhile (not after it), and the long session's first block is still
    scored against its whole prompt."""
    port = free_port()
    env = cloud_env(pair[0], port, shared_secret="s3cret-s3cret", prefill_chunk_tokens="16")
    with running("cloud_verifier", port, env, tmp_path) as chunked:
        long_prompt = np.asarray([(7 * i) % 250 + 5 for i in range(300)], dtype=np.uint32)
        model = AutoModelForCausalLM.from_pretrained(pair[0]).eval()
        long_next = int(full_logits(model, long_prompt.tolist())[-1].argmax())

        async def body(channel: CloudChannel) -> tuple[float, float, VerifyResult]:
            await open_greedy(channel, 1)
            started = asyncio.get_running_loop().time()
            opening = asyncio.create_task(
                channel.open_session(OpenSession(2, long_prompt, GREEDY, CorrectionKind.TOPK, 4))
            )
            await asyncio.sleep(0.05)  # the long prefill is under way
            await channel.verify(block_msg(1, 1, len(PROMPT), greedy_chain[:2]))
            short_done = asyncio.get_running_loop().time() - started
            await opening
            long_done = asyncio.get_running_loop().time() - started
            verdict = await channel.verify(block_msg(2, 1, len(long_prompt), [long_next]))
            return short_done, long_done, verdict

        short_done, long_done, verdict = with_channel(chunked, body)
        assert short_done < long_done  # verified between the long prompt's chunks
        assert verdict.n_accepted == 1  # the chunked cache holds the whole prompt
        lines = httpx.get(f"{chunked.url}/metrics").text.splitlines()
        forwards = sum(
            float(line.rsplit(" ", 1)[1])
            for line in lines
            if line.startswith("asymspec_target_forward_calls_total{") and 'kind="prefill"' in line
        )
        assert forwards >= 10  # ~19 chunk forwards, some shared with the verify


def test_a_feature_drafts_session_gets_the_targets_hidden_states(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """wants_features: SessionOpened carries h of every prompt position the target fed
    (gathered over 16-token prefill chunks), each verdict h of its tail and accepted drafts:
    the target's own last hidden states (after the final norm), rounded to bf16."""
    port = free_port()
    env = cloud_env(pair[0], port, shared_secret="s3cret-s3cret", prefill_chunk_tokens="16")
    model = AutoModelForCausalLM.from_pretrained(pair[0]).eval()
    prompt = [(7 * i) % 250 + 5 for i in range(40)]
    chain = list(prompt)
    for _ in range(3):
        chain.append(int(full_logits(model, chain)[-1].argmax()))
    wrong = (chain[len(prompt) + 2] + 1) % 300
    drafts = [*chain[len(prompt) : len(prompt) + 2], wrong]  # rejected at the third
    with torch.inference_mode():
        h = model.model(torch.tensor([[*chain[: len(prompt) + 2]]])).last_hidden_state[0]

    async def body(channel: CloudChannel) -> tuple[SessionOpened, VerifyResult]:
        tokens = np.asarray(prompt, dtype=np.uint32)
        opened = await channel.open_session(
            OpenSession(9, tokens, GREEDY, CorrectionKind.TOPK, 4, wants_features=True)
        )
        verdict = await channel.verify(block_msg(9, 1, len(prompt), drafts))
        return opened, verdict

    with running("cloud_verifier", port, env, tmp_path) as chunked:
        opened, verdict = with_channel(chunked, body)
    assert opened.features is not None and verdict.features is not None
    assert verdict.n_accepted == 2
    bf16 = h.to(torch.bfloat16).float()
    torch.testing.assert_close(
        features_from_wire(opened.features).float(), bf16[: len(prompt) - 1], atol=0.05, rtol=0.02
    )
    torch.testing.assert_close(  # positions len(prompt) - 1 .. len(prompt) + 1
        features_from_wire(verdict.features).float(), bf16[len(prompt) - 1 :], atol=0.05, rtol=0.02
    )


def test_a_one_token_prompt_opens_with_no_feature_rows(cloud: Service) -> None:
    """No prompt position was fed (the one token is the first block's tail): zero rows."""

    async def body(channel: CloudChannel) -> SessionOpened:
        one = np.asarray([7], dtype=np.uint32)
        return await channel.open_session(
            OpenSession(11, one, GREEDY, CorrectionKind.TOPK, 4, wants_features=True)
        )

    opened = with_channel(cloud, body)
    assert opened.features is not None and opened.features.shape == (0, 64)
