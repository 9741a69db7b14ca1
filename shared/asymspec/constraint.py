"""The part of a request's sampling transform that reads the tokens before each row:
penalties (repetition, presence, frequency) and a grammar mask.

Both sides hold one `Constraint` per request, built from what the session's sampling config
carries, and advance it over the same committed tokens; a row at a block's position i reads
the committed tokens plus the block's drafts before i. So the edge's q rows and the cloud's
p rows come from the same transform at every position, and acceptance stays exact for the
constrained distributions (DESIGN §12). Order within a row, as vLLM's: penalties, the
grammar mask, then `sampling.transform` (logit bias, temperature, top-k/p, min-p).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from asymspec.grammar import GrammarCompiler, GrammarError, Matcher
from asymspec.sampling import transform
from asymspec.sampling_params import Penalties, SamplingParams
from asymspec.wire import SamplingConfig


class Constraint:
    """One request's history-dependent transform, at its committed position."""

    def __init__(
        self,
        params: SamplingParams,
        penalties: Penalties,
        matcher: Matcher | None,
        prompt_ids: Sequence[int],
        vocab_size: int,
    ) -> None:
        self.params, self.penalties, self.matcher = params, penalties, matcher
        self.vocab_size = vocab_size
        self.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool)  # [V] for repetition
        self.prompt_seen[torch.as_tensor(list(prompt_ids), dtype=torch.long)] = True
        self.output_counts = torch.zeros(vocab_size, dtype=torch.float32)  # [V]

    def commit(self, tokens: Sequence[int]) -> None:
        """Generated tokens joined the request's text (in order)."""
        if not tokens:
            return
        if self.matcher is not None:
            self.matcher.advance([int(t) for t in tokens])
        ids = torch.as_tensor([int(t) for t in tokens], dtype=torch.long)
        self.output_counts.index_add_(0, ids, torch.ones(len(ids)))

    def rows(self, logits: torch.Tensor, drafts: Sequence[int]) -> torch.Tensor:
        """logits [n, V] of the positions after drafts[:0], drafts[:1], ... -> transformed
        float32 probabilities [n, V]. Past a draft the grammar refuses, the rows repeat the
        refused position's row: its draft has p = 0 there, so it is rejected and no later
        row of the block is ever read."""
        drafts = [int(t) for t in drafts]
        n = logits.shape[0]
        valid = len(drafts) if self.matcher is None else self.matcher.valid_prefix(drafts[: n - 1])
        out: list[torch.Tensor] = []
        counts = self.output_counts.clone()
        consumed = 0
        try:
            for i in range(n):
                if i > valid:
                    out.append(out[-1])
                    continue
                if i > 0:
                    counts[drafts[i - 1]] += 1.0
                    if self.matcher is not None:
                        self.matcher.advance([drafts[i - 1]])
                        consumed += 1
                out.append(self._row(logits[i], counts))
        finally:
            if self.matcher is not None:
                self.matcher.rollback(consumed)
        return torch.stack(out)

    def next_row(self, logits: torch.Tensor, drafts: Sequence[int]) -> torch.Tensor:
        """logits [V] of the position after all of ``drafts`` (which the grammar allows)
        -> its transformed float32 probabilities [V]: one drafting step."""
        drafts = [int(t) for t in drafts]
        counts = self.output_counts.clone()
        if drafts:
            counts.index_add_(0, torch.as_tensor(drafts), torch.ones(len(drafts)))
        if self.matcher is None:
            return self._row(logits, counts)
        self.matcher.advance(drafts)
        try:
            return self._row(logits, counts)
        finally:
            self.matcher.rollback(len(drafts))

    def _row(self, logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """One row [V]: penalties with these output counts, the mask, the transform."""
        logits = logits.float()
        p = self.penalties
        if p.repetition != 1.0:
            seen = self.prompt_seen | (counts > 0)
            penalised = torch.where(logits > 0, logits / p.repetition, logits * p.repetition)
            logits = torch.where(seen, penalised, logits)
        if p.presence or p.frequency:
            logits = logits - p.presence * (counts > 0).float() - p.frequency * counts
        if self.matcher is not None:
            allowed = self.matcher.allowed()
            if not bool(allowed.any()):
                raise ValueError("the grammar allows no token here")
            logits = logits.masked_fill(~allowed, float("-inf"))
            if not bool(torch.isfinite(logits).any()):
                # Only a draft row can be 0 on every allowed token (its restricted head, or
                # a row built from q's logarithm): q may be any distribution, so it becomes
                # uniform on the allowed tokens. A target row's logits are finite.
                logits = torch.zeros_like(logits).masked_fill(~allowed, float("-inf"))
        return transform(logits[None], self.params)[0]


class ConstraintBuilder:
    """Builds each request's `Constraint` from its sampling config, on either side; owns
    the side's grammar compiler (and so its compile cache). Without a tokenizer it can
    build penalties but refuses a grammar."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiler: GrammarCompiler | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        if self.tokenizer is None:
            raise GrammarError("this side has no tokenizer, so it cannot run a grammar")
        if self._compiler is None:
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self._compiler

    def build(self, config: SamplingConfig, tokens: Sequence[int]) -> Constraint | None:
        """The constraint after a session's ``tokens`` (its prompt, then any output it is
        opened with: ``config.prompt_len`` says where that starts); None for a config whose
        rows read no history (the engines' own transform is all of it)."""
        if not config.reads_history:
            return None
        if not 0 < config.prompt_len <= len(tokens):
            raise GrammarError(f"prompt_len {config.prompt_len} does not fit {len(tokens)} tokens")
        matcher = self.compiler.matcher(config.grammar) if config.grammar else None
        prompt, output = tokens[: config.prompt_len], tokens[config.prompt_len :]
        constraint = Constraint(config.params, config.penalties, matcher, prompt, self.vocab_size)
        constraint.commit(output)
        return constraint
