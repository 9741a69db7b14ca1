"""The llama.cpp engine on a tiny Llama written as GGUF: the same rows as the torch float32
reference (to llama.cpp's float16 KV cache), ragged batches equal to one session at a
time, rollback, session capacity, and the engine choice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from asymspec_engine.gguf_export import export_llama, quantize
from asymspec_engine.llamacpp import ENGINE_GGUF, LlamaCppEngine
from asymspec_engine.loading import EngineOptions, choose_engine, find_gguf, load_session_lm
from loadtest.tiny_models import save_tiny_pair
from tests.engine.conftest import full_logits

# float16 keys and values in llama.cpp's cache against float32 in torch's
TOLERANCE = 2e-2


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_gguf(tiny_pair: tuple[Path, Path]) -> Path:
    target_dir, _ = tiny_pair
    out = target_dir.parent / "target.f32.gguf"
    export_llama(target_dir, out)
    return out


@pytest.fixture(scope="module")
def reference(tiny_pair: tuple[Path, Path]) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float32).eval()


def _engine(path: Path, **kwargs: Any) -> LlamaCppEngine:
    return LlamaCppEngine(path, threads=1, **kwargs)


def _tokens(seed: int, n: int, vocab: int = 200) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n,), generator=generator).tolist()


def test_the_gguf_export_computes_the_checkpoints_logits(
    tiny_gguf: Path, reference: torch.nn.Module
) -> None:
    lm = _engine(tiny_gguf)
    sequence = _tokens(1, 40)
    last = lm.open("s", sequence[:30])
    assert last is not None and last.dtype == torch.float32
    expected = full_logits(reference, sequence)
    assert (last - expected[29]).abs().max() <= TOLERANCE
    (rows,) = lm.forward_new([("s", sequence[30:])])
    assert rows.shape == (10, lm.vocab_size)
    assert (rows - expected[30:]).abs().max() <= TOLERANCE
    assert lm.length("s") == 40 and lm.token_ids("s") == sequence
    assert lm.forward_calls == 2


def test_a_ragged_batch_equals_each_session_alone(tiny_gguf: Path) -> None:
    batched, alone = _engine(tiny_gguf), _engine(tiny_gguf)
    prompts = [_tokens(2, 7), _tokens(3, 19), _tokens(4, 2)]
    news = [_tokens(5, 5), _tokens(6, 1), _tokens(7, 3)]
    for i, prompt in enumerate(prompts):
        batched.open(f"s{i}", prompt)
        alone.open(f"s{i}", prompt)
    keep = [5, 1, 2]
    rows = batched.forward_new([(f"s{i}", new) for i, new in enumerate(news)], keep_rows=keep)
    for i, (new, k) in enumerate(zip(news, keep, strict=True)):
        (single,) = alone.forward_new([(f"s{i}", new)], keep_rows=[k])
        assert rows[i].shape == (k, batched.vocab_size)
        assert (rows[i] - single).abs().max() <= TOLERANCE


def test_a_batch_out_of_session_order_returns_its_rows_in_its_own_order(
    tiny_gguf: Path,
) -> None:
    """The engine feeds llama.cpp the sessions in stream order (one pass, not one per
    stream); each item still gets its own rows back."""
    batched, alone = _engine(tiny_gguf), _engine(tiny_gguf)
    for i in range(4):
        batched.open(f"s{i}", _tokens(60 + i, 6))
        alone.open(f"s{i}", _tokens(60 + i, 6))
    order, keep = [2, 0, 3, 1], [1, 3, 2, 0]
    news = {i: _tokens(70 + i, 3) for i in order}
    rows = batched.forward_new([(f"s{i}", news[i]) for i in order], keep_rows=keep)
    for position, (i, k) in enumerate(zip(order, keep, strict=True)):
        (single,) = alone.forward_new([(f"s{i}", news[i])], keep_rows=[k])
        assert rows[position].shape == (k, batched.vocab_size)
        assert torch.allclose(rows[position], single, rtol=0.0, atol=TOLERANCE)


def test_keep_rows_zero_caches_without_logits(tiny_gguf: Path, reference: torch.nn.Module) -> None:
    lm = _engine(tiny_gguf)
    sequence = _tokens(8, 30)
    lm.open("a", [])
    (chunk,) = lm.forward_new([("a", sequence[:20])], keep_rows=[0])
    assert chunk.shape == (0, lm.vocab_size)
    (rows,) = lm.forward_new([("a", sequence[20:])], keep_rows=[1])
    assert (rows[0] - full_logits(reference, sequence)[-1]).abs().max() <= TOLERANCE


def test_truncate_then_continue_equals_recompute(
    tiny_gguf: Path, reference: torch.nn.Module
) -> None:
    lm = _engine(tiny_gguf)
    prompt, rejected, accepted = _tokens(9, 12), _tokens(10, 4), _tokens(11, 3)
    lm.open("s", prompt)
    lm.forward_new([("s", rejected)])
    lm.truncate("s", len(prompt))  # the rejected block's cells are gone
    (rows,) = lm.forward_new([("s", accepted)])
    expected = full_logits(reference, prompt + accepted)[len(prompt) :]
    assert (rows - expected).abs().max() <= TOLERANCE
    with pytest.raises(ValueError, match="truncate"):
        lm.truncate("s", 100)
    lm.truncate("s", 0)
    assert lm.length("s") == 0
    (again,) = lm.forward_new([("s", prompt)], keep_rows=[1])
    assert (again[0] - full_logits(reference, prompt)[-1]).abs().max() <= TOLERANCE


def test_sessions_are_bounded_and_a_close_frees_one(tiny_gguf: Path) -> None:
    lm = _engine(tiny_gguf, max_sessions=2, session_tokens=64)
    assert lm.max_sessions == 2 and lm.restricts_head is False and lm.hidden_size == 0
    lm.open("a", _tokens(12, 4))
    lm.open("b", _tokens(13, 4))
    with pytest.raises(RuntimeError, match="at most 2 sessions"):
        lm.open("c", _tokens(14, 4))
    assert lm.sessions() == 2
    lm.close("a")
    lm.close("a")  # idempotent
    lm.open("c", _tokens(14, 4))
    with pytest.raises(ValueError, match="exceed"):
        lm.forward_new([("c", _tokens(15, 61))])  # 65 > 64 positions
    assert lm.length("c") == 4  # refused before touching the cache


def test_bad_batches_fail_before_touching_state(tiny_gguf: Path) -> None:
    lm = _engine(tiny_gguf)
    lm.open("a", _tokens(16, 3))
    with pytest.raises(ValueError, match="twice"):
        lm.forward_new([("a", [5]), ("a", [6])])
    with pytest.raises(ValueError, match="no new tokens"):
        lm.forward_new([("a", [])])
    with pytest.raises(KeyError):
        lm.forward_new([("a", [5]), ("missing", [6])])
    with pytest.raises(KeyError, match="already open"):
        lm.open("a", [1])
    assert lm.length("a") == 3
    with pytest.raises(NotImplementedError):
        lm.restrict_head([1, 2])


def test_q8_0_stays_close_to_the_float32_file(tiny_gguf: Path) -> None:
    quantized = tiny_gguf.parent / "target.q8_0.gguf"
    quantize(tiny_gguf, quantized, "q8_0")
    assert quantized.stat().st_size < tiny_gguf.stat().st_size
    full, q8 = _engine(tiny_gguf), _engine(quantized)
    prompt = _tokens(17, 25)
    p_full = torch.softmax(full.open("s", prompt), -1)  # type: ignore[arg-type]
    p_q8 = torch.softmax(q8.open("s", prompt), -1)  # type: ignore[arg-type]
    assert 0.5 * float((p_full - p_q8).abs().sum()) < 0.05  # total variation


def test_the_engine_choice_follows_the_files_and_the_setting(
    tiny_pair: tuple[Path, Path], tiny_gguf: Path
) -> None:
    target_dir, draft_dir = tiny_pair
    assert find_gguf(str(target_dir)) is None  # the checkpoint folder has no GGUF yet
    assert choose_engine("auto", str(target_dir), "cpu").name == "torch"
    assert choose_engine("auto", str(tiny_gguf), "cpu").name == "llama.cpp"
    assert choose_engine("auto", str(tiny_gguf), "cuda").name == "torch"
    assert choose_engine("torch", str(tiny_gguf), "cpu").reason == "asked for"
    with pytest.raises(ValueError, match="no GGUF"):
        choose_engine("llama.cpp", str(draft_dir), "cpu")
    with pytest.raises(ValueError, match="engine must be"):
        choose_engine("vllm", str(draft_dir), "cpu")
    folder = target_dir.parent / "with-gguf"
    folder.mkdir()
    for path in target_dir.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    (folder / ENGINE_GGUF).write_bytes(tiny_gguf.read_bytes())
    assert find_gguf(str(folder)) == folder / ENGINE_GGUF
    lm, tokenizer = load_session_lm(str(folder), EngineOptions(device="cpu", max_sessions=3))
    assert isinstance(lm, LlamaCppEngine)
    assert lm.name == "llama.cpp" and lm.max_sessions == 3
    assert lm.vocab_size == len(tokenizer)


def test_a_new_session_takes_over_a_closed_sessions_prefix(
    tiny_gguf: Path, reference: torch.nn.Module
) -> None:
    lm = _engine(tiny_gguf, max_sessions=3)
    first_round = _tokens(18, 40)
    lm.open("round1", first_round, scope="edge-1")
    lm.forward_new([("round1", _tokens(19, 5))])  # its answer, rejected tail included
    lm.truncate("round1", 43)
    lm.close("round1")  # kept: 43 tokens
    second_round = [*first_round, *lm_tokens_after(first_round)]
    last = lm.open("round2", second_round, scope="edge-1")
    assert lm.reused_tokens == 40  # the shared 40, not the 3 that differ
    assert last is not None
    assert (last - full_logits(reference, second_round)[-1]).abs().max() <= TOLERANCE
    lm.close("round2")
    lm.open("other-edge", second_round, scope="edge-2")  # never another scope's cache
    assert lm.reused_tokens == 40
    lm.open("short", second_round[:10], scope="edge-1")  # under MIN_REUSE_TOKENS
    assert lm.reused_tokens == 40
    with pytest.raises(ValueError, match="not empty"):
        lm.adopt_prefix("short", second_round)


def lm_tokens_after(prefix: list[int]) -> list[int]:
    return _tokens(len(prefix) + 100, 12)


def test_kept_sessions_give_way_to_live_ones(tiny_gguf: Path) -> None:
    lm = _engine(tiny_gguf, max_sessions=2)
    for seed, name in enumerate(("a", "b")):
        lm.open(name, _tokens(30 + seed, 30))
        lm.close(name)  # both kept
    lm.open("c", _tokens(21, 30))  # different tokens: takes the oldest kept stream
    lm.open("d", _tokens(22, 30))
    assert lm.sessions() == 2 and lm.reused_tokens == 0
    with pytest.raises(RuntimeError, match="at most 2 sessions"):
        lm.open("e", _tokens(23, 30))
    lm.close("c", retain=False)
    lm.open("e", _tokens(23, 30))


def test_a_full_engine_still_hands_a_kept_prefix_to_its_next_round(
    tiny_gguf: Path, reference: torch.nn.Module
) -> None:
    lm = _engine(tiny_gguf, max_sessions=2)
    first_round = _tokens(40, 30)
    lm.open("live", _tokens(41, 30))
    lm.open("round1", first_round)
    lm.close("round1")  # kept, and no stream is free: a new session must not evict it
    second_round = [*first_round, *lm_tokens_after(first_round)]
    last = lm.open("round2", second_round)
    assert lm.reused_tokens == 30
    assert last is not None
    assert (last - full_logits(reference, second_round)[-1]).abs().max() <= TOLERANCE


def test_a_chat_that_shares_only_an_opening_copies_it_and_leaves_the_closed_cache_whole(
    tiny_gguf: Path, reference: torch.nn.Module
) -> None:
    """Two chats that open alike (a chat template, a system prompt) but go on differently:
    the second starts from a copy of the first one's opening, while a stream is free, and
    the first conversation's next round still finds all of its own cache."""
    lm = _engine(tiny_gguf, max_sessions=4)
    opening = _tokens(60, 20)
    first_chat = [*opening, *_tokens(61, 60)]
    lm.open("chat1", first_chat)
    lm.close("chat1")
    second_chat = [*opening, *_tokens(62, 10)]
    last = lm.open("chat2", second_chat)
    assert lm.reused_tokens == 20  # the opening, copied
    assert last is not None
    assert (last - full_logits(reference, second_chat)[-1]).abs().max() <= TOLERANCE
    assert lm.length("chat2") == 30
    next_round = [*first_chat, *lm_tokens_after(first_chat)]
    last = lm.open("chat1-round2", next_round)
    assert lm.reused_tokens == 20 + 80  # the whole first chat: its stream was left alone
    assert last is not None
    assert (last - full_logits(reference, next_round)[-1]).abs().max() <= TOLERANCE


def test_a_long_closed_session_is_not_copied_for_a_short_opening(tiny_gguf: Path) -> None:
    """Copying takes the closed session's whole state: for a short shared opening of a
    long conversation, prefilling the opening costs less."""
    lm = _engine(tiny_gguf, max_sessions=4)
    opening = _tokens(70, 16)
    lm.open("long", [*opening, *_tokens(71, 600)])
    lm.close("long")
    lm.open("chat", [*opening, *_tokens(72, 10)])
    assert lm.reused_tokens == 0 and lm.length("chat") == 26


def test_without_prefix_reuse_a_closed_session_keeps_nothing(tiny_gguf: Path) -> None:
    lm = _engine(tiny_gguf, max_sessions=2, prefix_reuse=False)
    first_round = _tokens(50, 30)
    lm.open("round1", first_round)
    lm.close("round1")
    lm.open("round2", [*first_round, *lm_tokens_after(first_round)])
    assert lm.reused_tokens == 0


def test_a_closed_session_whose_stream_is_taken_is_restored_from_host_memory(
    tiny_gguf: Path, reference: torch.nn.Module
) -> None:
    """Two streams, three conversations: the first one's stream goes to the third, its
    cells to host memory, and its next round is prefilled only past them, with the rows
    the reference computes; without host memory it is prefilled whole."""
    for cache_bytes, reused in ((64 << 20, 40), (0, 0)):
        lm = _engine(tiny_gguf, max_sessions=2, prefix_cache_bytes=cache_bytes)
        first = _tokens(110, 40)
        lm.open("first", first, scope="edge-1")
        lm.close("first")
        lm.open("live", _tokens(111, 30), scope="edge-1")
        lm.open("third", _tokens(112, 30), scope="edge-1")  # takes the first one's stream
        assert (lm.saved_bytes > 0) == (cache_bytes > 0)
        lm.close("third", retain=False)
        next_round = [*first, *lm_tokens_after(first)]
        last = lm.open("first-round2", next_round, scope="edge-1")
        assert lm.reused_tokens == reused
        assert last is not None
        assert (last - full_logits(reference, next_round)[-1]).abs().max() <= TOLERANCE
        assert lm.token_ids("first-round2") == next_round


def test_host_memory_keeps_the_most_recent_within_its_budget_and_scope(tiny_gguf: Path) -> None:
    one_stream = _engine(tiny_gguf, max_sessions=1, prefix_cache_bytes=64 << 20)
    one_stream.open("probe", _tokens(120, 40))
    one_stream.close("probe")
    one_stream.open("evicts", _tokens(121, 40))  # the probe's cells go to host memory
    size = one_stream.saved_bytes
    assert size > 0
    lm = _engine(tiny_gguf, max_sessions=1, prefix_cache_bytes=size + size // 2)
    chats = [_tokens(130 + i, 40) for i in range(3)]
    for i, chat in enumerate(chats):  # each takes the last one's stream; one fits in memory
        lm.open(f"c{i}", chat, scope="edge-1")
        lm.close(f"c{i}")
    lm.open("other", _tokens(140, 40), scope="edge-1")  # c2 goes to host memory
    lm.close("other", retain=False)
    assert lm.saved_bytes <= size + size // 2
    lm.open("again-c0", [*chats[0], 7], scope="edge-1")  # given up for a newer one
    assert lm.reused_tokens == 0
    lm.close("again-c0", retain=False)
    lm.open("again-c2-elsewhere", [*chats[2], 7], scope="edge-2")  # never another scope's
    assert lm.reused_tokens == 0
    lm.close("again-c2-elsewhere", retain=False)
    lm.open("again-c2", [*chats[2], 7], scope="edge-1")
    assert lm.reused_tokens == 40


def test_a_padded_round_computes_the_rows_of_each_session_alone_and_keeps_every_stream(
    tiny_gguf: Path,
) -> None:
    """Sessions on ids 0, 1, 3, 4 with blocks of 1, 2, 1 and 2 tokens (three passes as
    they are): the round goes in one, with a throwaway token after each short block and
    two in the idle session's stream between; every row is the one each session computes
    alone, and every stream (the idle ones too) then goes on as if it had not been padded."""
    batched, alone = _engine(tiny_gguf), _engine(tiny_gguf)
    for i in range(6):
        batched.open(f"s{i}", _tokens(80 + i, 5 + i))
        alone.open(f"s{i}", _tokens(80 + i, 5 + i))
    news = {0: _tokens(90, 1), 1: _tokens(91, 2), 3: _tokens(93, 1), 4: _tokens(94, 2)}
    keep = {0: 1, 1: 2, 3: 1, 4: 1}
    rows = batched.forward_new([(f"s{i}", new) for i, new in news.items()], list(keep.values()))
    assert batched.padding_tokens == 4
    for (i, new), got in zip(news.items(), rows, strict=True):
        (single,) = alone.forward_new([(f"s{i}", new)], keep_rows=[keep[i]])
        assert (got - single).abs().max() <= TOLERANCE
    for i in range(6):  # every stream holds its real tokens only
        assert batched.length(f"s{i}") == alone.length(f"s{i}")
        follow = _tokens(100 + i, 2)
        (got,) = batched.forward_new([(f"s{i}", follow)])
        (single,) = alone.forward_new([(f"s{i}", follow)])
        assert (got - single).abs().max() <= TOLERANCE
