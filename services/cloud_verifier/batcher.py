"""The verification batcher: one actor owns the target model and its global work queue.

Blocks arrive asynchronously from many requests and edges. The batcher takes whatever has
arrived (waiting at most max_wait after the first item, up to max_batch_size blocks) and
verifies it with one target forward, independently of how the blocks were grouped on
arrival (AsymSpec §IV-C2). Target-only generations join the same forward and stay in it
(continuous batching, as in vLLM's scheduler): a generation is submitted once and decodes
one token in every round until it stops, so no session misses a round while its last token
travels through the event loop and back. Prompts join too: a prompt is prefilled in chunks
that share each round's forward with the verify and decode work (Sarathi-style chunked
prefill), so a long prompt never holds the target for seconds while everyone else's blocks
wait. The chunks are sized by time (`PrefillBudget` over the measured `ForwardCost`): a
round alone prefills what fits in a round's time, a round beside other work only the rows
that slow that work by a set fraction; on a GPU or an AMX CPU that is tens of rows riding
nearly free on a forward whose cost is its weights, on an AVX2 CPU a handful. A session
between two blocks (its verdict went back, its edge is drafting the next) counts as work
for a second: its block is due, and must not arrive to find a full round alone under way.
The prompt with the fewest tokens left goes first, so a short prompt is not queued behind
a long one.

Every use of the model, prefill, scoring, rollback and session close included, runs on the
batcher's model thread (the one that loaded the target, see `asymspec.model_thread`), so the
model and its caches have exactly one owner and the event loop stays free for the channel.
So does everything that reads or changes a session's state (its admission, verdict,
corrections and decode steps; see `cloud_verifier.sessions`): the event loop hands the
batcher a session's work and gets back what goes on the wire.
"""

from __future__ import annotations

import asyncio
import enum
import math
import time
from collections.abc import AsyncGenerator, Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asymspec.actors import ActorDied, Supervised
from asymspec.correction import Rung
from asymspec.model_thread import ModelThread
from asymspec.wire import BlockId, ErrorCode, Payload, TargetCost, TokenIds, VerifyResult, WireError
from asymspec_engine.hardware import ForwardThreads
from asymspec_engine.target import (
    PrefillChunk,
    ScoreRequest,
    StepRequest,
    TargetModel,
    fed_keys,
    fed_rows,
)
from cloud_verifier.forward_cost import ForwardCost, PrefillBudget
from cloud_verifier.metrics import CloudMetrics
from cloud_verifier.sessions import AnyBlock, Decoded, Session

# How long after its verdict (its prompt's prefill, its generation's end) a session's next
# block or decode step counts as due: an edge's draft, its queue and the round trip take
# tens to a few hundred milliseconds.
NEXT_BLOCK_WITHIN_S = 1.0


class JobKind(enum.Enum):
    VERIFY = enum.auto()
    GENERATE = enum.auto()
    PREFILL = enum.auto()
    CLOSE = enum.auto()


@dataclass(slots=True)
class _Job:
    kind: JobKind
    session: Session
    future: asyncio.Future[Any]
    block: AnyBlock | None = None
    generation: _Generation | None = None  # a generate job's state
    enqueued_s: float = field(default_factory=time.perf_counter)

    @property
    def verifies(self) -> bool:
        return self.kind is JobKind.VERIFY

    @property
    def generates(self) -> bool:
        return self.kind is JobKind.GENERATE

    @property
    def prefills(self) -> bool:
        return self.kind is JobKind.PREFILL

    @property
    def closes(self) -> bool:
        return self.kind is JobKind.CLOSE

    @property
    def forwards(self) -> bool:
        """Its work is a row of the round's forward (a close runs before it)."""
        return self.verifies or self.generates

    @property
    def rows(self) -> int:
        """The rows it puts in the round's forward, as planned (a verify: its drafts and
        the tail before them; a decode step: one; a pending recovered token adds one more,
        too rare to plan for)."""
        if self.block is not None:
            return len(self.block.draft_tokens) + 1
        return 1 if self.generates else 0


@dataclass(slots=True)
class _Generation:
    """A target-only generation held in every round until it ends; owned by the actor
    loop, which puts each token (then None, or the error that ended it) on ``tokens``.
    Its first round admits it (on the model thread, as every session change)."""

    job: _Job
    committed_tail: TokenIds  # the edge's recovered token, where one is awaited
    max_tokens: int
    stop_ids: frozenset[int]
    tokens: asyncio.Queue[Decoded | BaseException | None] = field(default_factory=asyncio.Queue)
    admitted: bool = False  # its session took it (set on the model thread, by _admit)
    abandoned: bool = False  # its consumer went away: dropped before the next round
    stopping: bool = False  # its edge asked it to stop: its next round's token is its last
    produced: int = 0  # its tokens out of the forward (counted on the model thread)
    consumed: int = 0  # its tokens its consumer is done with (it came back for the next)

    def end(self, error: BaseException | None = None) -> None:
        self.tokens.put_nowait(error)


@dataclass(slots=True)
class _Prefill:
    """A prompt being prefilled; owned by the actor loop."""

    job: _Job
    done: int = 0  # prompt tokens already in the target's cache
    started: bool = False  # the target's session is open
    features: list[torch.Tensor] = field(default_factory=list)  # h per chunk, where asked

    @property
    def total(self) -> int:
        return self.job.session.prompt_len - 1  # the last token is the first block's tail


@dataclass(slots=True)
class _Chunk:
    prefill: _Prefill
    start: int
    end: int
    features: torch.Tensor | None = None  # its positions' h, where the session asked


@dataclass(slots=True)
class _Round:
    """What the actor loop hands the model thread for one round."""

    jobs: list[_Job]  # closes, verify blocks and decode steps
    chunks: list[_Chunk]  # prompt chunks
    ended: list[Session]  # generations whose consumer went away
    stopping: list[Session]  # generations whose edge asked them to stop


class Batcher:
    def __init__(
        self,
        target: TargetModel,
        max_batch_size: int,
        max_wait_s: float,
        metrics: CloudMetrics,
        prefill_budget: PrefillBudget | None = None,
        threads: ForwardThreads | None = None,
        model_thread: ModelThread | None = None,
    ) -> None:
        self.target = target
        self.threads = threads  # None: the thread count set at start-up, never changed
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.prefill_budget = prefill_budget or PrefillBudget()
        self.cost = ForwardCost()  # what this target's forwards cost here, as measured
        # The same for forwards without prompt chunks: what a verify or decode round costs,
        # which an edge chooses γ and the pause by. A row's cost is far from a line on some
        # CPUs (2 threads of an AVX-512 EPYC, 135M target: 1 row 6.5 ms, 2 rows 15, 5 rows
        # 26, a 150-row prompt 125): a fit that takes prompt chunks in sees rows as cheap
        # and a fixed cost as dear, and would keep speculating where decoding alone is faster.
        self.step_cost = ForwardCost()
        self._step_fit: TargetCost | None = None  # the last one told apart (target_cost)
        self.metrics = metrics
        metrics.forward_base_seconds.set_function(lambda: self._fitted_cost()[0])
        metrics.forward_row_seconds.set_function(lambda: self._fitted_cost()[1])
        self._prefilling: list[_Prefill] = []
        self._generating: list[_Generation] = []
        # Every generation from its submission to its consumer's end, by session: the one
        # a StopGeneration stops (the actor adds it to `_generating` when it collects it).
        self._generations: dict[str, _Generation] = {}
        self._in_flight: list[_Job] = []  # the jobs of the forward under way
        # Sessions whose next block or decode step is due any moment: their verdict went
        # back, their prompt is in the cache or their generation ended, and nothing of
        # theirs has come since. Their rows and since when. A round with nothing else to do
        # prefills only what delays that work by the share, not a full round.
        self._work_due: dict[str, tuple[int, float]] = {}
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        # the thread that loaded the target (None: a new one); the batcher owns it from here
        self.model_thread = model_thread or ModelThread("target")
        self.actor = Supervised("batcher", self._fail_waiting)

    # ------------------------------------------------------------------ public API

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    def start(self) -> None:
        self.actor.start(self._run())

    async def stop(self) -> None:
        await self.actor.stop()
        self.model_thread.shutdown()

    def target_cost(self) -> TargetCost | None:
        """The forward cost an edge chooses γ by; None until base and slope are told apart.
        The last one told apart stands while they cannot be (rounds of one size only, as
        while edges have paused speculation and the cloud decodes alone): an edge told
        nothing would resume speculating only to learn again that it does not pay."""
        fit = self.step_cost.identified_fit()
        if fit is not None:
            self._step_fit = TargetCost(*fit)
        return self._step_fit

    def _fitted_cost(self) -> tuple[float, float]:
        """(base_s, per_row_s) for the gauges, NaN before any forward."""
        return self.cost.fit() or (math.nan, math.nan)

    def _fail_waiting(self, error: ActorDied) -> None:
        """The actor died: every job it holds or has queued fails with the reason."""
        queued = []
        while not self._queue.empty():
            queued.append(self._queue.get_nowait())
        held = [p.job for p in self._prefilling] + list(self._in_flight) + queued
        # the generations held in the batch (in flight or not) and those not yet collected
        generations = self._generating + [j.generation for j in queued if j.generation]
        self._prefilling, self._in_flight, self._generating = [], [], []
        for generation in generations:
            generation.end(error)
        for job in held:
            _resolve(job.future, False, error)

    async def prefill(self, session: Session) -> torch.Tensor | None:
        """Put the session's prompt in the target's cache; its positions' h where the
        session asked for them ([n, hidden]), else None."""
        features: torch.Tensor | None = await self._submit(JobKind.PREFILL, session)
        return features

    async def verify(self, session: Session, block: AnyBlock) -> VerifyResult:
        """Admit the block and score it (a retransmission: the verdict it got), or raise
        the admission's WireError."""
        result: VerifyResult = await self._submit(JobKind.VERIFY, session, block)
        return result

    async def correct(self, session: Session, block: BlockId, rung: Rung, index: int) -> Payload:
        """Answer an escalation from the row retained at the rejection (no forward: it
        runs on the model thread between rounds)."""
        self.actor.check()
        return await self.model_thread.run(session.correct, block, rung, index)

    async def generate(
        self,
        session: Session,
        max_tokens: int,
        stop_ids: Collection[int] = (),
        committed_tail: TokenIds | None = None,
    ) -> AsyncGenerator[Decoded, None]:
        """Target-only decoding: the session's next tokens, one per round, until a stop
        token (included) or ``max_tokens``. Its first round admits it with the edge's
        recovered token, where one is awaited (or raises the admission's WireError)."""
        self.actor.check()
        if max_tokens < 1:
            return
        tail = np.zeros(0, np.uint32) if committed_tail is None else committed_tail
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        job = _Job(JobKind.GENERATE, session, future)
        job.generation = generation = _Generation(job, tail, max_tokens, frozenset(stop_ids))
        self._generations[session.key] = generation
        self._queue.put_nowait(job)
        try:
            while (item := await generation.tokens.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
                generation.consumed += 1
        finally:
            generation.abandoned = True
            if self._generations.get(session.key) is generation:
                del self._generations[session.key]

    def stop_generation(self, session: Session) -> None:
        """End the session's generation with its next round's token (its edge speculates
        again). A stop that finds none under way (it ended meanwhile) does nothing."""
        generation = self._generations.get(session.key)
        if generation is not None:
            generation.stopping = True

    async def close(self, session: Session) -> None:
        await self._submit(JobKind.CLOSE, session)

    # ------------------------------------------------------------------ the actor

    def _submit(self, kind: JobKind, session: Session, block: AnyBlock | None = None) -> Any:
        self.actor.check()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Job(kind, session, future, block))
        return future

    async def _run(self) -> None:
        while True:
            jobs = await self._collect(wait=not (self._generating or self._can_prefill()))
            started = time.perf_counter()
            work = []
            for job in jobs:
                self._work_due.pop(job.session.key, None)  # here, or closing
                if job.prefills:
                    self._prefilling.append(_Prefill(job))
                    continue
                if job.generation is not None:
                    self._generating.append(job.generation)
                    continue
                if job.verifies:  # close jobs queue too; not counted
                    self.metrics.verify_queue_wait.observe(started - job.enqueued_s)
                work.append(job)
            ended = [g for g in self._generating if g.abandoned]
            for gone in ended:
                self._generating.remove(gone)
            stopping = [g for g in self._generating if g.stopping]
            for generation in stopping:
                generation.stopping = False  # applied once, in this round
            work += [g.job for g in self._generating]
            chunks = self._next_chunks(sum(job.rows for job in work) or self._due_rows(started))
            self._in_flight = work  # so that a death fails them too
            round_ = _Round(
                work, chunks, [g.job.session for g in ended], [g.job.session for g in stopping]
            )
            loop = asyncio.get_running_loop()
            outcomes = await self.model_thread.run(self._execute_rounds, round_, loop)
            handed_back_s = time.perf_counter()
            self._hand_back(work, outcomes, handed_back_s)
            self._in_flight = []
            self._advance(chunks, handed_back_s)

    def _hand_back(
        self, work: list[_Job], outcomes: list[tuple[bool, Any]], handed_back_s: float
    ) -> None:
        for job, (ok, value) in zip(work, outcomes, strict=True):
            if job.generation is None:
                _resolve(job.future, ok, value)
                if ok and job.verifies:
                    self._work_due[job.session.key] = (job.rows, handed_back_s)
            else:
                self._advance_generation(job.generation, ok, value, handed_back_s)

    def _advance_generation(
        self, generation: _Generation, ok: bool, value: Any, handed_back_s: float
    ) -> None:
        """Hand a generation its round's token; it ends at a stop token, its last token or
        an error (the model thread has ended it in the session already)."""
        if ok:
            generation.tokens.put_nowait(value)
            if not value.last:
                return
        # A session closed under it (the edge's request went away) just ends it: nobody is
        # waiting for an error frame about a session the edge itself closed.
        generation.end(None if ok or isinstance(value, SessionClosed) else value)
        self._generating.remove(generation)
        if ok:  # its edge's next ask or block is due (or its close: that clears it)
            self._work_due[generation.job.session.key] = (1, handed_back_s)

    async def _collect(self, wait: bool) -> list[_Job]:
        """Block for the first job (unless a prefill is under way, which must go on), then
        take what arrives within max_wait (up to the cap)."""
        if not wait and self._queue.empty():
            return []
        jobs = [await self._queue.get()]
        deadline = time.perf_counter() + self.max_wait_s
        while len(jobs) < self.max_batch_size:
            if not self._queue.empty():
                jobs.append(self._queue.get_nowait())
                continue
            remaining = deadline - time.perf_counter()
            if remaining <= 0 or not wait:
                break
            try:
                jobs.append(await asyncio.wait_for(self._queue.get(), remaining))
            except TimeoutError:
                break
        return jobs

    def _due_rows(self, now_s: float) -> int:
        """The rows of the work due any moment: sessions whose verdict left, whose prompt
        went into the cache or whose generation ended within `NEXT_BLOCK_WITHIN_S` (older
        ones are idle, or their edge is slow: forgotten)."""
        due = 0
        for key, (rows, handed_back_s) in list(self._work_due.items()):
            if now_s - handed_back_s > NEXT_BLOCK_WITHIN_S:
                del self._work_due[key]
            else:
                due += rows
        return due

    def _free_sessions(self) -> int | None:
        """Sessions the engine can still open (None: no bound). Read between rounds, while
        the model thread is idle; a close in the coming round frees its slot after it."""
        capacity = self.target.max_sessions
        return None if capacity is None else max(0, capacity - self.target.lm.sessions())

    def _admitted(self) -> list[_Prefill]:
        """The prompts that may take a chunk: those under way, and as many new ones as the
        engine has free sessions (the oldest first); the rest wait for a close."""
        free = self._free_sessions()
        admitted = []
        for prefill in self._prefilling:
            if prefill.started or free is None or free > 0:
                admitted.append(prefill)
                if not prefill.started and free is not None:
                    free -= 1
        return admitted

    def _can_prefill(self) -> bool:
        return bool(self._admitted())

    def _next_chunks(self, work_rows: int) -> list[_Chunk]:
        """This round's prefill chunks, as the budget plans them: the prompts with the
        fewest tokens left first (shortest remaining first: a short prompt's whole prefill
        costs the long one a round's few rows), the oldest among equals."""
        order = sorted(self._admitted(), key=lambda p: p.total - p.done)  # stable
        rests = [prefill.total - prefill.done for prefill in order]
        dones = [prefill.done for prefill in order]
        taken = self.prefill_budget.plan(rests, self.cost, work_rows, None, dones)
        return [  # (a prompt with nothing left to prefill gets its empty chunk: it resolves)
            _Chunk(prefill, prefill.done, prefill.done + take)
            for prefill, rest, take in zip(order, rests, taken, strict=True)
            if take > 0 or rest == 0
        ]

    def _advance(self, chunks: list[_Chunk], handed_back_s: float) -> None:
        """Record the chunks run; a prompt fully in the cache (or failed) resolves its job."""
        for chunk in chunks:
            prefill = chunk.prefill
            if prefill.job.future.done():  # failed on the worker, or the requester left
                self._drop(prefill)
                continue
            prefill.done = chunk.end
            if chunk.features is not None:
                prefill.features.append(chunk.features)
            if prefill.done >= prefill.total:
                _resolve(prefill.job.future, True, self._prompt_features(prefill))
                self._drop(prefill)
                # its first block or decode step comes next (a row at least): until it
                # does, a long prompt's rounds leave room for it, as between two blocks
                self._work_due[prefill.job.session.key] = (1, handed_back_s)

    def _prompt_features(self, prefill: _Prefill) -> torch.Tensor | None:
        if not prefill.job.session.wants_features:
            return None
        if not prefill.features:  # a one-token prompt: no position was fed
            return torch.zeros(0, self.target.hidden_size)
        return torch.cat(prefill.features)

    def _drop(self, prefill: _Prefill) -> None:
        if prefill in self._prefilling:
            self._prefilling.remove(prefill)

    # ------------------------------------------------------------------ worker thread

    def _execute_rounds(
        self, round_: _Round, loop: asyncio.AbstractEventLoop
    ) -> list[tuple[bool, Any]]:
        """Run the round on the worker thread; then, while its jobs are decode steps that
        go on and nothing else waits, run their next rounds here too, handing each round's
        tokens to the event loop as they come. A stream's next step then never waits for
        the event loop's turn: at one stream on 2 cores that hop was ~0.5 ms of a ~9 ms
        token (the last round's outcomes return as any round's)."""
        outcomes = self._execute_counted(round_)
        while self._decodes_on(round_, outcomes):
            loop.call_soon_threadsafe(self._hand_back, round_.jobs, outcomes, time.perf_counter())
            round_ = _Round(round_.jobs, [], [], [])
            outcomes = self._execute_counted(round_)
        return outcomes

    def _execute_counted(self, round_: _Round) -> list[tuple[bool, Any]]:
        outcomes = self._execute(round_)
        for job, (ok, _) in zip(round_.jobs, outcomes, strict=True):
            if ok and job.generation is not None:
                job.generation.produced += 1
        return outcomes

    def _decodes_on(self, round_: _Round, outcomes: list[tuple[bool, Any]]) -> bool:
        """Whether the next round is this one's decode steps again with nothing else due:
        no prompt under way, no job queued, no generation ending, stopping or abandoned,
        and every consumer keeping up (done with all but the newest token: one that lags,
        or left unseen, is then checked between rounds by the actor loop, as before).
        (Read on the worker thread: the actor loop, which alone changes the prompts under
        way, awaits this round; the queue and the flags are only read.)"""
        if not round_.jobs or round_.chunks or self._prefilling or not self._queue.empty():
            return False
        for job, (ok, value) in zip(round_.jobs, outcomes, strict=True):
            generation = job.generation
            if generation is None or not ok or value.last:
                return False
            if generation.stopping or generation.abandoned:
                return False
            if generation.produced - generation.consumed > 1:
                return False
        return True

    def _execute(self, round_: _Round) -> list[tuple[bool, Any]]:
        """Run one round on the worker thread: the closes and the ended generations, then
        the admissions and the stopped generations, then one forward for the prefill
        chunks, verify blocks and decode steps. Per job (ok, result or exception).

        Closes go first: an agent's next round, sent as its last one ended, often lands in
        the same round as that one's close, and its prefill adopts the closed session's
        cache only if the close has run (work of a closing session is moot: it fails)."""
        jobs, chunks = round_.jobs, round_.chunks
        for session in round_.ended:
            session.end_generation()
        results: dict[int, tuple[bool, Any]] = {}
        live: list[int] = []
        for i, job in enumerate(jobs):
            if job.closes:
                results[i] = _guard(self._close, job)
        for i, job in enumerate(jobs):
            if not job.forwards:
                continue
            if job.session.closed:
                results[i] = (False, SessionClosed(job.session.session_id))
                continue
            try:
                cached = _admit(job)
            except WireError as exc:
                results[i] = (False, exc)
                continue
            if cached is not None:  # a retransmitted block: the verdict it got
                results[i] = (True, cached)
            else:
                live.append(i)
        for session in round_.stopping:  # after the admissions: one may be admitted just now
            session.stop_generation()
        if self.threads is not None:  # set on this (the worker) thread, which runs forwards
            wanted = self.threads.for_round(
                self.target.lm.sessions(),
                cloud_decodes_alone=any(j.generates for j in jobs)
                and not any(j.verifies for j in jobs),
            )
            self.target.lm.set_threads(wanted)
        with torch.inference_mode():
            prefills = self._start_chunks(chunks)
            if live or prefills:
                try:
                    values = self._forward([jobs[i] for i in live], prefills)
                    results.update({i: (True, v) for i, v in zip(live, values, strict=True)})
                except Exception as exc:  # one bad round fails its jobs, never the actor
                    results.update({i: (False, exc) for i in live})
                    for chunk in chunks:
                        _resolve_threadsafe(chunk.prefill.job.future, exc)
        for i in live:  # an admitted generation whose step failed ends
            if jobs[i].generates and not results[i][0]:
                jobs[i].session.end_generation()
        return [results[i] for i in range(len(jobs))]

    def _start_chunks(self, chunks: list[_Chunk]) -> list[tuple[PrefillChunk, _Chunk]]:
        prefills = []
        for chunk in chunks:
            prefill, session = chunk.prefill, chunk.prefill.job.session
            if session.closed:
                _resolve_threadsafe(prefill.job.future, SessionClosed(session.session_id))
                continue
            if not prefill.started:
                # An earlier round of the same conversation from this edge may have left
                # most of this prompt in the cache: the chunk then starts past it.
                scope = str(session.owner)
                reused = self.target.start(session.key, session.confirmed[: prefill.total], scope)
                prefill.started = True
                if reused:
                    self.metrics.prefix_reused_tokens.inc(reused)
                    prefill.done = reused
                    chunk.end = min(prefill.total, reused + chunk.end - chunk.start)
                    chunk.start = reused
            if chunk.end > chunk.start:
                tokens = session.confirmed[chunk.start : chunk.end]
                prefills.append((PrefillChunk(session.key, tokens, session.wants_features), chunk))
        return prefills

    def _forward(self, jobs: list[_Job], starting: list[tuple[PrefillChunk, _Chunk]]) -> list[Any]:
        """The round's one target forward; per job its VerifyResult or Decoded token (the
        prefill chunks' features, where asked, go back with their chunks)."""
        prefills = [chunk for chunk, _ in starting]
        scores: list[ScoreRequest] = []
        steps: list[StepRequest] = []
        verify_jobs = [job for job in jobs if job.verifies]
        step_jobs = [job for job in jobs if job.generates]  # one decode step each
        for job in verify_jobs:
            assert job.block is not None
            pending = job.session.pending_tokens(self.target.length(job.session.key))
            new_tokens = [*pending, *(int(t) for t in job.block.draft_tokens)]
            gamma = len(job.block.draft_tokens)
            scores.append(
                ScoreRequest(job.session.key, new_tokens, gamma, job.session.wants_features)
            )
        # A constrained session's step is scored (γ = 0: the row after its pending tokens)
        # and sampled here, as its transform reads the tokens before the row; so is one
        # that reports log-probabilities, which need the row.
        constrained = [job for job in step_jobs if job.session.decodes_here]
        step_jobs = [job for job in step_jobs if not job.session.decodes_here]
        for job in constrained:
            pending = job.session.pending_tokens(self.target.length(job.session.key))
            scores.append(ScoreRequest(job.session.key, pending, 0))
        for job in step_jobs:
            s = job.session
            pending = s.pending_tokens(self.target.length(s.key))
            steps.append(StepRequest(s.key, pending, s.params, s.generator))
        keys = fed_keys(prefills, scores, steps, self.target.length)  # (before it runs)
        started = time.perf_counter()
        done = self.target.round(prefills, scores, steps)
        elapsed_s, fed = time.perf_counter() - started, fed_rows(prefills, scores, steps)
        self.cost.observe(fed, elapsed_s, keys)
        if not prefills:
            self.step_cost.observe(fed, elapsed_s, keys)
        kind = "verify" if verify_jobs else "decode" if steps or constrained else "prefill"
        self._observe_forward(kind, len(scores) + len(steps), started)
        for (_, chunk), features in zip(starting, done.prefill_features, strict=True):
            chunk.features = features
        values: dict[int, Any] = {}
        scored = done.score_logits[len(verify_jobs) :]
        for job, rows in zip(constrained, scored, strict=True):
            values[id(job)] = job.session.decode_next(rows[-1])
        for job, rows, features in zip(
            verify_jobs,
            done.score_logits[: len(verify_jobs)],
            done.score_features[: len(verify_jobs)],
            strict=True,
        ):
            assert job.block is not None
            kept = len(job.session.confirmed)  # the cache now holds confirmed + the drafts
            result, n_accepted = job.session.decide(job.block, rows, features)
            self.target.commit(job.session.key, kept + n_accepted)
            values[id(job)] = result
        if verify_jobs:
            self.metrics.verified_blocks.inc(len(verify_jobs))
        for job, token in zip(step_jobs, done.tokens, strict=True):
            values[id(job)] = job.session.decoded(token)
        return [values[id(job)] for job in jobs]

    def _close(self, job: _Job) -> None:
        job.session.closed = True
        self.target.close(job.session.key)  # idempotent

    def _observe_forward(self, kind: str, batch_size: int, started_s: float) -> None:
        self.metrics.target_forward_seconds.observe(time.perf_counter() - started_s)
        self.metrics.target_forward_calls.labels(kind=kind).inc()
        if batch_size:  # sequences verified or decoded; a prefill-only forward has none
            self.metrics.verify_batch_size.observe(batch_size)


class SessionClosed(WireError):
    """Work for a session closed before its round ran."""

    def __init__(self, session_id: int) -> None:
        super().__init__(ErrorCode.UNKNOWN_SESSION, f"session {session_id} is closed")


def _resolve(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if future.done():
        return  # the requester went away
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def _resolve_threadsafe(future: asyncio.Future[Any], exc: BaseException) -> None:
    """Fail a prefill's future from the worker thread (on its event loop)."""
    future.get_loop().call_soon_threadsafe(_resolve, future, False, exc)


def _admit(job: _Job) -> VerifyResult | None:
    """A verify block's or a new generation's admission (on the model thread, before the
    forward): None to run it, a retransmitted block's verdict, or the WireError."""
    if job.block is not None:
        return job.session.admit(job.block)
    generation = job.generation
    if generation is not None and not generation.admitted:
        generation.admitted = True  # whatever follows: a refused one ends with its error
        job.session.admit_generation(
            generation.committed_tail, generation.max_tokens, generation.stop_ids
        )
    return None


def _guard(run: Callable[[_Job], Any], job: _Job) -> tuple[bool, Any]:
    try:
        return True, run(job)
    except Exception as exc:
        return False, exc
