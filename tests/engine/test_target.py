"""TargetModel: block scores, commits of the accepted prefix, target-only steps."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from asymspec.sampling import SamplingParams, sample, transform
from asymspec_engine.loading import session_lm
from asymspec_engine.target import (
    PrefillChunk,
    ScoreRequest,
    StepRequest,
    TargetModel,
    attended_keys,
    fed_keys,
    fed_rows,
)
from loadtest.tiny_llama import TINY_VOCAB
from tests.engine.conftest import full_logits

GREEDY = SamplingParams(temperature=0.0)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_score_rows_are_p1_to_p_gamma_plus_1(
    target: TargetModel, tiny_target_model: LlamaForCausalLM
) -> None:
    prompt, drafts = [3, 1, 4, 1, 5], [9, 2, 6, 5]
    target.open("s", prompt)
    assert target.length("s") == 4  # the last prompt token is the first block's tail
    (rows,) = target.score([ScoreRequest("s", prompt[-1:] + drafts, num_draft_tokens=4)])
    assert rows.shape == (5, TINY_VOCAB)  # [γ+1, V]
    expected = full_logits(tiny_target_model, prompt + drafts)[4:]  # rows after x_0 .. x_γ
    assert _max_diff(rows, expected) <= 1e-4


def test_a_longer_tail_only_returns_the_block_rows(
    target: TargetModel, tiny_target_model: LlamaForCausalLM
) -> None:
    """Tail of 3 (e.g. tokens committed at the edge the cloud has not seen) + γ = 2."""
    target.open("s", [7, 7])
    (rows,) = target.score([ScoreRequest("s", [7, 8, 9, 10, 11], num_draft_tokens=2)])
    expected = full_logits(tiny_target_model, [7, 7, 8, 9, 10, 11])[-3:]
    assert rows.shape == (3, TINY_VOCAB) and _max_diff(rows, expected) <= 1e-4


def test_batched_scores_equal_unbatched(tiny_target_model: LlamaForCausalLM) -> None:
    prompts = [[1] * 30, [2, 3], [4, 5, 6, 7, 8, 9]]
    blocks = [[10, 11, 12, 13], [14], [15, 16]]  # γ = 4, 1, 2
    together, alone = (
        TargetModel(session_lm(tiny_target_model)),
        TargetModel(session_lm(tiny_target_model)),
    )
    requests = [
        ScoreRequest(f"s{i}", prompt[-1:] + block, len(block))
        for i, (prompt, block) in enumerate(zip(prompts, blocks, strict=True))
    ]
    for i, prompt in enumerate(prompts):
        together.open(f"s{i}", prompt)
        alone.open(f"s{i}", prompt)
    calls_before = together.forward_calls
    batched = together.score(requests)
    assert together.forward_calls - calls_before == 1  # one target forward per batch
    for request, rows in zip(requests, batched, strict=True):
        (single,) = alone.score([request])
        assert rows.shape == (request.num_draft_tokens + 1, TINY_VOCAB)
        assert _max_diff(torch.softmax(rows, -1), torch.softmax(single, -1)) <= 1e-4
        assert torch.equal(rows.argmax(-1), single.argmax(-1))


def test_commit_drops_rejected_positions(
    target: TargetModel, tiny_target_model: LlamaForCausalLM
) -> None:
    prompt, drafts = [2, 7, 1, 8], [2, 8, 1]
    target.open("s", prompt)
    target.score([ScoreRequest("s", prompt[-1:] + drafts, 3)])
    target.commit("s", len(prompt) + 1)  # accepted x_1; x_2 rejected, recovered 33
    committed = [*prompt, drafts[0], 33]
    (rows,) = target.score([ScoreRequest("s", [*committed[target.length("s") :], 4, 4], 2)])
    expected = full_logits(tiny_target_model, [*committed, 4, 4])[-3:]
    assert _max_diff(rows, expected) <= 1e-4


def test_generate_step_greedy_follows_the_argmax(
    target: TargetModel, tiny_target_model: LlamaForCausalLM
) -> None:
    sequence = [5, 10, 15]
    target.open("s", sequence)
    generator = torch.Generator().manual_seed(0)
    for _ in range(6):
        pending = sequence[target.length("s") :]
        (token,) = target.generate_step([StepRequest("s", pending, GREEDY, generator)])
        assert token == int(full_logits(tiny_target_model, sequence)[-1].argmax())
        sequence.append(token)


def test_batched_steps_sample_like_single_steps(tiny_target_model: LlamaForCausalLM) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    target = TargetModel(session_lm(tiny_target_model))
    for i, prompt in enumerate(prompts):
        target.open(f"s{i}", prompt)
    steps = [
        StepRequest(f"s{i}", p[-1:], params, torch.Generator().manual_seed(i))
        for i, p in enumerate(prompts)
    ]
    tokens = target.generate_step(steps)
    for i, prompt in enumerate(prompts):
        u = float(torch.rand((), generator=torch.Generator().manual_seed(i), dtype=torch.float64))
        probs = transform(full_logits(tiny_target_model, prompt)[-1], params)
        assert tokens[i] == sample(probs, u)


def test_score_needs_a_tail(target: TargetModel) -> None:
    target.open("s", [1, 2])
    with pytest.raises(ValueError):
        target.score([ScoreRequest("s", [3, 4], num_draft_tokens=2)])  # no tail before γ


def test_a_round_feeds_every_prefill_verify_and_decode_position() -> None:
    """What the cloud's forward cost is fitted on: 7 prompt tokens, a tail and 4 drafts,
    then a decode step that also feeds a recovered token."""
    greedy = SamplingParams(temperature=0.0)
    prefills = [PrefillChunk("a", [1] * 7)]
    scores = [ScoreRequest("b", [5, 6, 7, 8, 9], 4)]
    steps = [StepRequest("c", [3, 4], greedy, torch.Generator())]
    assert fed_rows(prefills, scores, steps) == 7 + 5 + 2
    assert fed_rows([], [], []) == 0
    # the keys those rows attend: the prompt's 7 rows after 100 cached positions see
    # 101 .. 107, the block's 5 after 20 see 21 .. 25, the step's 2 after 9 see 10 and 11
    lengths = {"a": 100, "b": 20, "c": 9}
    assert fed_keys(prefills, scores, steps, lengths.__getitem__) == 728 + 115 + 21
    assert attended_keys(0, 1) == 1 and attended_keys(0, 0) == 0
    assert fed_keys([], [], [], lengths.__getitem__) == 0
