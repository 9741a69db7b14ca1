"""Native decode and verify attention: one C call per layer for all of a forward's sessions.

Why: ``LlamaEngine`` keeps each session's KV in its own slot, so its attention was one
``scaled_dot_product_attention`` call per session and layer. For a 16-session decode step
of SmolLM2-135M (30 layers, ~500 cached positions each, 2 threads, AMX Xeon) those 480
calls took half the forward: ~76 us each, where reading the call's keys and values at the
machine's bandwidth takes ~18 us (``loadtest/results/native-attention/``). Each call pays
ATen's dispatch and its flash kernel's set-up, and parallelises only over 3 KV heads.

``native_attention.c`` does the same arithmetic (bf16 products accumulated in float32, a
float32 softmax, bf16 output) for every (session, KV head) of the forward in one OpenMP
loop on torch's own thread pool, and writes the new keys and values into the slots as it
goes. Sessions with many new tokens (prefill chunks) go, on AMX, to the same library's
prefill path, which blocks 16 positions of one query head per work item instead (torch's
CPU flash kernel took 40 % of a 2,000-token prefill here, ~385 GFLOP/s); without AMX they
stay with torch's flash kernel, whose blocked products win there over dot products.

The scores (queries against keys) run on AMX tiles where the CPU has them, else as
AVX512-BF16 dot products on keys transposed 16 at a time. The value sums are float32 FMAs
for a decode step's few queries; for a verify block's, AMX tile products of the weights
split into two bf16 parts.

It is built and loaded by ``asymspec_engine.native_build``. It needs a bfloat16 model
on a CPU with AVX512-BF16 (every CPU for which the engine picks bf16 has it). Where there
is no compiler, or the setting says ``off``, the engine keeps the per-session calls.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from asymspec_engine.hardware import cpu_flags
from asymspec_engine.native_build import build, load_kernel

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_attention.c")
LIBS = ("-lmvec", "-lm")  # glibc's vector math: the softmax's expf, 16 lanes at a time
# Above this many new tokens per session (prefill chunks) the decode path's per-(session, KV
# head) items parallelise badly and its per-query dot products lose to blocked products:
# such sessions go to the prefill path (AMX) or to torch's flash kernel.
MAX_NEW_TOKENS = 16


def unsupported_reason(dtype: torch.dtype, device: torch.device, head_dim: int) -> str | None:
    """Why this engine cannot use the kernel; None when it can."""
    if device.type != "cpu":
        return f"the model is on {device.type}, not a CPU"
    if dtype != torch.bfloat16:
        return f"the model is {dtype}, not bfloat16"
    if "avx512_bf16" not in cpu_flags():
        return "the CPU lacks AVX512-BF16"
    if head_dim % 32 != 0 or head_dim > 256:
        return f"head size {head_dim} is not a multiple of 32 up to 256"
    return None


_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int


@dataclass(slots=True)
class SessionPlan:
    """The sessions one forward hands the kernel, as the C arrays it reads every layer."""

    count: int
    row0: np.ndarray  # int64 [count]: each session's first row among the forward's T
    n_new: np.ndarray
    base: np.ndarray  # cached positions before this forward
    slots: np.ndarray  # each slot's data pointer
    capacity: np.ndarray


class NativeAttention:
    """The loaded kernel. Stateless: one engine's forwards call it from one thread."""

    def __init__(self, library: Path) -> None:
        self.library = ctypes.CDLL(str(library))  # after torch: it binds to torch's libgomp
        attend = self.library.asymspec_attend_bf16
        attend.argtypes = [_INT, _P, _P, _P, _P, _P, _INT]
        attend.argtypes += [_P, _I64, _P, _I64, _P, _I64, _P, _INT, _INT, _INT, ctypes.c_float]
        attend.argtypes += [_INT]
        attend.restype = _INT
        self._attend = attend
        prefill = self.library.asymspec_prefill_bf16
        prefill.argtypes, prefill.restype = attend.argtypes, _INT
        self._prefill = prefill
        self.library.asymspec_attention_uses_amx.restype = _INT
        self.library.asymspec_prefill_max_head_dim.restype = _INT
        # the kernel's own limit (its query block's chunks fill four tiles)
        self.prefill_max_head_dim = int(self.library.asymspec_prefill_max_head_dim())
        self.library.asymspec_attention_allow_amx.argtypes = [_INT]
        log.info("native attention: scores on %s", "AMX tiles" if self.uses_amx else "AVX512-BF16")

    @property
    def uses_amx(self) -> bool:
        """Whether the scores go through AMX tiles (compiled for them and allowed by the
        kernel); otherwise AVX512-BF16 dot products."""
        return bool(self.library.asymspec_attention_uses_amx())

    def prefills(self, head_dim: int) -> bool:
        """Whether ``prefill`` runs here for heads of ``head_dim`` (it needs AMX tiles and
        at most ``prefill_max_head_dim``); else prefill chunks stay with torch's flash kernel."""
        return self.uses_amx and head_dim <= self.prefill_max_head_dim

    def allow_amx(self, allow: bool) -> None:
        """Tests: the AVX512-BF16 path on a machine that has AMX (False), or back."""
        self.library.asymspec_attention_allow_amx(int(allow))

    @classmethod
    def for_engine(
        cls, dtype: torch.dtype, device: torch.device, head_dim: int, use: bool | None = None
    ) -> NativeAttention | None:
        """The kernel if it is wanted and can run here; else None (logged why). ``use``:
        True requires it, False declines it, None leaves it to the settings."""
        reason = unsupported_reason(dtype, device, head_dim)
        return load_kernel(
            "attention", use, reason, lambda settings: cls(build(SOURCE, settings, LIBS))
        )

    @staticmethod
    def plan(
        row0: Sequence[int],
        n_new: Sequence[int],
        base: Sequence[int],
        slots: Sequence[torch.Tensor],
    ) -> SessionPlan:
        """``slots``: each session's contiguous [layers, 2, H_kv, capacity, D] bf16 slot,
        already large enough for base + n_new positions."""
        for slot in slots:
            if slot.dtype != torch.bfloat16 or not slot.is_contiguous():
                raise ValueError("a KV slot must be a contiguous bfloat16 tensor")
        return SessionPlan(
            count=len(slots),
            row0=np.asarray(row0, dtype=np.int64),
            n_new=np.asarray(n_new, dtype=np.int64),
            base=np.asarray(base, dtype=np.int64),
            slots=np.asarray([slot.data_ptr() for slot in slots], dtype=np.int64),
            capacity=np.asarray([slot.shape[3] for slot in slots], dtype=np.int64),
        )

    def attend(
        self,
        plan: SessionPlan,
        layer: int,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        out: torch.Tensor,
        scale: float,
    ) -> None:
        """Writes the plan's new keys and values into layer ``layer`` of their slots and
        the attention of their queries into their rows of ``out``.

        ``q`` [T, H, D], ``k_new`` and ``v_new`` [T, H_kv, D]: bf16, each row's heads
        contiguous (rows may be strided); ``out`` [T, H, D] contiguous bf16.
        """
        self._call(self._attend, plan, layer, q, k_new, v_new, out, scale)

    def prefill(
        self,
        plan: SessionPlan,
        layer: int,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        out: torch.Tensor,
        scale: float,
    ) -> None:
        """``attend`` for sessions with many new tokens (prefill chunks); needs
        ``prefills`` for the head size."""
        if not self.prefills(q.shape[2]):
            raise RuntimeError(
                f"the native prefill attention needs AMX tiles and heads of at most "
                f"{self.prefill_max_head_dim}"
            )
        self._call(self._prefill, plan, layer, q, k_new, v_new, out, scale)

    def _call(
        self,
        entry: Callable[..., int],
        plan: SessionPlan,
        layer: int,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        out: torch.Tensor,
        scale: float,
    ) -> None:
        heads, kv_heads, head_dim = q.shape[1], k_new.shape[1], q.shape[2]
        for t in (q, k_new, v_new, out):
            if t.dtype != torch.bfloat16 or t.stride(2) != 1 or t.stride(1) != head_dim:
                raise ValueError("q, k_new, v_new and out must be bf16 with contiguous heads")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        rc = entry(
            plan.count,
            plan.row0.ctypes.data,
            plan.n_new.ctypes.data,
            plan.base.ctypes.data,
            plan.slots.ctypes.data,
            plan.capacity.ctypes.data,
            layer,
            q.data_ptr(),
            q.stride(0),
            k_new.data_ptr(),
            k_new.stride(0),
            v_new.data_ptr(),
            v_new.stride(0),
            out.data_ptr(),
            heads,
            kv_heads,
            head_dim,
            scale,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"native attention failed ({rc}): out of memory or bad shapes")
