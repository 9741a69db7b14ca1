"""Drafting under a constraint (penalties, a grammar mask): the edge's q rows read the
tokens before each position, as the cloud's p rows do (``asymspec.constraint``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from asymspec.constraint import Constraint
from asymspec.sampling import SamplingParams, draft_rows_from_half, sample
from asymspec_engine.draft import Draft, DraftRequest
from asymspec_engine.engine import draw_uniform
from edge_gateway.scheduler import DraftScheduler

# A constrained request drafts one step at a time with the draft's own distribution
# (temperature 1, no truncation), then applies its whole transform to log q here.
_OWN_DISTRIBUTION = SamplingParams()


async def propose_constrained(
    scheduler: DraftScheduler,
    constraint: Constraint,
    first: DraftRequest,
    stop_token_ids: frozenset[int],
    quantize_half: bool,
) -> Draft:
    """A block of ``first.num_draft_tokens`` drafts whose q rows went through the request's
    constraint (penalties, grammar mask) at each position, over the drafts before it.

    The engine transforms its rows without the tokens before them, so each step asks it
    for one token's row of the draft's own distribution (its own sampled token is dropped:
    the cache convention never feeds a sampled token, and the next step feeds ours). Any q
    keeps acceptance exact; this one is the draft's q under the same transform as p. A
    draft stop token ends the block: nothing after it would be committed."""
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    halves: list[np.ndarray] = []
    for step in range(first.num_draft_tokens):
        request = (
            replace(first, num_draft_tokens=1, params=_OWN_DISTRIBUTION, quantize_half=False)
            if step == 0
            else DraftRequest(first.session_id, [tokens[-1]], 1, _OWN_DISTRIBUTION, first.generator)
        )
        own = (await scheduler.propose(request)).rows[0]  # [V]
        q = constraint.next_row(torch.log(own), tokens)  # log 0 = -inf: masked as q was
        if quantize_half:
            half = q.half().numpy()  # [V] exactly what goes on the wire
            halves.append(half)
            q = torch.from_numpy(draft_rows_from_half(half[None])[0])
        rows.append(q)
        tokens.append(sample(q, draw_uniform(first.generator)))
        if tokens[-1] in stop_token_ids:
            break
    q_rows = torch.stack(rows)  # [γ, V]
    probs = q_rows[torch.arange(len(tokens)), torch.as_tensor(tokens)].numpy()
    return Draft(
        np.asarray(tokens, dtype=np.uint32),
        probs.astype(np.float32),
        q_rows,
        np.stack(halves) if halves else None,
    )
