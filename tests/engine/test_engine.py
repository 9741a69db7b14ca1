"""Both engines (CachedLM, LlamaEngine): cached, batched and rolled-back forwards equal
recomputing from scratch."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import (
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
)

from asymspec_engine import embedded
from asymspec_engine.embedded import EMBEDDED_DRAFT, ModelNotPrepared
from asymspec_engine.engine import CachedLM, SessionLM
from asymspec_engine.hardware import (
    Precision,
    pick_device,
    resolve_dtype,
    resolve_precision,
)
from asymspec_engine.llama import (
    _CAPACITY_QUANTUM,
    _TORCH_KEY_QUANTUM,
    LlamaEngine,
)
from asymspec_engine.loading import load_causal_lm, session_lm
from loadtest.tiny_llama import TINY_VOCAB, build_tiny_llama
from tests.engine.conftest import full_logits

Engine = type[CachedLM] | type[LlamaEngine]

TOLERANCE = 1e-4  # max abs difference, logits or probabilities


def _tokens(seed: int, n: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY_VOCAB, (n,), generator=generator).tolist()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


# ---------------------------------------------------------------- one session


def test_open_returns_the_last_row_of_the_prefill(
    target_lm: SessionLM, tiny_target_model: LlamaForCausalLM
) -> None:
    prompt = _tokens(0, 12)
    last_row = target_lm.open("s", prompt)  # [V]
    assert last_row is not None and last_row.shape == (TINY_VOCAB,)
    assert _max_diff(last_row, full_logits(tiny_target_model, prompt)[-1]) <= TOLERANCE
    assert target_lm.length("s") == 12 and target_lm.token_ids("s") == prompt


def test_incremental_logits_equal_full_recompute(
    target_lm: SessionLM, tiny_target_model: LlamaForCausalLM
) -> None:
    sequence = _tokens(1, 150)  # long enough to regrow the buffers (64-position quanta)
    target_lm.open("s", sequence[:10])
    start = 10
    for chunk in (1, 5, 1, 70, 3, 60):  # [n_new] per round, single and multi-token
        new = sequence[start : start + chunk]
        (logits,) = target_lm.forward_new([("s", new)])  # [chunk, V]
        expected = full_logits(tiny_target_model, sequence[: start + chunk])[start:]
        assert logits.shape == (chunk, TINY_VOCAB)
        assert _max_diff(logits, expected) <= TOLERANCE
        start += chunk
    assert target_lm.length("s") == start


def test_cpu_attention_matches_stock_sdpa_under_masks() -> None:
    """CachedLM swaps in SDPA with grouped-query attention inside the kernel on CPU; the
    rows it computes (masked: cached prefixes, padded batches) equal stock SDPA's."""
    model = build_tiny_llama(seed=3)
    assert model.config._attn_implementation == "sdpa"
    sequences = [_tokens(10 + i, n) for i, n in enumerate((40, 75, 9))]
    expected = [full_logits(model, seq) for seq in sequences]  # stock SDPA, no cache
    lm = CachedLM(model)
    assert model.config._attn_implementation != "sdpa"
    for i, seq in enumerate(sequences):
        lm.open(f"s{i}", seq[:-5])
    rows = lm.forward_new([(f"s{i}", seq[-5:]) for i, seq in enumerate(sequences)])
    for got, want in zip(rows, expected, strict=True):
        assert _max_diff(got, want[-5:]) <= TOLERANCE
    (single,) = lm.forward_new([("s0", _tokens(99, 3))])  # the unpadded path, masked
    assert single.shape == (3, TINY_VOCAB)


def test_empty_open_then_forward(target_lm: SessionLM, tiny_target_model: LlamaForCausalLM) -> None:
    assert target_lm.open("s", []) is None
    assert target_lm.length("s") == 0
    (logits,) = target_lm.forward_new([("s", [5, 6, 7])])
    assert _max_diff(logits, full_logits(tiny_target_model, [5, 6, 7])) <= TOLERANCE


def test_batch_of_one_appends_in_place(tiny_target_model: LlamaForCausalLM) -> None:
    """The fast path writes into the session's buffer: the prefix is neither copied nor
    recomputed while the buffer has room (a white-box check of the engine's promise)."""
    target_lm = CachedLM(tiny_target_model)
    target_lm.open("s", _tokens(2, 10))
    buffer_before = target_lm._session("s").keys[0]
    assert buffer_before is not None
    for token in _tokens(3, 20):
        target_lm.forward_new([("s", [token])])
    buffer_after = target_lm._session("s").keys[0]
    assert buffer_after is not None and buffer_after.data_ptr() == buffer_before.data_ptr()


# ---------------------------------------------------------------- batching


def _open_ragged(lm: SessionLM, prefixes: list[list[int]]) -> None:
    for i, prefix in enumerate(prefixes):
        lm.open(f"s{i}", prefix)


def test_batched_forward_equals_unbatched(
    tiny_target_model: LlamaForCausalLM, engine_cls: Engine
) -> None:
    prefixes = [_tokens(10, 3), _tokens(11, 40), [], _tokens(12, 17)]  # L_b differ, one empty
    new_tokens = [_tokens(20, 5), _tokens(21, 1), _tokens(22, 3), _tokens(23, 2)]  # n_b differ
    batched, alone = engine_cls(tiny_target_model), engine_cls(tiny_target_model)
    _open_ragged(batched, prefixes)
    _open_ragged(alone, prefixes)
    together = batched.forward_new([(f"s{i}", new) for i, new in enumerate(new_tokens)])
    for i, new in enumerate(new_tokens):
        (single,) = alone.forward_new([(f"s{i}", new)])
        assert together[i].shape == (len(new), TINY_VOCAB)
        probs, single_probs = torch.softmax(together[i], -1), torch.softmax(single, -1)
        assert _max_diff(probs, single_probs) <= TOLERANCE
        assert torch.equal(together[i].argmax(-1), single.argmax(-1))
    assert batched.forward_calls == len(prefixes) - 1 + 1  # 3 prefills (one empty) + 1 batch


def test_batched_rounds_keep_every_cache_right(
    tiny_target_model: LlamaForCausalLM, engine_cls: Engine
) -> None:
    """After a batched forward each session's own cache holds exactly its new K/V."""
    lm = engine_cls(tiny_target_model)
    sequences = [_tokens(30, 30), _tokens(31, 30), _tokens(32, 30)]
    cut = [4, 19, 9]  # prefix lengths
    for i, sequence in enumerate(sequences):
        lm.open(f"s{i}", sequence[: cut[i]])
    for step in ((2, 1, 4), (1, 3, 1), (5, 2, 2)):  # new-token counts per session per round
        batch = [(f"s{i}", sequences[i][cut[i] : cut[i] + n]) for i, n in enumerate(step)]
        outputs = lm.forward_new(batch)
        for i, n in enumerate(step):
            expected = full_logits(tiny_target_model, sequences[i][: cut[i] + n])[cut[i] :]
            assert _max_diff(outputs[i], expected) <= TOLERANCE
            cut[i] += n


# ---------------------------------------------------------------- rollback


def test_truncate_then_continue_equals_recompute(
    target_lm: SessionLM, tiny_target_model: LlamaForCausalLM
) -> None:
    prompt, rejected, replacement = _tokens(40, 20), _tokens(41, 5), _tokens(42, 3)
    target_lm.open("s", prompt)
    target_lm.open("other", prompt[:7])
    target_lm.forward_new([("s", rejected), ("other", [1])])  # batched, then rolled back
    target_lm.truncate("s", 22)  # keeps 2 of the 5
    assert target_lm.token_ids("s") == prompt + rejected[:2]
    (logits,) = target_lm.forward_new([("s", replacement)])
    expected = full_logits(tiny_target_model, prompt + rejected[:2] + replacement)[22:]
    assert _max_diff(logits, expected) <= TOLERANCE


def test_truncate_to_zero_restarts_the_session(
    target_lm: SessionLM, tiny_target_model: LlamaForCausalLM
) -> None:
    target_lm.open("s", _tokens(43, 9))
    target_lm.truncate("s", 0)
    (logits,) = target_lm.forward_new([("s", [3, 1, 4])])
    assert _max_diff(logits, full_logits(tiny_target_model, [3, 1, 4])) <= TOLERANCE


# ---------------------------------------------------------------- bookkeeping and errors


def test_sessions_count_and_idempotent_close(target_lm: SessionLM) -> None:
    target_lm.open("a", [1])
    target_lm.open("b", [2, 3])
    assert target_lm.sessions() == 2
    target_lm.close("a")
    target_lm.close("a")  # a retried close is harmless
    assert target_lm.sessions() == 1


@pytest.mark.parametrize(
    ("batch", "error"),
    [
        ([("missing", [1])], KeyError),  # unknown session
        ([("a", [1]), ("a", [2])], ValueError),  # one session twice in a batch
        ([("a", [])], ValueError),  # nothing to forward
    ],
)
def test_bad_batches_fail_before_touching_state(
    target_lm: SessionLM, batch: list[tuple[str, list[int]]], error: type[Exception]
) -> None:
    target_lm.open("a", [1, 2])
    with pytest.raises(error):
        target_lm.forward_new(batch)
    assert target_lm.length("a") == 2 and target_lm.forward_calls == 1


def test_truncate_cannot_grow_and_open_cannot_reopen(target_lm: SessionLM) -> None:
    target_lm.open("a", [1, 2])
    with pytest.raises(ValueError):
        target_lm.truncate("a", 3)
    with pytest.raises(KeyError):
        target_lm.open("a", [1])


def test_a_failed_prefill_leaves_no_session(target_lm: SessionLM) -> None:
    with pytest.raises(IndexError):  # a token id outside the vocabulary
        target_lm.open("s", [1, TINY_VOCAB + 5])
    assert target_lm.sessions() == 0
    target_lm.open("s", [1, 2])  # the id is free again


def _sliding_window_mistral() -> MistralForCausalLM:
    config = MistralConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=16,
        max_position_embeddings=64,
    )
    return MistralForCausalLM(config)


def test_sliding_window_models_are_refused() -> None:
    with pytest.raises(ValueError, match="full-attention"):
        CachedLM(_sliding_window_mistral())
    with pytest.raises(ValueError, match="sliding-window"):
        LlamaEngine(_sliding_window_mistral())


# ---------------------------------------------------------------- loading


def _save_checkpoint(folder: Path) -> LlamaForCausalLM:
    """A tiny Llama and a word-level tokenizer over its vocabulary, saved like any checkpoint."""
    model = build_tiny_llama(seed=5, hidden_size=32)
    model.save_pretrained(folder)
    words = WordLevel(
        {f"w{i}": i for i in range(TINY_VOCAB - 1)} | {"<unk>": TINY_VOCAB - 1}, "<unk>"
    )
    backend = Tokenizer(words)
    backend.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(folder)
    return model


def test_load_causal_lm_from_a_local_folder(tmp_path: Path) -> None:
    saved = _save_checkpoint(tmp_path)
    default, _ = load_causal_lm(str(tmp_path), device="cpu")
    assert not default.training and default.dtype == resolve_dtype("auto", "cpu")
    model, tokenizer = load_causal_lm(str(tmp_path), device="cpu", dtype=torch.float32)
    ids = tokenizer("w1 w5 w7")["input_ids"]
    assert ids == [1, 5, 7]
    assert _max_diff(full_logits(model, ids), full_logits(saved, ids)) <= TOLERANCE


def test_embedded_names_resolve_in_the_model_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYMSPEC_MODEL_CACHE", str(tmp_path))
    with pytest.raises(ModelNotPrepared, match="make models"):
        load_causal_lm(EMBEDDED_DRAFT, device="cpu")
    _save_checkpoint(tmp_path / "smollm2-draft")
    model, _ = load_causal_lm(EMBEDDED_DRAFT, device="cpu")
    assert model.config.vocab_size == TINY_VOCAB


def test_an_uncommitted_feature_draft_names_its_training_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYMSPEC_MODEL_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded, "COMMITTED_FEATURE_DRAFT_DIR", tmp_path / "not-committed")
    with pytest.raises(ModelNotPrepared, match=r"train_feature_draft\.py"):
        load_causal_lm(embedded.EMBEDDED_FEATURE_DRAFT, device="cpu")


def test_hub_ids_stay_offline_unless_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYMSPEC_ALLOW_DOWNLOAD", raising=False)
    with pytest.raises(OSError):  # not in the local HF cache, and no download attempted
        load_causal_lm("asymspec-test/does-not-exist", device="cpu")


def test_device_and_dtype_defaults() -> None:
    assert pick_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", "cpu") == torch.float32  # the torch engine's exact mode
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("float32", "cuda") == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float16", "cpu")


def test_precision_defaults_per_device() -> None:
    """auto: bf16 on CUDA, float32 (the exact mode) on every CPU, whatever it supports."""
    assert resolve_precision("auto", "cpu") == Precision(torch.float32)
    assert resolve_precision("bfloat16", "cpu") == Precision(torch.bfloat16)
    assert resolve_precision("auto", "cuda") == Precision(torch.bfloat16)
    with pytest.raises(ValueError, match="float16-weights"):
        resolve_precision("float16-weights", "cpu")


# ---------------------------------------------------------------- LlamaEngine specifics


def test_session_lm_picks_the_llama_engine_for_llamas() -> None:
    assert isinstance(session_lm(build_tiny_llama(seed=6)), LlamaEngine)


def test_kv_slot_is_written_in_place_and_rollback_moves_a_length(
    tiny_target_model: LlamaForCausalLM,
) -> None:
    lm = LlamaEngine(tiny_target_model)
    lm.open("s", _tokens(2, 10))
    slot = lm._session("s").kv
    assert slot is not None
    for token in _tokens(3, 20):
        lm.forward_new([("s", [token])])
    lm.truncate("s", 12)
    lm.forward_new([("s", [1, 2])])
    after = lm._session("s").kv
    assert after is not None and after.data_ptr() == slot.data_ptr()  # no copy, no regrowth


def test_torch_attention_over_padded_keys_equals_the_exact_length(
    tiny_target_model: LlamaForCausalLM,
) -> None:
    """Where torch's flash attention compiles a kernel per shape, the engine pads the keys
    it reads to a multiple of _TORCH_KEY_QUANTUM and masks the padding out: the rows are
    those of the exact keys (float32 here, padding forced on), for one-token steps, blocks
    and prompt chunks alike, and a session's key lengths come from a small set."""
    exact = LlamaEngine(tiny_target_model)
    padded = LlamaEngine(tiny_target_model)
    exact.pads_torch_keys, padded.pads_torch_keys = False, True
    sequences = [_tokens(70 + i, n) for i, n in enumerate((45, 90, 106, 171))]
    for news in (1, 5, 40):
        for lm in (exact, padded):
            for i, seq in enumerate(sequences):
                lm.open(f"s{i}-{news}", seq[: len(seq) - news])
        batch = [(f"s{i}-{news}", seq[len(seq) - news :]) for i, seq in enumerate(sequences)]
        want = exact.forward_new(batch)
        got = padded.forward_new(batch)
        for g, w, seq in zip(got, want, sequences, strict=True):
            assert _max_diff(g, w) <= TOLERANCE
            assert _max_diff(g, full_logits(tiny_target_model, seq)[-news:]) <= TOLERANCE
    assert _CAPACITY_QUANTUM % _TORCH_KEY_QUANTUM == 0  # a slot holds its padded keys
    lengths = {padded._torch_keys(total) for total in range(1, 1025)}
    assert lengths == set(range(_TORCH_KEY_QUANTUM, 1025, _TORCH_KEY_QUANTUM))
    assert all(padded._torch_keys(t) - _TORCH_KEY_QUANTUM < t for t in range(1, 1025))
    assert exact._torch_keys(37) == 37


def test_a_grown_kv_slot_holds_zeros_past_its_sessions_positions(
    tiny_target_model: LlamaForCausalLM,
) -> None:
    """Padded keys and values must weigh nothing: a slot's unwritten positions are zeros,
    never what the memory held before."""
    lm = LlamaEngine(tiny_target_model)
    lm.open("s", _tokens(4, 200))
    lm.forward_new([("s", _tokens(5, 100))])  # grows the slot past its first 256 positions
    slot = lm._session("s").kv
    assert slot is not None and slot.shape[3] > 300
    assert bool((slot[:, :, :, 300:] == 0).all())
    assert bool(slot[:, :, :, :300].ne(0).any())


def test_keep_rows_returns_only_the_trailing_rows(
    target_lm: SessionLM, tiny_target_model: LlamaForCausalLM
) -> None:
    sequences = [_tokens(50, 12), _tokens(51, 30)]
    target_lm.open("a", sequences[0][:7])
    target_lm.open("b", sequences[1][:28])
    rows = target_lm.forward_new(
        [("a", sequences[0][7:]), ("b", sequences[1][28:])], keep_rows=[2, 0]
    )
    assert rows[0].shape == (2, TINY_VOCAB) and rows[1].shape == (0, TINY_VOCAB)
    expected = full_logits(tiny_target_model, sequences[0])[-2:]
    assert _max_diff(rows[0], expected) <= TOLERANCE
    assert target_lm.length("b") == 30  # a prefill chunk: cached, no logits


def test_llama_engine_in_bf16_tracks_float32(tiny_target_model: LlamaForCausalLM) -> None:

    half = LlamaEngine(copy.deepcopy(tiny_target_model).bfloat16())
    sequence = _tokens(60, 40)
    half.open("s", sequence[:30])
    (rows,) = half.forward_new([("s", sequence[30:])])
    assert rows.dtype == torch.float32
    expected = torch.softmax(full_logits(tiny_target_model, sequence)[30:], -1)
    assert _max_diff(torch.softmax(rows, -1), expected) <= 0.05


def test_a_restricted_head_scores_its_tokens_and_nothing_else(
    tiny_target_model: LlamaForCausalLM,
) -> None:
    whole, restricted = LlamaEngine(tiny_target_model), LlamaEngine(tiny_target_model)
    kept = [0, 3, 7, 8, 40, TINY_VOCAB - 1]
    restricted.restrict_head([7, *kept])  # duplicates and order do not matter
    sequence = _tokens(80, 12)
    for lm in (whole, restricted):
        lm.open("s", sequence[:9])
    (full_rows,) = whole.forward_new([("s", sequence[9:])])
    (rows,) = restricted.forward_new([("s", sequence[9:])])
    assert rows.shape == full_rows.shape == (3, TINY_VOCAB)
    assert _max_diff(rows[:, kept], full_rows[:, kept]) <= TOLERANCE
    outside = [t for t in range(TINY_VOCAB) if t not in kept]
    assert bool(torch.isneginf(rows[:, outside]).all())  # probability 0
    assert bool(torch.softmax(rows, -1)[:, outside].eq(0).all())
    # head_only: the same logits on the head's columns alone, in token order
    restricted.truncate("s", 9)
    (on_head,) = restricted.forward_new([("s", sequence[9:])], head_only=True)
    assert torch.equal(on_head, rows[:, kept])
    head = restricted.restricted_head
    assert head is not None and head.ids.tolist() == kept
    assert head.columns[kept].tolist() == list(range(len(kept)))
    assert bool(head.columns[outside].eq(-1).all())
    (whole_rows,) = whole.forward_new([("s", [5])], head_only=True)  # no restriction: all V
    assert whole_rows.shape == (1, TINY_VOCAB) and whole.restricted_head is None
    for bad in ([], [TINY_VOCAB], [-1, 2]):
        with pytest.raises(ValueError, match="head token ids"):
            LlamaEngine(tiny_target_model).restrict_head(bad)
