"""The decoder layers in one native call: the same kernels, arguments and order as the
engine's Python loop, so the same bits, for decode steps, verify blocks and prefill chunks
in one forward, with biases, on one thread and two. Needs AMX (all three kernels native)."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from asymspec_engine.hardware import cpu_has_amx
from asymspec_engine.llama import LlamaEngine
from asymspec_engine.native_build import KernelUnavailable
from tests.engine.conftest import TINY_VOCAB, build_tiny_llama

pytestmark = pytest.mark.skipif(
    not cpu_has_amx() or shutil.which("cc") is None,
    reason="the native layers loop drives the AMX kernels, built with the machine's compiler",
)


def _model(seed: int, bias: bool = False) -> LlamaForCausalLM:
    """bf16, heads of 32 (the attention kernel's smallest)."""
    model = build_tiny_llama(seed=seed, hidden_size=128)
    if bias:  # as Qwen2's qkv (and some checkpoints' MLP) biases
        config = copy.deepcopy(model.config)
        config.attention_bias = config.mlp_bias = True
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
    return model.to(torch.bfloat16)


def _run(engine: LlamaEngine, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three rounds over four sessions: prompts of different lengths prefilled together,
    then a round mixing a decode step, a verify block, a prefill chunk and a new prompt,
    then decode steps. Returns every round's logits and each session's KV cache."""
    generator = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(0, TINY_VOCAB, (n,), generator=generator).tolist()

    for name in "abc":
        engine.open(name, [])
    out = engine.forward_new([("a", ids(7)), ("b", ids(40)), ("c", ids(90))])
    engine.open("d", [])
    mixed = [("a", ids(1)), ("b", ids(5)), ("c", ids(33)), ("d", ids(18))]
    out += engine.forward_new(mixed, keep_rows=[1, 5, 1, 1])
    out += engine.forward_new([(name, ids(1)) for name in "abcd"])
    caches = []
    for name in "abcd":
        session = engine._session(name)
        assert session.kv is not None
        caches.append(session.kv[:, :, :, : session.length].clone())
    return out, caches


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_loop_gives_the_python_loops_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bias: bool, threads: int
) -> None:
    monkeypatch.setenv("ASYMSPEC_KERNEL_CACHE", str(tmp_path))
    half = _model(seed=21, bias=bias)
    in_c, in_python = LlamaEngine(half), LlamaEngine(half, native_layers=False)
    assert in_c.native_layers is not None and in_python.native_layers is None
    assert in_c.native_attention is not None and in_c.native_attention.prefills(32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got, got_kv = _run(in_c, seed=22)
        want, want_kv = _run(in_python, seed=22)
    finally:
        torch.set_num_threads(before)
    assert len(got) == len(want) == 11
    for a, b in zip(got + got_kv, want + want_kv, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)
    assert bool(torch.isfinite(torch.cat(got)).all())


def test_prefill_chunks_left_to_torch_take_the_python_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the AMX prefill path a forward with prefill chunks attends them by torch,
    which the native loop cannot call: that forward goes through Python, the same bits."""
    monkeypatch.setenv("ASYMSPEC_KERNEL_CACHE", str(tmp_path))
    half = _model(seed=23)
    in_c, in_python = LlamaEngine(half), LlamaEngine(half, native_layers=False)
    assert in_c.native_attention is not None
    in_c.native_attention.allow_amx(False)
    try:
        assert not in_c.native_attention.prefills(32)
        got, got_kv = _run(in_c, seed=24)
        want, want_kv = _run(in_python, seed=24)
    finally:
        in_c.native_attention.allow_amx(True)
    for a, b in zip(got + got_kv, want + want_kv, strict=True):
        assert torch.equal(a, b)


def test_settings_switch_the_loop_off_and_on_demands_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ASYMSPEC_KERNEL_CACHE", str(tmp_path))
    half = _model(seed=25)
    monkeypatch.setenv("ASYMSPEC_NATIVE_LAYERS", "off")
    assert LlamaEngine(half).native_layers is None
    monkeypatch.setenv("ASYMSPEC_NATIVE_LAYERS", "on")
    assert LlamaEngine(half).native_layers is not None
    with pytest.raises(KernelUnavailable, match="no native linear kernel"):
        LlamaEngine(half, native_linear=False)
    monkeypatch.setenv("ASYMSPEC_NATIVE_LAYERS", "auto")
    assert LlamaEngine(half, native_pointwise=False).native_layers is None
