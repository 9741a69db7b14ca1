"""Running a service process: its settings (``asymspec.cli``: flags over the environment),
then uvicorn.

Both services start the same way (`python -m edge_gateway`, `python -m cloud_verifier`).
uvicorn closes idle keep-alive connections but waits forever for a request's head, so a
client trickling header bytes (slowloris) holds a connection for good: the HTTP protocol
here closes a connection whose request head is not complete `header_timeout_s` after the
connection opened or after its previous response.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


class ServiceSettings(Protocol):
    host: str
    port: int
    header_timeout_s: float


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head."""

    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the head arrived (or it upgraded)
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request on this connection has the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection: no request head in %s s", self.header_timeout_s)
            self.transport.close()


S = TypeVar("S", bound=ServiceSettings)


def serve(settings: S, create_app: Callable[[S], Any]) -> None:
    """Serve the app the settings make."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # One worker: the model, its caches and the batching actor live in this one process.
    protocol = functools.partial(HeaderTimeoutProtocol, header_timeout_s=settings.header_timeout_s)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        workers=1,
        http=protocol,  # type: ignore[arg-type]
    )
