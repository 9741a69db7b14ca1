"""The edge's channel against a peer that breaks the protocol: a real WebSocket server that
completes the handshake, then answers a request with a frame the edge cannot decode, or
with a message type a cloud never sends. The edge treats both as protocol errors: it closes
the connection with 1002, so the waiter fails at once with ChannelDown (and its session
re-opens elsewhere) instead of hanging until a deadline."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from websockets.asyncio.server import ServerConnection, serve

from asymspec.sampling_params import SamplingParams
from asymspec.wire import Hello, HelloAck, OpenSession, SamplingConfig, encode
from edge_gateway.channel import ChannelDown, CloudChannel
from edge_gateway.credentials import CloudCredentials
from edge_gateway.metrics import EdgeMetrics

OPEN = OpenSession(1, np.arange(1, 6, dtype=np.uint32), SamplingConfig(SamplingParams(0.0), 7))


async def answer_with(reply: bytes) -> tuple[type[BaseException] | None, int | None]:
    """(what the edge's open_session raised, the close code the edge sent)."""
    closed: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()

    async def peer(ws: ServerConnection) -> None:
        await ws.recv()  # Hello
        await ws.send(encode(HelloAck("not-a-cloud")))
        await ws.recv()  # the OpenSession
        await ws.send(reply)
        await ws.wait_closed()
        if not closed.done():
            closed.set_result(ws.close_code)

    async with serve(peer, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        metrics = EdgeMetrics.create(CollectorRegistry())
        channel = CloudChannel(f"ws://127.0.0.1:{port}", CloudCredentials("secret-secret"), metrics)
        channel.start()
        try:
            await channel.wait_connected(10)
            raised: type[BaseException] | None = None
            try:
                await asyncio.wait_for(channel.open_session(OPEN), 10)
            except Exception as exc:
                raised = type(exc)
            return raised, await asyncio.wait_for(closed, 10)
        finally:
            await channel.stop()


@pytest.mark.parametrize(
    "reply",
    [b"\x93\x01\xff not msgpack", encode(Hello("edge", "a cloud never sends Hello"))],
    ids=["undecodable", "unexpected-type"],
)
def test_a_broken_reply_closes_the_connection_and_fails_the_waiter(reply: bytes) -> None:
    raised, close_code = asyncio.run(answer_with(reply))
    assert raised is ChannelDown  # at once, not after the reply deadline
    assert close_code == 1002
