"""The verification batcher: one actor owns the target model and its global work queue.

Blocks arrive asynchronously from many requests and edges. The batcher takes whatever has
arrived (waiting at most max_wait after the first item, up to max_batch_size blocks) and
verifies it with one target forward, independently of how the blocks were grouped on
arrival (AsymSpec §IV-C2). Target-only decode steps are batched the same way. Every use of
the model, prefill, scoring, rollback and session close included, runs on the batcher's
single worker thread, so the model and its caches have exactly one owner and the event
loop stays free for the channel.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from asymspec.backends.target import ScoreRequest, StepRequest, TargetModel
from asymspec.wire import VerifyResult
from cloud_verifier.metrics import CloudMetrics
from cloud_verifier.sessions import AnyBlock, Session

JobKind = Literal["verify", "decode", "prefill", "close"]


@dataclass(slots=True)
class _Job:
    kind: JobKind
    session: Session
    future: asyncio.Future[Any]
    block: AnyBlock | None = None
    enqueued_s: float = field(default_factory=time.perf_counter)


class Batcher:
    def __init__(
        self, target: TargetModel, max_batch_size: int, max_wait_s: float, metrics: CloudMetrics
    ) -> None:
        self.target = target
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.metrics = metrics
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target")
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ public API

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._worker.shutdown(wait=True, cancel_futures=True)

    async def prefill(self, session: Session) -> None:
        await self._submit("prefill", session)

    async def verify(self, session: Session, block: AnyBlock) -> VerifyResult:
        result: VerifyResult = await self._submit("verify", session, block)
        return result

    async def decode(self, session: Session) -> int:
        token: int = await self._submit("decode", session)
        return token

    async def close(self, session: Session) -> None:
        await self._submit("close", session)

    # ------------------------------------------------------------------ the actor

    def _submit(self, kind: JobKind, session: Session, block: AnyBlock | None = None) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Job(kind, session, future, block))
        return future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = await self._collect()
            started = time.perf_counter()
            for job in jobs:
                if job.kind == "verify":  # prefill, decode and close jobs queue too; not counted
                    self.metrics.verify_queue_wait.observe(started - job.enqueued_s)
            outcomes = await loop.run_in_executor(self._worker, self._execute, jobs)
            for job, (ok, value) in zip(jobs, outcomes, strict=True):
                if job.future.done():
                    continue  # the requester went away
                if ok:
                    job.future.set_result(value)
                else:
                    job.future.set_exception(value)

    async def _collect(self) -> list[_Job]:
        """Block for the first job, then take what arrives within max_wait (up to the cap)."""
        jobs = [await self._queue.get()]
        deadline = time.perf_counter() + self.max_wait_s
        while len(jobs) < self.max_batch_size:
            if not self._queue.empty():
                jobs.append(self._queue.get_nowait())
                continue
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            try:
                jobs.append(await asyncio.wait_for(self._queue.get(), remaining))
            except TimeoutError:
                break
        return jobs

    # ------------------------------------------------------------------ worker thread

    def _execute(self, jobs: list[_Job]) -> list[tuple[bool, Any]]:
        """Run one round on the worker thread; per job (ok, result or exception)."""
        results: dict[int, tuple[bool, Any]] = {}
        by_kind: dict[JobKind, list[int]] = {"prefill": [], "verify": [], "decode": [], "close": []}
        for i, job in enumerate(jobs):
            by_kind[job.kind].append(i)
        with torch.inference_mode():
            for i in by_kind["prefill"]:
                results[i] = _guard(self._prefill, jobs[i])
            self._batch(jobs, by_kind["verify"], self._verify, results)
            self._batch(jobs, by_kind["decode"], self._decode, results)
            for i in by_kind["close"]:
                results[i] = _guard(self._close, jobs[i])
        return [results[i] for i in range(len(jobs))]

    def _batch(
        self,
        jobs: list[_Job],
        indices: list[int],
        run: Callable[[list[_Job]], list[Any]],
        results: dict[int, tuple[bool, Any]],
    ) -> None:
        live = [i for i in indices if not jobs[i].session.closed]
        for i in set(indices) - set(live):
            results[i] = (False, RuntimeError("session closed"))
        if not live:
            return
        try:
            values = run([jobs[i] for i in live])
            results.update({i: (True, v) for i, v in zip(live, values, strict=True)})
        except Exception as exc:  # one bad batch fails its jobs, never the actor
            results.update({i: (False, exc) for i in live})

    def _prefill(self, job: _Job) -> None:
        started = time.perf_counter()
        self.target.open(job.session.key, job.session.confirmed)
        self.metrics.target_forward_seconds.observe(time.perf_counter() - started)
        self.metrics.target_forward_calls.labels(kind="prefill").inc()

    def _verify(self, jobs: list[_Job]) -> list[VerifyResult]:
        requests = []
        for job in jobs:
            assert job.block is not None
            pending = job.session.pending_tokens(self.target.length(job.session.key))
            new_tokens = [*pending, *(int(t) for t in job.block.draft_tokens)]
            requests.append(ScoreRequest(job.session.key, new_tokens, len(job.block.draft_tokens)))
        started = time.perf_counter()
        logits = self.target.score(requests)
        self._observe_forward("verify", len(jobs), started)
        verdicts = []
        for job, rows in zip(jobs, logits, strict=True):
            assert job.block is not None
            kept = len(job.session.confirmed)  # the cache now holds confirmed + the drafts
            result, n_accepted = job.session.decide(job.block, rows)
            self.target.commit(job.session.key, kept + n_accepted)
            verdicts.append(result)
        self.metrics.verified_blocks.inc(len(jobs))
        return verdicts

    def _decode(self, jobs: list[_Job]) -> list[int]:
        requests = []
        for job in jobs:
            s = job.session
            requests.append(
                StepRequest(
                    s.key, s.pending_tokens(self.target.length(s.key)), s.params, s.generator
                )
            )
        started = time.perf_counter()
        tokens = self.target.generate_step(requests)
        self._observe_forward("decode", len(jobs), started)
        for job, token in zip(jobs, tokens, strict=True):
            job.session.confirmed.append(token)
        return tokens

    def _close(self, job: _Job) -> None:
        job.session.closed = True
        self.target.close(job.session.key)  # idempotent

    def _observe_forward(self, kind: str, batch_size: int, started_s: float) -> None:
        self.metrics.target_forward_seconds.observe(time.perf_counter() - started_s)
        self.metrics.target_forward_calls.labels(kind=kind).inc()
        self.metrics.verify_batch_size.observe(batch_size)


def _guard(run: Callable[[_Job], Any], job: _Job) -> tuple[bool, Any]:
    try:
        return True, run(job)
    except Exception as exc:
        return False, exc
