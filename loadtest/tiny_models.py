"""A tiny but real model pair on disk for tests through real service processes.

A byte-level BPE tokenizer trained in memory on a few lines of text (with a chat template),
and two random-weight Llamas over its vocabulary — a target and a draft that is a noisy
copy of it, so blocks see both acceptances and rejections. Saved with `save_pretrained`,
they load through the same `load_causal_lm` path as any Hugging Face checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from asymspec.correction import Rung
from asymspec.sampling import SamplingParams
from asymspec.wire import CorrectionKind, SamplingConfig
from asymspec_engine.feature_draft import save_fc
from asymspec_engine.loading import session_lm
from asymspec_engine.target import (
    PrefillChunk,
    Round,
    ScoreRequest,
    StepRequest,
    TargetModel,
)
from cloud_verifier.sessions import Session
from loadtest.tiny_llama import build_tiny_llama, feature_copy, noisy_copy

TINY_VOCAB = 320
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "for i in range(10):\n    print(i * i)\n",
    "Speculative decoding drafts tokens at the edge and verifies them in the cloud.",
    "import numpy as np\nx = np.arange(8)\n",
] * 20


def build_tokenizer(vocab_size: int = TINY_VOCAB) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|end|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_pair(root: Path, draft_noise: float = 0.02) -> tuple[Path, Path]:
    """Write target/ and draft/ checkpoints (weights + tokenizer) under root."""
    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    target = build_tiny_llama(seed=0, hidden_size=64, vocab_size=vocab)
    draft = noisy_copy(target, noise_std=draft_noise, seed=1)
    paths = root / "target", root / "draft"
    for model, path in zip((target, draft), paths, strict=True):
        model.config.eos_token_id = tokenizer.eos_token_id
        model.config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return paths


def save_tiny_feature_draft(target_dir: Path, out: Path) -> Path:
    """``feature_copy`` of the saved tiny target as a feature draft folder (a one-layer
    checkpoint with the target's tokenizer, and its fc)."""
    draft, fc = feature_copy(AutoModelForCausalLM.from_pretrained(target_dir).eval())
    draft.save_pretrained(out)
    PreTrainedTokenizerFast.from_pretrained(target_dir).save_pretrained(out)
    save_fc(out, fc)
    return out


def greedy_cloud_session(session_id: int) -> Session:
    """A greedy cloud verification session with a 3-token confirmed prefix, for tests that
    drive the cloud's batcher directly."""
    return Session(
        session_id=session_id,
        owner=1,
        config=SamplingConfig(SamplingParams(0.0, 0, 1.0), 7),
        first_rung=Rung(CorrectionKind.TOPK, 4),
        confirmed=[1, 2, 3],
    )


class RecordingTarget(TargetModel):
    """The real target, recording each round's prefill chunk sizes and decode rows."""

    def __init__(self) -> None:
        super().__init__(session_lm(build_tiny_llama(seed=0, hidden_size=32)))
        self.rounds: list[tuple[dict[str, int], int]] = []

    def round(
        self,
        prefills: Sequence[PrefillChunk],
        scores: Sequence[ScoreRequest],
        steps: Sequence[StepRequest],
    ) -> Round:
        chunks = {c.session_id: len(c.token_ids) for c in prefills}  # "owner:session"
        self.rounds.append((chunks, len(scores) + len(steps)))
        return super().round(prefills, scores, steps)
