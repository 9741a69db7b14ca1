"""Admission control in front of the OpenAI API: API keys, body size and read time,
concurrency.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which buffers streams), so a
streamed response counts against the concurrency limit for its whole life. A POST's body is
read here first, within `body_timeout_s` (else 408), and only then does the request take a
concurrency slot: a client that sends half a body holds no slot. /health and /metrics stay
open: orchestrators and scrapers do not carry API keys.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

from edge_gateway.metrics import EdgeMetrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_OPEN_PATHS = ("/health", "/metrics")


class Admission:
    def __init__(
        self,
        app: ASGIApp,
        api_keys: frozenset[str],
        max_concurrent: int,
        max_body_bytes: int,
        metrics: EdgeMetrics,
        body_timeout_s: float = 30.0,
    ) -> None:
        self.app, self.api_keys, self.metrics = app, api_keys, metrics
        self.max_concurrent, self.max_body_bytes = max_concurrent, max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_keys and not self._authorized(headers.get("authorization", "")):
            self.metrics.requests_rejected.labels(reason="auth").inc()
            await _error(send, 401, "Invalid or missing API key.", "invalid_api_key")
            return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await _error(send, 413, f"Request body over {self.max_body_bytes} bytes.", "too_large")
            return
        if scope["method"] != "POST":
            await self.app(scope, _limited_body(receive, self.max_body_bytes), send)
            return
        try:
            replay = await self._read_body(receive)
        except TimeoutError:
            self.metrics.requests_rejected.labels(reason="slow_body").inc()
            message = f"Request body not received within {self.body_timeout_s} s."
            await _error(send, 408, message, "body_timeout")
            return
        except BodyTooLarge:
            await _error(send, 413, f"Request body over {self.max_body_bytes} bytes.", "too_large")
            return
        if replay is None:
            return  # the client left before its body was in
        if self.active >= self.max_concurrent:
            self.metrics.requests_rejected.labels(reason="overload").inc()
            await _error(send, 429, "Too many concurrent requests; retry shortly.", "overloaded")
            return
        self.active += 1
        try:
            await self.app(scope, replay, send)
        finally:
            self.active -= 1

    async def _read_body(self, receive: Receive) -> Receive | None:
        """The whole body, within the time limit; a receive that hands it over as one
        message and then passes on to the client's (a disconnect while streaming). None if
        the client disconnected first."""
        deadline_s = time.monotonic() + self.body_timeout_s
        chunks: list[bytes] = []
        seen = 0
        while True:
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0:
                raise TimeoutError
            message = await asyncio.wait_for(receive(), remaining_s)
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_body_bytes:
                raise BodyTooLarge(self.max_body_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks)}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()

        return replay

    def _authorized(self, authorization: str) -> bool:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        # every key compared: the time taken does not say which one matched
        return any([hmac.compare_digest(token.encode(), key.encode()) for key in self.api_keys])


class BodyTooLarge(HTTPException):
    """Raised mid-read; the app's HTTP error handler turns it into an OpenAI 413 body."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"Request body over {max_bytes} bytes.")


def _limited_body(receive: Receive, max_bytes: int) -> Receive:
    """A chunked body (no Content-Length) is counted as it arrives."""
    seen = 0

    async def limited() -> Message:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > max_bytes:
            raise BodyTooLarge(max_bytes)
        return message

    return limited


async def _error(send: Send, status: int, message: str, code: str) -> None:
    error_type = {
        401: "invalid_request_error",
        408: "invalid_request_error",
        413: "invalid_request_error",
    }.get(status, "rate_limit_error")
    body = json.dumps(
        {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 429:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
