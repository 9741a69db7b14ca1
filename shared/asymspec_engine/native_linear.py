"""Native bf16 linear layers on AMX tiles (``native_linear.c``).

Why: a decode step of a small model is mostly its weights streaming through the linear
layers, and oneDNN's packed bf16 products read them at about half the speed the memory
gives on an AMX Xeon with 2 cores: SmolLM2-135M's products cost 28-33 ms at 16 rows on
2 threads, where this kernel takes 15-16 ms and the bandwidth allows ~13. It stays ahead
up to 512 rows (95 against 108 ms at 256, 2 threads) and is level at 1,024
(``loadtest/results/native-linear/``), so on AMX it replaces oneDNN for every product.

The arithmetic is oneDNN's on AMX: bf16 products summed in float32 by ``tdpbf16ps``, the
bias added in float32, the result rounded to bf16 (nearest even).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from asymspec_engine.hardware import cpu_has_amx
from asymspec_engine.native_build import KernelUnavailable, build, load_kernel

SOURCE = Path(__file__).with_name("native_linear.c")
K_MULTIPLE = 32  # a tile's depth: every input width must be a multiple of it


def unsupported_reason(
    dtype: torch.dtype, device: torch.device, in_features: list[int]
) -> str | None:
    """Why these linear layers cannot use the kernel; None when they can."""
    if device.type != "cpu":
        return f"the model is on {device.type}, not a CPU"
    if dtype != torch.bfloat16:
        return f"the model is {dtype}, not bfloat16"
    if not cpu_has_amx():
        return "the CPU lacks AMX-BF16"
    odd = sorted({k for k in in_features if k % K_MULTIPLE != 0})
    if odd:
        return f"input widths {odd} are not multiples of {K_MULTIPLE}"
    return None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] bf16 in the kernel's layout: per block of 16 output columns (the
    last padded with zeros), its K/32 tiles of [16 k-pairs][16 columns][2]."""
    n, k = weight.shape
    if k % K_MULTIPLE != 0:
        raise ValueError(f"input width {k} is not a multiple of {K_MULTIPLE}")
    padded = F.pad(weight.to(torch.bfloat16), (0, 0, 0, -n % 16))
    tiles = padded.view(-1, 16, k // 32, 16, 2)  # [col block, col, k tile, k pair, 2]
    return tiles.permute(0, 2, 3, 1, 4).contiguous()


class NativeLinear:
    """The loaded kernel. Stateless; any thread may call it."""

    def __init__(self, library: Path) -> None:
        self.library = ctypes.CDLL(str(library))  # after torch: it binds to torch's libgomp
        self.library.asymspec_linear_uses_amx.restype = ctypes.c_int
        if not self.library.asymspec_linear_uses_amx():
            raise KernelUnavailable(
                "the kernel may not use AMX tiles here (not built for "
                "them, or the OS refused tile data)"
            )
        run = self.library.asymspec_linear_bf16
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        run.argtypes = [p, i64, i64, p, i64, p, p, ctypes.c_int]
        run.restype = ctypes.c_int
        self._run = run

    @classmethod
    def for_engine(
        cls,
        dtype: torch.dtype,
        device: torch.device,
        in_features: list[int],
        use: bool | None = None,
    ) -> NativeLinear | None:
        """The kernel if it is wanted and can run here; else None (logged why). ``use``:
        True requires it, False declines it, None leaves it to the settings."""
        reason = unsupported_reason(dtype, device, in_features)
        return load_kernel("linear", use, reason, lambda settings: cls(build(SOURCE, settings)))

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x`` [M, K] bf16 (rows contiguous) times the packed weight; [M, out_features]
        bf16. ``bias``: float32 [out_features] or None."""
        rows, k = x.shape
        if x.dtype != torch.bfloat16 or x.stride(1) != 1 or x.stride(0) != k:
            x = x.to(torch.bfloat16).contiguous()
        if packed.shape[1] * K_MULTIPLE != k:
            raise ValueError(f"x has {k} columns, the weight {packed.shape[1] * K_MULTIPLE}")
        y = x.new_empty((rows, out_features))
        if rows == 0:
            return y
        rc = self._run(
            x.data_ptr(),
            rows,
            k,
            packed.data_ptr(),
            out_features,
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"native linear failed ({rc}): out of memory or bad shapes")
        return y
