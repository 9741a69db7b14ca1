"""Actor tasks that fail loudly: each service runs a few long-lived asyncio tasks (the edge's
draft scheduler and cloud channels, the cloud's batcher) that every request depends on. One
that dies must not stall its requests in silence: `Supervised` keeps why it died, fails what
was waiting on it, refuses new work, and its owner's /health reports the reason."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("asymspec.actors")


class ActorDied(RuntimeError):
    """The actor a request needed has stopped; the request cannot be served here."""


class Supervised:
    """One actor task: started by `start`, stopped by `stop`; `failure` says why it died."""

    def __init__(self, name: str, on_death: Callable[[ActorDied], None]) -> None:
        self.name, self._on_death = name, on_death
        self.failure: str | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self, run: Coroutine[Any, Any, None]) -> None:
        self._task = asyncio.create_task(run, name=self.name)
        self._task.add_done_callback(self._done)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.remove_done_callback(self._done)  # stopping is not dying
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def check(self) -> None:
        """Raise ActorDied if the actor is gone (before queueing work it would never do)."""
        if self.failure is not None:
            raise ActorDied(self.failure)

    def _done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        cause = f"{type(exc).__name__}: {exc}" if exc is not None else "it returned"
        self.failure = f"the {self.name} stopped ({cause})"
        log.critical("%s", self.failure, exc_info=exc)
        self._on_death(ActorDied(self.failure))
