"""The backends on the embedded SmolLM2 pair (needs ``make models``; fails loudly without).

Slow: each target forward takes ~0.1-0.2 s on 2 CPU cores. The default run skips these with
``-m "not slow"``; CI runs them after ``make models``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from asymspec.sampling import SamplingParams
from asymspec_engine.draft import DraftModel
from asymspec_engine.embedded import EMBEDDED_DRAFT, EMBEDDED_TARGET, embedded_path
from asymspec_engine.engine import CachedLM
from asymspec_engine.llama import LlamaEngine
from asymspec_engine.loading import load_causal_lm, session_lm
from asymspec_engine.reference import speculative_generate, target_generate
from asymspec_engine.target import TargetModel
from loadtest.prompts import humaneval_prompts

pytestmark = pytest.mark.slow

Loaded = tuple[PreTrainedModel, PreTrainedTokenizerBase]


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Overrides conftest's tiny-model setting: a 135M model's matmuls use every core."""
    yield


@pytest.fixture(scope="module")
def embedded_target() -> Loaded:
    embedded_path(EMBEDDED_TARGET)  # raises ModelNotPrepared ("run make models") if missing
    return load_causal_lm(EMBEDDED_TARGET, device="cpu", dtype=torch.float32)  # exact mode


@pytest.fixture(scope="module")
def embedded_draft() -> Loaded:
    embedded_path(EMBEDDED_DRAFT)
    return load_causal_lm(EMBEDDED_DRAFT, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def heldout_ids(embedded_target: Loaded) -> list[list[int]]:
    tokenizer = embedded_target[1]
    return [list(tokenizer(text)["input_ids"]) for text in humaneval_prompts("heldout")[:3]]


def test_the_pair_shares_one_tokenizer(embedded_target: Loaded, embedded_draft: Loaded) -> None:
    (target, target_tokenizer), (draft, draft_tokenizer) = embedded_target, embedded_draft
    assert target.config.vocab_size == draft.config.vocab_size
    text = humaneval_prompts("heldout")[0]
    assert target_tokenizer(text)["input_ids"] == draft_tokenizer(text)["input_ids"]


@pytest.mark.parametrize("engine_cls", [CachedLM, LlamaEngine])
def test_cached_and_batched_scores_equal_recompute(
    embedded_target: Loaded,
    heldout_ids: list[list[int]],
    engine_cls: type[CachedLM] | type[LlamaEngine],
) -> None:
    model = embedded_target[0]
    batched, alone = engine_cls(model), engine_cls(model)
    batch = []
    for i, ids in enumerate(heldout_ids):  # prompts of different lengths
        batched.open(f"s{i}", ids[:-5])
        alone.open(f"s{i}", ids[:-5])
        batch.append((f"s{i}", ids[-5:]))  # tail + γ = 4
    together = batched.forward_new(batch)
    for i, (request, ids) in enumerate(zip(batch, heldout_ids, strict=True)):
        (single,) = alone.forward_new([request])
        with torch.inference_mode():
            full = model(torch.tensor([ids])).logits[0, -5:].float()  # [5, V]
        assert float((single - full).abs().max()) <= 1e-3  # logits of magnitude ~10-30
        probs, single_probs = torch.softmax(together[i], -1), torch.softmax(single, -1)
        assert float((probs - single_probs).abs().max()) <= 1e-4
        assert torch.equal(together[i].argmax(-1), single.argmax(-1))


def test_greedy_reference_equals_target_only(
    embedded_target: Loaded, embedded_draft: Loaded, heldout_ids: list[list[int]]
) -> None:
    target = TargetModel(session_lm(embedded_target[0]))
    draft = DraftModel(session_lm(embedded_draft[0]))
    assert isinstance(target.lm, LlamaEngine) and isinstance(draft.lm, LlamaEngine)
    greedy = SamplingParams(temperature=0.0)
    for ids in heldout_ids[:2]:
        expected = target_generate(target, ids, 16, greedy, seed=0)
        result = speculative_generate(target, draft, ids, 16, 4, greedy, seed=0)
        assert result.tokens == expected.tokens
        assert result.stats.accepted_tokens > 0  # a distilled draft agrees some of the time


def test_bf16_engine_tracks_float32(heldout_ids: list[list[int]]) -> None:
    """The bf16 engine (the default on CPUs with AMX / AVX512-BF16) scores like float32 up
    to bf16 rounding: same argmax on nearly every row, probabilities within a few percent."""
    model, _ = load_causal_lm(EMBEDDED_TARGET, device="cpu", dtype=torch.bfloat16)
    exact_model, _ = load_causal_lm(EMBEDDED_TARGET, device="cpu", dtype=torch.float32)
    half, exact = LlamaEngine(model), LlamaEngine(exact_model)
    agree = total = 0
    for i, ids in enumerate(heldout_ids):
        half.open(f"s{i}", [])
        exact.open(f"s{i}", [])
        (rows,) = half.forward_new([(f"s{i}", ids)])
        (exact_rows,) = exact.forward_new([(f"s{i}", ids)])
        probs, exact_probs = torch.softmax(rows, -1), torch.softmax(exact_rows, -1)
        tv = 0.5 * (probs - exact_probs).abs().sum(-1)  # [n] total variation per row
        assert float(tv.median()) < 0.05
        agree += int((rows.argmax(-1) == exact_rows.argmax(-1)).sum())
        total += len(ids)
    assert agree / total > 0.9
