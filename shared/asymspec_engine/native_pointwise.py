"""A decoder layer's pointwise work fused in C (``native_pointwise.c``): RMSNorm with the
residual add before it, the rotary embedding in place, SiLU(gate) * up.

Why: torch spends ~17 ops a layer on them, each with dispatch and a thread-pool fork on a
few kilobytes, which cost up to a quarter of a bf16 decode or verify forward at 16-80 rows
(``loadtest/results/native-linear/``). The roundings are torch's op by op, so the engine's
bf16 arithmetic is unchanged up to float32 evaluation order. bf16 on x86 CPUs only (the
engine keeps torch's ops elsewhere, and in float32).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from asymspec_engine.native_build import build, load_kernel

SOURCE = Path(__file__).with_name("native_pointwise.c")
LIBS = ("-lmvec", "-lm")  # glibc's vector expf for SiLU
MAX_HEAD_DIM = 512


def unsupported_reason(dtype: torch.dtype, device: torch.device, head_dim: int) -> str | None:
    """Why this engine cannot use the kernel; None when it can."""
    if device.type != "cpu":
        return f"the model is on {device.type}, not a CPU"
    if dtype != torch.bfloat16:
        return f"the model is {dtype}, not bfloat16"
    if head_dim % 2 != 0 or head_dim > MAX_HEAD_DIM:
        return f"head size {head_dim} is not even up to {MAX_HEAD_DIM}"
    return None


def _ptr(t: torch.Tensor) -> int:
    return int(t.data_ptr())


class NativePointwise:
    """The loaded kernel. Stateless; a norm or SiLU call with enough rows splits them over
    torch's threads (``torch.get_num_threads()``), the rest run on the calling thread."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        lib.asymspec_rms_norm.argtypes = [p, i64, i64, p, f32, p, i32]
        lib.asymspec_add_rms_norm.argtypes = [p, p, i64, i64, p, f32, p, i32]
        lib.asymspec_rotary.argtypes = [p, i64, i64, i64, i64, p, p]
        lib.asymspec_silu_mul.argtypes = [p, i64, i64, p, i32]
        for name in ("rms_norm", "add_rms_norm", "rotary", "silu_mul"):
            getattr(lib, f"asymspec_{name}").restype = None
        self.library = lib

    @classmethod
    def for_engine(
        cls, dtype: torch.dtype, device: torch.device, head_dim: int, use: bool | None = None
    ) -> NativePointwise | None:
        """The kernel if it is wanted and can run here; else None (logged why). ``use``:
        True requires it, False declines it, None leaves it to the settings."""
        reason = unsupported_reason(dtype, device, head_dim)
        return load_kernel(
            "pointwise", use, reason, lambda settings: cls(build(SOURCE, settings, LIBS))
        )

    @staticmethod
    def _check(*tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.dtype != torch.bfloat16 or not t.is_contiguous():
                raise ValueError("the pointwise kernel takes contiguous bf16 tensors")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * RMSNorm(x) for x [T, H]."""
        self._check(x, weight)
        out = torch.empty_like(x)
        rows, width = x.shape
        self.library.asymspec_rms_norm(
            _ptr(x), rows, width, _ptr(weight), eps, _ptr(out), torch.get_num_threads()
        )
        return out

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None, eps: float
    ) -> torch.Tensor | None:
        """x += delta in place (the residual stream, [T, H]); then weight * RMSNorm(x), or
        None without a weight."""
        self._check(x, delta, *([] if weight is None else [weight]))
        if delta.shape != x.shape:
            raise ValueError(f"delta {tuple(delta.shape)} for x {tuple(x.shape)}")
        rows, width = x.shape
        out = None if weight is None else torch.empty_like(x)
        self.library.asymspec_add_rms_norm(
            _ptr(x),
            _ptr(delta),
            rows,
            width,
            None if weight is None else _ptr(weight),
            eps,
            None if out is None else _ptr(out),
            torch.get_num_threads(),
        )
        return out

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """In place: qk [T, heads, D] (each row's heads contiguous, rows may be strided)
        rotated by cos and sin [T, D]."""
        self._check(cos, sin)
        rows, heads, dim = qk.shape
        if qk.dtype != torch.bfloat16 or qk.stride(2) != 1 or qk.stride(1) != dim:
            raise ValueError("qk must be bf16 with contiguous heads")
        if cos.shape != (rows, dim) or sin.shape != (rows, dim):
            raise ValueError("cos and sin must be [T, D]")
        self.library.asymspec_rotary(_ptr(qk), rows, qk.stride(0), heads, dim, _ptr(cos), _ptr(sin))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up for gate_up [T, 2 I] laid out [gate | up]; [T, I]."""
        self._check(gate_up)
        rows, width = gate_up.shape
        out = gate_up.new_empty((rows, width // 2))
        self.library.asymspec_silu_mul(
            _ptr(gate_up), rows, width // 2, _ptr(out), torch.get_num_threads()
        )
        return out
