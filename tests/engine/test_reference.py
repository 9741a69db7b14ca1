"""The in-process reference decoder on tiny random Llama models.

Tiers, as in vLLM's spec-decode tests: greedy output token-identical to target-only greedy,
counters that add up, seeded determinism, and (slow) a chi-square test that speculative
sampling's output is distributed as the target's.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import LlamaForCausalLM

from asymspec.sampling import SamplingParams, transform
from asymspec_engine.draft import DraftModel
from asymspec_engine.loading import session_lm
from asymspec_engine.reference import GenerationResult, speculative_generate, target_generate
from asymspec_engine.target import TargetModel
from loadtest.tiny_llama import build_tiny_llama, noisy_copy
from tests.engine.conftest import feature_draft_lm, full_logits, one_torch_thread

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = ([1, 2, 3, 4], [50], [7, 7, 7, 7, 7, 7, 7, 7, 30, 31, 32, 33])


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def target_model() -> LlamaForCausalLM:
    return build_tiny_llama(seed=0, hidden_size=64)


@pytest.fixture(scope="module")
def drafts(target_model: LlamaForCausalLM) -> dict[str, LlamaForCausalLM]:
    return {
        "independent": build_tiny_llama(seed=1, hidden_size=32),  # accepts ~ never
        "near": noisy_copy(target_model, noise_std=0.01, seed=2),  # accepts some
        "same": target_model,  # accepts ~ always
    }


def _pair(
    target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM
) -> tuple[TargetModel, DraftModel]:
    return TargetModel(session_lm(target_model)), DraftModel(session_lm(draft_model))


def _assert_counters_add_up(result: GenerationResult, prompt_len: int) -> None:
    s = result.stats
    assert s.output_tokens == len(result.tokens)  # output = accepted + recovered + bonus
    assert sum(s.accepted_per_position) == s.accepted_tokens
    assert sum(s.drafted_per_position) == s.draft_tokens
    assert all(0.0 <= rate <= 1.0 for rate in s.acceptance_per_position())
    assert s.recovered_tokens + s.bonus_tokens <= s.blocks  # at most one per block
    assert s.target_forward_calls == s.blocks + (prompt_len > 1)  # + prefill
    assert s.draft_forward_calls >= s.blocks


@pytest.mark.parametrize("draft_name", ["independent", "near"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_output_is_target_only_greedy(
    target_model: LlamaForCausalLM,
    drafts: dict[str, LlamaForCausalLM],
    draft_name: str,
    gamma: int,
) -> None:
    target, draft = _pair(target_model, drafts[draft_name])
    for prompt in PROMPTS:
        expected = target_generate(target, prompt, 24, GREEDY, seed=0)
        result = speculative_generate(target, draft, prompt, 24, gamma, GREEDY, seed=0)
        assert result.tokens == expected.tokens
        _assert_counters_add_up(result, len(prompt))
    assert target.lm.sessions() == 0 and draft.lm.sessions() == 0  # closed after use


@pytest.mark.parametrize("gamma", [1, 4])
def test_a_feature_drafts_greedy_output_is_target_only_greedy(
    target_model: LlamaForCausalLM, gamma: int
) -> None:
    """Fed the target's h as the verdicts come (the prompt's at open), the feature draft's
    blocks accept some and reject some; the output is the target's greedy output."""
    target, draft = (
        TargetModel(session_lm(target_model)),
        DraftModel(feature_draft_lm(target_model)),
    )
    accepted = 0
    for prompt in PROMPTS:
        expected = target_generate(target, prompt, 24, GREEDY, seed=0)
        result = speculative_generate(target, draft, prompt, 24, gamma, GREEDY, seed=0)
        assert result.tokens == expected.tokens
        _assert_counters_add_up(result, len(prompt))
        accepted += result.stats.accepted_tokens
    assert 0 < accepted < 3 * 24
    assert target.lm.sessions() == 0 and draft.lm.sessions() == 0


def test_near_draft_exercises_accept_recover_and_bonus(
    target_model: LlamaForCausalLM, drafts: dict[str, LlamaForCausalLM]
) -> None:
    target, draft = _pair(target_model, drafts["near"])
    params = SamplingParams(temperature=0.7)
    result = speculative_generate(target, draft, PROMPTS[0], 64, 4, params, seed=1)
    s = result.stats
    assert len(result.tokens) == 64
    assert s.accepted_tokens > 0 and s.recovered_tokens > 0 and s.bonus_tokens > 0
    assert s.accepted_per_position[0] >= s.accepted_per_position[-1]  # a prefix is accepted
    _assert_counters_add_up(result, len(PROMPTS[0]))


def test_identical_draft_is_always_accepted(
    target_model: LlamaForCausalLM, drafts: dict[str, LlamaForCausalLM]
) -> None:
    """p and q come from the same weights, so p/q = 1 up to float rounding."""
    target, draft = _pair(target_model, drafts["same"])
    params = SamplingParams(temperature=0.7, top_k=40)
    result = speculative_generate(target, draft, PROMPTS[2], 40, 4, params, seed=3)
    assert result.stats.acceptance_rate >= 0.95
    assert result.stats.blocks <= 10  # ~γ + 1 tokens per block


def test_seeded_runs_repeat_and_seeds_differ(
    target_model: LlamaForCausalLM, drafts: dict[str, LlamaForCausalLM]
) -> None:
    target, draft = _pair(target_model, drafts["near"])
    params = SamplingParams(temperature=1.0)
    runs = [
        speculative_generate(target, draft, PROMPTS[0], 32, 3, params, seed=s) for s in (5, 5, 6)
    ]
    assert runs[0].tokens == runs[1].tokens and runs[0].stats == runs[1].stats
    assert runs[0].tokens != runs[2].tokens
    assert target_generate(target, PROMPTS[0], 16, params, 5).tokens == (
        target_generate(target, PROMPTS[0], 16, params, 5).tokens
    )


def test_stops_at_eos_and_at_max_new_tokens(
    target_model: LlamaForCausalLM, drafts: dict[str, LlamaForCausalLM]
) -> None:
    target, draft = _pair(target_model, drafts["near"])
    greedy = target_generate(target, PROMPTS[0], 30, GREEDY, seed=0).tokens
    eos = greedy[9]
    expected = greedy[: greedy.index(eos) + 1]
    result = speculative_generate(
        target, draft, PROMPTS[0], 30, 4, GREEDY, seed=0, eos_token_id=eos
    )
    assert result.tokens == expected
    assert target_generate(target, PROMPTS[0], 30, GREEDY, 0, eos_token_id=eos).tokens == expected
    _assert_counters_add_up(result, len(PROMPTS[0]))
    for max_new in (0, 1, 5):
        assert (
            speculative_generate(target, draft, PROMPTS[0], max_new, 4, GREEDY, 0).tokens
            == (greedy[:max_new])
        )


def test_gamma_must_be_positive(target_model: LlamaForCausalLM) -> None:
    target, draft = _pair(target_model, target_model)
    with pytest.raises(ValueError):
        speculative_generate(target, draft, [1], 4, 0, GREEDY, seed=0)


# ---------------------------------------------------------------- statistical (slow)

STAT_VOCAB = 8
STAT_TRIALS = 2000
STAT_LENGTH = 2  # the joint distribution of the first two output tokens is tested


def _exact_joint(model: LlamaForCausalLM, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """P(first STAT_LENGTH tokens) under target-only sampling, computed, not sampled."""
    joint = np.zeros([STAT_VOCAB] * STAT_LENGTH)
    for tokens in itertools.product(range(STAT_VOCAB), repeat=STAT_LENGTH):
        probability = 1.0
        for i, token in enumerate(tokens):
            row = transform(full_logits(model, prompt + list(tokens[:i]))[-1], params)
            probability *= float(row[token])
        joint[tokens] = probability
    return joint


@pytest.mark.slow
@pytest.mark.parametrize(
    ("copy_weight", "stop_confidence", "features"),
    [(0.0, 0.0, False), (0.6, 0.0, False), (0.0, 0.15, False), (0.0, 0.0, True)],
    ids=["plain", "copy", "stop", "feature-draft"],
)
def test_speculative_output_is_distributed_as_the_target(
    copy_weight: float, stop_confidence: float, features: bool
) -> None:
    target_model = build_tiny_llama(seed=10, hidden_size=32, vocab_size=STAT_VOCAB)
    draft_model = build_tiny_llama(seed=11, hidden_size=32, vocab_size=STAT_VOCAB)
    target = TargetModel(session_lm(target_model))
    lm = feature_draft_lm(target_model, 1.0) if features else session_lm(draft_model)
    draft = DraftModel(lm, copy_weight, stop_confidence)
    # "1 2" occurred before, followed by 3: with copy_weight > 0 every draft step copies.
    params, prompt = SamplingParams(temperature=1.0), [1, 2, 3, 1, 2]
    counts: Counter[tuple[int, ...]] = Counter()
    accepted, drafted, blocks = 0, 0, 0
    for seed in range(STAT_TRIALS):
        result = speculative_generate(target, draft, prompt, STAT_LENGTH, 2, params, seed=seed)
        counts[tuple(result.tokens)] += 1
        accepted += result.stats.accepted_tokens
        drafted, blocks = drafted + result.stats.draft_tokens, blocks + result.stats.blocks
    assert 0.1 * STAT_TRIALS < accepted < 1.9 * STAT_TRIALS  # both accept and reject paths ran
    if stop_confidence > 0.0:  # blocks cut after an unsure first token, and full ones, ran
        assert blocks < drafted < 1.9 * blocks
    expected = _exact_joint(target_model, prompt, params).ravel() * STAT_TRIALS
    observed = np.zeros_like(expected)
    for tokens, count in counts.items():
        observed[np.ravel_multi_index(tokens, [STAT_VOCAB] * STAT_LENGTH)] = count
    keep = expected > 0
    _, p_value = stats.chisquare(observed[keep], expected[keep] * observed.sum() / expected.sum())
    assert p_value > 1e-3
    assert torch.get_num_threads() == 1
