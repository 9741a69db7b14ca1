"""Server-sent events for the streaming responses, and closing their iterators when a
client leaves (the close is what cancels the engine's request)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)


async def close_shielded(iterator: AsyncIterator[Any]) -> None:
    """Close an async iterator even inside a cancelled scope (client gone): the close is
    what tells the engine to cancel the request and free its state on both sides."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """An SSE response that notices a client leaving and closes its event iterator.

    Starlette watches for ``http.disconnect`` only under ASGI spec < 2.4 (uvicorn says
    2.3); under 2.4 it learns of a disconnect only when a send fails, and then leaves the
    iterator to the garbage collector. An engine waiting on a stalled cloud sends nothing,
    so the request would live on. Here the watch runs whatever the server's spec version,
    and the iterator is closed at once, which cancels the engine's request.
    """

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client went away during a send
                    except Exception:  # headers are sent: there is no one to answer now
                        logger.exception("event stream failed")
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            await close_shielded(self.events)
