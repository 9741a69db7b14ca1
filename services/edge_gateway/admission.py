"""Admission control in front of the OpenAI API: API keys, body size, concurrency.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which buffers streams), so a
streamed response counts against the concurrency limit for its whole life. /health and
/metrics stay open: orchestrators and scrapers do not carry API keys.
"""

from __future__ import annotations

import hmac
import json
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
    ) -> None:
        self.app, self.api_keys, self.metrics = app, api_keys, metrics
        self.max_concurrent, self.max_body_bytes = max_concurrent, max_body_bytes
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
        if self.active >= self.max_concurrent:
            self.metrics.requests_rejected.labels(reason="overload").inc()
            await _error(send, 429, "Too many concurrent requests; retry shortly.", "overloaded")
            return
        self.active += 1
        try:
            await self.app(scope, _limited_body(receive, self.max_body_bytes), send)
        finally:
            self.active -= 1

    def _authorized(self, authorization: str) -> bool:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return any(hmac.compare_digest(token.encode(), key.encode()) for key in self.api_keys)


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
    error_type = {401: "invalid_request_error", 413: "invalid_request_error"}.get(
        status, "rate_limit_error"
    )
    body = json.dumps(
        {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 429:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
