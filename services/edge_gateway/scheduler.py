"""The edge scheduler: one actor owns the draft model and batches drafting across requests.

Each request's decoding loop asks for a block only when its prefix is confirmed (it has no
open block), so whatever sits in the queue is a ready, confirmed-prefix request; the actor
drafts all of them (up to max_batch) in one batched forward per draft step. While one
request's block is out for verification the actor keeps drafting the others — never a
descendant of an unresolved block (AsymSpec §IV-C1).

Scheduling policies (the README's "Modes"):
- pipeline: draft whatever is ready, as soon as it is ready;
- sync: synchronous rounds, drafting only once every active request has asked, so no
  request starts block k+1 before all finished block k;
- runahead: sync rounds, plus each request drafts its next block from its unconfirmed
  prefix while its block is out (the request loop asks; wasted drafts are counted);
- stop-and-wait: one request at a time, one block at a time (the caller holds `exclusive`).

Every draft-model call (open, propose, close) runs on the actor's model thread (the one that
loaded the draft, see `asymspec.model_thread`), so the model and its caches have exactly one
owner. A rollback to the confirmed prefix rides the request's next propose
(``DraftRequest.rollback_to``): as a call of its own it queued behind other requests'
drafting once per block.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from asymspec.actors import ActorDied, Supervised
from asymspec.model_thread import ModelThread
from asymspec.modes import Mode
from asymspec_engine.draft import Draft, DraftModel, DraftRequest
from edge_gateway.metrics import EdgeMetrics


class DraftScheduler:
    def __init__(
        self,
        draft: DraftModel,
        mode: Mode,
        max_batch: int,
        metrics: EdgeMetrics,
        model_thread: ModelThread | None = None,
        prefill_chunk_tokens: int = 256,
    ) -> None:
        self.draft, self.mode, self.max_batch = draft, mode, max_batch
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.metrics = metrics
        # the thread that loaded the draft (None: a new one); the scheduler owns it from here
        self.model_thread = model_thread or ModelThread("draft")
        self._ready: list[tuple[DraftRequest, asyncio.Future[Draft]]] = []
        self._wakeup = asyncio.Event()
        self._active = 0  # requests between open() and close(): the sync barrier's size
        self.actor = Supervised("draft scheduler", self._fail_waiting)
        self._idle_since_s = time.perf_counter()
        self.exclusive = asyncio.Lock()  # stop-and-wait: one block in flight at a time

    def start(self) -> None:
        self.actor.start(self._run())

    async def stop(self) -> None:
        await self.actor.stop()
        self.model_thread.shutdown()

    def _fail_waiting(self, error: ActorDied) -> None:
        for _, future in self._ready:
            if not future.done():
                future.set_exception(error)
        self._ready.clear()

    @property
    def waiting(self) -> int:
        return len(self._ready)

    # ------------------------------------------------------------------ request API

    async def open(
        self,
        session_id: str,
        prompt_ids: Sequence[int],
        prev_features: torch.Tensor | None = None,
        prefill: bool = True,
    ) -> None:
        """Prefill the draft's cache with the prompt (all but its last token; a feature
        draft reads ``prev_features`` [len(prompt) - 1, hidden] with them). A long prompt
        goes in chunks of `prefill_chunk_tokens`, each its own call on the model thread, so
        the other requests' drafting runs between them instead of waiting for the whole
        prompt (a 2,000-token prompt holds a 2-core CPU's draft for about a second).
        Without ``prefill`` the session opens empty, for a request that will not draft
        soon: `catch_up` feeds it when it does."""
        prefix = list(prompt_ids[:-1])
        if prefill and len(prefix) <= self.prefill_chunk_tokens:
            await self._call(self.draft.open, session_id, prompt_ids, prev_features)
        else:
            await self._call(self.draft.start, session_id)
            try:
                if prefill:
                    await self._prefill(session_id, prefix, prev_features)
            except Exception:
                await self._call(self.draft.close, session_id)  # no half-open session
                raise
        self._active += 1

    async def catch_up(self, session_id: str, rollback_to: int, token_ids: Sequence[int]) -> None:
        """Roll a token draft's cache back to ``rollback_to`` tokens and feed it
        ``token_ids`` (the confirmed tokens it missed, but the last), in chunks as `open`
        does: a draft that fell far behind catches up without holding the others'."""
        await self._call(self.draft.rollback, session_id, rollback_to)
        await self._prefill(session_id, token_ids, None)

    async def _prefill(
        self, session_id: str, token_ids: Sequence[int], features: torch.Tensor | None
    ) -> None:
        for start in range(0, len(token_ids), self.prefill_chunk_tokens):
            end = min(len(token_ids), start + self.prefill_chunk_tokens)
            chunk_features = None if features is None else features[start:end]
            await self._call(self.draft.prefill, session_id, token_ids[start:end], chunk_features)

    async def close(self, session_id: str) -> None:
        self._active -= 1
        self._wakeup.set()  # the sync barrier may now be complete
        await self._call(self.draft.close, session_id)

    @property
    def active(self) -> int:
        """Requests with an open draft session (decoding now)."""
        return self._active

    def cached_length(self, session_id: str) -> int:
        """Tokens in the session's draft cache. Read between this session's own draft
        calls (the worker changes it only inside them)."""
        return self.draft.length(session_id)

    async def propose(self, request: DraftRequest) -> Draft:
        """Queue a ready request; resolves with its block once the actor drafted it."""
        self.actor.check()
        future: asyncio.Future[Draft] = asyncio.get_running_loop().create_future()
        self._ready.append((request, future))
        self.metrics.requests_waiting.set(len(self._ready))
        self._wakeup.set()
        return await future

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self.model_thread.run(fn, *args)

    # ------------------------------------------------------------------ the actor

    def _batch_ready(self) -> bool:
        if not self._ready:
            return False
        if self.mode.drafts_in_rounds:
            return len(self._ready) >= min(self._active, self.max_batch)
        return True

    async def _run(self) -> None:
        while True:
            while not self._batch_ready():
                self._wakeup.clear()
                await self._wakeup.wait()
            batch, self._ready = self._ready[: self.max_batch], self._ready[self.max_batch :]
            self.metrics.requests_waiting.set(len(self._ready))
            live = [(r, f) for r, f in batch if not f.done()]  # skip cancelled requests
            if not live:
                continue
            started = time.perf_counter()
            self.metrics.edge_idle.inc(started - self._idle_since_s)
            try:
                drafts = await self._call(self._propose, [r for r, _ in live])
            except Exception as exc:
                for _, future in live:
                    if not future.done():
                        future.set_exception(exc)
            else:
                for (_, future), draft in zip(live, drafts, strict=True):
                    if not future.done():
                        future.set_result(draft)
            self._idle_since_s = time.perf_counter()
            self.metrics.edge_busy.inc(self._idle_since_s - started)
            self.metrics.draft_forward.observe(self._idle_since_s - started)
            self.metrics.draft_batch_size.observe(len(live))

    def _propose(self, requests: list[DraftRequest]) -> list[Draft]:
        with torch.inference_mode():
            return self.draft.propose(requests)
