"""The history-reading part of the sampling transform, by hand: penalties, the grammar mask,
rows over a block's drafts, the end-of-text token, and the wire's carrying of it all."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asymspec.constraint import Constraint, ConstraintBuilder
from asymspec.grammar import GrammarCompiler, GrammarError, from_choice, from_json_schema
from asymspec.sampling import transform
from asymspec.sampling_params import NO_PENALTIES, Penalties, SamplingParams
from asymspec.wire import OpenSession, SamplingConfig, decode, encode
from loadtest.tiny_models import build_tokenizer

V = 6
GREEDY = SamplingParams(temperature=0.0)


def test_penalties_by_hand() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 1.0, 0.0, -2.0])
    penalties = Penalties(repetition=2.0, presence=0.5, frequency=0.25)
    constraint = Constraint(SamplingParams(), penalties, None, prompt_ids=[1], vocab_size=V)
    constraint.commit([0, 0, 3])  # output: token 0 twice, token 3 once
    row = constraint.rows(logits[None], [])[0]
    expected = torch.tensor(
        [
            2.0 / 2 - 0.5 - 2 * 0.25,  # seen in the output: positive logit divided, then both
            -1.0 * 2,  # seen in the prompt only: repetition, no presence or frequency
            0.5,
            1.0 / 2 - 0.5 - 0.25,
            0.0,  # unseen
            -2.0,
        ]
    )
    assert torch.allclose(row, torch.softmax(expected, dim=-1), atol=1e-6)


def test_a_row_reads_the_drafts_before_it() -> None:
    logits = torch.zeros(3, V)
    constraint = Constraint(SamplingParams(), Penalties(presence=2.0), None, [], V)
    rows = constraint.rows(logits, [4, 5])
    assert rows[0, 4] == rows[0, 5]  # nothing drafted yet
    assert rows[1, 4] < rows[1, 5]  # after draft 4
    assert rows[2, 4] == rows[2, 5] < rows[2, 0]  # after 4 and 5
    assert torch.equal(constraint.output_counts, torch.zeros(V))  # drafts are not committed


def test_min_p_and_logit_bias() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04, 0.0]) + 1e-30)
    row = transform(logits, SamplingParams(min_p=0.15))  # drops what is below 0.075
    assert torch.allclose(row, torch.tensor([0.5, 0.3, 0.1, 0, 0, 0]) / 0.9)
    assert int(transform(logits, SamplingParams(0.0, logit_bias=((4, 100.0),))).argmax()) == 4
    assert torch.equal(transform(logits, SamplingParams(1.8, min_p=1.0)), transform(logits, GREEDY))


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tokenizer = build_tokenizer()
    return GrammarCompiler(tokenizer, len(tokenizer) + 4)  # a model that pads its vocabulary


def test_the_grammar_masks_every_row_of_a_block(compiler: GrammarCompiler) -> None:
    tokenizer = build_tokenizer()
    yes, no = (tokenizer.encode(word) for word in ("yes", "no"))
    constraint = Constraint(
        SamplingParams(),
        NO_PENALTIES,
        compiler.matcher(from_choice(["yes", "no"])),
        [],
        compiler.vocab_size,
    )
    logits = torch.zeros(len(yes) + 1, compiler.vocab_size)
    rows = constraint.rows(logits, yes)
    assert set(rows[0].nonzero().flatten().tolist()) >= {yes[0], no[0]}
    assert rows[0, tokenizer.eos_token_id] == 0.0 and rows[0, -1] == 0.0  # padded ids: never
    assert rows[-1].nonzero().flatten().tolist() == [tokenizer.eos_token_id]  # complete
    # a draft the grammar refuses: its row gives it p = 0, and the rows after repeat it
    bad = tokenizer.encode("x")[0]
    rows = constraint.rows(torch.zeros(3, compiler.vocab_size), [bad, bad])
    assert rows[0, bad] == 0.0 and torch.equal(rows[1], rows[0]) and torch.equal(rows[2], rows[0])
    constraint.commit([*yes, tokenizer.eos_token_id])  # the end, after the complete text
    with pytest.raises(GrammarError):
        constraint.commit(no)


def test_rows_after_the_end_of_text_roll_back_exactly(compiler: GrammarCompiler) -> None:
    """A block that ends the text (its last draft the end-of-text token) is rolled back
    after its rows are computed: the end can be committed afterwards (llguidance alone
    loses the accepting state when rolled back over it)."""
    tokenizer = build_tokenizer()
    eos = tokenizer.eos_token_id
    schema = {"type": "object", "properties": {"a": {"enum": [1]}}, "required": ["a"]}
    matcher = compiler.matcher(from_json_schema(schema))
    constraint = Constraint(SamplingParams(), NO_PENALTIES, matcher, [], compiler.vocab_size)
    text = tokenizer.encode('{"a":1}')
    constraint.commit(text[:-1])
    for _ in range(2):  # computed twice: the same rows
        rows = constraint.rows(torch.zeros(3, compiler.vocab_size), [text[-1], eos])
        assert rows[0, text[-1]] > 0 and rows[0, eos] == 0
        assert rows[1].nonzero().flatten().tolist() == [eos] == rows[2].nonzero().flatten().tolist()
    constraint.commit([text[-1], eos])
    assert matcher.done


def test_a_draft_row_with_no_mass_on_the_allowed_tokens_becomes_uniform_on_them(
    compiler: GrammarCompiler,
) -> None:
    tokenizer = build_tokenizer()
    matcher = compiler.matcher(from_choice(["yes", "no"]))
    constraint = Constraint(SamplingParams(), NO_PENALTIES, matcher, [], compiler.vocab_size)
    own = torch.zeros(compiler.vocab_size)
    own[tokenizer.encode("x")[0]] = 1.0  # the draft put all its mass on a refused token
    row = constraint.next_row(torch.log(own), [])
    allowed = matcher.allowed()
    assert torch.allclose(row[allowed], torch.full_like(row[allowed], 1 / int(allowed.sum())))
    assert math.isclose(float(row.sum()), 1.0, rel_tol=1e-6)


def test_a_session_opened_mid_request_starts_where_its_output_left_off() -> None:
    """A session reopened on another replica gets prompt + output as its tokens; the config's
    prompt_len tells the constraint which of them are output (penalties count only those)."""
    config = SamplingConfig(SamplingParams(), 0, Penalties(presence=1.0), prompt_len=2)
    reopened = ConstraintBuilder(None, V).build(config, [1, 2, 3, 3])
    fresh = ConstraintBuilder(None, V).build(config, [1, 2])
    assert reopened is not None and fresh is not None
    fresh.commit([3, 3])
    assert torch.equal(reopened.output_counts, fresh.output_counts)
    assert reopened.output_counts[1] == 0 and reopened.output_counts[3] == 2


def test_bad_grammars_are_refused(compiler: GrammarCompiler) -> None:
    with pytest.raises(GrammarError):
        compiler.check(from_json_schema({"type": "bogus"}))
    with pytest.raises(GrammarError):  # no tokenizer on this side: no grammar
        ConstraintBuilder(None, V).build(
            SamplingConfig(GREEDY, 0, grammar='start: "a"', prompt_len=1), [1]
        )
    assert ConstraintBuilder(None, V).build(SamplingConfig(GREEDY, 0), [1]) is None


def test_the_transform_travels_once_per_session_and_whole() -> None:
    config = SamplingConfig(
        SamplingParams(0.7, 5, 0.9, min_p=0.05, logit_bias=((2, -3.5), (9, 1.25))),
        seed=7,
        penalties=Penalties(1.1, -0.5, 0.75),
        grammar=from_choice(["a", "b"]),
    )
    message = OpenSession(1, np.array([1, 2], dtype=np.uint32), config)
    decoded = decode(encode(message))
    assert isinstance(decoded, OpenSession) and decoded.sampling == config
