"""Running a service process: its settings (``asymspec.cli``: flags over the environment),
then uvicorn.

Both services start the same way (`python -m edge_gateway`, `python -m cloud_verifier`).
uvicorn closes idle keep-alive connections but waits forever for a request's head, so a
client trickling header bytes (slowloris) holds a connection for good: the HTTP protocol
here closes a connection whose request head is not complete `header_timeout_s` after the
connection opened or after its previous response.

TLS is uvicorn's own (the settings' `tls_options`). uvicorn does not tell the app who the
TLS peer is, so the WebSocket protocol here adds the verified client certificate's subject
to the scope, as the ASGI TLS extension names it (`extensions.tls.client_cert_name`): the
cloud's channel takes an edge's identity from it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.http11 import Request


class ServiceSettings(Protocol):
    host: str
    port: int
    header_timeout_s: float
    coalesce_frames: bool

    def tls_options(self) -> dict[str, Any]:
        """uvicorn's ssl_* keyword arguments; empty = plain HTTP."""
        ...


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


# RFC 4514's short names for the attributes an edge certificate's subject carries
_SHORT_NAMES = {
    "commonName": "CN",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "countryName": "C",
    "stateOrProvinceName": "ST",
    "localityName": "L",
}


def subject_name(peer_cert: dict[str, Any] | None) -> str | None:
    """A verified peer certificate's subject as RFC 4514 writes it (``CN=edge-a,O=acme``:
    the most specific attribute first); None without a certificate."""
    if not peer_cert or not peer_cert.get("subject"):
        return None
    rdns = [
        "+".join(f"{_SHORT_NAMES.get(k, k)}={v}" for k, v in rdn) for rdn in peer_cert["subject"]
    ]
    return ",".join(reversed(rdns))


class CoalescingTransport:
    """A transport whose writes within one turn of the event loop leave as one write: the
    verdicts of one verification batch, sent by as many tasks, become one TLS record (and
    one TCP segment where they fit) instead of one each. Everything else is the transport's."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._pending: list[bytes] = []
        self._flush_handle: asyncio.Handle | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._pending.append(bytes(data))
        if self._flush_handle is None:
            # after every callback already ready: the tasks woken with this one
            self._flush_handle = asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        data, self._pending = b"".join(self._pending), []
        if data and not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self.flush()  # a close frame written just before must go first
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class PeerCertWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol, with the TLS client certificate's subject in the scope
    and, with ``coalesce_frames``, the frames of one turn of the loop written together."""

    def __init__(self, *args: Any, coalesce_frames: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.coalesce_frames = coalesce_frames

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.coalesce_frames:
            self.transport = cast(asyncio.Transport, CoalescingTransport(self.transport))

    def handle_connect(self, event: Request) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)  # absent when the upgrade was refused
        if scope is None:
            return
        ssl_object = self.transport.get_extra_info("ssl_object")
        cert = ssl_object.getpeercert() if ssl_object is not None else None
        # The app task is created but has not run yet: it sees this scope entry.
        scope["extensions"]["tls"] = {"client_cert_name": subject_name(cert)}


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
        ws=functools.partial(  # type: ignore[arg-type]
            PeerCertWebSocketProtocol, coalesce_frames=settings.coalesce_frames
        ),
        **settings.tls_options(),
    )
