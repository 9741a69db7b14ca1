"""The cloud end of the edge channel: one WebSocket per edge, many requests multiplexed.

Each frame is one `asymspec.wire` message. The connection starts with Hello/HelloAck: the
edge is identified there (`cloud_verifier.identities`: its client certificate, its token or
the shared secret), and its identity labels its sessions' limit, metrics and logs. Model
work (prefill, verification, decoding, close) goes to the batcher; corrections are
answered on the event loop from the retained target row, since they need no forward.
Replies are written by whichever task finished, under one send lock, so frames never
interleave. When the edge goes away, its sessions are closed and their KV caches freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import Any

import numpy as np
from fastapi import WebSocket, WebSocketDisconnect

from asymspec.constraint import ConstraintBuilder
from asymspec.correction import Rung
from asymspec.grammar import GrammarError
from asymspec.wire import (
    BlockId,
    CloseSession,
    CorrectionRequest,
    CorrectionResponse,
    ErrorCode,
    ErrorFrame,
    GenerateRequest,
    GenerateTokens,
    Hello,
    HelloAck,
    Message,
    OpenSession,
    SessionOpened,
    StopGeneration,
    VerifyBlock,
    VerifyBlockFull,
    WireError,
    decode,
    encode,
)
from asymspec_engine.feature_draft import features_to_wire
from cloud_verifier.batcher import Batcher
from cloud_verifier.identities import Credentials, EdgeIdentities, Refused
from cloud_verifier.metrics import CloudMetrics
from cloud_verifier.sessions import Session
from cloud_verifier.settings import CloudSettings

log = logging.getLogger("asymspec.cloud")
_connection_ids = itertools.count(1)


class _Connection:
    """One edge's channel: its sessions, its in-flight tasks and its writer."""

    def __init__(self, ws: WebSocket, server: ChannelServer) -> None:
        self.ws, self.server = ws, server
        self.id = next(_connection_ids)
        self.credentials: Credentials | None = None
        self.identity = "?"  # until the Hello is admitted
        self.sessions: dict[int, Session] = {}
        # sessions whose prompt is being prefilled: True once it is in, False if it failed
        self.opening: dict[int, asyncio.Future[bool]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self._send_lock = asyncio.Lock()

    async def send(self, msg: Message) -> None:
        frame = encode(msg)
        async with self._send_lock:
            await self.ws.send_bytes(frame)
        self.server.count(self, "downlink", len(frame))

    def spawn(self, work: Any, session_id: int, block: BlockId | None = None) -> None:
        task = asyncio.create_task(self._reporting(work, session_id, block))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _reporting(self, work: Any, session_id: int, block: BlockId | None) -> None:
        """Run a handler; a failure becomes a typed error frame naming its session/block."""
        try:
            await work
        except WireError as exc:
            await self.send_error(exc.code, exc.message, session_id, block)
        except WebSocketDisconnect:
            raise
        except Exception as exc:  # a bug in one request must not take the channel down
            log.exception("channel handler failed")
            await self.send_error(
                ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", session_id, block
            )

    async def send_error(
        self, code: ErrorCode, message: str, session_id: int | None, block: BlockId | None
    ) -> None:
        with contextlib.suppress(Exception):  # the socket may already be gone
            await self.send(ErrorFrame(code, message, session_id, block))


class ChannelServer:
    def __init__(
        self,
        settings: CloudSettings,
        batcher: Batcher,
        metrics: CloudMetrics,
        identities: EdgeIdentities,
        constraints: ConstraintBuilder | None = None,
    ) -> None:
        self.settings, self.batcher, self.metrics = settings, batcher, metrics
        self.identities = identities
        # penalties and grammars (a grammar needs the target's tokenizer)
        self.constraints = constraints or ConstraintBuilder(None, batcher.vocab_size)
        self.server_id = f"cloud-{settings.port}"
        self.connections: set[_Connection] = set()

    @property
    def session_count(self) -> int:
        return sum(len(c.sessions) for c in self.connections)

    def sessions_of(self, identity: str) -> int:
        """Open sessions of one edge, over all its connections."""
        return sum(len(c.sessions) for c in self.connections if c.identity == identity)

    def describe(self) -> list[dict[str, int | str]]:
        return [
            {"connection": c.id, "edge": c.identity, "sessions": len(c.sessions)}
            for c in self.connections
        ]

    def count(self, conn: _Connection, direction: str, n_bytes: int) -> None:
        self.metrics.link_bytes.labels(direction=direction).inc(n_bytes)
        self.metrics.link_frames.labels(direction=direction).inc()
        self.metrics.edge_link_bytes.labels(edge=conn.identity, direction=direction).inc(n_bytes)

    async def revoke(self) -> int:
        """After the identities were reloaded: close every connection whose credentials no
        longer admit it (1008, the reason in the close frame); returns how many."""
        cut = 0
        for conn in list(self.connections):
            if conn.credentials is None:
                continue
            try:
                self.identities.admit(conn.credentials)
            except Refused as exc:
                log.warning("closing the channel of edge %s: %s", conn.identity, exc)
                await conn.send_error(ErrorCode.UNAUTHORIZED, str(exc), None, None)
                with contextlib.suppress(Exception):
                    await conn.ws.close(code=1008, reason=str(exc)[:120])
                cut += 1
        return cut

    async def serve(self, ws: WebSocket) -> None:
        await ws.accept()
        conn = _Connection(ws, self)
        tls = ws.scope.get("extensions", {}).get("tls") or {}
        cert_name: str | None = tls.get("client_cert_name")
        try:
            if not await self._handshake(conn, cert_name):
                return
            self.connections.add(conn)
            self.metrics.connected_edges.inc()
            try:
                while True:
                    frame = await self._next_frame(conn)
                    if frame is None:
                        return
                    await self._receive(conn, frame)
            finally:
                self.metrics.connected_edges.dec()
                self.connections.discard(conn)
                log.info("edge %s disconnected (connection %d)", conn.identity, conn.id)
        except WebSocketDisconnect:
            pass
        finally:
            await self._release(conn)

    async def _next_frame(self, conn: _Connection) -> bytes | None:
        """The next binary frame; a text frame closes the connection with 1003 (the wire is
        binary only) and None is returned."""
        message = await conn.ws.receive()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        data = message.get("bytes")
        if data is None:
            await conn.send_error(
                ErrorCode.MALFORMED, "text frame: the channel is binary", None, None
            )
            await conn.ws.close(code=1003)
            return None
        return bytes(data)

    async def _handshake(self, conn: _Connection, cert_name: str | None) -> bool:
        """Hello within `handshake_timeout_s` of the upgrade, or the connection is closed."""
        try:
            frame = await asyncio.wait_for(
                self._next_frame(conn), self.settings.handshake_timeout_s
            )
        except TimeoutError:
            self.metrics.channel_auth_failures.inc()
            await conn.ws.close(code=1008, reason="no Hello in time")
            return False
        if frame is None:
            return False
        try:
            hello = decode(frame, self.settings.max_frame_bytes)
        except WireError as exc:
            await conn.send(ErrorFrame(exc.code, exc.message, None, None))
            await conn.ws.close(code=1002)
            return False
        try:
            if not isinstance(hello, Hello):
                raise Refused(f"expected Hello, got {type(hello).__name__}")
            credentials = Credentials(cert_name, hello.edge_id, hello.auth_token)
            conn.identity = self.identities.admit(credentials)
        except Refused as exc:
            self.metrics.channel_auth_failures.inc()
            log.warning("refused an edge from %s: %s", _peer(conn.ws), exc)
            await conn.send(ErrorFrame(ErrorCode.UNAUTHORIZED, str(exc), None, None))
            await conn.ws.close(code=1008)
            return False
        conn.credentials = credentials
        log.info(
            "edge %s connected from %s (connection %d)", conn.identity, _peer(conn.ws), conn.id
        )
        await conn.send(HelloAck(self.server_id))
        return True

    async def _receive(self, conn: _Connection, frame: bytes) -> None:
        self.count(conn, "uplink", len(frame))
        try:
            msg = decode(frame, self.settings.max_frame_bytes)
        except WireError as exc:
            await conn.send_error(exc.code, exc.message, None, None)
            return
        if isinstance(msg, VerifyBlock | VerifyBlockFull):
            conn.spawn(self._verify(conn, msg), msg.block.session_id, msg.block)
        elif isinstance(msg, CorrectionRequest):
            conn.spawn(self._correct(conn, msg), msg.block.session_id, msg.block)
        elif isinstance(msg, OpenSession):
            conn.spawn(self._open(conn, msg), msg.session_id)
        elif isinstance(msg, CloseSession):
            conn.spawn(self._close(conn, msg.session_id), msg.session_id)
        elif isinstance(msg, GenerateRequest):
            conn.spawn(self._generate(conn, msg), msg.session_id)
        elif isinstance(msg, StopGeneration):
            # Inline, not spawned: it lands before any frame the edge sent after it. A stop
            # for a session that closed meanwhile is moot.
            session = conn.sessions.get(msg.session_id)
            if session is not None:
                self.batcher.stop_generation(session)
        else:
            await conn.send_error(
                ErrorCode.MALFORMED, f"unexpected {type(msg).__name__}", None, None
            )

    def _session(self, conn: _Connection, session_id: int) -> Session:
        try:
            return conn.sessions[session_id]
        except KeyError:
            raise WireError(ErrorCode.UNKNOWN_SESSION, f"unknown session {session_id}") from None

    async def _open(self, conn: _Connection, msg: OpenSession) -> None:
        if msg.session_id in conn.sessions:
            raise WireError(ErrorCode.MALFORMED, f"session {msg.session_id} is already open")
        if self.sessions_of(conn.identity) >= self.settings.max_sessions_per_edge:
            raise WireError(
                ErrorCode.OVERLOADED, f"too many open sessions for edge {conn.identity}"
            )
        if not 0 < len(msg.prompt_tokens) <= self.settings.max_context_tokens:
            raise WireError(ErrorCode.MALFORMED, "prompt must have 1..max_context_tokens tokens")
        if int(msg.prompt_tokens.max()) >= self.batcher.vocab_size:
            raise WireError(ErrorCode.MALFORMED, "prompt token id outside the vocabulary")
        prompt = [int(t) for t in msg.prompt_tokens]
        try:
            constraint = self.constraints.build(msg.sampling, prompt)
        except GrammarError as exc:
            raise WireError(ErrorCode.UNSUPPORTED, f"cannot run the grammar: {exc}") from None
        if msg.wants_features and not self.batcher.target.provides_features:
            raise WireError(
                ErrorCode.UNSUPPORTED,
                "this verifier's target engine returns no hidden states, so it cannot serve "
                "a feature draft (use a token draft at the edge, or a Llama-family target)",
            )
        # from here on the session is the batcher's: its state changes on the model thread
        session = Session(
            session_id=msg.session_id,
            owner=conn.id,
            config=msg.sampling,
            first_rung=Rung(msg.first_kind, msg.first_size),
            confirmed=prompt,
            wants_features=msg.wants_features,
            constraint=constraint,
        )
        conn.sessions[msg.session_id] = session
        opened = conn.opening[msg.session_id] = asyncio.get_running_loop().create_future()
        try:
            features = await self.batcher.prefill(session)
        except BaseException:
            # A failed or abandoned prefill leaves no session behind, on either side.
            opened.set_result(False)
            conn.sessions.pop(msg.session_id, None)
            await asyncio.shield(self.batcher.close(session))
            raise
        else:
            opened.set_result(True)
        finally:
            conn.opening.pop(msg.session_id, None)
        self.metrics.edge_sessions_opened.labels(edge=conn.identity).inc()
        await conn.send(
            SessionOpened(
                msg.session_id,
                session.prompt_len,
                None if features is None else features_to_wire(features),
                self.batcher.target_cost(),
            )
        )

    async def _close(self, conn: _Connection, session_id: int) -> None:
        session = conn.sessions.pop(session_id, None)
        if session is not None:
            await self.batcher.close(session)

    async def _release(self, conn: _Connection) -> None:
        for task in list(conn.tasks):
            task.cancel()
        await asyncio.gather(*conn.tasks, return_exceptions=True)
        for session_id in list(conn.sessions):
            await self._close(conn, session_id)

    async def _verify(self, conn: _Connection, msg: VerifyBlock | VerifyBlockFull) -> None:
        session = self._session(conn, msg.block.session_id)
        await conn.send(await self.batcher.verify(session, msg))

    async def _correct(self, conn: _Connection, msg: CorrectionRequest) -> None:
        session = self._session(conn, msg.block.session_id)
        payload = await self.batcher.correct(session, msg.block, Rung(msg.kind, msg.size), msg.rung)
        self.metrics.cloud_corrections.labels(kind=msg.kind.label).inc()
        await conn.send(CorrectionResponse(msg.block, payload))

    async def _generate(self, conn: _Connection, msg: GenerateRequest) -> None:
        """The cloud decodes the session alone, one token per frame: target-only mode
        (SPADE's Target baseline), or a speculative session while its edge has paused
        speculation. An edge may send it right behind the session's open (target-only: the
        first token then costs one trip to the cloud and back, not two): it starts once the
        prompt is in."""
        opening = conn.opening.get(msg.session_id)
        if opening is not None and not await asyncio.shield(opening):
            raise WireError(ErrorCode.UNKNOWN_SESSION, f"session {msg.session_id} did not open")
        session = self._session(conn, msg.session_id)
        stop = {int(t) for t in msg.stop_token_ids}
        # aclosing: a failed send ends the generation now, not when the generator is collected
        async with contextlib.aclosing(
            self.batcher.generate(session, msg.max_tokens, stop, msg.committed_tail)
        ) as decoded_tokens:
            async for decoded in decoded_tokens:
                ids = np.array([decoded.token], np.uint32)
                frame = GenerateTokens(msg.session_id, ids, decoded.last, decoded.logprobs)
                await conn.send(frame)


def _peer(ws: WebSocket) -> str:
    return f"{ws.client.host}:{ws.client.port}" if ws.client else "?"
