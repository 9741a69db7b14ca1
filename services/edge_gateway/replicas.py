"""The cloud verifier replicas an edge talks to: one channel per replica URL, each session
placed on one of them, and placed again when its replica is lost.

A replica holds only soft state: the sessions placed on it (their confirmed prefix and the
target's KV cache for it). The edge holds every session's confirmed prefix, so a session
whose replica goes away is opened again on a live one from that prefix and carries on where
it was (`decoding._RequestState.open`). Placement is least-loaded: the connected replica
with the fewest sessions of this edge, the first listed on a tie.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from asymspec.wire import CloseSession
from edge_gateway.channel import ChannelDown, CloudChannel, SessionBytes
from edge_gateway.credentials import CloudCredentials
from edge_gateway.metrics import EdgeMetrics


class CloudReplicas:
    def __init__(
        self,
        urls: Sequence[str],
        credentials: CloudCredentials,
        metrics: EdgeMetrics,
        reply_timeout_s: float = 30.0,
        coalesce_frames: bool = True,
    ) -> None:
        if not urls:
            raise ValueError("at least one cloud verifier URL is needed")
        self.ledger = SessionBytes()  # one account per session, whichever replica it is on
        self.channels = [
            CloudChannel(
                url,
                credentials,
                metrics,
                ledger=self.ledger,
                reply_timeout_s=reply_timeout_s,
                coalesce_frames=coalesce_frames,
            )
            for url in urls
        ]
        self._placed: dict[int, CloudChannel] = {}

    @property
    def urls(self) -> list[str]:
        return [c.url for c in self.channels]

    @property
    def connected(self) -> bool:
        """Whether any replica can take a session."""
        return any(c.connected for c in self.channels)

    @property
    def refused(self) -> str | None:
        """Why no replica will take a session, when every one refused us for one reason."""
        reasons = {c.refused for c in self.channels}
        return reasons.pop() if len(reasons) == 1 else None

    def not_ready_reason(self) -> str | None:
        dead = [c.actor.failure for c in self.channels if c.actor.failure]
        if dead:
            return "; ".join(dead)
        if self.connected:
            return None
        refused = self.refused
        where = ", ".join(self.urls)
        return (
            f"{refused} ({where})" if refused else f"not connected to any cloud verifier ({where})"
        )

    def start(self) -> None:
        for channel in self.channels:
            channel.start()

    async def stop(self) -> None:
        await asyncio.gather(*(c.stop() for c in self.channels))

    async def wait_connected(self, timeout_s: float) -> None:
        """Until any replica is connected; ChannelDown after ``timeout_s``, or at once when
        every replica refused the secret (waiting would not change that)."""
        if self.connected:
            return
        if self.refused:
            raise ChannelDown(f"{self.refused} ({', '.join(self.urls)})")
        waits = [asyncio.ensure_future(c.wait_connected(timeout_s)) for c in self.channels]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        if not self.connected:
            raise ChannelDown(f"no cloud verifier reachable at {', '.join(self.urls)}")

    def load(self, channel: CloudChannel) -> int:
        return sum(1 for c in self._placed.values() if c is channel)

    async def place(self, session_id: int, timeout_s: float) -> CloudChannel:
        """Put a session on the least-loaded connected replica (waiting up to ``timeout_s``
        for one); a session placed before moves."""
        await self.wait_connected(timeout_s)
        live = [c for c in self.channels if c.connected]
        if not live:  # lost again between the wake-up and now
            raise ChannelDown(f"no cloud verifier reachable at {', '.join(self.urls)}")
        self._placed.pop(session_id, None)
        channel = min(live, key=self.load)
        self._placed[session_id] = channel
        return channel

    def channel_of(self, session_id: int) -> CloudChannel:
        """The replica a session is open on (it must have been placed)."""
        return self._placed[session_id]

    async def close(self, session_id: int) -> None:
        """Close a finished session on its replica (if it got one) and forget it, and the
        stream of tokens it may have asked for and not read."""
        channel = self._placed.pop(session_id, None)
        if channel is not None:
            channel.end_stream(session_id)
            with contextlib.suppress(ChannelDown):  # a lost replica has dropped it already
                await channel.send(CloseSession(session_id))
