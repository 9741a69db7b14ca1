"""A decoder engine for Llama-family checkpoints (Llama, SmolLM2, Qwen2, Mistral).

transformers runs one padded batch through a cache object rebuilt per forward, and its
LM head scores every position. This engine owns the whole forward instead, because on a
CPU everything beside the matrix products is what made a forward slow:

- **ragged batches**: the new tokens of every session in a batch are laid end to end in
  one ``[T, hidden]`` matrix, so the projections and the MLP run once for all sessions
  with no padding to the longest prefix; only attention runs per session, against that
  session's own cache, with its own causal offset;
- **KV slots**: each session owns one preallocated ``[layers, 2, H_kv, capacity, D]``
  tensor; a forward writes its new K/V in place and rollback (``truncate``) only moves a
  length; capacity grows geometrically and rarely;
- **logits only where needed**: each batch item says how many trailing rows it needs
  (γ+1 for a verify block, 1 for a decode step, 0 for a prefill chunk), and only those
  rows go through the final norm and the LM head;
- **AMX-tiled bf16 weights** on CPUs with AMX: the native kernel of
  ``asymspec_engine.native_linear`` streams the weights at close to the memory's
  bandwidth, about twice as fast as oneDNN's packed products at 1-80 rows;
- **prepacked bf16 weights** on CPUs with AVX512-BF16 (or AMX without the native kernel):
  oneDNN's packed layout
  (``mkldnn._reorder_linear_weight``) runs the same bf16 products 1.6x faster than
  ``F.linear`` here (``scripts/forward_cost.py`` records the figures); without AMX, rows
  are padded only to the next power of two below 16 (AMX computes 16-row tiles, AVX512
  every padded row), and products of at most 4 rows (decode steps) go through FBGEMM's
  fp16 kernel on the same weights, which streams them ~1.9x faster than oneDNN's at one
  row (``loadtest/results/engine-avx512bf16/``);
- **float16 weights** (``fp16_weights``) on x86 CPUs without native bf16 (AVX2): FBGEMM's
  packed fp16 matrices with float32 activations and accumulation. There, bf16 is emulated
  (5x slower than fp32 at 16 rows) and MKL's fp32 products are slow at a few rows; on an
  AVX2 EPYC one thread ran a one-session decode step in 27 instead of 56 ms and a 5-row
  verify in 37 instead of 106 ms (``loadtest/results/forward_cost-avx2/``), with fp16's
  11-bit mantissa (bf16 has 8).

The arithmetic is the transformers Llama decoder's (RMSNorm in float32, rotary embedding
from the model's own ``inv_freq``, SDPA with grouped-query attention), so in float32 the
logits match transformers to rounding. It has the same interface as ``CachedLM``, which
stays the fallback for other architectures.
"""

from __future__ import annotations

import enum
import itertools
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from asymspec_engine.engine import NewTokens, SessionTable
from asymspec_engine.hardware import cpu_has_amx, fp16_weights_supported
from asymspec_engine.native_attention import MAX_NEW_TOKENS, NativeAttention
from asymspec_engine.native_layers import NativeLayers
from asymspec_engine.native_linear import NativeLinear, pack_weight
from asymspec_engine.native_pointwise import NativePointwise

log = logging.getLogger("asymspec.engine")

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})
_CAPACITY_QUANTUM = 256  # KV slot capacity grows in multiples of this many positions
# torch's CPU flash attention in bf16 / fp16 on AMX runs oneDNN brgemm kernels that it
# JIT-compiles for each shape and keeps for good, per thread (at::native::cpublas's
# KernelCache). Its shapes follow the key length, so a server that sees every length keeps
# compiling: a verifier's memory grew 20 % in a 10-minute soak (loadtest/results/
# soak-kernel-cache/). Padding the keys it reads to a multiple of this (masked out) bounds
# them.
_TORCH_KEY_QUANTUM = 64
_PACK_BATCH_HINT = 16  # oneDNN picks its packed layout for about this many rows


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """None when this engine can run ``model``; else the reason it cannot (use ``CachedLM``)."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} is not a Llama-family decoder"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (only silu)"
    window = getattr(config, "sliding_window", None)
    sliding = window is not None and getattr(config, "use_sliding_window", True)
    if sliding and window < config.max_position_embeddings:
        return f"sliding-window attention ({window} positions)"
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", "default") == "dynamic":
        return "no static rotary embedding"
    return None


# torch marks FBGEMM's fp16 linear deprecated (its successor lives in a separate package);
# the pinned torch has it, and tests/engine/test_engine.py fails loudly once it does not.
warnings.filterwarnings("ignore", message="fbgemm_.*deprecated", category=UserWarning)


class WeightLayout(enum.Enum):
    """How the engine stores the linear layers' weights (chosen once, at load)."""

    PLAIN = "plain"  # the model's own tensors, F.linear
    AMX_NATIVE = "AMX-tiled bf16 (native kernel)"  # CPUs with AMX: native_linear.c
    ONEDNN_BF16 = "oneDNN-packed bf16"  # CPUs with AMX / AVX512-BF16
    # AVX512-BF16 without AMX: also FBGEMM fp16 packings for products of a few rows
    ONEDNN_BF16_FEW_ROWS_FP16 = "oneDNN-packed bf16 (FBGEMM float16 for few rows)"
    FBGEMM_FP16 = "FBGEMM-packed float16"  # float32 activations, fp16 weights (AVX2 CPUs)

    @property
    def packs_bf16(self) -> bool:
        """oneDNN's packed bf16 weights."""
        return self in (WeightLayout.ONEDNN_BF16, WeightLayout.ONEDNN_BF16_FEW_ROWS_FP16)

    @property
    def pads_rows(self) -> bool:
        """Whether its products compute more rows than they are fed (``_Linear.computed_rows``)."""
        return self.packs_bf16 or self is WeightLayout.AMX_NATIVE


class _Linear:
    """``y = x W^T (+ b)``, with W prepacked where that is faster (``WeightLayout``)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        layout: WeightLayout,
        native: NativeLinear | None = None,
    ) -> None:
        """``native``: the kernel, for the AMX_NATIVE layout (and only for it)."""
        if (native is not None) != (layout is WeightLayout.AMX_NATIVE):
            raise ValueError("the native kernel goes with the AMX_NATIVE layout only")
        self.layout = layout
        self.bias = bias
        self.native = native
        self.out_features = int(weight.shape[0])
        # (FBGEMM fp16 packing, float32 bias) for products of at most _FEW_ROWS rows
        self.few_rows: tuple[torch.Tensor, torch.Tensor] | None = None
        if native is not None:
            self.weight = pack_weight(weight)
            self.bias = None if bias is None else bias.float().contiguous()
        elif layout.packs_bf16:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
            if layout is WeightLayout.ONEDNN_BF16_FEW_ROWS_FP16:
                # bf16's 8-bit mantissa fits fp16's 11 bits: the same weights (but for the
                # 0.015 % below fp16's normal range), with float32 activations.
                self.few_rows = _fbgemm_fp16(weight, bias)
        elif layout is WeightLayout.FBGEMM_FP16:
            self.weight, self.bias = _fbgemm_fp16(weight, bias)
        else:
            self.weight = weight

    def computed_rows(self, rows: int) -> int:
        """The rows its product computes for ``rows`` rows of input (1 or more). oneDNN
        caches a primitive (~2 MB here) per distinct row count, so ragged batches of every
        size grew the cloud's memory without bound (1 to 400 rows cost 570 MB): its bf16
        products pad rows to a few bucket sizes instead (``_row_bucket``). The native AMX
        kernel computes whole 16-row tiles. FBGEMM's few-row products and the plain layouts
        compute exactly the rows they are fed."""
        if self.layout is WeightLayout.AMX_NATIVE:
            return -(-rows // 16) * 16
        if not self.layout.packs_bf16 or (self.few_rows is not None and rows <= _FEW_ROWS):
            return rows
        return _row_bucket(rows, _SMALL_BUCKETS_FROM)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] -> [T, out]
        if self.native is not None:
            return self.native(x, self.weight, self.out_features, self.bias)
        if self.layout is WeightLayout.PLAIN:
            return F.linear(x, self.weight, self.bias)
        if self.layout is WeightLayout.FBGEMM_FP16:
            return torch.fbgemm_linear_fp16_weight_fp32_activation(
                x.contiguous(), self.weight, self.bias
            )
        rows = x.shape[0]
        if self.few_rows is not None and rows <= _FEW_ROWS:
            packed, bias = self.few_rows
            out = torch.fbgemm_linear_fp16_weight_fp32_activation(
                x.float().contiguous(), packed, bias
            )
            return out.to(x.dtype)
        bucket = self.computed_rows(rows)
        if bucket != rows:
            x = F.pad(x, (0, 0, 0, bucket - rows))
        out = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return out[:rows]


def _fbgemm_fp16(
    weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FBGEMM's packed fp16 matrix and the float32 bias its call always takes."""
    packed = torch.fbgemm_pack_gemm_matrix_fp16(weight.float().contiguous())
    return packed, torch.zeros(weight.shape[0]) if bias is None else bias.float()


# AMX computes 16-row tiles, so padding fewer rows to 16 is free there; AVX512-BF16 alone
# computes every padded row: on an EPYC a one-row decode step padded to 16 rows cost 29 ms
# of products against 19.6 unpadded (gate_up alone, weights in cache: 280 against 72 us),
# so there the buckets below 16 rows are powers of two.
_SMALL_BUCKETS_FROM = 16 if cpu_has_amx() else 1
# Without AMX, oneDNN's bf16 kernels stream weights poorly at a row or two: the model's
# products cost 19.6 ms at one row against 10.3 ms for FBGEMM's fp16 kernel on the same
# weights (an AVX512-BF16 EPYC, one thread, cold caches; 16.2 against 14.8 at 4 rows, and
# bf16 wins from 8 on). So there the bf16 engine also keeps an fp16 packing for decode
# steps of a few rows: twice the weights' memory for a ~1.8x faster one-session step.
_FEW_ROWS = 4


def _row_bucket(rows: int, smallest: int = 16) -> int:
    """Powers of two from ``smallest`` to 16, then 32, 48, .., 128, then 192, 256, .., 512
    (steps of 64), then powers of two."""
    if rows <= 16:
        return max(smallest, 1 << (rows - 1).bit_length())
    if rows <= 128:
        return -(-rows // 16) * 16
    if rows <= 512:
        return -(-rows // 64) * 64
    return 1 << (rows - 1).bit_length()


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: _Linear  # hidden -> (H + 2 H_kv) D
    o: _Linear  # H D -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: _Linear  # hidden -> 2 I
    down: _Linear  # I -> hidden
    down_in: int  # I


@dataclass(frozen=True)
class RestrictedHead:
    """A draft's LM head over some of the vocabulary (``LlamaEngine.restrict_head``)."""

    ids: torch.Tensor  # [K] the tokens it scores, ascending
    columns: torch.Tensor  # [V] each token's column among ids, -1 for the tokens left out

    @classmethod
    def of(cls, ids: torch.Tensor, vocab_size: int) -> RestrictedHead:
        columns = torch.full((vocab_size,), -1, dtype=torch.long, device=ids.device)
        return cls(ids, columns.index_copy_(0, ids, torch.arange(len(ids), device=ids.device)))


@dataclass
class _Session:
    token_ids: list[int] = field(default_factory=list)
    kv: torch.Tensor | None = None  # [layers, 2, H_kv, capacity, D]

    @property
    def length(self) -> int:
        return len(self.token_ids)


def _weight_layout(
    model: PreTrainedModel,
    dtype: torch.dtype,
    fp16_weights: bool,
    few_rows_fp16: bool | None,
    native: NativeLinear | None,
) -> WeightLayout:
    """The native AMX kernel where it loaded (``native``); else oneDNN packing pays on CPUs
    in bf16 (AMX / AVX512-BF16 kernels), with FBGEMM fp16 packings beside it for few rows
    where there is no AMX (``few_rows_fp16``, None: where it pays); FBGEMM fp16 alone only
    when asked for (it changes the weights' precision, so the exact float32 mode is not it)."""
    if native is not None:  # never with fp16 weights: the engine does not load it then
        return WeightLayout.AMX_NATIVE
    on_cpu = model.device.type == "cpu"
    if fp16_weights:
        if not (on_cpu and dtype == torch.float32 and fp16_weights_supported()):
            raise ValueError("fp16 weights need a float32 model on an x86 CPU with AVX2")
        return WeightLayout.FBGEMM_FP16
    if (
        on_cpu
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    ):
        if few_rows_fp16 is None:
            few_rows_fp16 = not cpu_has_amx() and fp16_weights_supported()
        elif few_rows_fp16 and not fp16_weights_supported():
            raise ValueError("fp16 packings for few rows need an x86 CPU with AVX2 (FBGEMM)")
        return WeightLayout.ONEDNN_BF16_FEW_ROWS_FP16 if few_rows_fp16 else WeightLayout.ONEDNN_BF16
    if few_rows_fp16:
        raise ValueError("fp16 packings for few rows are for a bf16 model on a CPU")
    return WeightLayout.PLAIN


class LlamaEngine(SessionTable[_Session]):
    """Per-session KV slots and ragged batched forwards over a Llama-family decoder.

    Not thread-safe: one owner (the edge scheduler, the cloud batcher) drives it.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        fp16_weights: bool = False,
        few_rows_fp16: bool | None = None,
        native_attention: bool | None = None,
        native_linear: bool | None = None,
        native_pointwise: bool | None = None,
        native_layers: bool | None = None,
    ) -> None:
        """``native_attention``: the native decode/verify attention kernel (True: required,
        False: never; None: as ``ASYMSPEC_NATIVE_ATTENTION`` says, by default where it
        builds and suits the model; see ``asymspec_engine.native_attention``).
        ``native_linear``: the native AMX products, alike (``ASYMSPEC_NATIVE_LINEAR``,
        ``asymspec_engine.native_linear``); never with fp16 weights. ``native_pointwise``:
        the fused norms, rotary and SiLU, alike (``ASYMSPEC_NATIVE_POINTWISE``,
        ``asymspec_engine.native_pointwise``). ``native_layers``: the decoder layers in
        one native call where all three kernels are native, alike
        (``ASYMSPEC_NATIVE_LAYERS``, ``asymspec_engine.native_layers``)."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"LlamaEngine cannot run this model: {reason}")
        super().__init__()
        config = model.config
        self.model = model
        self.forward_calls = 0
        self.dtype = next(model.parameters()).dtype
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        )
        self.eps = float(config.rms_norm_eps)
        widths = [int(config.hidden_size), self.num_heads * self.head_dim]
        widths.append(int(config.intermediate_size))
        wants_fp16 = fp16_weights or bool(few_rows_fp16)
        self.native_linear = NativeLinear.for_engine(
            self.dtype, model.device, widths, False if wants_fp16 else native_linear
        )
        self.layout = _weight_layout(
            model, self.dtype, fp16_weights, few_rows_fp16, self.native_linear
        )
        self._build(model)
        self.native_attention = NativeAttention.for_engine(
            self.dtype, model.device, self.head_dim, native_attention
        )
        # Whether the sessions torch's attention serves read keys padded to a quantum: where
        # its flash attention compiles a kernel per shape (``_TORCH_KEY_QUANTUM``).
        self.pads_torch_keys = (
            model.device.type == "cpu"
            and self.dtype in (torch.bfloat16, torch.float16)
            and cpu_has_amx()
        )
        self.pointwise = NativePointwise.for_engine(
            self.dtype, model.device, self.head_dim, native_pointwise
        )
        self.native_layers = NativeLayers.for_engine(
            self.native_linear, self.pointwise, self.native_attention, native_layers
        )
        if self.native_layers is not None:
            self.native_layers.bind(self.layers)
        log.info(
            "LlamaEngine: %d layers, %s on %s, %s weights, %s pointwise, %s attention, "
            "layers driven from %s",
            len(self.layers),
            self.dtype,
            model.device,
            self.layout.value,
            "native" if self.pointwise is not None else "torch",
            "native" if self.native_attention is not None else "torch",
            "C" if self.native_layers is not None else "Python",
        )

    # ------------------------------------------------------------------ weights

    @torch.inference_mode()
    def _build(self, model: PreTrainedModel) -> None:
        inner = model.model
        self.embed = inner.embed_tokens.weight  # [V, hidden]
        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv_w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
            qkv_b = None
            if attn.q_proj.bias is not None:
                qkv_b = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
            gate_up_w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            gate_up_b = None
            if mlp.gate_proj.bias is not None:
                gate_up_b = torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
            self.layers.append(
                _Layer(
                    input_norm=layer.input_layernorm.weight,
                    qkv=self.make_linear(qkv_w, qkv_b),
                    o=self.make_linear(attn.o_proj.weight, attn.o_proj.bias),
                    post_norm=layer.post_attention_layernorm.weight,
                    gate_up=self.make_linear(gate_up_w, gate_up_b),
                    down=self.make_linear(mlp.down_proj.weight, mlp.down_proj.bias),
                    down_in=int(mlp.down_proj.weight.shape[1]),
                )
            )
        self.final_norm = inner.norm.weight
        self.head = self.make_linear(model.lm_head.weight, None)
        self.restricted_head: RestrictedHead | None = None  # set by restrict_head
        self.scaling = self.head_dim**-0.5
        rotary = inner.rotary_emb
        self.inv_freq = rotary.inv_freq.float()  # [D/2]
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.max_positions = int(model.config.max_position_embeddings)
        positions = torch.arange(self.max_positions, device=self.inv_freq.device).float()
        freqs = torch.outer(positions, self.inv_freq)  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.cos = (emb.cos() * self.rope_scaling).to(self.dtype)
        self.sin = (emb.sin() * self.rope_scaling).to(self.dtype)

    def make_linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> _Linear:
        """A linear layer in this engine's weight layout."""
        return _Linear(weight, bias, self.layout, self.native_linear)

    # ------------------------------------------------------------------ sessions

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def vocab_size(self) -> int:
        return int(self.embed.shape[0])

    @property
    def head_ids(self) -> torch.Tensor | None:
        """The tokens a restricted head scores; None when it scores the whole vocabulary."""
        return None if self.restricted_head is None else self.restricted_head.ids

    def padded_rows(self, rows: int) -> int:
        """The rows the linear layers compute for a forward fed ``rows`` positions (every
        product pads alike, ``_Linear.computed_rows``): 16 at least on AMX, whose tiles
        make those rows cost the same."""
        return 0 if rows == 0 else self.layers[0].qkv.computed_rows(rows)

    def _new_session(self) -> _Session:
        return _Session()

    def _prefill(self, session_id: str, token_ids: Sequence[int]) -> torch.Tensor:
        return self.forward_new([(session_id, token_ids)], keep_rows=[1])[0][-1]

    def _reserve(self, session: _Session, needed: int) -> torch.Tensor:
        """The session's KV slot with room for ``needed`` positions (grown 1.5x at least)."""
        kv = session.kv
        if kv is not None and kv.shape[3] >= needed:
            return kv
        old = 0 if kv is None else kv.shape[3]
        capacity = max(needed, old + old // 2)
        capacity = -(-capacity // _CAPACITY_QUANTUM) * _CAPACITY_QUANTUM
        shape = (len(self.layers), 2, self.num_kv_heads, capacity, self.head_dim)
        grown = torch.empty(shape, dtype=self.dtype, device=self.device)
        if kv is not None and session.length > 0:
            grown[:, :, :, : session.length] = kv[:, :, :, : session.length]
        # Past the copied positions zeros, not whatever memory held: torch's attention reads
        # padded keys and values there (``_torch_keys``), which must be finite to weigh
        # nothing. Only the tail: the copy writes the rest.
        grown[:, :, :, session.length :].zero_()
        session.kv = grown
        return grown

    # ------------------------------------------------------------------ forward

    def forward_new(
        self,
        batch: Sequence[NewTokens],
        keep_rows: Sequence[int] | None = None,
        head_only: bool = False,
    ) -> list[torch.Tensor]:
        """One forward over many sessions; appends the new tokens to each session's cache.

        ``keep_rows[b]``: how many trailing rows of logits item b needs (default: all).
        Returns per item the float32 logits [keep_rows[b], V]; the last row predicts the
        token after the item's last new token. ``head_only`` with a restricted head: the
        logits of its tokens only, [keep_rows[b], len(head_ids)], in head_ids' order.
        """
        counts = [len(new_ids) for _, new_ids in batch]
        keeps = list(counts) if keep_rows is None else [int(k) for k in keep_rows]
        return self.forward_features(batch, keeps, [0] * len(batch), head_only=head_only)[0]

    def forward_features(
        self,
        batch: Sequence[NewTokens],
        keep_rows: Sequence[int],
        feature_rows: Sequence[int],
        inputs: torch.Tensor | None = None,
        head_only: bool = False,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``forward_new``, also returning each item's last ``feature_rows[b]`` hidden states
        after the final norm (what the LM head reads: a feature draft's input, see
        ``asymspec_engine.feature_draft``), in the model's dtype, [feature_rows[b], hidden].

        ``inputs`` [T, hidden]: the input vectors of the new tokens, all items' laid end to
        end, instead of the embedding rows of their ids (a feature draft's fused inputs).
        """
        if not batch:
            return [], []
        if len({session_id for session_id, _ in batch}) != len(batch):
            raise ValueError("a session appears twice in one batch")
        counts = [len(new_ids) for _, new_ids in batch]
        keeps = [int(k) for k in keep_rows]
        features = [int(k) for k in feature_rows]
        sessions = [self._session(session_id) for session_id, _ in batch]
        for (session_id, _), session, n_new, keep, feature in zip(
            batch, sessions, counts, keeps, features, strict=True
        ):
            if n_new == 0:
                raise ValueError(f"session {session_id!r}: no new tokens to forward")
            if not (0 <= keep <= n_new and 0 <= feature <= n_new):
                raise ValueError(f"session {session_id!r}: keep {keep} of {n_new} rows")
            if session.length + n_new > self.max_positions:
                raise ValueError(
                    f"session {session_id!r}: {session.length + n_new} positions exceed "
                    f"the model's {self.max_positions}"
                )
        if inputs is not None and tuple(inputs.shape) != (sum(counts), self.embed.shape[1]):
            raise ValueError(f"inputs {tuple(inputs.shape)}: need [{sum(counts)}, hidden]")
        with torch.inference_mode():
            out = self._forward(batch, sessions, counts, keeps, features, inputs, head_only)
        for session, (_, new_ids) in zip(sessions, batch, strict=True):
            session.token_ids.extend(int(t) for t in new_ids)
        self.forward_calls += 1
        return out

    def _forward(
        self,
        batch: Sequence[NewTokens],
        sessions: list[_Session],
        counts: list[int],
        keeps: list[int],
        features: list[int],
        inputs: torch.Tensor | None,
        head_only: bool,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        device = self.device
        ids: list[int] = []
        positions: list[int] = []
        for (_, new_ids), session in zip(batch, sessions, strict=True):
            ids.extend(int(t) for t in new_ids)
            positions.extend(range(session.length, session.length + len(new_ids)))
        position_ids = torch.tensor(positions, device=device)
        cos = self.cos[position_ids][:, None]  # [T, 1, D]
        sin = self.sin[position_ids][:, None]
        slots = [
            self._reserve(session, session.length + n_new)  # [layers, 2, H_kv, capacity, D]
            for session, n_new in zip(sessions, counts, strict=True)
        ]
        row0 = [end - n for end, n in zip(itertools.accumulate(counts), counts, strict=True)]
        # Sessions with few new tokens (decode, verify) go to the native kernel's decode path,
        # one call per layer for all of them; the rest (prefill chunks) to its prefill path
        # where it has one (AMX), else to torch's flash attention.
        native = self.native_attention
        few = [b for b, n in enumerate(counts) if n <= MAX_NEW_TOKENS]
        decoding = [] if native is None else few
        prefilling = [b for b in range(len(batch)) if b not in decoding]
        native_prefills = native is not None and native.prefills(self.head_dim)
        plan = prefill_plan = None
        if native is not None and decoding:
            plan = native.plan(
                [row0[b] for b in decoding],
                [counts[b] for b in decoding],
                [sessions[b].length for b in decoding],
                [slots[b] for b in decoding],
            )
        if native is not None and native_prefills and prefilling:
            prefill_plan = native.plan(
                [row0[b] for b in prefilling],
                [counts[b] for b in prefilling],
                [sessions[b].length for b in prefilling],
                [slots[b] for b in prefilling],
            )
        by_torch = [] if native_prefills else prefilling  # their attention: torch's SDPA
        # Per session, views into its slot made once per forward, not once per layer (on a
        # CPU each view costs about a microsecond of Python, and a forward has B x layers).
        writes, keys, values, masks = {}, {}, {}, {}
        for b in by_torch:
            base, total = sessions[b].length, sessions[b].length + counts[b]
            seen = self._torch_keys(total)
            writes[b] = slots[b][:, :, :, base:total]  # [layers, 2, H_kv, n, D]
            keys[b] = slots[b][:, 0:1, :, :seen]  # [layers, 1, H_kv, seen, D]
            values[b] = slots[b][:, 1:2, :, :seen]
            masks[b] = self._causal_mask(base, counts[b], seen)
        h_q, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        attn_scale = self.scaling

        # x: the residual stream, this forward's own tensor (the native pointwise kernel
        # adds to it in place); h: its normed rows, the next product's input.
        if inputs is None:
            x = self.embed[torch.tensor(ids, device=device)]  # [T, hidden]
        else:
            x = inputs.to(device=device, dtype=self.dtype, copy=True)
        if self.pointwise is not None:  # the kernel takes [T, D]: views made once
            cos, sin = cos[:, 0], sin[:, 0]
        h = self._norm(x, self.layers[0].input_norm)
        if self.native_layers is not None and not by_torch:  # one native call, every layer
            self.native_layers.run(
                x,
                h,
                cos,
                sin,
                plan,
                prefill_plan,
                (h_q, h_kv, d),
                self.layers[0].down_in,
                self.eps,
                attn_scale,
            )
        else:
            for i, layer in enumerate(self.layers):
                qkv = layer.qkv(h)  # [T, (H + 2 H_kv) D]
                qk, v = qkv.split([(h_q + h_kv) * d, h_kv * d], dim=-1)
                qk = self._rotary(qk.view(-1, h_q + h_kv, d), cos, sin)  # [T, H + H_kv, D]
                if plan is not None or prefill_plan is not None:
                    assert native is not None
                    attn = x.new_empty((x.shape[0], h_q, d))  # [T, H, D]
                    q_rows, k_rows, v_rows = qk[:, :h_q], qk[:, h_q:], v.view(-1, h_kv, d)
                    if plan is not None:
                        native.attend(plan, i, q_rows, k_rows, v_rows, attn, attn_scale)
                    if prefill_plan is not None:
                        native.prefill(prefill_plan, i, q_rows, k_rows, v_rows, attn, attn_scale)
                    for b in by_torch:  # their rows of attn
                        start, stop = row0[b], row0[b] + counts[b]
                        attn[start:stop] = self._torch_attention(
                            qk[start:stop],
                            v[start:stop],
                            writes[b][i],
                            keys[b][i],
                            values[b][i],
                            masks[b],
                        )
                else:
                    attn = torch.cat(
                        [
                            self._torch_attention(
                                qk[start : start + n],
                                v[start : start + n],
                                writes[b][i],
                                keys[b][i],
                                values[b][i],
                                masks[b],
                            )
                            for b, (start, n) in enumerate(zip(row0, counts, strict=True))
                        ]
                    )
                x, h = self._add_norm(x, layer.o(attn.view(-1, h_q * d)), layer.post_norm)
                act = self._silu_mul(layer.gate_up(h))
                following = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else None
                x, h = self._add_norm(x, layer.down(act), following)

        # Per item the last max(keep, feature) rows go through the final norm once; the
        # logits come from its last `keep` and the features are its last `feature`.
        ends = list(itertools.accumulate(counts))
        spans = [max(k, f) for k, f in zip(keeps, features, strict=True)]
        rows = [r for end, span in zip(ends, spans, strict=True) for r in range(end - span, end)]
        head = self.restricted_head
        columns = self.vocab_size if head is None or not head_only else len(head.ids)
        if not rows:
            no_logits = torch.empty((0, columns), dtype=torch.float32, device=device)
            no_features = x.new_empty((0, x.shape[1]))
            return [no_logits for _ in batch], [no_features for _ in batch]
        hidden = self._rms_norm(x[torch.tensor(rows, device=device)], self.final_norm)
        per_item = hidden.split(spans)
        feature_out = [h[h.shape[0] - f :] for h, f in zip(per_item, features, strict=True)]
        if not any(keeps):
            no_logits = torch.empty((0, columns), dtype=torch.float32, device=device)
            return [no_logits for _ in batch], feature_out
        if spans == keeps:  # no item wants more feature rows than logits (decode, verify)
            scored = hidden
        else:
            scored = torch.cat([h[h.shape[0] - k :] for h, k in zip(per_item, keeps, strict=True)])
        if head is None or head_only:
            logits = self.head(scored).float()  # [sum(keeps), V or K]
        else:  # a restricted head: -inf (probability 0) outside its tokens
            logits = torch.full(
                (scored.shape[0], self.vocab_size),
                float("-inf"),
                dtype=torch.float32,
                device=device,
            )
            logits.index_copy_(1, head.ids, self.head(scored).float())
        return list(logits.split(keeps)), feature_out

    def _torch_attention(
        self,
        qk: torch.Tensor,
        v: torch.Tensor,
        write: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """One session's attention by torch: its n rows of qk [n, H + H_kv, D] and v
        [n, H_kv D]; writes their keys and values into its slot's ``write`` view
        [2, H_kv, n, D]; returns [n, H, D]."""
        h_q, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        n = qk.shape[0]
        write[0].copy_(qk[:, h_q:].transpose(0, 1))
        write[1].copy_(v.view(n, h_kv, d).transpose(0, 1))
        # Fold each KV head's query group into the query axis, [1, H_kv, g n, D]: CPU flash
        # attention runs that ~1.5-2x faster than with enable_gqa for several queries, and
        # 4-6x faster in bf16 for one (on an AVX512-BF16 EPYC 94 against 24 us at 100
        # positions; scripts/forward_cost.py). Masks are folded alike; one query sees its
        # whole prefix and needs none.
        q = qk[:, :h_q].transpose(0, 1)  # [H, n, D]
        out = F.scaled_dot_product_attention(
            q.reshape(1, h_kv, -1, d), keys, values, attn_mask=mask, scale=self.scaling
        )
        return out.view(h_q, n, d).transpose(0, 1)  # [n, H, D]

    @torch.inference_mode()
    def restrict_head(self, token_ids: Sequence[int]) -> None:
        """Score only ``token_ids``; every other token gets logit -inf, i.e. probability 0.

        For a **draft** only: a draft may propose from any distribution q (acceptance and
        recovery stay exact as long as both use the same q), and its LM head over the whole
        vocabulary is most of its weights (49,152 x 256 of a 17M-parameter draft), so
        scoring the few thousand tokens a target writes nearly always saves most of the head's
        cost. A target's p must stay whole: never call this on a verifier's engine.
        """
        ids = torch.tensor(sorted(set(int(t) for t in token_ids)), device=self.device)
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= self.vocab_size:
            raise ValueError(
                f"head token ids must be a non-empty subset of 0..{self.vocab_size - 1}"
            )
        self.head = self.make_linear(self.model.lm_head.weight[ids].contiguous(), None)
        self.restricted_head = RestrictedHead.of(ids, self.vocab_size)
        log.info("LlamaEngine: LM head restricted to %d of %d tokens", ids.numel(), self.vocab_size)

    def _torch_keys(self, total: int) -> int:
        """The key positions torch's attention reads for a session of ``total`` positions:
        ``total``, or where its kernels are compiled per shape, ``total`` rounded up to
        ``_TORCH_KEY_QUANTUM`` (a slot's capacity is a multiple of it, so they exist)."""
        if not self.pads_torch_keys:
            return total
        return -(-total // _TORCH_KEY_QUANTUM) * _TORCH_KEY_QUANTUM

    def _causal_mask(self, base: int, n_new: int, keys: int) -> torch.Tensor | None:
        """[g n, keys], row j n + i for query i of group member j (the folded layout): 0
        where the query may attend, -inf where not (later positions, and the padding past
        ``base + n``); None for one query that sees every key. Additive and in the model's
        dtype because SDPA converts a boolean mask on every call (two ops per session and
        layer: 8% of a 16-block verify here)."""
        if n_new == 1 and keys == base + 1:
            return None
        rows = torch.arange(n_new, device=self.device)[:, None]
        cols = torch.arange(keys, device=self.device)[None]
        future = (cols > rows + base).repeat(self.num_heads // self.num_kv_heads, 1)
        mask = torch.zeros(future.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(future, float("-inf"))

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """transformers' LlamaRMSNorm: the variance in float32, the scale in the weight's dtype."""
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)  # one fused op
        return weight * normed.to(x.dtype)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``_rms_norm``, by the native pointwise kernel where there is one."""
        if self.pointwise is not None:
            return self.pointwise.rms_norm(x, weight, self.eps)
        return self._rms_norm(x, weight)

    def _rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``_rotate``; the native kernel rotates qk in place (in the qkv product) and takes
        cos and sin as [T, D], torch's ops as [T, 1, D]."""
        if self.pointwise is not None:
            self.pointwise.rotary(qk, cos, sin)
            return qk
        return _rotate(qk, cos, sin)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up of a [T, 2 I] gate_up product, [T, I]."""
        if self.pointwise is not None:
            return self.pointwise.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _add_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after adding ``delta``, and its ``_rms_norm`` by ``weight``
        (None: the last layer's output, normed later and only on the rows kept, so x)."""
        if self.pointwise is not None:
            normed = self.pointwise.add_rms_norm(x, delta, weight, self.eps)  # x in place
            return x, x if normed is None else normed
        x = x + delta
        return x, x if weight is None else self._rms_norm(x, weight)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (transformers' rotate_half convention). x [T, H, D]; cos, sin [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
