"""Grammars that constrain what a request may generate (llguidance underneath).

A request's constraint (a JSON schema, a regex, a choice, a Lark grammar) becomes one
llguidance grammar text at the edge's API; that text travels once per session in the
sampling config (and its digest), and both sides compile it against the same tokenizer,
so the edge's draft rows and the cloud's verified rows are masked by the same grammar
state at every position. Compiling is cached per text; a session gets a copy of the
compiled matcher and advances it over its own tokens.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import numpy as np
import torch
from llguidance import LLMatcher
from transformers import PreTrainedTokenizerFast
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

if TYPE_CHECKING:  # a TypedDict of the binding's stubs only
    from llguidance._lib import JsonCompileOptions

# Compiled grammars kept per side: agents send the same few schemas again and again.
COMPILED_GRAMMARS_KEPT = 64


class GrammarError(ValueError):
    """A grammar that does not compile (the client's error: a 400 at the edge)."""


# JSON is written compactly (``json.dumps(separators=(",", ":"))``): with whitespace allowed
# between tokens, a model can spend its whole budget on blanks and never close the object.
COMPACT_JSON: JsonCompileOptions = {"whitespace_flexible": False}


def from_json_schema(schema: dict[str, Any] | bool) -> str:
    """OpenAI's ``json_schema`` (strict or not, the schema is enforced either way)."""
    if schema is True or schema == {}:
        return from_json_object()
    try:
        text = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=COMPACT_JSON)
        return str(text)
    except ValueError as exc:
        raise GrammarError(f"not a JSON schema: {exc}") from None


def from_json_object() -> str:
    """OpenAI's ``json_object``: any JSON object."""
    return from_json_schema({"type": "object"})


def from_regex(pattern: str) -> str:
    return str(LLMatcher.grammar_from_regex(pattern))


def from_choice(choices: list[str]) -> str:
    """vLLM's ``guided_choice``: exactly one of the strings."""
    if not choices:
        raise GrammarError("a choice needs at least one string")
    alternatives = " | ".join(json.dumps(choice) for choice in choices)
    return from_lark(f"start: {alternatives}")


def from_lark(grammar: str) -> str:
    """vLLM's ``guided_grammar`` in Lark syntax (llguidance's dialect)."""
    return str(LLMatcher.grammar_from_lark(grammar))


class GrammarCompiler:
    """Compiles grammar texts against one tokenizer; owns the compile cache of its side."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            raise GrammarError("grammars need a fast (Rust) tokenizer")
        # ~1 s for a large vocabulary: built once per process, when the first grammar comes
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer)
        self.vocab_size = vocab_size  # the model's rows, which may pad the tokenizer's
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()

    def check(self, grammar: str) -> None:
        """Raise GrammarError for a grammar this tokenizer cannot run."""
        self.matcher(grammar)

    def matcher(self, grammar: str) -> Matcher:
        compiled = self._compiled.get(grammar)
        if compiled is None:
            compiled = LLMatcher(self.tokenizer, grammar, log_level=0)
            if compiled.is_error():
                raise GrammarError(f"the grammar does not compile: {compiled.get_error()}")
            self._compiled[grammar] = compiled
            while len(self._compiled) > COMPILED_GRAMMARS_KEPT:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(grammar)
        return Matcher(compiled.deep_copy(), self.vocab_size, self.eos_token_id)


class Matcher:
    """One session's grammar state: which tokens may come next, advanced token by token.

    The end-of-text token is kept here rather than fed to llguidance: rolling its matcher
    back over that token leaves it in a state that is no longer accepting (llguidance
    1.9), and a block's rows are computed by advancing over its drafts and rolling back."""

    def __init__(self, matcher: LLMatcher, vocab_size: int, eos_token_id: int | None) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id  # ends the text once the grammar is complete
        self._ended = 0  # end-of-text tokens taken after the complete text (normally 0 or 1)

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next (ids past the tokenizer's: none)."""
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        if self._ended:  # the text has ended: only its end may repeat
            if self.eos_token_id is not None:
                mask[self.eos_token_id] = True
            return mask
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        mask[: len(allowed)] = torch.from_numpy(allowed)
        return mask

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the grammar accepts in order from here."""
        ends = [t == self.eos_token_id for t in tokens]
        if self._ended:
            return next((i for i, end in enumerate(ends) if not end), len(tokens))
        # llguidance never sees the end-of-text token (see the class): the tokens before
        # the first one are validated, and it is allowed where they leave the text complete
        first_end = ends.index(True) if any(ends) else len(tokens)
        body = tokens[:first_end]
        valid = int(self._matcher.validate_tokens(body)) if body else 0
        if valid < first_end or first_end == len(tokens):
            return valid
        for token in body:  # valid, so no error state
            self._matcher.consume_token(token)
        accepting = bool(self._matcher.is_accepting())
        self._rollback_matcher(len(body))
        if not accepting:
            return valid
        return valid + next(
            (i for i, end in enumerate(ends[first_end:]) if not end), len(ends) - first_end
        )

    def advance(self, tokens: list[int]) -> None:
        """Consume tokens the grammar allows (checked first: a refused token would leave
        the matcher in an error state for good)."""
        if not tokens:
            return
        if self.valid_prefix(tokens) != len(tokens):
            raise GrammarError(f"the grammar does not allow {tokens}")
        for token in tokens:
            if token == self.eos_token_id and (self._ended or self._matcher.is_accepting()):
                self._ended += 1
            elif not self._matcher.consume_token(token):
                raise GrammarError(f"the grammar refused {token}: {self._matcher.get_error()}")

    def rollback(self, count: int) -> None:
        ended = min(count, self._ended)
        self._ended -= ended
        self._rollback_matcher(count - ended)

    def _rollback_matcher(self, count: int) -> None:
        if count and not self._matcher.rollback(count):
            raise GrammarError(f"cannot roll the grammar back {count} tokens")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing but the end of the text."""
        return bool(self._ended or self._matcher.is_stopped())
