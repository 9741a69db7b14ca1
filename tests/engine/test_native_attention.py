"""The native attention kernel, its decode/verify path and its prefill path: as accurate as
torch's flash attention on the same bf16 inputs, writes exactly the new keys and values, and
the engine's forwards with it track the forwards without it. Built here with the machine's
compiler; skipped where the CPU lacks AVX512-BF16 or there is no compiler (the engine then
keeps torch's attention)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from asymspec_engine.hardware import cpu_flags
from asymspec_engine.llama import LlamaEngine
from asymspec_engine.native_attention import LIBS, SOURCE, NativeAttention
from asymspec_engine.native_build import KernelUnavailable, NativeKernelSettings, build
from tests.engine.conftest import TINY_VOCAB, build_tiny_llama

pytestmark = pytest.mark.skipif(
    "avx512_bf16" not in cpu_flags() or shutil.which("cc") is None,
    reason="the native kernel needs a CPU with AVX512-BF16 and a C compiler",
)

HEADS, KV_HEADS, LAYERS = 8, 2, 3


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> NativeAttention:
    cache = tmp_path_factory.mktemp("kernels")
    return NativeAttention(build(SOURCE, NativeKernelSettings(kernel_cache=cache), LIBS))


def _bf16(generator: torch.Generator, *shape: int, std: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * std).to(torch.bfloat16)


@pytest.fixture(params=["amx", "avx512"])
def native_path(request: pytest.FixtureRequest, native: NativeAttention) -> Iterator[str]:
    """Each score path the machine can run: AMX tiles where it has them, and always the
    AVX512-BF16 dot products."""
    native.allow_amx(request.param == "amx")
    if request.param == "amx" and not native.uses_amx:
        pytest.skip("no AMX here")
    yield request.param
    native.allow_amx(True)


def _errors_against_float64(
    slots: list[torch.Tensor],
    before: list[torch.Tensor],
    row0: list[int],
    counts: list[int],
    bases: list[int],
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    out: torch.Tensor,
    layer: int,
    scale: float,
) -> tuple[float, float]:
    """After the kernel ran on ``out``: checks that each session's new keys and values
    landed at positions base .. base + n - 1 of ``layer`` only, and returns the largest
    errors against float64 attention of the same bf16 inputs, the kernel's and torch's
    bf16 SDPA's."""
    q, k, v = qkv
    worst_native = worst_torch = 0.0
    for b, (base, n_new) in enumerate(zip(bases, counts, strict=True)):
        rows_b = slice(row0[b], row0[b] + n_new)
        total = base + n_new
        expected = before[b].clone()
        expected[layer, 0, :, base:total] = k[rows_b].transpose(0, 1)
        expected[layer, 1, :, base:total] = v[rows_b].transpose(0, 1)
        assert torch.equal(slots[b], expected)
        group = HEADS // KV_HEADS
        keys = slots[b][layer, 0, :, :total].repeat_interleave(group, 0)
        values = slots[b][layer, 1, :, :total].repeat_interleave(group, 0)
        queries = q[rows_b].transpose(0, 1)  # [H, n, D]
        mask = torch.ones(n_new, total, dtype=torch.bool).tril(base)
        exact = F.scaled_dot_product_attention(
            queries.double(), keys.double(), values.double(), attn_mask=mask, scale=scale
        )
        by_torch = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=scale
        )
        got = out[rows_b].transpose(0, 1)
        assert not got.isnan().any()
        worst_native = max(worst_native, float((got.double() - exact).abs().max()))
        worst_torch = max(worst_torch, float((by_torch.double() - exact).abs().max()))
    return worst_native, worst_torch


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("n_new", [1, 3, 16])
def test_the_kernel_is_as_accurate_as_torch_flash_attention(
    native: NativeAttention, native_path: str, head_dim: int, n_new: int
) -> None:
    """Ragged sessions (1 to 700 cached positions, so 16-key blocks end mid-way), queries
    in strided rows; against float64 attention of the same bf16 inputs, the kernel's
    error stays within torch's bf16 SDPA error on the same sessions (both round the output
    to bf16, so both are ~1 bf16 ulp)."""
    generator = torch.Generator().manual_seed(head_dim * 100 + n_new)
    bases = [0, 1, 15, 16, 17, 250, 700]
    slots = [_bf16(generator, LAYERS, 2, KV_HEADS, base + n_new + 5, head_dim) for base in bases]
    before = [slot.clone() for slot in slots]
    rows = len(bases) * n_new
    qkv = _bf16(generator, rows, HEADS + 2 * KV_HEADS, head_dim, std=2.0)
    q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)  # strided rows
    out = torch.full((rows, HEADS, head_dim), float("nan"), dtype=torch.bfloat16)
    layer, scale = 1, head_dim**-0.5
    row0 = [b * n_new for b in range(len(bases))]
    native.attend(native.plan(row0, [n_new] * len(bases), bases, slots), layer, q, k, v, out, scale)
    worst_native, worst_torch = _errors_against_float64(
        slots, before, row0, [n_new] * len(bases), bases, (q, k, v), out, layer, scale
    )
    assert worst_native <= 1.25 * worst_torch + 1e-3, (worst_native, worst_torch)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_the_prefill_path_is_as_accurate_as_torch_flash_attention(
    native: NativeAttention, head_dim: int
) -> None:
    """Prefill chunks of ragged sizes after ragged prefixes (64-key blocks and 16-position
    query blocks ending mid-way, a chunk of 17 = one block and one row), queries in strided
    rows: the new keys and values land exactly, and against float64 the output errs no
    more than torch's bf16 SDPA on the same sessions; the same bits on 1 and 2 threads."""
    if not native.prefills(head_dim):
        pytest.skip("the prefill path needs AMX")
    generator = torch.Generator().manual_seed(head_dim)
    bases = [0, 1, 63, 64, 65, 300, 0]
    counts = [100, 17, 40, 64, 33, 256, 20]
    row0 = [sum(counts[:b]) for b in range(len(counts))]
    slots = [
        _bf16(generator, LAYERS, 2, KV_HEADS, b + n + 5, head_dim)
        for b, n in zip(bases, counts, strict=True)
    ]
    before = [slot.clone() for slot in slots]
    qkv = _bf16(generator, sum(counts), HEADS + 2 * KV_HEADS, head_dim, std=2.0)
    q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)  # strided rows
    out = torch.full((sum(counts), HEADS, head_dim), float("nan"), dtype=torch.bfloat16)
    layer, scale = 2, head_dim**-0.5
    plan = native.plan(row0, counts, bases, slots)
    native.prefill(plan, layer, q, k, v, out, scale)

    worst_native, worst_torch = _errors_against_float64(
        slots, before, row0, counts, bases, (q, k, v), out, layer, scale
    )
    assert worst_native <= 1.5 * worst_torch + 1e-3, (worst_native, worst_torch)

    threads = torch.get_num_threads()
    outputs = []
    for n_threads in (1, 2):
        torch.set_num_threads(n_threads)
        try:
            again = torch.empty_like(out)
            native.prefill(native.plan(row0, counts, bases, slots), layer, q, k, v, again, scale)
        finally:
            torch.set_num_threads(threads)
        outputs.append(again)
    assert torch.equal(outputs[0], out) and torch.equal(outputs[1], out)


def test_the_prefill_path_needs_amx_and_heads_up_to_128(native: NativeAttention) -> None:
    assert not native.prefills(256)
    native.allow_amx(False)
    try:
        assert not native.prefills(32)
        slot = torch.zeros(1, 2, 1, 64, 32, dtype=torch.bfloat16)
        rows = torch.zeros(20, 3, 32, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="AMX"):
            native.prefill(
                native.plan([0], [20], [0], [slot]),
                0,
                rows[:, :1],
                rows[:, 1:2],
                rows[:, 2:],
                torch.empty(20, 1, 32, dtype=torch.bfloat16),
                1.0,
            )
    finally:
        native.allow_amx(True)


@pytest.mark.parametrize("amx", [True, False])
def test_engine_forwards_with_the_kernel_track_float32_as_torch_attention_does(amx: bool) -> None:
    """Decode rows, verify blocks and a prefill chunk (the kernel's prefill path on AMX,
    torch's flash attention without) in one forward, then rollbacks and more rounds.
    Against the float32 engine, the bf16 engine with the kernel errs no more than the bf16
    engine without it (both drift alike: bf16 products, then keys that differ by a
    rounding)."""
    exact = build_tiny_llama(seed=5, hidden_size=128)  # head size 32
    model = build_tiny_llama(seed=5, hidden_size=128).to(torch.bfloat16)
    engines = {
        "native": LlamaEngine(model, native_attention=True),
        "torch": LlamaEngine(model, native_attention=False),
        "float32": LlamaEngine(exact),
    }
    kernel = engines["native"].native_attention
    assert kernel is not None
    assert engines["torch"].native_attention is None
    if amx and not kernel.uses_amx:
        pytest.skip("no AMX here")
    kernel.allow_amx(amx)
    try:
        assert kernel.prefills(32) == amx
        _forward_rounds(engines)
    finally:
        kernel.allow_amx(True)


def _forward_rounds(engines: dict[str, LlamaEngine]) -> None:
    generator = torch.Generator().manual_seed(0)
    lengths = (1, 40, 300, 77)
    prompts = [torch.randint(0, TINY_VOCAB, (n,), generator=generator).tolist() for n in lengths]
    for engine in engines.values():
        for i, prompt in enumerate(prompts):
            engine.open(f"s{i}", prompt)
    new = {"s0": [3], "s1": [4, 5, 6, 7, 8], "s2": list(range(10, 50)), "s3": [9]}
    for round_ in range(4):
        rows = {name: engine.forward_new(list(new.items())) for name, engine in engines.items()}
        for i in range(len(new)):
            want = torch.softmax(rows["float32"][i], -1)
            err = {k: float((torch.softmax(rows[k][i], -1) - want).abs().max()) for k in rows}
            assert err["native"] <= err["torch"] + 0.025, (round_, i, err)
        for engine in engines.values():
            engine.truncate("s1", engine.length("s1") - 2)  # a partly rejected block
        new = {"s0": [round_], "s1": [1, 2, 3], "s2": [7], "s3": [8, 9]}


def test_settings_switch_the_kernel_off_and_on_demands_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ASYMSPEC_KERNEL_CACHE", str(tmp_path))
    model = build_tiny_llama(seed=2, hidden_size=128).to(torch.bfloat16)
    monkeypatch.setenv("ASYMSPEC_NATIVE_ATTENTION", "off")
    assert LlamaEngine(model).native_attention is None
    monkeypatch.setenv("ASYMSPEC_NATIVE_ATTENTION", "auto")
    assert LlamaEngine(model).native_attention is not None
    built = list(tmp_path.glob("native_attention-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    LlamaEngine(model)  # cached: not rebuilt
    assert built[0].stat().st_mtime_ns == stamp
    monkeypatch.setenv("ASYMSPEC_NATIVE_ATTENTION", "on")
    with pytest.raises(KernelUnavailable, match="float32"):
        LlamaEngine(build_tiny_llama(seed=2, hidden_size=128))  # float32: not for the kernel
    monkeypatch.setenv("ASYMSPEC_NATIVE_ATTENTION", "auto")
    assert LlamaEngine(build_tiny_llama(seed=2, hidden_size=128)).native_attention is None


def test_no_compiler_leaves_torch_attention(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ASYMSPEC_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    model = build_tiny_llama(seed=2, hidden_size=128).to(torch.bfloat16)
    assert LlamaEngine(model).native_attention is None
    with pytest.raises(KernelUnavailable, match="compiler"):
        LlamaEngine(model, native_attention=True)


def test_loading_the_kernel_leaves_subnormal_arithmetic_alone(native: NativeAttention) -> None:
    """Built with -ffast-math, but linked without it: a library linked with it sets
    flush-to-zero for the whole process when loaded (numpy, torch and hypothesis then
    round every subnormal to 0)."""
    tiny, two = sys.float_info.min, 2.0
    assert tiny / two > 0.0
    assert float(torch.tensor(tiny, dtype=torch.float64) / two) > 0.0
    assert float(torch.tensor(torch.finfo(torch.float32).tiny) / two) > 0.0
