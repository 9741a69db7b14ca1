"""One causal LM serving many sessions, each with its own KV cache (§IV-C2).

``CachedLM`` owns, per session, the key/value tensors of every token it has seen, so a
session's prefix is computed once and never again: each round only the new tokens go
through the model. ``forward_new`` runs a single forward for many sessions whose cached
prefixes and new-token counts differ, which is what lets the cloud batch verifications
across requests and the edge batch draft steps.

How the batch is laid out, per layer, in one padded frame of ``L_max + N_max`` positions::

    session b:  [ zeros (L_max - L_b) | cached prefix (L_b) | new (n_b) | pad (N_max - n_b) ]

A 2-D attention mask hides the zeros and the pads, and position ids restart from each
session's own length, so every real token sees exactly its own prefix. The pads sit *after*
the real new tokens, so causality already hides them from real tokens, and every pad query
still has at least one real key before it (no fully masked row, hence no NaN).

A batch of one skips all of this: the model appends straight into the session's buffers.

Each session's buffers have spare capacity (grown by doubling), so appending a few tokens
writes in place instead of copying the whole prefix, and rolling back (``truncate``) only
moves a length. The transformers ``Cache`` object is rebuilt per forward around these
buffers; that is the only coupling to the transformers cache API (5.x: ``Cache(layers=...)``
with ``CacheLayerMixin`` layers, passed as ``cache=``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

# Buffers grow to a multiple of this many positions, so short appends rarely reallocate.
_CAPACITY_QUANTUM = 64

NewTokens = tuple[str, Sequence[int]]  # (session_id, token ids the session's cache has not seen)


class SessionLM(Protocol):
    """What the draft and target backends need of an engine (``LlamaCppEngine``,
    ``LlamaEngine``, ``CachedLM``). Capabilities only some engines have are members every
    engine answers, so callers ask instead of checking types: ``max_sessions`` (None:
    unbounded), ``hidden_size`` (0: no hidden states; else ``forward_features`` returns
    them), ``restricts_head`` (whether ``restrict_head`` can narrow a draft's LM head),
    ``adopt_prefix`` (how many of a new session's tokens a closed session in its ``scope``
    already holds; 0 where the engine keeps no closed sessions)."""

    name: str  # "llama.cpp" or "torch": logged and recorded in results
    forward_calls: int
    max_sessions: int | None
    restricts_head: bool

    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    def set_threads(self, threads: int) -> None: ...

    def restrict_head(self, token_ids: Sequence[int]) -> None: ...

    def sessions(self) -> int: ...

    def length(self, session_id: str) -> int: ...

    def token_ids(self, session_id: str) -> list[int]: ...

    def open(
        self, session_id: str, token_ids: Sequence[int], scope: str = ""
    ) -> torch.Tensor | None: ...

    def adopt_prefix(self, session_id: str, token_ids: Sequence[int]) -> int: ...

    def close(self, session_id: str) -> None: ...

    def truncate(self, session_id: str, new_length: int) -> None: ...

    def forward_new(
        self, batch: Sequence[NewTokens], keep_rows: Sequence[int] | None = None
    ) -> list[torch.Tensor]: ...


def _grown(
    buffer: torch.Tensor | None, length: int, needed: int, like: torch.Tensor
) -> torch.Tensor:
    """``buffer`` [B, H_kv, capacity, D] with room for ``needed`` positions, keeping ``:length``.

    ``like`` [B, H_kv, *, D] gives shape, dtype and device when there is no buffer yet.
    """
    if buffer is not None and buffer.shape[-2] >= needed:
        return buffer
    old_capacity = 0 if buffer is None else buffer.shape[-2]
    capacity = max(needed, 2 * old_capacity)
    capacity = -(-capacity // _CAPACITY_QUANTUM) * _CAPACITY_QUANTUM
    shape = (like.shape[0], like.shape[1], capacity, like.shape[3])
    grown = torch.zeros(shape, dtype=like.dtype, device=like.device)  # zeros: pads must be finite
    if buffer is not None and length > 0:
        grown[:, :, :length] = buffer[:, :, :length]
    return grown


def _cpu_gqa_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, but grouped-query attention stays inside the kernel
    when a mask is present. transformers repeats K/V once per query head under a mask (its
    rule for CUDA kernels), which on CPU copies the whole cached prefix in every layer: a
    γ = 4 verify at a 1,000-token prefix spent 40 of its 190 ms in that copy. Same outputs.

    query [B, H, q, D]; key, value [B, H_kv, k, D]; returns [B, q, H, D].
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = attention_mask is None and q_len > 1
    if causal and kv_len != q_len:
        raise ValueError(f"an unmasked forward of {q_len} tokens over {kv_len} keys")
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


_CPU_GQA_SDPA = "asymspec_cpu_gqa_sdpa"
AttentionInterface.register(_CPU_GQA_SDPA, _cpu_gqa_sdpa)
AttentionMaskInterface.register(_CPU_GQA_SDPA, sdpa_mask)  # the masks SDPA would get


def draw_uniform(generator: torch.Generator) -> float:
    """One u in [0, 1) from a request's generator; draft and target sampling both use it.

    float64, so that u never rounds up to 1.
    """
    return float(torch.rand((), generator=generator, dtype=torch.float64))


class _BufferLayer(CacheLayerMixin):
    """One attention layer's K/V for one forward, appended in place into a buffer."""

    is_croppable = False  # rollback is ``CachedLM.truncate``, never ``Cache.crop``

    def __init__(self, keys: torch.Tensor | None, values: torch.Tensor | None, length: int) -> None:
        super().__init__()
        self.key_buffer = keys  # [B, H_kv, capacity, D]
        self.value_buffer = values  # [B, H_kv, capacity, D]
        self.length = length
        self.is_initialized = keys is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [B, H_kv, n_new, D]
        end = self.length + key_states.shape[-2]
        self.key_buffer = _grown(self.key_buffer, self.length, end, key_states)
        self.value_buffer = _grown(self.value_buffer, self.length, end, value_states)
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self.is_initialized = True
        self.keys = self.key_buffer[:, :, :end]  # views: attention reads the buffer in place
        self.values = self.value_buffer[:, :, :end]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0  # (kv_length, kv_offset)

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1


class _HasTokens(Protocol):
    token_ids: list[int]


S = TypeVar("S", bound=_HasTokens)


class SessionTable(Generic[S]):
    """The per-session bookkeeping every engine shares: open, close, rollback and lengths.
    An engine says how a session starts (``_new_session``) and how a prompt is prefilled
    (``_prefill``); rollback only moves a length, the cache's tail is overwritten later."""

    def __init__(self) -> None:
        self._sessions: dict[str, S] = {}

    def _new_session(self) -> S:
        raise NotImplementedError

    def _prefill(self, session_id: str, token_ids: Sequence[int]) -> torch.Tensor:
        """Forward a fresh session's prompt; the logits [V] after its last token."""
        raise NotImplementedError

    def sessions(self) -> int:
        return len(self._sessions)

    def length(self, session_id: str) -> int:
        """How many tokens the session's cache holds."""
        return len(self._session(session_id).token_ids)

    def token_ids(self, session_id: str) -> list[int]:
        """The tokens the session's cache holds (a copy)."""
        return list(self._session(session_id).token_ids)

    def adopt_prefix(self, session_id: str, token_ids: Sequence[int]) -> int:
        """Closed sessions are not kept: nothing to adopt."""
        self._session(session_id)
        return 0

    def open(
        self, session_id: str, token_ids: Sequence[int], scope: str = ""
    ) -> torch.Tensor | None:
        """Start a session and prefill ``token_ids`` (may be empty); ``scope`` is unused
        (this engine keeps no closed sessions to reuse).

        Returns the logits [V] after the last token (None for an empty prefill): a prompt's
        other rows are never needed, so the LM head runs on the last position only.
        """
        if session_id in self._sessions:
            raise KeyError(f"session {session_id!r} is already open")
        self._sessions[session_id] = self._new_session()
        if not token_ids:
            return None
        try:
            return self._prefill(session_id, token_ids)
        except BaseException:
            del self._sessions[session_id]  # a failed prefill leaves no half-open session
            raise

    def close(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)  # idempotent: a retried close is not an error

    def truncate(self, session_id: str, new_length: int) -> None:
        """Roll back to the first ``new_length`` tokens (a confirmed prefix); O(1)."""
        tokens = self._session(session_id).token_ids
        if not 0 <= new_length <= len(tokens):
            raise ValueError(f"cannot truncate a {len(tokens)}-token session to {new_length}")
        del tokens[new_length:]

    def _session(self, session_id: str) -> S:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise KeyError(f"unknown session {session_id!r}") from None


@dataclass
class _Session:
    """The cached state of one session: its tokens and per-layer K/V buffers."""

    token_ids: list[int] = field(default_factory=list)
    keys: list[torch.Tensor | None] = field(default_factory=list)  # per layer [1, H_kv, cap, D]
    values: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.token_ids)


class CachedLM(SessionTable[_Session]):
    """A causal LM with per-session KV caches and batched incremental forwards.

    Not thread-safe: one owner (the edge scheduler, the cloud batcher) drives it.
    """

    name = "torch"
    max_sessions: int | None = None
    restricts_head = False
    hidden_size = 0  # no hidden states

    def __init__(self, model: PreTrainedModel, pad_token_id: int = 0) -> None:
        config = model.config.get_text_config(decoder=True)
        layer_types, _ = get_layer_types_and_kwargs(config)
        if any(kind != "full_attention" for kind in layer_types):
            # Sliding-window and linear-attention layers keep a different state than a
            # growing K/V buffer; supporting them needs their own layer class.
            raise ValueError(f"only full-attention models are supported, got {set(layer_types)}")
        if model.device.type == "cpu" and config._attn_implementation == "sdpa":
            model.set_attn_implementation(_CPU_GQA_SDPA)
        super().__init__()
        self.model = model
        self.num_layers = len(layer_types)
        self.pad_token_id = pad_token_id  # any valid id: pads are masked out
        self.forward_calls = 0  # model forwards run, prefill included

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.get_text_config(decoder=True).vocab_size)

    def set_threads(self, threads: int) -> None:
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def restrict_head(self, token_ids: Sequence[int]) -> None:
        raise NotImplementedError("CachedLM scores the whole vocabulary (restricts_head)")

    def _new_session(self) -> _Session:
        return _Session(keys=[None] * self.num_layers, values=[None] * self.num_layers)

    def _prefill(self, session_id: str, token_ids: Sequence[int]) -> torch.Tensor:
        return self._forward_one(session_id, token_ids, logits_to_keep=1)[-1]

    def forward_new(
        self, batch: Sequence[NewTokens], keep_rows: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """One forward over many sessions; appends the new tokens to each session's cache.

        Returns per request the float32 logits [keep_rows[b], V] of its last rows (default:
        all n_new rows); the last row predicts the token after the last new token.
        """
        logits = self._forward_new(batch)
        if keep_rows is None:
            return logits
        return [rows[rows.shape[0] - keep :] for rows, keep in zip(logits, keep_rows, strict=True)]

    def _forward_new(self, batch: Sequence[NewTokens]) -> list[torch.Tensor]:
        if not batch:
            return []
        if len({session_id for session_id, _ in batch}) != len(batch):
            raise ValueError("a session appears twice in one batch")
        for session_id, new_ids in batch:
            self._session(session_id)  # fail before any state changes
            if len(new_ids) == 0:
                raise ValueError(f"session {session_id!r}: no new tokens to forward")
        if len(batch) == 1:
            session_id, new_ids = batch[0]
            return [self._forward_one(session_id, new_ids, logits_to_keep=0)]
        return self._forward_padded(batch)

    @torch.inference_mode()
    def _forward_one(
        self, session_id: str, new_ids: Sequence[int], logits_to_keep: int
    ) -> torch.Tensor:
        """Fast path for a batch of one: the model writes into the session's own buffers."""
        session = self._session(session_id)
        start, n_new = session.length, len(new_ids)
        layers = [
            _BufferLayer(k, v, start) for k, v in zip(session.keys, session.values, strict=True)
        ]
        input_ids = torch.tensor([list(new_ids)], device=self.device)  # [1, n_new]
        position_ids = torch.arange(start, start + n_new, device=self.device)[None]  # [1, n_new]
        logits = self._run(input_ids, None, position_ids, layers, logits_to_keep)  # [1, k, V]
        session.keys = [layer.key_buffer for layer in layers]  # may have been regrown
        session.values = [layer.value_buffer for layer in layers]
        session.token_ids.extend(int(t) for t in new_ids)
        return logits[0]

    @torch.inference_mode()
    def _forward_padded(self, batch: Sequence[NewTokens]) -> list[torch.Tensor]:
        sessions = [self._session(session_id) for session_id, _ in batch]
        lengths = [s.length for s in sessions]
        counts = [len(new_ids) for _, new_ids in batch]
        l_max, n_max = max(lengths), max(counts)
        # Built on the CPU row by row, then moved once.
        input_ids = torch.full((len(batch), n_max), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), l_max + n_max), dtype=torch.long)
        position_ids = torch.zeros((len(batch), n_max), dtype=torch.long)
        for b, ((_, new_ids), length, n_new) in enumerate(zip(batch, lengths, counts, strict=True)):
            input_ids[b, :n_new] = torch.tensor(list(new_ids))
            attention_mask[b, l_max - length : l_max + n_new] = 1
            position_ids[b] = torch.arange(length, length + n_max)  # pads' positions are unused
        layers = self._gather_layers(sessions, l_max, l_max + n_max)
        logits = self._run(  # [B, n_max, V]
            input_ids.to(self.device),
            attention_mask.to(self.device),
            position_ids.to(self.device),
            layers,
            logits_to_keep=0,
        )
        for b, (session, (_, new_ids)) in enumerate(zip(sessions, batch, strict=True)):
            self._scatter_new(session, layers, b, l_max, len(new_ids))
            session.token_ids.extend(int(t) for t in new_ids)
        return [logits[b, :n_new] for b, n_new in enumerate(counts)]

    def _gather_layers(
        self, sessions: list[_Session], l_max: int, capacity: int
    ) -> list[_BufferLayer]:
        """Per layer, the sessions' prefixes right-aligned at ``l_max`` in one zeroed buffer."""
        layers = []
        for i in range(self.num_layers):
            keys = values = None
            template = next((s.keys[i] for s in sessions if s.keys[i] is not None), None)
            if template is not None and l_max > 0:
                shape = (len(sessions), template.shape[1], capacity, template.shape[3])
                # Uninitialised, then only the left pads zeroed (masked keys must be finite):
                # the prefixes are copied over and the model writes every position from
                # l_max on, so zero-filling the whole frame was a fifth of a batch-16 decode.
                keys = template.new_empty(shape)  # [B, H_kv, l_max + n_max, D]
                values = template.new_empty(shape)
                for b, session in enumerate(sessions):
                    k, v, length = session.keys[i], session.values[i], session.length
                    keys[b, :, : l_max - length] = 0.0
                    values[b, :, : l_max - length] = 0.0
                    if k is not None and v is not None and length > 0:
                        keys[b, :, l_max - length : l_max] = k[0, :, :length]
                        values[b, :, l_max - length : l_max] = v[0, :, :length]
            layers.append(_BufferLayer(keys, values, l_max))
        return layers

    def _scatter_new(
        self, session: _Session, layers: list[_BufferLayer], b: int, l_max: int, n_new: int
    ) -> None:
        """Append row ``b``'s new K/V from the padded batch buffers to the session's own."""
        start, end = session.length, session.length + n_new
        for i, layer in enumerate(layers):
            assert layer.key_buffer is not None and layer.value_buffer is not None
            new_k = layer.key_buffer[b : b + 1, :, l_max : l_max + n_new]  # [1, H_kv, n_new, D]
            new_v = layer.value_buffer[b : b + 1, :, l_max : l_max + n_new]
            keys = _grown(session.keys[i], start, end, new_k)
            values = _grown(session.values[i], start, end, new_v)
            keys[:, :, start:end] = new_k
            values[:, :, start:end] = new_v
            session.keys[i], session.values[i] = keys, values

    def _run(
        self,
        input_ids: torch.Tensor,  # [B, n]
        attention_mask: torch.Tensor | None,  # [B, L + n] 1 = real token, or None: all real
        position_ids: torch.Tensor,  # [B, n]
        layers: list[_BufferLayer],
        logits_to_keep: int,  # 0 = every position
    ) -> torch.Tensor:
        cache = Cache(layers=list(layers))
        output = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        self.forward_calls += 1
        return output.logits.float()  # [B, n or logits_to_keep, V]
