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

from asymspec.backends.draft import DraftModel
from asymspec.backends.embedded import EMBEDDED_DRAFT, EMBEDDED_TARGET, embedded_path
from asymspec.backends.engine import CachedLM
from asymspec.backends.loading import load_causal_lm
from asymspec.backends.target import TargetModel
from asymspec.prompts import humaneval_prompts
from asymspec.reference import speculative_generate, target_generate
from asymspec.sampling import SamplingParams

pytestmark = pytest.mark.slow

Loaded = tuple[PreTrainedModel, PreTrainedTokenizerBase]


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Overrides conftest's tiny-model setting: a 135M model's matmuls use every core."""
    yield


@pytest.fixture(scope="module")
def embedded_target() -> Loaded:
    embedded_path(EMBEDDED_TARGET)  # raises ModelNotPrepared ("run make models") if missing
    return load_causal_lm(EMBEDDED_TARGET, device="cpu")


@pytest.fixture(scope="module")
def embedded_draft() -> Loaded:
    embedded_path(EMBEDDED_DRAFT)
    return load_causal_lm(EMBEDDED_DRAFT, device="cpu")


@pytest.fixture(scope="module")
def heldout_ids(embedded_target: Loaded) -> list[list[int]]:
    tokenizer = embedded_target[1]
    return [list(tokenizer(text)["input_ids"]) for text in humaneval_prompts("heldout")[:3]]


def test_the_pair_shares_one_tokenizer(embedded_target: Loaded, embedded_draft: Loaded) -> None:
    (target, target_tokenizer), (draft, draft_tokenizer) = embedded_target, embedded_draft
    assert target.config.vocab_size == draft.config.vocab_size
    text = humaneval_prompts("heldout")[0]
    assert target_tokenizer(text)["input_ids"] == draft_tokenizer(text)["input_ids"]


def test_cached_and_batched_scores_equal_recompute(
    embedded_target: Loaded, heldout_ids: list[list[int]]
) -> None:
    model = embedded_target[0]
    batched, alone = CachedLM(model), CachedLM(model)
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
    target = TargetModel(CachedLM(embedded_target[0]))
    draft = DraftModel(CachedLM(embedded_draft[0]))
    greedy = SamplingParams(temperature=0.0)
    for ids in heldout_ids[:2]:
        expected = target_generate(target, ids, 16, greedy, seed=0)
        result = speculative_generate(target, draft, ids, 16, 4, greedy, seed=0)
        assert result.tokens == expected.tokens
        assert result.stats.accepted_tokens > 0  # a distilled draft agrees some of the time
