"""A TCP relay on loopback that keeps every byte it relays: what a listener on the path
between edge and cloud would read. It runs its own event loop on a thread, so tests drive
real processes through it synchronously."""

from __future__ import annotations

import asyncio
import contextlib
import threading


class WireTap:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        # per connection: (client -> upstream, upstream -> client)
        self.connections: list[tuple[bytearray, bytearray]] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> WireTap:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def uplink(self) -> bytes:
        return b"".join(bytes(up) for up, _ in self.connections)

    @property
    def captured(self) -> bytes:
        return b"".join(bytes(up) + bytes(down) for up, down in self.connections)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._relay, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        uplink, downlink = bytearray(), bytearray()
        self.connections.append((uplink, downlink))
        await asyncio.gather(_pipe(reader, up_writer, uplink), _pipe(up_reader, writer, downlink))


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, kept: bytearray
) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            kept.extend(data)
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(Exception):
        writer.close()


def websocket_payloads(stream: bytes) -> bytes:
    """What a listener reads from a captured plaintext WebSocket stream: the HTTP upgrade
    skipped, each frame's payload unmasked (a client masks its frames with a key that the
    frame itself carries, which hides nothing) and the payloads joined."""
    at = stream.index(b"\r\n\r\n") + 4
    out = bytearray()
    while at + 2 <= len(stream):
        masked, length = stream[at + 1] & 0x80, stream[at + 1] & 0x7F
        at += 2
        if length == 126:
            length, at = int.from_bytes(stream[at : at + 2], "big"), at + 2
        elif length == 127:
            length, at = int.from_bytes(stream[at : at + 8], "big"), at + 8
        key = stream[at : at + 4] if masked else b"\0\0\0\0"
        at += 4 if masked else 0
        payload = stream[at : at + length]
        out.extend(b ^ key[i % 4] for i, b in enumerate(payload))
        at += length
    return bytes(out)
