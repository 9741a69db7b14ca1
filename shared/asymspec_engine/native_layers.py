"""A forward's decoder layers in one native call (``native_layers.c``).

Why: with every kernel native, what a layer costs beside its kernels is the Python that
drives them: nine calls a layer, each checking arguments, allocating its output and
crossing ctypes (10-25 us each here), about 6 ms of a 21 ms one-session decode step over
SmolLM2-135M's 30 layers. ``native_layers.c`` runs the same kernels with the same arguments
in the same order, through the entry points of the libraries already loaded, so a forward
gives the same bits with or without it (``tests/engine/test_native_layers.py``).

It needs all three kernels (linear, pointwise, attention) and a forward whose sessions all
go to the native attention; the engine keeps its Python loop otherwise.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from asymspec_engine.native_attention import NativeAttention, SessionPlan
from asymspec_engine.native_build import (
    KernelUnavailable,
    NativeKernelSettings,
    build,
    load_kernel,
)
from asymspec_engine.native_linear import NativeLinear
from asymspec_engine.native_pointwise import NativePointwise

SOURCE = Path(__file__).with_name("native_layers.c")

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class _Kernels(ctypes.Structure):
    _fields_ = [
        (name, _P) for name in ("linear", "add_rms_norm", "rotary", "silu_mul", "attend", "prefill")
    ]


class _LayerWeights(ctypes.Structure):
    _fields_ = [
        (name, _P)
        for name in (
            "qkv",
            "o",
            "gate_up",
            "down",
            "qkv_bias",
            "o_bias",
            "gate_up_bias",
            "down_bias",
            "post_norm",
            "next_norm",
        )
    ]


class _Sessions(ctypes.Structure):
    _fields_ = [
        ("count", _I64),
        ("row0", _P),
        ("n", _P),
        ("base", _P),
        ("slots", _P),
        ("cap", _P),
    ]


class _Shape(ctypes.Structure):
    _fields_ = [
        ("T", _I64),
        ("hidden", _I64),
        ("I", _I64),
        ("H", _I64),
        ("H_kv", _I64),
        ("D", _I64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("threads", ctypes.c_int),
    ]


class PackedLinear(Protocol):
    """What the loop reads of a linear layer: the native kernel's packed weight and its
    float32 bias (or None)."""

    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def bias(self) -> torch.Tensor | None: ...


class DecoderLayer(Protocol):
    """What the loop reads of a decoder layer."""

    @property
    def input_norm(self) -> torch.Tensor: ...

    @property
    def qkv(self) -> PackedLinear: ...

    @property
    def o(self) -> PackedLinear: ...

    @property
    def post_norm(self) -> torch.Tensor: ...

    @property
    def gate_up(self) -> PackedLinear: ...

    @property
    def down(self) -> PackedLinear: ...


def _address(library: ctypes.CDLL, name: str) -> int:
    address = ctypes.cast(getattr(library, name), _P).value
    assert address is not None
    return address


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else int(t.data_ptr())


def _sessions(plan: SessionPlan | None) -> _Sessions:
    if plan is None:
        return _Sessions(0, None, None, None, None, None)
    arrays = (plan.row0, plan.n_new, plan.base, plan.slots, plan.capacity)
    return _Sessions(plan.count, *(a.ctypes.data for a in arrays))


class NativeLayers:
    """The loaded loop, bound to one engine's kernels and weights (``bind``)."""

    def __init__(
        self,
        library: Path,
        linear: NativeLinear,
        pointwise: NativePointwise,
        attention: NativeAttention,
    ) -> None:
        self.library = ctypes.CDLL(str(library))
        run = self.library.asymspec_layers_bf16
        # kernels, layers, their count, shape, the two session lists, then nine tensors
        run.argtypes = [_P, _P, ctypes.c_int, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P]
        run.restype = ctypes.c_int
        self._run = run
        self._kernels = _Kernels(
            _address(linear.library, "asymspec_linear_bf16"),
            _address(pointwise.library, "asymspec_add_rms_norm"),
            _address(pointwise.library, "asymspec_rotary"),
            _address(pointwise.library, "asymspec_silu_mul"),
            _address(attention.library, "asymspec_attend_bf16"),
            _address(attention.library, "asymspec_prefill_bf16"),
        )
        self._layers: ctypes.Array[_LayerWeights] | None = None
        self._keep: list[torch.Tensor] = []  # the tensors whose pointers _layers holds

    @classmethod
    def for_engine(
        cls,
        linear: NativeLinear | None,
        pointwise: NativePointwise | None,
        attention: NativeAttention | None,
        use: bool | None = None,
    ) -> NativeLayers | None:
        """The loop where the engine has all three native kernels and it is wanted; else
        None (logged why). ``use``: True requires it, False declines it, None leaves it to
        the settings (``ASYMSPEC_NATIVE_LAYERS``)."""
        missing = [
            name
            for name, kernel in (
                ("linear", linear),
                ("pointwise", pointwise),
                ("attention", attention),
            )
            if kernel is None
        ]
        reason = f"no native {', '.join(missing)} kernel" if missing else None

        def load(settings: NativeKernelSettings) -> NativeLayers:
            if linear is None or pointwise is None or attention is None:  # (reason says)
                raise KernelUnavailable(str(reason))
            return cls(build(SOURCE, settings), linear, pointwise, attention)

        return load_kernel("layers", use, reason, load)

    def bind(self, layers: Sequence[DecoderLayer]) -> None:
        """The engine's layers, once their weights are packed (and again if they change)."""
        table = (_LayerWeights * len(layers))()
        keep: list[torch.Tensor] = []
        for i, layer in enumerate(layers):
            following = layers[i + 1].input_norm if i + 1 < len(layers) else None
            linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
            for t in [lin.weight for lin in linears] + [layer.post_norm]:
                if t.dtype != torch.bfloat16 or not t.is_contiguous():
                    raise ValueError("the loop takes contiguous bf16 weights and norms")
            table[i] = _LayerWeights(
                *(_ptr(lin.weight) for lin in linears),
                *(_ptr(lin.bias) for lin in linears),
                _ptr(layer.post_norm),
                _ptr(following),
            )
            keep += [lin.weight for lin in linears] + [
                lin.bias for lin in linears if lin.bias is not None
            ]
            keep += [layer.post_norm] + ([] if following is None else [following])
        self._layers, self._keep = table, keep

    def run(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        decoding: SessionPlan | None,
        prefilling: SessionPlan | None,
        heads: tuple[int, int, int],
        intermediate: int,
        eps: float,
        scale: float,
    ) -> None:
        """Every bound layer over x [T, hidden] (the residual stream, in place) and h, its
        rows normed by the first layer's input norm; on return h holds nothing useful.
        cos, sin [T, D]. ``heads``: (H, H_kv, D). Every row must belong to a session of
        ``decoding`` or ``prefilling``."""
        if self._layers is None:
            raise RuntimeError("bind the engine's layers first")
        for t in (x, h, cos, sin):
            if t.dtype != torch.bfloat16 or not t.is_contiguous():
                raise ValueError("x, h, cos and sin must be contiguous bf16")
        h_q, h_kv, d = heads
        rows, hidden = x.shape
        threads = torch.get_num_threads()
        shape = _Shape(rows, hidden, intermediate, h_q, h_kv, d, eps, scale, threads)
        qkv = x.new_empty((rows, (h_q + 2 * h_kv) * d))
        attn = x.new_empty((rows, h_q * d))
        delta = x.new_empty((rows, hidden))
        gate_up = x.new_empty((rows, 2 * intermediate))
        act = x.new_empty((rows, intermediate))
        rc = self._run(
            ctypes.byref(self._kernels),
            self._layers,
            len(self._layers),
            ctypes.byref(shape),
            ctypes.byref(_sessions(decoding)),
            ctypes.byref(_sessions(prefilling)),
            *(t.data_ptr() for t in (x, h, cos, sin, qkv, attn, delta, gate_up, act)),
        )
        if rc != 0:
            layer, step = divmod(rc, 1000)
            raise RuntimeError(f"native layers failed at layer {layer - 1}, step {step}")
