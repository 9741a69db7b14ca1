"""The native AMX linear kernel: its packing, its products against float64 on the same bf16
inputs (every row and column count it special-cases), the same bits on any thread count,
and the engine's forwards with it tracking float32 as closely as with oneDNN's products.
Built here with the machine's compiler; skipped where the CPU lacks AMX or there is no
compiler (the engine then keeps oneDNN)."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch

from asymspec_engine import native_linear
from asymspec_engine.hardware import cpu_has_amx
from asymspec_engine.llama import LlamaEngine, WeightLayout
from asymspec_engine.native_build import KernelUnavailable, NativeKernelSettings, build
from asymspec_engine.native_linear import NativeLinear
from tests.engine.conftest import TINY_VOCAB, build_tiny_llama, full_logits

pytestmark = pytest.mark.skipif(
    not cpu_has_amx() or shutil.which("cc") is None,
    reason="the native linear kernel needs a CPU with AMX-BF16 and a C compiler",
)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> NativeLinear:
    cache = tmp_path_factory.mktemp("kernels")
    return NativeLinear(build(native_linear.SOURCE, NativeKernelSettings(kernel_cache=cache)))


def _bf16(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(torch.bfloat16)


def test_pack_lays_each_tile_out_as_amx_reads_it() -> None:
    """Tile (column block c, k tile t) row r holds columns 16c.. as (k = 32t + 2r, +1) pairs;
    columns past N are zeros."""
    weight = torch.arange(20 * 64, dtype=torch.float32).view(20, 64).to(torch.bfloat16)
    packed = native_linear.pack_weight(weight)
    assert packed.shape == (2, 2, 16, 16, 2)
    for c, t, r, col, pair in [(0, 0, 0, 0, 0), (0, 1, 3, 5, 1), (1, 0, 7, 3, 0), (1, 1, 15, 2, 1)]:
        n, k = 16 * c + col, 32 * t + 2 * r + pair
        assert packed[c, t, r, col, pair] == weight[n, k]
    assert bool(packed[1, :, :, 4:].eq(0).all())  # columns 20..31 do not exist
    with pytest.raises(ValueError, match="multiple of 32"):
        native_linear.pack_weight(torch.zeros(16, 48, dtype=torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 80, 81, 100, 128, 145])
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 32), (40, 96), (96, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_products_are_float32_sums_rounded_to_bf16(
    kernel: NativeLinear, rows: int, out_features: int, in_features: int, with_bias: bool
) -> None:
    """Against float64 on the same bf16 inputs: within one bf16 rounding (plus float32's
    summation error), for partial row blocks, several passes of row blocks (128 and 145
    rows: two passes each, 145's last block partial) and a partial column block."""
    generator = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    x = _bf16(generator, rows, in_features)
    weight = _bf16(generator, out_features, in_features)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    y = kernel(x, native_linear.pack_weight(weight), out_features, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
    want = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    summing = in_features * 2**-23 * (x.double().abs() @ weight.double().abs().T)
    assert bool(((y.double() - want).abs() <= want.abs() * 2**-8 + summing + 1e-30).all())


@pytest.mark.parametrize("rows", [33, 150])
def test_thread_counts_give_the_same_bits(kernel: NativeLinear, rows: int) -> None:
    """Each column block is summed by one thread in one order, however many there are."""
    generator = torch.Generator().manual_seed(7)
    x, weight = _bf16(generator, rows, 128), _bf16(generator, 200, 128)
    packed = native_linear.pack_weight(weight)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(kernel(x, packed, 200, None))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(kernel: NativeLinear) -> None:
    """Each sum runs over k in order, whichever pass of row blocks its row falls in, so a
    row's products are the same alone, in one pass, or in the third of three."""
    generator = torch.Generator().manual_seed(9)
    x, weight = _bf16(generator, 200, 96), _bf16(generator, 72, 96)
    packed = native_linear.pack_weight(weight)
    together = kernel(x, packed, 72, None)  # 13 row blocks: passes of 5, 5 and 3
    for start, stop in ((0, 100), (100, 200), (190, 191)):  # 7, 7 and 1 row blocks
        assert torch.equal(together[start:stop], kernel(x[start:stop], packed, 72, None))


def test_strided_rows_are_read_as_their_values(kernel: NativeLinear) -> None:
    generator = torch.Generator().manual_seed(8)
    wide, weight = _bf16(generator, 20, 128), _bf16(generator, 32, 64)
    packed = native_linear.pack_weight(weight)
    assert torch.equal(
        kernel(wide[:, :64], packed, 32, None), kernel(wide[:, :64].clone(), packed, 32, None)
    )


def test_the_engine_runs_its_products_on_the_kernel_and_tracks_float32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYMSPEC_KERNEL_CACHE", str(tmp_path))
    model = build_tiny_llama(seed=5)
    half = copy.deepcopy(model).to(torch.bfloat16)
    native, onednn = LlamaEngine(half), LlamaEngine(half, native_linear=False)
    assert native.layout is WeightLayout.AMX_NATIVE and native.native_linear is not None
    assert onednn.layout is WeightLayout.ONEDNN_BF16
    assert [native.padded_rows(r) for r in (0, 1, 16, 17, 80)] == [0, 16, 16, 32, 80]
    generator = torch.Generator().manual_seed(9)
    sequence = torch.randint(0, TINY_VOCAB, (60,), generator=generator).tolist()
    expected = torch.softmax(full_logits(model, sequence)[40:], -1)
    err = {}
    for name, engine in (("native", native), ("onednn", onednn)):
        engine.open("s", sequence[:40])
        # a 17-row block (two row blocks), then one-row steps
        rows = [engine.forward_new([("s", sequence[40:57])])[0]]
        rows += [engine.forward_new([("s", [t])])[0] for t in sequence[57:60]]
        got = torch.softmax(torch.cat(rows)[: len(expected)], -1)
        err[name] = float((got - expected).abs().max())
    assert 0.0 < err["native"] <= err["onednn"] + 0.02, err


def test_a_restricted_head_scores_its_columns_as_the_whole_head_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A draft's head of 37 tokens: a partial column block, masked stores."""
    monkeypatch.setenv("ASYMSPEC_KERNEL_CACHE", str(tmp_path))
    half = build_tiny_llama(seed=6).to(torch.bfloat16)
    whole, restricted = LlamaEngine(half), LlamaEngine(half)
    kept = list(range(1, TINY_VOCAB, 2))[:37]
    restricted.restrict_head(kept)
    for engine in (whole, restricted):
        engine.open("s", [1, 2, 3, 4])
    (full,) = whole.forward_new([("s", [5, 6])])
    (only,) = restricted.forward_new([("s", [5, 6])], head_only=True)
    assert only.shape == (2, 37)
    assert torch.equal(only, full[:, kept])


def test_settings_switch_the_kernel_off_and_on_demands_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ASYMSPEC_KERNEL_CACHE", str(tmp_path))
    half = build_tiny_llama(seed=2).to(torch.bfloat16)
    monkeypatch.setenv("ASYMSPEC_NATIVE_LINEAR", "off")
    assert LlamaEngine(half).layout is WeightLayout.ONEDNN_BF16
    monkeypatch.setenv("ASYMSPEC_NATIVE_LINEAR", "on")
    assert LlamaEngine(half).layout is WeightLayout.AMX_NATIVE
    assert len(list(tmp_path.glob("native_linear-*.so"))) == 1
    with pytest.raises(KernelUnavailable, match="float32"):
        LlamaEngine(build_tiny_llama(seed=2))
    monkeypatch.setenv("ASYMSPEC_NATIVE_LINEAR", "auto")
    assert LlamaEngine(build_tiny_llama(seed=2)).layout is WeightLayout.PLAIN
    odd = build_tiny_llama(seed=2, hidden_size=48).to(torch.bfloat16)  # 48: not a tile's depth
    assert LlamaEngine(odd).layout is WeightLayout.ONEDNN_BF16
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("ASYMSPEC_KERNEL_CACHE", str(tmp_path / "empty"))
    assert LlamaEngine(half).layout is WeightLayout.ONEDNN_BF16
