"""Text on the edge: prompts to token ids, and committed token ids back to safe text deltas.

The engine speaks tokens only (``engine_api``); this module is where text is made, so that
stop strings, UTF-8 boundaries and chat templates live in one place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

# Tokens that end a turn or a document in common chat templates; those the tokenizer has
# stop generation besides its eos.
END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")
# How many prompt tokens the detokenizer decodes before the first generated one, as vLLM
# does: SentencePiece drops a word's leading space when the word is decoded on its own.
CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence


def _as_token_ids(encoded: Any) -> list[int]:
    """apply_chat_template's result as a flat list of ids: transformers 5 returns a
    BatchEncoding unless return_dict=False, and other versions may nest a batch of one."""
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    ids = list(encoded)
    if ids and isinstance(ids[0], list):
        (ids,) = ids
    return [int(t) for t in ids]


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """A raw completion prompt, with the tokenizer's own special tokens (e.g. BOS)."""
    return _as_token_ids(tokenizer(text, add_special_tokens=True)["input_ids"])


def render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]]
) -> list[int]:
    """Chat messages -> prompt token ids through the tokenizer's chat template, ending with
    the assistant's generation prompt.

    Control tokens written inside message contents (a user typing ``<|im_end|>``) are
    encoded as plain text, so a message cannot forge a turn of another role. A tokenizer
    without a template gets a plain ``role: content`` transcript ending in ``assistant:``.
    """
    if not getattr(tokenizer, "chat_template", None):
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return encode_prompt(tokenizer, "\n".join([*lines, "assistant:"]))
    encoded = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        sanitize_control_tokens=True,
    )
    return _as_token_ids(encoded)


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The eos id(s) plus the end-of-turn tokens of ``END_TOKENS`` the tokenizer added.

    Only the added vocabulary is searched: end tokens are added (special) tokens, and the
    full vocabulary takes ~60 ms to build on a 49k-token tokenizer, per call.
    """
    ids: set[int] = set()
    eos = tokenizer.eos_token_id
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, Sequence):
        ids.update(int(t) for t in eos)
    added = tokenizer.get_added_vocab()
    ids.update(added[token] for token in END_TOKENS if token in added)
    return frozenset(ids)


class IncrementalDetokenizer:
    """Token ids in, text deltas out that never need to be taken back.

    UTF-8: a byte-level tokenizer splits one character over several tokens, and decoding a
    partial character yields U+FFFD. As vLLM and TGI do, we decode a short window twice,
    without and with the new tokens (``ids[prefix:read]`` and ``ids[prefix:]``), and emit the
    difference only once it no longer ends in U+FFFD; until then the tokens stay unread.
    Decoding a window rather than the whole sequence keeps each token O(window), not O(n).

    Stop strings: text that could be the start of a stop string is held back until it is
    known not to be one; when a stop string appears, the text before it is emitted, the
    rest is dropped, ``stopped`` is set and further tokens are ignored. ``num_tokens``
    counts the tokens consumed up to and including the one that completed the stop string.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        stop_strings: Sequence[str] = (),
        context_ids: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.stopped = False
        self.num_tokens = 0
        self._ids = [int(t) for t in context_ids[-CONTEXT_TOKENS:]]  # context + generated
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(self._ids)  # tokens before this are emitted (or held below)
        self._held = ""  # decoded text not yet emitted: a possible stop-string start

    def add(self, token_ids: Sequence[int]) -> str:
        """Consume tokens one by one (so a stop string ends the count exactly where it
        completes) and return the text that is now safe to emit."""
        deltas = []
        for token_id in token_ids:
            if self.stopped:
                break
            self.num_tokens += 1
            self._ids.append(int(token_id))
            deltas.append(self._release(self._decode_stable()))
        return "".join(deltas)

    def finish(self) -> str:
        """Generation is over: flush everything held, a trailing U+FFFD included (the model
        really did end on an incomplete character)."""
        if self.stopped:
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        tail = self._decode(self._ids[self._prefix_offset :])[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        return self._release(tail, final=True)

    def _decode(self, ids: Sequence[int]) -> str:
        # Spaces are not "cleaned up": the clean-up rewrites text around punctuation, which
        # would change already-emitted text as the window moves.
        text = self.tokenizer.decode(
            list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        assert isinstance(text, str)  # one sequence in, one string out
        return text

    def _decode_stable(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or a character still incomplete
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def _release(self, delta: str, final: bool = False) -> str:
        text = self._held + delta
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped, self._held = True, ""
            return text[:cut]
        keep = 0 if final else self._partial_stop_length(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def _first_stop(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
        return min(found) if found else None

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop_strings:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
