"""Real components for the API tests: a byte-level BPE tokenizer trained in memory and a
target-only engine that decodes with a tiny random-weight Llama in-process.

Neither is a mock: the tokenizer is a trained ``tokenizers`` BPE with a chat template,
and the engine runs the project's ``CachedLM`` / ``TargetModel`` step by step. Test knobs
(``step_delay_s``, ``stall_after_tokens``, ``fail_after_tokens``, ``ready``) only delay,
stall, fail or refuse; what the engine saw and how each request ended is recorded for the
tests to check.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from asymspec_engine.loading import session_lm
from asymspec_engine.target import StepRequest, TargetModel
from edge_gateway.engine_api import GenerationError, GenerationRequest
from loadtest.tiny_llama import build_tiny_llama

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Multi-byte text on purpose: byte-level BPE splits é, 日本 and emoji over several tokens,
# which is what the detokenizer's UTF-8 hold-back is for.
_CORPUS_LINES = (
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b",
    "Speculative decoding drafts tokens at the edge and verifies them in the cloud.",
    "Café crème, naïve façade, déjà vu; Straße und Müller.",
    "日本語のテキストと中文文本。",
    "Emoji: 😀 🚀 🎉 ✅ — and symbols: €, £, ±, →.",
    "Hello, world! How are you today? I am fine, thank you.",
    "for i in range(10):\n    print(i * i)",
)


def build_test_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style) trained on a few hundred lines; ~1 s on one core."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: no unknown text
        show_progress=False,
    )
    lines = [f"{line} ({i})" for i in range(40) for line in _CORPUS_LINES]
    tokenizer.train_from_iterator(lines, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    wrapped.chat_template = CHATML_TEMPLATE
    return wrapped


def build_test_model(vocab_size: int, seed: int = 0) -> LlamaForCausalLM:
    """The backend tests' tiny Llama (2 layers, GQA), with the tokenizer's vocabulary."""
    return build_tiny_llama(seed=seed, hidden_size=64, vocab_size=vocab_size)


T = TypeVar("T")


class LocalEngine:
    """Target-only decoding in-process; implements ``edge_gateway.engine_api.Engine``.

    Model calls run in a worker thread (``asyncio.to_thread``) so the event loop keeps
    serving; a lock makes concurrent requests take turns, as ``CachedLM`` has one owner.
    """

    def __init__(self, model: LlamaForCausalLM, tokens_per_chunk: int = 3) -> None:
        self.target = TargetModel(session_lm(model))
        self.tokens_per_chunk = tokens_per_chunk  # > 1: chunks look like spec-decode blocks
        self.step_delay_s = 0.0  # a pause before each chunk (a slow link)
        self.stall_after_tokens: int | None = None  # then wait forever (a lost cloud)
        self.fail_after_tokens: int | None = None  # raise GenerationError after this many
        self.requests: list[GenerationRequest] = []  # what the API handed over
        self.generated: dict[str, list[int]] = {}  # request_id -> ids yielded so far
        self.outcomes: dict[str, str] = {}  # request_id -> finished | closed | failed
        self._lock = threading.Lock()

    def open_sessions(self) -> int:
        return self.target.lm.sessions()

    def _locked(self, fn: Callable[..., T], *args: object) -> T:
        with self._lock:
            return fn(*args)

    def _decode_chunk(
        self, request: GenerationRequest, pending: list[int], generator: torch.Generator, n: int
    ) -> list[int]:
        """Up to ``n`` tokens, stopping after a stop token (which is included)."""
        chunk: list[int] = []
        for _ in range(n):
            step = StepRequest(request.request_id, pending, request.params, generator)
            (token,) = self._locked(self.target.generate_step, [step])
            chunk.append(token)
            pending = [token]
            if token in request.stop_token_ids:
                break
        return chunk

    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[int]]:
        self.requests.append(request)
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        generator = torch.Generator().manual_seed(seed % 2**63)
        produced = self.generated.setdefault(request.request_id, [])
        outcome = "closed"  # unless it runs to the end or fails: the consumer closed us
        await asyncio.to_thread(
            self._locked, self.target.open, request.request_id, request.prompt_ids
        )
        try:
            pending = [request.prompt_ids[-1]]  # open() prefilled all but the last token
            while len(produced) < request.max_new_tokens:
                if self.step_delay_s:
                    await asyncio.sleep(self.step_delay_s)
                if self.stall_after_tokens is not None and len(produced) >= self.stall_after_tokens:
                    await asyncio.Event().wait()  # only cancellation gets us out
                if self.fail_after_tokens is not None and len(produced) >= self.fail_after_tokens:
                    outcome = "failed"
                    raise GenerationError("injected engine failure", 500)
                n = min(self.tokens_per_chunk, request.max_new_tokens - len(produced))
                chunk = await asyncio.to_thread(self._decode_chunk, request, pending, generator, n)
                produced.extend(chunk)
                pending = chunk[-1:]
                yield chunk
                if chunk[-1] in request.stop_token_ids:
                    break
            outcome = "finished"
        finally:
            # Synchronous on purpose: this may run inside a cancelled scope, where an await
            # would be interrupted before the session is freed.
            self._locked(self.target.close, request.request_id)
            self.outcomes[request.request_id] = outcome
