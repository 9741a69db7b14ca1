"""The torch engine for Llama-family checkpoints (Llama, SmolLM2, Qwen2, Mistral).

transformers runs one padded batch through a cache object rebuilt per forward, and its
LM head scores every position. This engine owns the whole forward instead:

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
- **hidden states** where asked (a feature draft's input) and a **restricted LM head**
  (a draft's), which the llama.cpp engine does not offer.

The arithmetic is the transformers Llama decoder's (RMSNorm in float32, rotary embedding
from the model's own ``inv_freq``, SDPA with grouped-query attention), so in float32 the
logits match transformers to rounding: this is the exact reference engine, and the one
that runs on CUDA. ``CachedLM`` stays the fallback for other architectures; on CPUs the
llama.cpp engine (``asymspec_engine.llamacpp``) is the fast one.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from asymspec_engine.engine import NewTokens, SessionTable
from asymspec_engine.hardware import cpu_has_amx

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


class _Linear:
    """``y = x W^T (+ b)``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias
        self.out_features = int(weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] -> [T, out]
        return F.linear(x, self.weight, self.bias)


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


class LlamaEngine(SessionTable[_Session]):
    """Per-session KV slots and ragged batched forwards over a Llama-family decoder.

    Not thread-safe: one owner (the edge scheduler, the cloud batcher) drives it.
    """

    name = "torch"
    restricts_head = True  # ``restrict_head``: a draft's head over some tokens
    max_sessions: int | None = None  # KV slots are allocated per session, without a bound

    def __init__(self, model: PreTrainedModel) -> None:
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
        self._build(model)
        # Whether torch's attention reads keys padded to a quantum: where its flash
        # attention compiles a kernel per shape (``_TORCH_KEY_QUANTUM``).
        self.pads_torch_keys = (
            model.device.type == "cpu"
            and self.dtype in (torch.bfloat16, torch.float16)
            and cpu_has_amx()
        )
        log.info("LlamaEngine: %d layers, %s on %s", len(self.layers), self.dtype, model.device)

    @property
    def hidden_size(self) -> int:
        """The width of the hidden states ``forward_features`` returns."""
        return int(self.embed.shape[1])

    def set_threads(self, threads: int) -> None:
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

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
        return _Linear(weight, bias)

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
        # Per session, views into its slot made once per forward, not once per layer (on a
        # CPU each view costs about a microsecond of Python, and a forward has B x layers).
        writes, keys, values, masks = [], [], [], []
        for session, n_new, slot in zip(sessions, counts, slots, strict=True):
            base, total = session.length, session.length + n_new
            seen = self._torch_keys(total)
            writes.append(slot[:, :, :, base:total])  # [layers, 2, H_kv, n, D]
            keys.append(slot[:, 0:1, :, :seen])  # [layers, 1, H_kv, seen, D]
            values.append(slot[:, 1:2, :, :seen])
            masks.append(self._causal_mask(base, n_new, seen))
        h_q, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim

        # x: the residual stream; h: its normed rows, the next product's input.
        if inputs is None:
            x = self.embed[torch.tensor(ids, device=device)]  # [T, hidden]
        else:
            x = inputs.to(device=device, dtype=self.dtype, copy=True)
        h = self._rms_norm(x, self.layers[0].input_norm)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(h)  # [T, (H + 2 H_kv) D]
            qk, v = qkv.split([(h_q + h_kv) * d, h_kv * d], dim=-1)
            qk = _rotate(qk.view(-1, h_q + h_kv, d), cos, sin)  # [T, H + H_kv, D]
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
            x = x + layer.o(attn.view(-1, h_q * d))
            h = self._rms_norm(x, layer.post_norm)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
            if i + 1 < len(self.layers):
                h = self._rms_norm(x, self.layers[i + 1].input_norm)

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
        # positions). Masks are folded alike; one query sees its
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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (transformers' rotate_half convention). x [T, H, D]; cos, sin [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
