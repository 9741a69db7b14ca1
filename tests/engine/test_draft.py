"""DraftModel: proposed blocks are consistent, batched like unbatched, seeded, rolled back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaForCausalLM

from asymspec.sampling import SamplingParams, draft_rows_from_half, transform
from asymspec_engine.draft import (
    COPY_MAX_SUFFIX,
    COPY_MIN_SUFFIX,
    Draft,
    DraftModel,
    DraftRequest,
    confidence,
    copy_candidate,
    mix_copy,
)
from asymspec_engine.loading import session_lm
from loadtest.tiny_llama import TINY_VOCAB
from tests.engine.conftest import full_logits

T1 = SamplingParams(temperature=1.0)
GREEDY = SamplingParams(temperature=0.0)


def _request(
    session_id: str, pending: list[int], gamma: int, params: SamplingParams = T1, seed: int = 0
) -> DraftRequest:
    return DraftRequest(session_id, pending, gamma, params, torch.Generator().manual_seed(seed))


def _propose_one(
    draft: DraftModel, prompt: list[int], gamma: int, params: SamplingParams = T1, seed: int = 0
) -> Draft:
    draft.open("s", prompt)
    return draft.propose([_request("s", prompt[-1:], gamma, params, seed)])[0]


def test_block_shapes_and_q_of_the_drafted_tokens(draft: DraftModel) -> None:
    block = _propose_one(draft, [4, 8, 15], gamma=4)
    assert block.tokens.dtype == np.uint32 and block.tokens.shape == (4,)
    assert block.probs.dtype == np.float32 and block.probs.shape == (4,)
    assert block.rows.dtype == torch.float32 and block.rows.shape == (4, TINY_VOCAB)
    for i, token in enumerate(block.tokens):
        assert block.probs[i] == block.rows[i, int(token)]  # exactly q_i(x_i), bit for bit
        assert block.probs[i] > 0.0
    assert torch.allclose(block.rows.sum(-1), torch.ones(4))


def test_rows_are_the_transformed_draft_distributions(
    draft: DraftModel, tiny_draft_model: LlamaForCausalLM
) -> None:
    """q_i is the transform of the draft's logits after prompt + x_1 .. x_{i-1}."""
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    prompt = [1, 2, 3, 5, 8]
    block = _propose_one(draft, prompt, gamma=3, params=params)
    logits = full_logits(tiny_draft_model, prompt + block.tokens.tolist())  # [n, V]
    expected = transform(logits[len(prompt) - 1 : len(prompt) + 2], params)  # [γ, V]
    assert float((block.rows - expected).abs().max()) <= 1e-4


def test_greedy_drafts_follow_the_argmax_chain(
    draft: DraftModel, tiny_draft_model: LlamaForCausalLM
) -> None:
    prompt = [9, 9, 2]
    block = _propose_one(draft, prompt, gamma=5, params=GREEDY)
    logits = full_logits(tiny_draft_model, prompt + block.tokens.tolist())
    assert block.tokens.tolist() == logits[2:7].argmax(-1).tolist()
    assert block.probs.tolist() == [1.0] * 5


def test_batched_propose_equals_one_at_a_time(tiny_draft_model: LlamaForCausalLM) -> None:
    """Different prefixes, pending counts and γ (rows finish early) in one batch."""
    prompts = [[1, 2, 3, 4, 5, 6, 7], [10], [20, 21, 22]]
    cuts, gammas = [4, 0, 1], [4, 1, 2]  # prefix lengths; the rest of a prompt is pending
    together, alone = (
        DraftModel(session_lm(tiny_draft_model)),
        DraftModel(session_lm(tiny_draft_model)),
    )
    for i, prompt in enumerate(prompts):
        together.lm.open(f"s{i}", prompt[: cuts[i]])
        alone.lm.open(f"s{i}", prompt[: cuts[i]])

    def request(i: int) -> DraftRequest:  # a fresh generator per call: same seed, same u's
        return _request(f"s{i}", prompts[i][cuts[i] :], gammas[i], seed=i)

    calls_before = together.lm.forward_calls
    batched = together.propose([request(i) for i in range(len(prompts))])
    assert together.lm.forward_calls - calls_before == max(gammas)  # one forward per step
    for i in range(len(prompts)):
        (single,) = alone.propose([request(i)])
        assert batched[i].tokens.tolist() == single.tokens.tolist()
        assert float((batched[i].rows - single.rows).abs().max()) <= 1e-4
        assert together.length(f"s{i}") == len(prompts[i]) + gammas[i] - 1


def test_same_seed_same_block_other_seed_other_block(tiny_draft_model: LlamaForCausalLM) -> None:
    blocks = []
    for seed in (7, 7, 8):
        model = DraftModel(session_lm(tiny_draft_model))
        blocks.append(_propose_one(model, [3, 3, 3], gamma=8, seed=seed))
    assert blocks[0].tokens.tolist() == blocks[1].tokens.tolist()
    assert np.array_equal(blocks[0].probs, blocks[1].probs)
    assert blocks[0].tokens.tolist() != blocks[2].tokens.tolist()


def test_rollback_then_propose_equals_a_fresh_draft(tiny_draft_model: LlamaForCausalLM) -> None:
    """After a verdict the draft keeps the confirmed prefix and continues from it."""
    draft = DraftModel(session_lm(tiny_draft_model))
    prompt = [5, 6, 7, 8]
    first = _propose_one(draft, prompt, gamma=4, params=GREEDY)
    # Verdict: 2 accepted, then a recovered token 42.
    committed = prompt + first.tokens[:2].tolist() + [42]
    draft.rollback("s", len(prompt) + 2)
    assert draft.length("s") == len(prompt) + 2
    pending = committed[draft.length("s") :]
    again = draft.propose([_request("s", pending, 3, GREEDY)])[0]
    fresh = DraftModel(session_lm(tiny_draft_model))
    expected = _propose_one(fresh, committed, gamma=3, params=GREEDY)
    assert again.tokens.tolist() == expected.tokens.tolist()
    assert float((again.rows - expected.rows).abs().max()) <= 1e-4


def test_a_rollback_riding_the_propose_equals_one_before_it(
    tiny_draft_model: LlamaForCausalLM,
) -> None:
    """``rollback_to`` drops the rejected drafts inside the propose, per request: the same
    block as a separate rollback call first, for a batch where one request rolls back and
    one keeps its cache."""
    prompt = [5, 6, 7, 8]
    riding, separate = (DraftModel(session_lm(tiny_draft_model)) for _ in range(2))
    for model in (riding, separate):
        first = _propose_one(model, prompt, gamma=4, params=GREEDY)
        model.open("t", [3, 1, 4])
    committed = prompt + first.tokens[:1].tolist() + [42]  # 1 accepted, then recovered
    kept = len(prompt) + 1

    def requests(rollback_to: int | None) -> list[DraftRequest]:
        rolled = DraftRequest(
            "s", committed[kept:], 3, GREEDY, torch.Generator(), rollback_to=rollback_to
        )
        return [rolled, _request("t", [4], 2, GREEDY)]

    separate.rollback("s", kept)
    expected = separate.propose(requests(None))
    got = riding.propose(requests(kept))
    for g, e in zip(got, expected, strict=True):
        assert g.tokens.tolist() == e.tokens.tolist()
        assert float((g.rows - e.rows).abs().max()) <= 1e-4
    assert riding.length("s") == separate.length("s") == len(committed) + 3 - 1
    assert riding.length("t") == separate.length("t") == 2 + 1 + 1  # prefill, pending, x_1


def test_rollback_past_the_cache_keeps_it(draft: DraftModel) -> None:
    """All γ accepted: the confirmed prefix is longer than the cache (x_γ never fed)."""
    _propose_one(draft, [1, 2], gamma=3)
    assert draft.length("s") == 1 + 1 + 2  # prefill, pending, x_1 .. x_{γ-1}
    draft.rollback("s", 2 + 3)
    assert draft.length("s") == 4


def test_full_upload_drafts_sample_from_the_float16_rows(draft: DraftModel) -> None:
    """With quantize_half, q is the float16 row the cloud reconstructs, on both sides."""
    draft.open("a", [1, 2, 3])
    draft.open("b", [4, 5])
    half_request = DraftRequest("a", [3], 3, T1, torch.Generator().manual_seed(0), True)
    exact, half = draft.propose([_request("b", [5], 2), half_request])
    assert exact.half_rows is None
    assert half.half_rows is not None and half.half_rows.dtype == np.float16
    assert half.half_rows.shape == (3, TINY_VOCAB)
    assert np.array_equal(half.rows.numpy(), draft_rows_from_half(half.half_rows))
    for i, token in enumerate(half.tokens):
        assert half.probs[i] == half.rows[i, int(token)] > 0.0


@pytest.mark.parametrize(("pending", "gamma"), [([1], 0), ([], 2)])
def test_invalid_requests_are_refused(draft: DraftModel, pending: list[int], gamma: int) -> None:
    draft.open("s", [1, 2])
    with pytest.raises(ValueError):
        draft.propose([_request("s", pending, gamma)])


def test_open_needs_a_prompt(draft: DraftModel) -> None:
    with pytest.raises(ValueError):
        draft.open("s", [])


# ---------------------------------------------------------------- copying from the context


@pytest.mark.parametrize(
    ("context", "expected"),
    [
        ([5, 6, 7, 1, 5, 6], 7),  # "5 6" seen before, then 7
        ([1, 2, 3, 9, 2, 3, 8, 1, 2, 3], 9),  # the trigram "1 2 3" wins over the bigram "2 3"
        ([2, 3, 4, 2, 3, 5, 2, 3], 5),  # the latest earlier occurrence of "2 3"
        ([1, 2, 3, 4, 5, 9, 3, 4, 5, 8, 1, 2, 3, 4, 5], 9),  # the 5-gram over a later 3-gram
        # n stops at 8: the 9-gram "0 11..18" (then 1) loses to the latest 8-gram (then 2)
        ([0, *range(11, 19), 1, 7, *range(11, 19), 2, 0, *range(11, 19)], 2),
        ([1, 2, 3, 4], None),  # no suffix repeats
        ([7, 7], None),  # too short for a bigram before the suffix
        ([7, 7, 7], 7),  # overlapping occurrence: "7 7" at 0, followed by 7
    ],
)
def test_copy_candidate_hand_cases(context: list[int], expected: int | None) -> None:
    assert copy_candidate(np.asarray(context, dtype=np.int64)) == expected


def _copy_by_definition(context: list[int]) -> int | None:
    """Longest n first; the latest start s < L - n whose n tokens equal the suffix's."""
    length = len(context)
    for n in range(COPY_MAX_SUFFIX, COPY_MIN_SUFFIX - 1, -1):
        starts = [s for s in range(length - n) if context[s : s + n] == context[length - n :]]
        if starts:
            return context[starts[-1] + n]
    return None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=40))  # few symbols: many repeats
def test_copy_candidate_matches_its_definition(context: list[int]) -> None:
    assert copy_candidate(np.asarray(context, dtype=np.int64)) == _copy_by_definition(context)


def test_mix_copy_moves_mass_and_keeps_a_distribution() -> None:
    q = torch.tensor([0.5, 0.3, 0.2, 0.0])
    mixed = mix_copy(q, copy=3, weight=0.6, greedy=False)
    assert torch.allclose(mixed, torch.tensor([0.2, 0.12, 0.08, 0.6]))
    assert float(mixed.sum()) == pytest.approx(1.0)
    one_hot = torch.tensor([1.0, 0.0, 0.0, 0.0])  # a greedy q
    assert mix_copy(one_hot, copy=2, weight=0.6, greedy=True).tolist() == [0, 0, 1, 0]
    assert mix_copy(one_hot, copy=2, weight=0.4, greedy=True).tolist() == [1, 0, 0, 0]


def test_copy_weight_drafts_the_copy_and_reports_the_mixed_q(
    tiny_draft_model: LlamaForCausalLM,
) -> None:
    draft = DraftModel(session_lm(tiny_draft_model), copy_weight=0.8)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4]  # "1 4" and "3 1 4" were followed by 1
    greedy = _propose_one(draft, prompt, gamma=3, params=GREEDY)
    assert greedy.tokens.tolist() == [1, 5, 9]  # then "4 1" -> 5, "1 5" -> 9: copying on
    assert (
        greedy.rows[0].tolist() == torch.nn.functional.one_hot(torch.tensor(1), TINY_VOCAB).tolist()
    )
    sampled = DraftModel(session_lm(tiny_draft_model), copy_weight=0.8)
    block = _propose_one(sampled, prompt, gamma=1, params=T1)
    assert float(block.rows[0, 1]) >= 0.8  # λ on the copy, plus the model's own mass
    assert float(block.rows[0].sum()) == pytest.approx(1.0, abs=1e-5)
    assert block.probs[0] == block.rows[0, int(block.tokens[0])]
    with pytest.raises(ValueError, match="copy_weight"):
        DraftModel(session_lm(tiny_draft_model), copy_weight=1.0)


def test_a_restricted_head_drafts_only_its_tokens(tiny_draft_model: LlamaForCausalLM) -> None:
    """q is 0 outside the head's tokens, and the rows are still distributions whose drafted
    tokens carry exactly q_i(x_i)."""
    lm = session_lm(tiny_draft_model)
    kept = list(range(0, TINY_VOCAB, 3))
    lm.restrict_head(kept)
    draft = DraftModel(lm)
    block = _propose_one(draft, [3, 6, 9, 12], gamma=6, seed=4)
    outside = [t for t in range(TINY_VOCAB) if t not in set(kept)]
    assert set(block.tokens.tolist()) <= set(kept)
    assert bool(block.rows[:, outside].eq(0).all())
    assert torch.allclose(block.rows.sum(-1), torch.ones(6))
    for i, token in enumerate(block.tokens):
        assert block.probs[i] == block.rows[i, int(token)] > 0.0


class _WholeVocabularyDraft(DraftModel):
    """The same draft with every row finished and drawn over the whole vocabulary."""

    def restricted_head(self) -> None:
        return None


def test_a_restricted_head_drafts_on_its_columns_exactly_as_on_the_whole_vocabulary(
    tiny_draft_model: LlamaForCausalLM,
) -> None:
    """With a restricted head, rows are mixed and drawn on the head's K columns unless their
    copy lies off the head or they go on the wire as float16. Every block equals the
    whole-vocabulary path's: the same tokens, float16 rows and stopping points, and q to
    float32 rounding (the softmax sums K columns instead of V; exact on this tiny model)."""
    kept = list(range(0, TINY_VOCAB, 3))
    drafts = []
    for cls in (DraftModel, _WholeVocabularyDraft):
        lm = session_lm(tiny_draft_model)
        lm.restrict_head(kept)
        drafts.append(cls(lm, copy_weight=0.7, stop_confidence=0.05))
    on_columns, whole = drafts
    assert on_columns.restricted_head() is not None and whole.restricted_head() is None
    prompts = {
        "copies-off-head": [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4],  # "1 4" was followed by 1
        "copies-on-head": [6, 9, 12, 30, 6, 9],  # "6 9" was followed by 12
        "greedy": [6, 9, 12, 30, 6, 9, 12],
        "no-copy": [5, 7, 11, 13],
        "float16": [2, 4, 8, 2, 4],
    }
    params = {"greedy": GREEDY, "no-copy": T1}
    for seed in range(12):
        blocks = []
        for draft in drafts:
            requests: list[DraftRequest] = []
            for name, prompt in prompts.items():
                draft.open(name, prompt)
                generator = torch.Generator().manual_seed(seed * 10 + len(requests))
                sampling = params.get(name, SamplingParams(temperature=0.7))
                requests.append(
                    DraftRequest(name, prompt[-1:], 5, sampling, generator, name == "float16")
                )
            blocks.append(draft.propose(requests))
            for name in prompts:
                draft.close(name)
        for got, want in zip(*blocks, strict=True):
            assert got.tokens.tolist() == want.tokens.tolist()
            torch.testing.assert_close(got.rows, want.rows, rtol=0.0, atol=1e-6)
            assert np.array_equal(got.probs, got.rows[range(len(got.tokens)), got.tokens])
            assert (got.half_rows is None) == (want.half_rows is None)
            if got.half_rows is not None:
                assert np.array_equal(got.half_rows, want.half_rows)
    copied_off_head = blocks[0][0]
    assert 1 in copied_off_head.tokens.tolist()  # the copy off the head was drafted


def test_confidence_hand_cases() -> None:
    """softmax([0, ln 3]) = [1/4, 3/4]; a copy takes λ of the mass."""
    logits = torch.tensor([[0.0, float(np.log(3.0))]] * 3)
    got = confidence(logits, [1, 1, 1], [None, 1, 0], weight=0.5)
    assert torch.allclose(got, torch.tensor([0.75, 0.5 * 0.75 + 0.5, 0.5 * 0.75]))
    restricted = torch.tensor([[0.0, float("-inf")]])  # a restricted head's -inf columns
    assert confidence(restricted, [0], [None], weight=0.9).tolist() == [1.0]
    # the head's columns only (tokens 1 and 3 of 4): token 2 is off the head, model mass 0
    columns = torch.tensor([-1, 0, -1, 1])
    on_head = torch.tensor([[0.0, float(np.log(3.0))]] * 3)
    got = confidence(on_head, [3, 1, 2], [None, None, 2], weight=0.5, columns=columns)
    assert torch.allclose(got, torch.tensor([0.75, 0.25, 0.5]))


def test_a_block_ends_after_its_first_unsure_token(tiny_draft_model: LlamaForCausalLM) -> None:
    """With τ, a block is cut right after the first token whose confidence is below τ, and
    it is otherwise the same block (same tokens, rows and cache) as without τ."""
    prompt, gamma = [4, 8, 15, 16], 6
    full = _propose_one(DraftModel(session_lm(tiny_draft_model)), prompt, gamma, seed=3)
    sure = full.probs.tolist()  # at T = 1 without a copier, q itself is the confidence
    low, above = sorted(set(sure[:-1]))[:2]
    tau = (low + above) / 2  # only the least sure of the first γ - 1 tokens is below it
    cut = sure.index(low) + 1
    assert cut < gamma
    short_draft = DraftModel(session_lm(tiny_draft_model), stop_confidence=tau)
    short = _propose_one(short_draft, prompt, gamma, seed=3)
    assert short.tokens.tolist() == full.tokens[:cut].tolist()
    assert torch.equal(short.rows, full.rows[:cut])
    assert short_draft.length("s") == len(prompt) + cut - 1  # x_cut is sampled, never fed
    with pytest.raises(ValueError, match="stop_confidence"):
        DraftModel(session_lm(tiny_draft_model), stop_confidence=1.0)
