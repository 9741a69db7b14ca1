"""The edge's decoding engines: speculative (every speculative mode), draft-only, target-only.

A speculative request runs one loop: ask the scheduler for a block (only once the prefix is
confirmed), upload it, await the verdict, resolve a rejection through the correction ladder
(asking the cloud for more only when the certificate does not fit the request's budget),
commit, stream the new tokens, repeat. Glossary as vLLM's: per block the output is the
accepted draft tokens plus one recovered (after a rejection) or bonus (all accepted) token.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

from asymspec.actors import ActorDied
from asymspec.constraint import ConstraintBuilder
from asymspec.correction import Correction, Ladder, Recovered, topk_hopeless
from asymspec.fidelity import FidelityBudget
from asymspec.modes import Mode
from asymspec.wire import (
    BlockId,
    CorrectionKind,
    CorrectionRequest,
    ErrorCode,
    GenerateRequest,
    GenerateTokens,
    OpenSession,
    Payload,
    SamplingConfig,
    SessionOpened,
    StopGeneration,
    VerifyBlock,
    VerifyBlockFull,
    VerifyResult,
    config_digest,
)
from asymspec_engine.draft import Draft, DraftRequest
from asymspec_engine.engine import draw_uniform
from asymspec_engine.feature_draft import FeatureLog, features_from_wire
from asymspec_engine.suffix import SuffixDrafter
from edge_gateway.channel import ChannelDown, CloudChannel, CloudError, ReplyTimeout
from edge_gateway.constrained_draft import propose_constrained
from edge_gateway.draft_length import GoodputDraftLength
from edge_gateway.engine_api import GenerationError, GenerationRequest
from edge_gateway.metrics import EdgeMetrics
from edge_gateway.mode_rates import batch_bucket
from edge_gateway.replicas import CloudReplicas
from edge_gateway.scheduler import DraftScheduler
from edge_gateway.settings import EdgeSettings

_NO_TAIL = np.zeros(0, dtype=np.uint32)
# Why a speculating request's first token is the cloud's own (`Mode.first_token_from_prefill`)
FIRST_TOKEN = "first_token"


def _seed(request: GenerationRequest) -> int:
    """OpenAI's seed is an int64: a negative one travels as the same 64 bits, unsigned."""
    return request.seed % 2**64 if request.seed is not None else random.getrandbits(63)


def _session_ids() -> Iterator[int]:
    """Session ids only need to be unique on this edge's channel; small ones keep every block
    header short on the slow uplink (msgpack spends 1-3 bytes on them instead of 9)."""
    return itertools.count(1)


def _config(request: GenerationRequest, seed: int) -> SamplingConfig:
    config = SamplingConfig(request.params, seed, request.penalties, request.grammar)
    if config.reads_history:  # where its output starts, for a session reopened mid-request
        config = replace(config, prompt_len=len(request.prompt_ids))
    return replace(config, logprobs=request.logprobs)


def _note_logprobs(request: GenerationRequest, frame: GenerateTokens) -> None:
    """The log-probabilities a cloud frame carries, in token order."""
    if frame.logprobs is None:
        return
    lp = frame.logprobs
    k = len(lp.top_ids) // max(1, len(frame.tokens))
    for i in range(len(frame.tokens)):
        top = slice(i * k, (i + 1) * k)
        request.token_logprobs.append(
            (float(lp.token_logprobs[i]), lp.top_ids[top].tolist(), lp.top_logprobs[top].tolist())
        )


# What a request can meet from the cloud side (or a dead actor): each has its HTTP answer.
_CLOUD_FAILURES = (ChannelDown, CloudError, ReplyTimeout, ActorDied)


def _cloud_failure(exc: ChannelDown | CloudError | ReplyTimeout | ActorDied) -> GenerationError:
    if isinstance(exc, ChannelDown):
        return GenerationError(f"cloud verifier unavailable: {exc}", 503, "service_unavailable")
    if isinstance(exc, ActorDied):
        return GenerationError(f"the edge cannot serve: {exc}", 503, "service_unavailable")
    if isinstance(exc, ReplyTimeout):
        return GenerationError(f"cloud verifier timed out: {exc}", 504, "timeout_error")
    if isinstance(exc, CloudError) and exc.code == ErrorCode.OVERLOADED:
        # The cloud holds as many sessions as it allows this edge: a client should retry.
        return GenerationError(
            f"the cloud verifier is at capacity: {exc}", 429, "rate_limit_error", retry_after_s=1
        )
    return GenerationError(f"cloud verifier error: {exc}", 502, "server_error")


async def _generated(
    channel: CloudChannel, frames: asyncio.Queue[GenerateTokens | Exception]
) -> AsyncGenerator[GenerateTokens, None]:
    """A cloud generation's frames from its session's stream, up to the one marked done.
    An error frame for the session raises it; no frame within the reply timeout raises
    ReplyTimeout."""
    while True:
        try:
            frame = await asyncio.wait_for(frames.get(), channel.reply_timeout_s)
        except TimeoutError:
            waited_s = channel.reply_timeout_s
            raise ReplyTimeout(f"no tokens from {channel.url} in {waited_s} s") from None
        if isinstance(frame, Exception):
            raise frame
        yield frame
        if frame.done:
            return


@dataclass(slots=True)
class _Block:
    """The one open block of a request (the confirmed-prefix invariant)."""

    id: BlockId
    draft: Draft


class SpeculativeEngine:
    """Cloud-edge speculative decoding; the mode picks uplink, correction and scheduling."""

    def __init__(
        self,
        settings: EdgeSettings,
        mode: Mode,
        scheduler: DraftScheduler,
        cloud: CloudReplicas,
        metrics: EdgeMetrics,
        constraints: ConstraintBuilder | None = None,
    ) -> None:
        self.settings, self.mode, self.scheduler = settings, mode, scheduler
        self.cloud, self.metrics = cloud, metrics
        # penalties and grammars; a grammar needs the tokenizer
        self.constraints = constraints or ConstraintBuilder(None, scheduler.draft.lm.vocab_size)
        self.ladder: Ladder = settings.ladder()
        self.session_ids = _session_ids()
        # The goodput rule's measurements per sampling regime, greedy or not: a draft agrees
        # with a greedy target far more often than with a sampled one, so a mixed load would
        # price (and pause) each with the other's acceptance and rates.
        self.goodput = {
            greedy: GoodputDraftLength(
                settings.max_num_draft_tokens,
                pipelined=mode.pipelines,
                min_suffix_expected=settings.suffix_min_expected_tokens,
            )
            for greedy in (True, False)
        }
        self.suffix = self._suffix_drafter(settings, mode, scheduler)
        # Requests from their open to their end: the batch the pause and goodput rules
        # size. One counts while its sessions open, so that a burst of arrivals sees itself.
        self.decoding = 0

    @staticmethod
    def _suffix_drafter(
        settings: EdgeSettings, mode: Mode, scheduler: DraftScheduler
    ) -> SuffixDrafter | None:
        """The edge's suffix drafter, or None where suffix blocks cannot go: switched off;
        a feature draft (it feeds each token with the target's features of the position
        before, which a block it did not draft leaves it without); runahead (it drafts
        the next block on top of the draft's cache of this one)."""
        if not settings.suffix_drafting or scheduler.draft.needs_features or mode.runs_ahead:
            return None
        return SuffixDrafter(settings.suffix_config(), settings.suffix_store_bytes)

    def suffix_draft(self, tokens: list[int]) -> Draft:
        """A block of the suffix drafter's tokens: q one-hot at each (it replaces the draft
        model there), so q(x_i) = 1 travels and acceptance is p_i(x_i); the rows are kept
        for a correction, whose residual is then p without x_i, renormalised."""
        gamma, vocab = len(tokens), self.scheduler.draft.lm.vocab_size
        ids = np.asarray(tokens, dtype=np.uint32)  # [γ]
        rows = torch.zeros((gamma, vocab), dtype=torch.float32)  # [γ, V]
        rows[torch.arange(gamma), torch.as_tensor(ids.astype(np.int64))] = 1.0
        half = rows.half().numpy() if self.mode.uploads_full_rows else None  # one-hot: exact
        return Draft(ids, np.ones(gamma, dtype=np.float32), rows, half)

    def pause_reason(self, greedy: bool) -> str | None:
        """Why requests (greedy or not) do not draft their next blocks now, but let the
        cloud decode for them, or None: the batch limit (``speculative_disable_by_batch_size``),
        then the goodput pause where it applies."""
        settings, batch = self.settings, self.decoding
        if not settings.speculates_at(batch):
            return "batch_size"
        goodput = settings.goodput_pause and settings.draft_length.maximises_goodput
        if goodput and self.mode.pipelines and not self.goodput[greedy].speculation_pays(batch):
            return "goodput"
        return None

    def open_message(
        self, session_id: int, prompt: list[int], config: SamplingConfig, first_rung: int
    ) -> OpenSession:
        """``first_rung``: the ladder index whose answer a rejection's verdict carries."""
        first = self.ladder.rungs()[first_rung]
        tokens = np.asarray(prompt, dtype=np.uint32)
        wants_features = self.scheduler.draft.needs_features
        return OpenSession(session_id, tokens, config, first.kind, first.size, wants_features)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[int]]:
        seed = _seed(request)
        config = _config(request, seed)
        session_id = next(self.session_ids)
        state = _RequestState(self, request, session_id, seed, config)
        self.cloud.ledger.track(session_id)
        self.decoding += 1
        # One try for open and run: whenever the request ends (done, failed, or the client
        # gone while the session was still opening), both sides of its session are closed.
        try:
            await state.open_both()
            async for tokens in state.run():
                yield tokens
        except _CLOUD_FAILURES as exc:
            raise _cloud_failure(exc) from exc
        finally:
            self.decoding -= 1
            await state.stop_catching_up()
            if self.suffix is not None:
                self.suffix.remember(state.confirmed[len(request.prompt_ids) :])
            await self._close(session_id, opened_draft=state.key)
            request.stats.uplink_bytes, request.stats.downlink_bytes = self.cloud.ledger.of(
                session_id
            )
            self.cloud.ledger.forget(session_id)

    async def _close(self, session_id: int, opened_draft: str) -> None:
        """Close both sides of a request's session."""
        await self.cloud.close(session_id)
        with contextlib.suppress(KeyError):
            await self.scheduler.close(opened_draft)


class _RequestState:
    """One request's decoding loop and its state: confirmed prefix, budget, block sequence."""

    def __init__(
        self,
        engine: SpeculativeEngine,
        request: GenerationRequest,
        session_id: int,
        seed: int,
        config: SamplingConfig,
    ) -> None:
        self.engine, self.request, self.config = engine, request, config
        self.session_id, self.key, self.digest = session_id, str(session_id), config_digest(config)
        self.confirmed: list[int] = list(request.prompt_ids)
        self.tail: list[int] = []  # a recovered token the cloud does not know yet
        self.seq = 0
        self.budget = FidelityBudget(
            request.fidelity_budget
            if request.fidelity_budget is not None
            else engine.settings.fidelity_budget
        )
        self.truncated_target = request.params.is_truncated
        self.first_rung = engine.ladder.first_rung(
            topk_hopeless(self.budget.remaining, self.truncated_target)
        )
        self.gamma = request.num_draft_tokens or engine.settings.num_draft_tokens
        self.generator = torch.Generator().manual_seed(seed % 2**63)
        self.produced = 0
        self.next_draft: Draft | None = None  # a runahead block that turned out valid
        # How many of the draft cache's tokens the last verdict confirmed (before the first
        # block, the prompt's all but last, as open() cached them): the next propose rolls
        # the cache back to it. A feature draft's count stops before the block's drafts,
        # which it fed with its own ĥ: they go in again with the target's h.
        self.draft_confirmed = len(self.confirmed) - 1
        # A feature draft's target features by position (None: a token draft)
        draft = engine.scheduler.draft
        self.features = FeatureLog(draft.hidden_size) if draft.needs_features else None
        self.constraint = engine.constraints.build(config, request.prompt_ids)
        # Feeding the draft what it missed while the request did not draft (`_catch_up`)
        self.catching_up: asyncio.Task[None] | None = None
        self.output_s = time.perf_counter()  # when the request's last tokens came (`_measure`)
        self.generation_sent: str | None = None  # why, where its open asked for tokens
        self.goodput = engine.goodput[request.params.is_greedy]  # its regime's

    async def open_both(self) -> None:
        """Open the cloud's session and the draft's. A token draft opens alongside the
        cloud; a feature draft needs the prompt's features, so it opens after."""
        scheduler = self.engine.scheduler
        if self.features is not None:
            await self.open()
            prompt = self.confirmed
            await scheduler.open(self.key, prompt, self.features.before(0, len(prompt) - 1))
            return
        # A request that will not draft its first block leaves its draft's cache empty: its
        # prefill would only hold up the first token and take the cores from the cloud
        # (eight agent conversations on one 2-core machine: 0.78x target-only with it, 0.88x
        # without); the draft catches up if the request drafts later. Unless a suffix block
        # goes first, it asks for its tokens right behind the open, as target-only does:
        # the first token then costs one trip to the cloud and back, not two. A request
        # that speculates asks for its first token so (`first_token_from_prefill`): the
        # first block would otherwise hold it up by a drafting and a verify trip.
        paused = self._pause_reason()
        suffix_first = self._takes_suffix_blocks and bool(
            self._suffix_tokens(self.request.max_new_tokens, speculating=paused is None)
        )
        asks: str | None = None
        if not suffix_first:
            first_token = paused is None and self.engine.mode.first_token_from_prefill
            asks = FIRST_TOKEN if first_token else paused
        opening = asyncio.ensure_future(self.open(asks))
        drafting = asyncio.ensure_future(
            scheduler.open(self.key, self.confirmed, prefill=paused is None)
        )
        try:
            await asyncio.gather(opening, drafting)
        finally:  # neither may outlive the other's failure or a cancellation
            for part in (opening, drafting):
                part.cancel()
            await asyncio.gather(opening, drafting, return_exceptions=True)

    async def open(self, paused: str | None = None) -> None:
        """Open the session from the confirmed prefix on a live replica. A replica lost
        while it opens is retried on another (or the same, back) until `cloud_deadline_s`
        from the first try has passed; after that the request fails with ChannelDown.
        ``paused``: why the request's first tokens are the cloud's own, which it then asks
        for right behind the open (`generation_sent`): all of them, or with `FIRST_TOKEN`
        the first alone."""
        engine = self.engine
        deadline_s = time.monotonic() + engine.settings.cloud_deadline_s
        while True:
            channel = await engine.cloud.place(
                self.session_id, max(0.0, deadline_s - time.monotonic())
            )
            message = engine.open_message(
                self.session_id, self.confirmed, self.config, self.first_rung
            )
            then = None
            if paused is not None:
                channel.stream(self.session_id)  # its tokens may come before the open's reply
                remaining = self.request.max_new_tokens - self.produced
                then = self._generate_request(1 if paused == FIRST_TOKEN else remaining)
            try:
                opened = await channel.open_session(message, then)
                if opened.target_cost is not None:
                    for goodput in engine.goodput.values():
                        goodput.target_cost = opened.target_cost
                self._log_prompt_features(opened)
                self.generation_sent = paused
                return
            except BaseException as exc:
                if then is not None:
                    channel.end_stream(self.session_id)
                if not isinstance(exc, ChannelDown) or time.monotonic() >= deadline_s:
                    raise

    def _generate_request(self, max_tokens: int) -> GenerateRequest:
        """The ask for up to ``max_tokens`` of the cloud's own tokens (after the tail)."""
        stop = np.asarray(sorted(self.request.stop_token_ids), dtype=np.uint32)
        tail = np.asarray(self.tail, dtype=np.uint32) if self.tail else _NO_TAIL
        return GenerateRequest(self.session_id, max_tokens, stop, tail)

    def _log_prompt_features(self, opened: SessionOpened) -> None:
        if self.features is None:
            return
        if opened.features is None:
            raise CloudError(ErrorCode.UNSUPPORTED, "the cloud sent no features at open")
        self.features.extend(0, features_from_wire(opened.features))

    @property
    def channel(self) -> CloudChannel:
        """The replica the session is open on (its placement's owner says)."""
        return self.engine.cloud.channel_of(self.session_id)

    def uniform(self) -> float:
        return draw_uniform(self.generator)

    async def run(self) -> AsyncIterator[list[int]]:
        self.output_s = time.perf_counter()
        try:
            async for tokens in self._blocks():
                yield tokens
        finally:
            self.engine.metrics.fidelity_spent_per_request.observe(self.budget.spent)

    async def _blocks(self) -> AsyncIterator[list[int]]:
        limit, stop_ids = self.request.max_new_tokens, self.request.stop_token_ids
        while self.produced < limit:
            try:
                next_tokens = self._next_tokens(limit - self.produced)
                async with contextlib.aclosing(next_tokens) as batches:
                    async for new_tokens in batches:
                        out = new_tokens[: limit - self.produced]
                        stop_at = next((i for i, t in enumerate(out) if t in stop_ids), None)
                        if stop_at is not None:
                            out = out[: stop_at + 1]
                        self.produced += len(out)
                        yield out
                        if stop_at is not None:
                            return
            except ChannelDown:
                await self._reopen()
            except CloudError as exc:
                if exc.code != ErrorCode.UNKNOWN_SESSION:
                    raise
                await self._reopen()  # the cloud restarted between two of our frames

    async def _next_tokens(self, remaining: int) -> AsyncGenerator[list[int], None]:
        """One block's tokens, or, while speculation is paused, the tokens the cloud
        decodes alone (`_cloud_decoded`) as they come."""
        # the cloud's own tokens come first where the open asked for them
        sent, self.generation_sent = self.generation_sent, None
        paused = sent or self._why_paused()
        speculating = sent is None and (self.next_draft is not None or paused is None)
        takes_suffix = sent is None and self._takes_suffix_blocks
        suffix = self._suffix_block(remaining, speculating) if takes_suffix else None
        if suffix is not None:
            block = await self._one_block(len(suffix.tokens), suffix)
            self._measure(None, len(block), block_rows=len(suffix.tokens) + 1)
            yield block
            return
        if not speculating:
            assert paused is not None
            decoded = self._cloud_decoded(remaining, paused, sent=sent is not None)
            async with contextlib.aclosing(decoded) as tokens:  # its stream ends with it
                async for token in tokens:
                    if paused == FIRST_TOKEN:  # the prefill's, no decoding rate
                        self.output_s = time.perf_counter()
                    else:
                        self._measure(False, 1)
                    yield [token]
            return
        gamma = self._next_gamma()
        if gamma > remaining - 1 and self.request.num_draft_tokens:
            self.request.stats.record_shortened("max_tokens")
        block = await self._one_block(max(1, min(gamma, remaining - 1)))
        self._measure(True, len(block))
        yield block

    def _measure(self, speculating: bool | None, n_tokens: int, block_rows: int = 0) -> None:
        """The time since the request's last tokens went to these ``n_tokens``, from a
        draft model's block (``speculating``) or the cloud decoding alone; a suffix block's
        (None) are its own rule's: they stay out of the rates the pause compares, and time
        its block of ``block_rows`` and the suffix blocks' rate instead."""
        now_s, engine = time.perf_counter(), self.engine
        batch, seconds = engine.decoding, now_s - self.output_s
        measured = self.goodput.measured
        if speculating is None:
            self.goodput.block_times.observe(batch, block_rows, seconds)
            per_s = measured.observe_suffix(batch, n_tokens, seconds)
            source = "suffix"
        else:
            per_s = measured.observe(batch, speculating, n_tokens, seconds)
            source = "speculating" if speculating else "decoding"
        if per_s is not None and math.isfinite(per_s):
            labels = {
                "source": source,
                "sampling": "greedy" if self.request.params.is_greedy else "sampled",
                "batch": str(batch_bucket(batch)),
            }
            engine.metrics.mode_tokens_per_s.labels(**labels).set(per_s)
        self.output_s = now_s

    @property
    def _takes_suffix_blocks(self) -> bool:
        """A suffix block speculates: not for a request that turned speculation off or asks
        for logprobs; a constrained one drafts under its grammar instead."""
        request = self.request
        return (
            request.num_draft_tokens != 0 and request.logprobs is None and self.constraint is None
        )

    def _why_paused(self) -> str | None:
        """Why the next block is not the draft model's: `_pause_reason`, or the draft still
        catching up; None when it is."""
        paused = self._pause_reason()
        if paused is None and self.next_draft is None and not self._draft_ready():
            return "draft_catching_up"
        return paused

    def _pause_reason(self) -> str | None:
        """Why the request's next block is not the draft model's (the request's own
        setting first, then the edge's pause), or None."""
        if self.request.num_draft_tokens == 0:
            return "request"
        if self.request.logprobs is not None:
            return "logprobs"  # they live at the cloud: it samples every token
        return self.engine.pause_reason(self.request.params.is_greedy)

    def _draft_ready(self) -> bool:
        """Whether the draft can draft the next block: it is at most a prefill chunk behind
        the confirmed prefix (a propose feeds that much itself). Otherwise a catch-up starts
        and the cloud decodes alone until it is done, rather than waiting for it."""
        if self.catching_up is not None:
            if not self.catching_up.done():
                return False
            catching_up, self.catching_up = self.catching_up, None
            catching_up.result()  # its failure is the request's
        if self.features is not None:
            return True  # a feature draft is fed with the target's features by propose
        scheduler = self.engine.scheduler
        kept = min(self.draft_confirmed, scheduler.cached_length(self.key))
        missed = self.confirmed[kept:-1]
        if len(missed) <= scheduler.prefill_chunk_tokens:
            return True
        self.catching_up = asyncio.ensure_future(self._catch_up(kept, missed))
        return False

    async def _catch_up(self, kept: int, missed: list[int]) -> None:
        await self.engine.scheduler.catch_up(self.key, kept, missed)
        self.draft_confirmed = kept + len(missed)

    async def stop_catching_up(self) -> None:
        """The request ended: its catch-up goes before its draft session closes."""
        if self.catching_up is not None:
            self.catching_up.cancel()
            await asyncio.gather(self.catching_up, return_exceptions=True)

    def _suffix_block(self, remaining: int, speculating: bool) -> Draft | None:
        """The next block from the suffix drafter where the goodput rule says it pays more
        than the draft model (``speculating``) or the cloud decoding alone; else None."""
        tokens = self._suffix_tokens(remaining, speculating)
        return self.engine.suffix_draft(tokens) if tokens else None

    def _suffix_tokens(self, remaining: int, speculating: bool) -> list[int]:
        engine = self.engine
        if engine.suffix is None or self.next_draft is not None or remaining < 2:
            return []
        limit = min(engine.settings.suffix_max_tokens, remaining - 1)
        # A seeded request's blocks depend on the request alone, so that the same request
        # gives the same text again: the store holds whatever others wrote meanwhile.
        seeded = self.request.seed is not None
        proposal = engine.suffix.propose(self.confirmed, limit, use_store=not seeded)
        gamma = self.goodput.suffix_tokens(proposal.probs, engine.decoding, speculating)
        return list(proposal.tokens[:gamma])

    async def _cloud_decoded(
        self, max_tokens: int, paused: str, sent: bool = False
    ) -> AsyncGenerator[int, None]:
        """Speculation paused (``paused`` says why): the cloud samples up to ``max_tokens``
        from p alone (its generation joins the verify rounds, as a target-only one does)
        and streams them. Asking for them all at once keeps the cloud's decoding from ever
        waiting on an ask; every `paused_look_tokens` the request looks whether to speculate
        again (`_still_paused`), and if so asks the cloud to stop: the generation ends a
        token or two later, and each token it sent stays confirmed (each is a sample of p).
        The draft's cache falls behind meanwhile; the next block feeds it what it missed.
        ``sent``: the ask went out behind the session's open."""
        channel, metrics = self.channel, self.engine.metrics
        look_every = self.engine.settings.paused_look_tokens
        queue = channel.stream(self.session_id)
        unseen, stopping = 0, False  # tokens since the last look; the stop went out
        try:
            if not sent:
                await channel.send(self._generate_request(max_tokens))
            self.tail = []  # the cloud has it now
            async for frame in _generated(channel, queue):
                _note_logprobs(self.request, frame)
                for token in (int(t) for t in frame.tokens):
                    self._confirm([token])
                    if paused != FIRST_TOKEN:  # the prefill's token is no pause
                        metrics.cloud_decoded_tokens.inc()
                        self.request.stats.record_paused(paused, 1)
                    yield token
                max_tokens -= len(frame.tokens)
                unseen += len(frame.tokens)
                caught_up = self.catching_up is not None and self.catching_up.done()
                if stopping or frame.done or (unseen < look_every and not caught_up):
                    continue
                unseen = 0
                still_paused = self._still_paused(max_tokens)
                if still_paused is None:
                    stopping = True
                    await channel.send(StopGeneration(self.session_id))
                else:
                    paused = still_paused
        finally:
            channel.end_stream(self.session_id)

    def _still_paused(self, remaining: int) -> str | None:
        """At a look while the cloud decodes alone: why the request stays paused, or None
        where it should speculate again (the pause ended and the draft is ready, or a
        suffix block pays more than the cloud decoding alone)."""
        paused = self._why_paused()
        if paused is None:
            return None
        if self._takes_suffix_blocks and self._suffix_tokens(remaining, speculating=False):
            return None
        return paused

    async def _reopen(self) -> None:
        """The session's replica went away mid-request: open the session again from the
        confirmed prefix on a live replica (within the deadline) and carry on; the open
        block is dropped."""
        engine = self.engine
        self.seq, self.tail, self.next_draft, self.generation_sent = 0, [], None, None
        # The draft's cache lags the confirmed prefix by >= 1 (the last token is pending);
        # the next propose rolls it back there.
        self.draft_confirmed = min(self.draft_confirmed, len(self.confirmed) - 1)
        await self.open()
        engine.metrics.session_reopens.inc()

    async def _one_block(self, gamma: int, suffix: Draft | None = None) -> list[int]:
        if self.engine.mode.waits_alone:
            async with self.engine.scheduler.exclusive:
                return await self._block(gamma, suffix)
        return await self._block(gamma, suffix)

    async def _draft(
        self,
        gamma: int,
        pending: list[int],
        rollback_to: int | None = None,
        prev_features: torch.Tensor | None = None,
    ) -> Draft:
        request = DraftRequest(
            session_id=self.key,
            pending_tokens=pending,
            num_draft_tokens=gamma,
            params=self.request.params,
            generator=self.generator,
            quantize_half=self.engine.mode.uploads_full_rows,
            rollback_to=rollback_to,
            prev_features=prev_features,
        )
        if self.constraint is not None:
            return await propose_constrained(
                self.engine.scheduler,
                self.constraint,
                request,
                self.request.stop_token_ids,
                self.engine.mode.uploads_full_rows,
            )
        return await self.engine.scheduler.propose(request)

    def _confirm(self, tokens: list[int]) -> None:
        """Tokens join the confirmed prefix (and advance the constraint, as the cloud's)."""
        self.confirmed += tokens
        if self.constraint is not None:
            self.constraint.commit(tokens)

    async def _block(self, gamma: int, suffix: Draft | None = None) -> list[int]:
        """One block: ``suffix``'s (drafted without the model), a runahead's, or drafted."""
        engine, metrics = self.engine, self.engine.metrics
        draft, self.next_draft = suffix or self.next_draft, None
        from_runahead = draft is not None and suffix is None
        draft_s: float | None = None  # drafted while the last block was out, or no model
        if draft is None:
            # The draft's cache after rolling back to what the last verdict confirmed (its
            # owner's count, clipped: the last draft token was sampled, never fed), and what
            # it has not seen of the confirmed prefix.
            kept = min(self.draft_confirmed, self.engine.scheduler.cached_length(self.key))
            end = len(self.confirmed)
            features = None if self.features is None else self.features.before(kept, end)
            drafting_since_s = time.perf_counter()
            draft = await self._draft(gamma, self.confirmed[kept:], kept, features)
            draft_s = time.perf_counter() - drafting_since_s
        if suffix is None and self.request.num_draft_tokens and len(draft.tokens) < gamma:
            self.request.stats.record_shortened("draft_stopped")
        gamma = len(draft.tokens)
        self.seq += 1
        block = _Block(BlockId(self.session_id, self.seq, len(self.confirmed), self.digest), draft)
        tail = np.asarray(self.tail, dtype=np.uint32) if self.tail else _NO_TAIL
        msg: VerifyBlock | VerifyBlockFull
        if draft.half_rows is not None:
            msg = VerifyBlockFull(block.id, draft.tokens, draft.half_rows, tail)
        else:
            msg = VerifyBlock(block.id, draft.tokens, draft.probs, tail)
        sent_s = time.perf_counter()
        verdict = asyncio.ensure_future(self.channel.verify(msg))
        # a runahead block of a constrained request would need the constraint advanced
        # over unconfirmed drafts: it waits for the verdict instead
        runs_ahead = engine.mode.runs_ahead and self.constraint is None
        runahead = self._runahead(draft) if runs_ahead else None
        try:
            result = await verdict
        except BaseException:
            if runahead is not None:  # let it finish before anything rolls the cache back
                await asyncio.gather(runahead, return_exceptions=True)
            raise
        metrics.verify_round_trip.observe(time.perf_counter() - sent_s)
        self.request.stats.verify_round_trips += 1
        new_token = await self._resolve(block, result)
        n = result.n_accepted
        accepted = [int(t) for t in draft.tokens[:n]]
        base_len = len(self.confirmed)
        self._confirm([*accepted, new_token])
        if runahead is not None:
            await self._adopt_runahead(await runahead, n == gamma, new_token)
        engine.metrics.record_block(gamma, n)
        self.request.stats.record_block(gamma, n)
        if suffix is not None:
            # The draft's cache did not see this block: what it holds stays as confirmed
            # as it was, and the next propose feeds it everything since.
            metrics.suffix_drafts.inc()
            metrics.suffix_draft_tokens.inc(gamma)
            metrics.suffix_accepted.inc(n)
            self.goodput.observe_suffix_block(gamma, n)
            return [*accepted, new_token]
        if self.features is None:
            # The accepted part of what the draft fed stays; the next propose drops the rest
            # (unless an adopted runahead block, drafted from exactly this prefix, goes next).
            self.draft_confirmed = base_len + n
        else:
            self._log_block_features(result, base_len)
            # The draft fed its block's tokens with its own ĥ: from base_len on they go in
            # again with the verdict's h. A runahead block was drafted on top of the last
            # one's guesses, so the count stays where that block's started.
            if not from_runahead:
                self.draft_confirmed = base_len
        self.goodput.observe_block(gamma, n, draft_s)
        self._adapt_gamma(gamma, n)
        return [*accepted, new_token]

    def _log_block_features(self, result: VerifyResult, base_len: int) -> None:
        """The verdict's h of positions base_len - 1 .. base_len + n_accepted - 1."""
        assert self.features is not None
        if result.features is None:
            raise CloudError(ErrorCode.UNSUPPORTED, "the cloud sent a verdict without features")
        self.features.extend(base_len - 1, features_from_wire(result.features))

    def _next_gamma(self) -> int:
        """The next block's γ: the request's own, else as ``settings.draft_length`` says."""
        engine = self.engine
        if self.request.num_draft_tokens or not engine.settings.draft_length.maximises_goodput:
            return self.gamma
        return self.goodput.choose(engine.decoding, self.gamma)

    def _adapt_gamma(self, gamma: int, n_accepted: int) -> None:
        """Online per-request γ (SPADE's draft length, adapted as acceptance is observed):
        the schedule of HF transformers' assisted generation — two more after a fully
        accepted block, one fewer after a rejection — within [1, max_num_draft_tokens]."""
        settings = self.engine.settings
        if not settings.draft_length.adapts_per_request or self.request.num_draft_tokens:
            return  # fixed or goodput γ, or the client pinned it for this request
        step = 2 if n_accepted == gamma else -1
        self.gamma = max(1, min(settings.max_num_draft_tokens, self.gamma + step))

    def _runahead(self, draft: Draft) -> asyncio.Future[Draft]:
        """Runahead modes (an ablation, PipeInfer-style): while the block is out, draft the
        next one from the *unconfirmed* prefix, guessing all γ accepted and the bonus token
        being the draft's own next token (the runahead's first token)."""
        gamma = len(draft.tokens)
        return asyncio.ensure_future(self._draft(gamma + 1, [int(draft.tokens[-1])]))

    async def _adopt_runahead(self, runahead: Draft, all_accepted: bool, new_token: int) -> None:
        """Keep the runahead block if the guess held; otherwise its drafting was wasted."""
        if all_accepted and new_token == int(runahead.tokens[0]):
            # Its later tokens were drafted from exactly the confirmed prefix.
            self.next_draft = _drop_first(runahead)
        else:
            self.engine.metrics.wasted_draft_tokens.inc(len(runahead.tokens))

    async def _resolve(self, block: _Block, result: VerifyResult) -> int:
        """The token after the accepted prefix: bonus, cloud-recovered or recovered here."""
        if result.next_token is not None:
            self.tail = []  # the cloud sampled it, so it already has it
            if result.n_accepted < len(block.draft.tokens):
                self.engine.metrics.corrections.labels(kind="cloud").inc()
                self.request.stats.record_correction("cloud")
            return result.next_token
        assert result.correction is not None
        correction = Correction(
            self.engine.ladder,
            block.draft.rows[result.n_accepted],
            self.budget,
            self.uniform,
            truncated_target=self.truncated_target,
            rung_index=self.first_rung,
        )
        payload: Payload = result.correction
        while True:
            outcome = correction.on_payload(payload)
            if isinstance(outcome, Recovered):
                self._count_correction(outcome)
                self.tail = [outcome.token]
                return outcome.token
            self.engine.metrics.correction_rounds.inc()
            self.request.stats.correction_round_trips += 1
            reply = await self.channel.correct(
                CorrectionRequest(block.id, outcome.kind, outcome.size, correction.rung_index)
            )
            payload = reply.payload

    def _count_correction(self, outcome: Recovered) -> None:
        m = self.engine.metrics
        m.corrections.labels(kind=outcome.kind.label).inc()
        if outcome.kind is CorrectionKind.TOPK:
            m.correction_topk_k.observe(outcome.size)
        if outcome.eps:
            m.fidelity_spent.inc(outcome.eps)
        self.request.stats.record_correction(outcome.kind.label, outcome.size, outcome.eps or 0.0)


def _drop_first(draft: Draft) -> Draft:
    half = None if draft.half_rows is None else draft.half_rows[1:]
    return Draft(draft.tokens[1:], draft.probs[1:], draft.rows[1:], half)


class DraftOnlyEngine:
    """SPADE's Draft baseline: the edge decodes alone with the draft model (no cloud)."""

    def __init__(
        self, scheduler: DraftScheduler, constraints: ConstraintBuilder | None = None
    ) -> None:
        self.scheduler = scheduler
        self.constraints = constraints or ConstraintBuilder(None, scheduler.draft.lm.vocab_size)
        self.session_ids = _session_ids()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[int]]:
        if request.logprobs is not None:
            raise GenerationError(
                "logprobs are the target's, and draft-only mode has no target",
                400,
                "invalid_request_error",
            )
        key = str(next(self.session_ids))
        seed = _seed(request)
        generator = torch.Generator().manual_seed(seed % 2**63)
        constraint = self.constraints.build(_config(request, seed), request.prompt_ids)
        await self.scheduler.open(key, request.prompt_ids)
        try:
            pending = [request.prompt_ids[-1]]
            for _ in range(request.max_new_tokens):
                step = DraftRequest(key, pending, 1, request.params, generator)
                if constraint is None:
                    draft = await self.scheduler.propose(step)
                else:
                    stop_ids = request.stop_token_ids
                    draft = await propose_constrained(
                        self.scheduler, constraint, step, stop_ids, False
                    )
                    constraint.commit([int(draft.tokens[0])])
                token = int(draft.tokens[0])
                yield [token]
                if token in request.stop_token_ids:
                    return
                pending = [token]
        finally:
            await self.scheduler.close(key)


class TargetOnlyEngine:
    """SPADE's Target baseline: the cloud decodes alone and streams tokens back. A replica
    lost mid-stream is replaced by a live one, which goes on from the prompt plus the
    tokens already streamed (greedy: the same output; sampled: a fresh draw from there)."""

    def __init__(self, cloud: CloudReplicas, deadline_s: float) -> None:
        self.cloud, self.deadline_s = cloud, deadline_s
        self.session_ids = _session_ids()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[int]]:
        session_id = next(self.session_ids)
        config = _config(request, _seed(request))
        stop = np.asarray(sorted(request.stop_token_ids), dtype=np.uint32)
        produced: list[int] = []
        lost_at_s: float | None = None  # when the current outage began
        try:
            while True:
                waited_s = 0.0 if lost_at_s is None else time.monotonic() - lost_at_s
                channel = await self.cloud.place(session_id, max(0.0, self.deadline_s - waited_s))
                try:
                    async for tokens in self._stream(
                        channel, session_id, config, request, produced, stop
                    ):
                        produced += tokens
                        lost_at_s = None
                        yield tokens
                    return
                except ChannelDown:
                    lost_at_s = lost_at_s or time.monotonic()
                    if time.monotonic() - lost_at_s >= self.deadline_s:
                        raise
                finally:
                    channel.end_stream(session_id)
        except _CLOUD_FAILURES as exc:
            raise _cloud_failure(exc) from exc
        finally:
            await self.cloud.close(session_id)

    async def _stream(
        self,
        channel: CloudChannel,
        session_id: int,
        config: SamplingConfig,
        request: GenerationRequest,
        produced: list[int],
        stop: np.ndarray,
    ) -> AsyncIterator[list[int]]:
        """Open the session from the prompt and what was produced, then stream the rest."""
        if len(produced) >= request.max_new_tokens or (
            produced and produced[-1] in request.stop_token_ids
        ):
            return  # it had all been streamed when the replica was lost
        queue = channel.stream(session_id)
        prompt = np.asarray([*request.prompt_ids, *produced], dtype=np.uint32)
        remaining = request.max_new_tokens - len(produced)
        # The generation goes right behind the open: the cloud starts it once the prompt is
        # in, so the first token costs one trip to the cloud and back, not two.
        generate = GenerateRequest(session_id, remaining, stop, _NO_TAIL)
        await channel.open_session(OpenSession(session_id, prompt, config), then=generate)
        async for frame in _generated(channel, queue):
            _note_logprobs(request, frame)
            yield [int(t) for t in frame.tokens]
