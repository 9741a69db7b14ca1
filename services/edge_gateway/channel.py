"""The edge end of the cloud channel: one persistent WebSocket, many requests multiplexed.

Callers send a message and await the reply that matches it: SessionOpened by session id,
VerifyResult and CorrectionResponse by block id, GenerateTokens into a per-session queue.
A typed ErrorFrame fails the waiter it names; a reply that does not come within
`reply_timeout_s` fails it with `ReplyTimeout`. A frame the edge cannot decode, or one of a
type the cloud never sends, is a protocol error: the connection is closed (1002), so that
every waiter on it fails with `ChannelDown` and its session is re-opened elsewhere, rather
than one waiter hanging. The channel reconnects with exponential backoff; while it is down,
waiters fail with `ChannelDown`, and new calls wait for the connection up to the configured
deadline (the request layer decides what to re-open). A refusal (the cloud refused our
credentials, TLS failed either way, or the URL would carry them in plaintext: see
`edge_gateway.credentials`) is kept as `refused`, which `/health` reports and which fails
requests at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Hashable
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection
from websockets.protocol import State

from asymspec.actors import Supervised
from asymspec.wire import (
    CorrectionRequest,
    CorrectionResponse,
    ErrorCode,
    ErrorFrame,
    GenerateTokens,
    Hello,
    HelloAck,
    Message,
    OpenSession,
    SessionOpened,
    VerifyBlock,
    VerifyBlockFull,
    VerifyResult,
    WireError,
    decode,
    encode,
)
from edge_gateway.credentials import CloudCredentials, refusal
from edge_gateway.metrics import EdgeMetrics

log = logging.getLogger("asymspec.edge.channel")


class ChannelDown(ConnectionError):
    """The cloud is unreachable (or the connection dropped while a reply was awaited)."""


class ReplyTimeout(TimeoutError):
    """The cloud did not answer one request in time (the connection itself is up)."""


class CloudError(RuntimeError):
    """The cloud answered a request with a typed error frame."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


class SessionBytes:
    """Link bytes per tracked session, (uplink, downlink), counted where the link counters
    are counted so that the per-request figures add up to them. One ledger serves every
    replica's channel: a session re-placed on another replica keeps one account."""

    def __init__(self) -> None:
        self._bytes: dict[int, tuple[int, int]] = {}

    def track(self, session_id: int) -> None:
        self._bytes.setdefault(session_id, (0, 0))

    def of(self, session_id: int) -> tuple[int, int]:
        return self._bytes.get(session_id, (0, 0))

    def forget(self, session_id: int) -> None:
        self._bytes.pop(session_id, None)

    def add(self, session_id: int | None, direction: str, n_bytes: int) -> None:
        if session_id is None or session_id not in self._bytes:
            return
        up, down = self._bytes[session_id]
        self._bytes[session_id] = (
            (up + n_bytes, down) if direction == "uplink" else (up, down + n_bytes)
        )


class CoalescingConnection(ClientConnection):
    """A client connection whose frames written in one turn of the event loop leave in one
    transport write: one TLS record (and, with room in the window, one TCP segment) instead
    of one per frame. The blocks of a draft batch are sent by their requests' tasks, all
    woken by the same forward, so they leave together; each TLS record costs 22 bytes (a
    5-byte header, a 16-byte tag, the content type) against a ~50-byte block frame."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: list[bytes] = []
        self._flush_handle: asyncio.Handle | None = None

    def send_data(self) -> None:
        if self.protocol.state is not State.OPEN:  # closing: in order, at once, as before
            self._flush()
            super().send_data()
            return
        self._pending.extend(self.protocol.data_to_send())
        if self._flush_handle is None:
            # Runs after every callback already ready: the tasks woken with this one
            self._flush_handle = self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        data, self._pending = b"".join(self._pending), []
        if data and not self.transport.is_closing():
            self.transport.write(data)


class CloudChannel:
    def __init__(
        self,
        url: str,
        credentials: CloudCredentials,
        metrics: EdgeMetrics,
        max_frame_bytes: int = 64 * 1024 * 1024,
        ledger: SessionBytes | None = None,
        reply_timeout_s: float = 30.0,
        coalesce_frames: bool = True,
    ) -> None:
        self.url, self.credentials, self.metrics = url, credentials, metrics
        self.coalesce_frames = coalesce_frames
        self.max_frame_bytes, self.reply_timeout_s = max_frame_bytes, reply_timeout_s
        self.refused: str | None = None  # why the cloud refused our handshake, until it accepts
        self.ledger = ledger or SessionBytes()
        self._ws: ClientConnection | None = None
        self._connected = asyncio.Event()
        self._waiters: dict[Hashable, asyncio.Future[Any]] = {}
        self._streams: dict[int, asyncio.Queue[GenerateTokens | Exception]] = {}
        self.actor = Supervised(f"cloud channel to {url}", self._fail_all)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def start(self) -> None:
        reason = self.credentials.plaintext_refusal(self.url)
        if reason is not None:
            # Never connects: nothing would change by retrying
            log.error("cloud channel to %s: %s", self.url, reason)
            self.refused = reason
            return
        self.actor.start(self._run())

    async def stop(self) -> None:
        await self.actor.stop()
        if self._ws is not None:
            await self._ws.close()

    async def wait_connected(self, timeout_s: float) -> None:
        self.actor.check()
        try:
            await asyncio.wait_for(self._connected.wait(), timeout_s)
        except TimeoutError:
            raise ChannelDown(f"the cloud at {self.url} is unreachable") from None

    # ------------------------------------------------------------------ requests

    async def open_session(self, msg: OpenSession, then: Message | None = None) -> SessionOpened:
        """Open a session; ``then``: a frame sent right behind the open, before its reply (a
        generation, which the cloud starts once the prompt is in)."""
        reply: SessionOpened = await self._request(("open", msg.session_id), msg, then)
        return reply

    async def verify(self, msg: VerifyBlock | VerifyBlockFull) -> VerifyResult:
        reply: VerifyResult = await self._request(("verify", msg.block), msg)
        return reply

    async def correct(self, msg: CorrectionRequest) -> CorrectionResponse:
        reply: CorrectionResponse = await self._request(("correct", msg.block), msg)
        return reply

    def stream(self, session_id: int) -> asyncio.Queue[GenerateTokens | Exception]:
        """The queue GenerateTokens frames of a session land in (target-only mode)."""
        return self._streams.setdefault(session_id, asyncio.Queue())

    def end_stream(self, session_id: int) -> None:
        self._streams.pop(session_id, None)

    async def send(self, msg: Message) -> None:
        ws = self._ws
        if ws is None or not self.connected:
            raise ChannelDown("not connected to the cloud")
        frame = encode(msg)
        try:
            await ws.send(frame)
        except websockets.ConnectionClosed as exc:
            raise ChannelDown("the cloud connection closed") from exc
        self._count("uplink", type(msg).__name__, len(frame), _frame_session(msg))

    async def _request(self, key: Hashable, msg: Message, then: Message | None = None) -> Any:
        if key in self._waiters:
            raise RuntimeError(f"a request for {key} is already in flight")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiters[key] = future
        try:
            await self.send(msg)
            if then is not None:
                await self.send(then)
            return await asyncio.wait_for(future, self.reply_timeout_s)
        except TimeoutError:
            raise ReplyTimeout(
                f"no reply to {type(msg).__name__} from {self.url} in {self.reply_timeout_s} s"
            ) from None
        finally:
            self._waiters.pop(key, None)

    # ------------------------------------------------------------------ connection

    async def _run(self) -> None:
        backoff_s = 0.1
        ssl_context = self.credentials.ssl_context(self.url)
        while True:
            try:
                async with websockets.connect(
                    self.url,
                    ssl=ssl_context,
                    max_size=self.max_frame_bytes,
                    compression=None,
                    ping_interval=20,
                    create_connection=CoalescingConnection if self.coalesce_frames else None,
                ) as ws:
                    await self._handshake(ws)
                    backoff_s, self.refused = 0.1, None
                    self._ws = ws
                    self._connected.set()
                    self.metrics.cloud_connected.inc()
                    log.info("connected to the cloud at %s", self.url)
                    await self._read(ws)
            except asyncio.CancelledError:
                raise
            except CloudError as exc:
                if exc.code == ErrorCode.UNAUTHORIZED:
                    self.refused = f"the cloud refused this edge: {exc.message}"
                log.error("cloud channel: %s; retrying in %.1f s", exc, backoff_s)
            except websockets.ConnectionClosed as exc:
                if exc.rcvd is not None and exc.rcvd.code == 1008:  # revoked while connected
                    self.refused = f"the cloud refused this edge: {exc.rcvd.reason}"
                log.warning("cloud channel: %s; retrying in %.1f s", exc, backoff_s)
            except Exception as exc:
                tls_refusal = refusal(exc, ssl_context is not None, bool(self.credentials.certfile))
                if tls_refusal is not None:
                    self.refused = tls_refusal
                    log.error("cloud channel: %s; retrying in %.1f s", tls_refusal, backoff_s)
                else:
                    log.warning("cloud channel: %s; retrying in %.1f s", exc, backoff_s)
            finally:
                if self.connected:
                    self.metrics.cloud_connected.dec()  # counts connected replicas
                self._connected.clear()
                self._ws = None
                self._fail_all(ChannelDown("the cloud connection was lost"))
            await asyncio.sleep(backoff_s * (0.5 + random.random()))
            backoff_s = min(backoff_s * 2, 5.0)

    async def _handshake(self, ws: ClientConnection) -> None:
        await ws.send(encode(Hello(self.credentials.edge_id, self.credentials.token)))
        reply = decode(await ws.recv(decode=False), self.max_frame_bytes)
        if isinstance(reply, ErrorFrame):
            raise CloudError(reply.code, reply.message)
        if not isinstance(reply, HelloAck):
            raise CloudError(ErrorCode.MALFORMED, f"expected HelloAck, got {type(reply).__name__}")

    async def _read(self, ws: ClientConnection) -> None:
        async for frame in ws:
            data = frame if isinstance(frame, bytes) else frame.encode()
            try:
                msg = decode(data, self.max_frame_bytes)
            except WireError as exc:
                self._count("downlink", "undecodable", len(data))
                await self._protocol_error(ws, f"undecodable frame from the cloud: {exc}")
                return
            self._count("downlink", type(msg).__name__, len(data), _frame_session(msg))
            if not self._route(msg):
                await self._protocol_error(ws, f"unexpected {type(msg).__name__} from the cloud")
                return

    async def _protocol_error(self, ws: ClientConnection, reason: str) -> None:
        log.error("%s: closing the connection (its sessions re-open)", reason)
        await ws.close(code=1002, reason=reason[:120])

    def _count(
        self, direction: str, message: str, n_bytes: int, session_id: int | None = None
    ) -> None:
        """Link bytes as the channel's frames carry them (WebSocket headers not included)."""
        self.ledger.add(session_id, direction, n_bytes)
        self.metrics.link_bytes.labels(direction=direction).inc(n_bytes)
        self.metrics.link_frames.labels(direction=direction).inc()
        self.metrics.link_message_bytes.labels(direction=direction, message=message).inc(n_bytes)

    def _route(self, msg: Message) -> bool:
        """Hand a frame to its waiter; False for a type the cloud never sends."""
        if isinstance(msg, SessionOpened):
            self._resolve(("open", msg.session_id), msg)
        elif isinstance(msg, VerifyResult):
            self._resolve(("verify", msg.block), msg)
        elif isinstance(msg, CorrectionResponse):
            self._resolve(("correct", msg.block), msg)
        elif isinstance(msg, GenerateTokens):
            self.stream(msg.session_id).put_nowait(msg)
        elif isinstance(msg, ErrorFrame):
            self._route_error(msg)
        else:
            return False
        return True

    def _resolve(self, key: Hashable, value: Any) -> None:
        future = self._waiters.get(key)
        if future is not None and not future.done():
            future.set_result(value)

    def _route_error(self, msg: ErrorFrame) -> None:
        error = CloudError(msg.code, msg.message)
        keys: list[Hashable] = []
        if msg.block is not None:
            keys = [("verify", msg.block), ("correct", msg.block)]
        elif msg.session_id is not None:
            keys = [("open", msg.session_id)]
            keys += [k for k in self._waiters if _session_of(k) == msg.session_id]
            if msg.session_id in self._streams:
                self._streams[msg.session_id].put_nowait(error)
        else:
            log.error("cloud error without a session: %s", error)
        for key in keys:
            future = self._waiters.get(key)
            if future is not None and not future.done():
                future.set_exception(error)

    def _fail_all(self, error: Exception) -> None:
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(error)
        for queue in self._streams.values():
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(error)


def _session_of(key: Hashable) -> int | None:
    if isinstance(key, tuple) and len(key) == 2:
        target = key[1]
        return int(target.session_id) if hasattr(target, "session_id") else int(target)
    return None


def _frame_session(msg: Message) -> int | None:
    """The session a frame belongs to (None for Hello and connection-level errors)."""
    session_id = getattr(msg, "session_id", None)
    if session_id is None:
        block = getattr(msg, "block", None)
        session_id = getattr(block, "session_id", None)
    return None if session_id is None else int(session_id)
