"""The native pointwise kernel: torch's bf16 results bit for bit for the norms, the residual
add and the rotary embedding, SiLU(gate) * up within one bf16 rounding (its exp is not
torch's), and the engine's forwards with it tracking float32 as closely as without it.
Built here with the machine's compiler; skipped where there is none or the CPU is not
x86 (the engine then keeps torch's ops)."""

from __future__ import annotations

import copy
import platform
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from asymspec_engine.llama import LlamaEngine, _rotate
from asymspec_engine.native_build import KernelUnavailable, NativeKernelSettings, build
from asymspec_engine.native_pointwise import LIBS, SOURCE, NativePointwise
from tests.engine.conftest import TINY_VOCAB, build_tiny_llama, full_logits

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None,
    reason="the native pointwise kernel is built for x86 CPUs with a C compiler",
)

EPS = 1e-5


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> NativePointwise:
    cache = tmp_path_factory.mktemp("kernels")
    return NativePointwise(build(SOURCE, NativeKernelSettings(kernel_cache=cache), LIBS))


def _bf16(generator: torch.Generator, *shape: int, std: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * std).to(torch.bfloat16)


def _torch_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=EPS).to(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 17, 80])
def test_norms_and_the_residual_add_are_torchs_bits(kernel: NativePointwise, rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    x, delta = _bf16(generator, rows, 576, std=3.0), _bf16(generator, rows, 576)
    weight = (1 + _bf16(generator, 576, std=0.2)).to(torch.bfloat16)
    assert torch.equal(kernel.rms_norm(x, weight, EPS), _torch_norm(x, weight))
    residual = x.clone()
    normed = kernel.add_rms_norm(residual, delta, weight, EPS)
    assert torch.equal(residual, x + delta)  # added in place
    assert normed is not None and torch.equal(normed, _torch_norm(x + delta, weight))
    alone = x.clone()
    assert kernel.add_rms_norm(alone, delta, None, EPS) is None  # the add alone
    assert torch.equal(alone, x + delta)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_rotary_is_torchs_bits_in_place_on_strided_rows(
    kernel: NativePointwise, head_dim: int
) -> None:
    """In place on the q and k heads of a fused qkv product, whose rows are strided."""
    generator = torch.Generator().manual_seed(head_dim)
    rows, heads = 9, 6
    qkv = _bf16(generator, rows, (heads + 2) * head_dim)
    qk = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    positions = torch.arange(100, 100 + rows).float()
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(positions, inv_freq)
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    want = _rotate(qk.clone(), cos[:, None], sin[:, None])
    untouched = qkv[:, heads * head_dim :].clone()
    kernel.rotary(qk, cos, sin)
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, heads * head_dim :], untouched)


def test_silu_times_up_is_within_one_rounding_of_torch(kernel: NativePointwise) -> None:
    generator = torch.Generator().manual_seed(3)
    gate_up = _bf16(generator, 40, 2 * 384, std=3.0)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = kernel.silu_mul(gate_up)
    assert got.shape == want.shape
    exact = float(torch.eq(got, want).float().mean())
    assert exact > 0.99  # exp differs from torch's in the last float bits, rarely
    # one ulp of SiLU, then the product's rounding: two bf16 roundings (8 bits each)
    assert bool(((got.float() - want.float()).abs() <= want.float().abs() * 2**-6).all())


def test_rows_split_over_threads_give_the_same_bits(kernel: NativePointwise) -> None:
    """Calls this large split their rows over torch's threads; 1, 2 and 3 threads (one
    more than rows divide evenly into) give the same bits."""
    generator = torch.Generator().manual_seed(9)
    x, delta = _bf16(generator, 80, 576, std=3.0), _bf16(generator, 80, 576)
    weight = (1 + _bf16(generator, 576, std=0.2)).to(torch.bfloat16)
    gate_up = _bf16(generator, 80, 2 * 1536, std=3.0)
    threads = torch.get_num_threads()
    outputs = []
    try:
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            residual = x.clone()
            normed = kernel.add_rms_norm(residual, delta, weight, EPS)
            outputs.append(
                (kernel.rms_norm(x, weight, EPS), residual, normed, kernel.silu_mul(gate_up))
            )
    finally:
        torch.set_num_threads(threads)
    for other in outputs[1:]:
        for a, b in zip(outputs[0], other, strict=True):
            assert b is not None and torch.equal(a, b)


def test_the_engine_tracks_float32_as_closely_with_the_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYMSPEC_KERNEL_CACHE", str(tmp_path))
    model = build_tiny_llama(seed=11)
    half = copy.deepcopy(model).to(torch.bfloat16)
    fused, plain = LlamaEngine(half), LlamaEngine(half, native_pointwise=False)
    assert fused.pointwise is not None and plain.pointwise is None
    generator = torch.Generator().manual_seed(12)
    sequence = torch.randint(0, TINY_VOCAB, (50,), generator=generator).tolist()
    expected = torch.softmax(full_logits(model, sequence)[30:], -1)
    err = {}
    for name, engine in (("fused", fused), ("plain", plain)):
        engine.open("s", sequence[:30])
        rows = [engine.forward_new([("s", sequence[30:45])])[0]]
        rows += [engine.forward_new([("s", [t])])[0] for t in sequence[45:50]]
        got = torch.softmax(torch.cat(rows)[: len(expected)], -1)
        err[name] = float((got - expected).abs().max())
    assert 0.0 < err["fused"] <= err["plain"] + 0.02, err


def test_inputs_given_to_a_forward_are_not_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel adds to the residual stream in place: a feature draft's fused inputs must
    come back as they went in."""
    monkeypatch.setenv("ASYMSPEC_KERNEL_CACHE", str(tmp_path))
    engine = LlamaEngine(build_tiny_llama(seed=13).to(torch.bfloat16))
    assert engine.pointwise is not None
    inputs = _bf16(torch.Generator().manual_seed(14), 3, engine.embed.shape[1])
    before = inputs.clone()
    engine.open("s", [1, 2])
    engine.forward_features([("s", [3, 4, 5])], [1], [0], inputs=inputs)
    assert torch.equal(inputs, before)


def test_settings_switch_the_kernel_off_and_on_demands_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ASYMSPEC_KERNEL_CACHE", str(tmp_path))
    half = build_tiny_llama(seed=2).to(torch.bfloat16)
    monkeypatch.setenv("ASYMSPEC_NATIVE_POINTWISE", "off")
    assert LlamaEngine(half).pointwise is None
    monkeypatch.setenv("ASYMSPEC_NATIVE_POINTWISE", "on")
    assert LlamaEngine(half).pointwise is not None
    with pytest.raises(KernelUnavailable, match="float32"):
        LlamaEngine(build_tiny_llama(seed=2))
    monkeypatch.setenv("ASYMSPEC_NATIVE_POINTWISE", "auto")
    assert LlamaEngine(build_tiny_llama(seed=2)).pointwise is None
