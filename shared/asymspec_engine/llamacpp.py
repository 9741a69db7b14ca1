"""The llama.cpp engine: GGUF models on CPUs, through llama.cpp's C API.

llama.cpp is the maintained CPU inference engine of the field (quantised GGUF weights,
kernels for every x86 instruction set from AVX2 to AMX, picked when it is built), so this
engine is a thin owner of one llama.cpp context and nothing of the forward itself:

- **a KV stream per session**: a session is a llama.cpp sequence id with its own stream of
  ``session_tokens`` cells (llama.cpp's non-unified cache, as ``llama-server -np N`` runs),
  so each session's attention reads its own cells only. A unified cache (one pool for all
  sessions) attends over every session's cells with a mask: a 16-session verify of 5
  tokens each took twice as long with it here;
- **one ``llama_decode`` per round**: every session's new tokens go into one batch, each
  token tagged with its session's sequence id and position, whatever their lengths
  (llama.cpp masks each sequence's attention to its own cells). llama.cpp runs it as one
  pass over the weights per run of consecutive sequence ids with equal token counts, so
  a round is padded with throwaway tokens where that saves passes (``llama_passes``);
- **logits only where asked**: a token's ``logits`` flag is set only for the trailing
  ``keep_rows`` of its item, so the LM head runs on those rows only, and they come back
  as one contiguous float32 block;
- **rollback** is ``llama_memory_seq_rm`` from the kept length on;
- **prefix reuse**: a closed session's stream is kept (while no new session needs it, the
  least recently closed given up first), and a new session in the same scope whose tokens
  begin with at least ``MIN_REUSE_TOKENS`` of its tokens takes that stream over, rolled back
  to the common prefix: an agent's next round, which resends the whole conversation, is
  prefilled from where the last round's context ends. A new chat that shares only its
  opening (the chat template, a system prompt) with a closed one gets a copy of those
  cells in a free stream instead. Exact: the cells hold the keys and values of exactly
  those tokens at those positions.

Sampling never happens here: the float32 rows go to the project's own sampling code
(acceptance, recovery and the transforms must see exactly the rows both sides use).

llama.cpp quantises activations for its quantised products, and the rows a forward
computes depend on how its batch is split, so a γ+1-row verify and a one-row decode step
can round a near-tie apart: acceptance stays exact with respect to the p computed, but
greedy output may differ from target-only's where two logits tie to within that rounding.
The torch engine in float32 is the exact reference.
"""

from __future__ import annotations

import ctypes
import heapq
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asymspec_engine import llama_passes
from asymspec_engine.engine import NewTokens

log = logging.getLogger("asymspec.engine")

# The file a prepared model folder holds for this engine, and its quantisation: Q8_0 keeps
# the embedded target's Q4_1 weights but for one rounding. Q4_0 runs llama.cpp's repacked CPU
# kernels and was faster at every shape (1.5x a decode step, 1.8x a 2-row verify, 1.4x a
# prefill on an AVX-512 EPYC), but as a second 4-bit rounding it is another model: its next
# token agreed with the float32 reference's at 60 % of positions, Q8_0's at 96 %
# (loadtest/results/forward-cost/). A GGUF of the user's own choosing runs as it is.
ENGINE_QUANT = "q8_0"
ENGINE_GGUF = f"model.{ENGINE_QUANT}.gguf"
LLAMA_MAX_SEQ = 256  # llama.cpp's limit on sequence ids per context
MIN_REUSE_TOKENS = 16  # a shorter common prefix is cheaper to prefill than to look for
MOSTLY_SHARED = 0.9  # a closed stream worth adopting while a free one waits (adopt_prefix)
# A shorter prefix is copied from a closed stream where the copy costs less than the prefill
# it saves: on 2 cores of an EPYC, copying a 200-token sequence's state took 2.7 ms and a
# 2,000-token one's 24 ms (about 12 us a token), prefilling runs at about 1 ms a token.
COPY_TOKENS_PER_PREFILL_TOKEN = 32
_backend_lock = threading.Lock()
_log_callback_ref: object = None  # llama.cpp keeps the C pointer: keep its Python object alive


def _worth_copying(shared: int, held: int) -> bool:
    """Whether copying a whole ``held``-token state costs less than prefilling ``shared``."""
    return shared * COPY_TOKENS_PER_PREFILL_TOKEN >= held


def llama_cpp_available() -> bool:
    """Whether llama.cpp's Python bindings import (``make install`` builds them)."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def _log_line(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # ggml's levels: 1 debug, 2 info, 3 warn, 4 error, 5 continuation. Only warnings and
    # errors reach our log: llama.cpp prints every tensor it loads otherwise.
    if level in (3, 4):
        log.warning("llama.cpp: %s", text.decode(errors="replace").rstrip())


def bindings() -> Any:
    """The low-level ctypes module, with the backend initialised once per process."""
    global _log_callback_ref
    import llama_cpp

    with _backend_lock:
        if _log_callback_ref is None:
            _log_callback_ref = llama_cpp.llama_log_callback(_log_line)
            llama_cpp.llama_log_set(_log_callback_ref, ctypes.c_void_p())
            llama_cpp.llama_backend_init()
    return llama_cpp


@dataclass
class _Session:
    # its KV stream: None until it first holds a token, so that opening a session never
    # gives up a closed session's stream that it would then adopt (``adopt_prefix``)
    seq_id: int | None = None
    token_ids: list[int] = field(default_factory=list)
    scope: str = ""  # whose closed sessions it may reuse (the cloud: one edge's)


@dataclass
class _Saved:
    """A closed session's cells kept in host memory after its stream went to another."""

    token_ids: list[int]
    scope: str
    state: ctypes.Array[ctypes.c_ubyte]  # llama_state_seq_get_data's bytes


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


class LlamaCppEngine:
    """Per-session sequences in one llama.cpp context; one decode per batched forward.

    Not thread-safe: one owner (the edge scheduler, the cloud batcher) drives it, as
    llama.cpp's own contexts require.
    """

    # ggml's threads spin at each of a forward's hundreds of barriers: with more threads
    # than free cores one preempted thread stalls the others for a time slice each time
    # (a 16-chat run went 10x slower beside a busy process). Callers never raise its threads
    # above the cores it was given.
    name = "llama.cpp"
    restricts_head = False  # its LM head scores the whole vocabulary
    hidden_size = 0  # hidden states are not asked of it (a feature draft runs on torch)

    def restrict_head(self, token_ids: Sequence[int]) -> None:
        raise NotImplementedError("the llama.cpp engine scores the whole vocabulary")

    def __init__(
        self,
        gguf_path: str | Path,
        threads: int = 1,
        max_sessions: int = 16,
        session_tokens: int = 4096,
        batch_tokens: int = 2048,
        micro_batch_tokens: int = 512,
        prefix_reuse: bool = True,
        pad_rounds: bool = True,
        prefix_cache_bytes: int = 0,
    ) -> None:
        """``max_sessions``: sessions open at once (each a KV stream); ``session_tokens``:
        the most tokens a session holds (at most the model's trained context);
        ``batch_tokens``: the most tokens one ``llama_decode`` takes (longer prefills go in
        several); ``micro_batch_tokens``: llama.cpp's physical batch (it splits larger ones);
        ``prefix_reuse``: keep closed sessions' streams for ``adopt_prefix``;
        ``prefix_cache_bytes``: host memory for closed sessions' cells once their streams are
        needed (as llama-server's ``--cache-ram``; 0: none); ``pad_rounds``:
        pad a round where that saves passes (``llama_passes``; off only to measure it)."""
        if not 1 <= max_sessions <= LLAMA_MAX_SEQ:
            raise ValueError(f"max_sessions must be 1..{LLAMA_MAX_SEQ}, got {max_sessions}")
        lib = bindings()
        self._lib = lib
        self.path = Path(gguf_path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no GGUF model at {self.path}")
        model_params = lib.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self._model = lib.llama_model_load_from_file(str(self.path).encode(), model_params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {self.path}")
        trained = int(lib.llama_model_n_ctx_train(self._model))
        self.session_tokens = min(session_tokens, trained) if trained > 0 else session_tokens
        params = lib.llama_context_default_params()
        params.n_ctx = max_sessions * self.session_tokens
        params.n_batch = batch_tokens
        params.n_ubatch = min(micro_batch_tokens, batch_tokens)
        params.n_seq_max = max_sessions
        params.kv_unified = False
        params.n_threads = threads
        params.n_threads_batch = threads
        params.no_perf = True
        self._ctx = lib.llama_init_from_model(self._model, params)
        if not self._ctx:
            lib.llama_model_free(self._model)
            raise ValueError(f"llama.cpp could not create a context for {self.path}")
        self._memory = lib.llama_get_memory(self._ctx)
        vocab = lib.llama_model_get_vocab(self._model)
        self._vocab_size = int(lib.llama_vocab_n_tokens(vocab))
        self.max_sessions: int | None = max_sessions
        self.prefix_reuse = prefix_reuse
        self.pad_rounds = pad_rounds
        self.prefix_cache_bytes = prefix_cache_bytes if prefix_reuse else 0
        self._saved: OrderedDict[int, _Saved] = OrderedDict()  # oldest first
        self._saved_ids = 0
        self.saved_bytes = 0
        self._seq_ids = max_sessions
        self.batch_tokens = batch_tokens
        self.micro_batch_tokens = int(params.n_ubatch)
        self._threads = threads
        self._batch = lib.llama_batch_init(batch_tokens, 0, 1)
        self._free_seq_ids = list(range(max_sessions))  # a heap: the lowest id goes first
        self._sessions: dict[str, _Session] = {}
        self._retained: OrderedDict[int, _Session] = OrderedDict()  # closed; oldest first
        self.forward_calls = 0
        self.reused_tokens = 0  # prompt tokens taken from closed sessions' streams
        self.padding_tokens = 0  # throwaway tokens that saved passes (``llama_passes``)
        log.info(
            "llama.cpp engine: %s, %d sessions of up to %d tokens, %d threads",
            self.path.name,
            max_sessions,
            self.session_tokens,
            threads,
        )

    def __del__(self) -> None:
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        if getattr(self, "_batch", None) is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            lib.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            lib.llama_model_free(self._model)
            self._model = None

    # ------------------------------------------------------------------ sessions

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def threads(self) -> int:
        return self._threads

    def set_threads(self, threads: int) -> None:
        """Threads for the next forwards (the cloud changes them per round, colocated)."""
        if threads != self._threads:
            self._lib.llama_set_n_threads(self._ctx, threads, threads)
            self._threads = threads

    def sessions(self) -> int:
        return len(self._sessions)

    def length(self, session_id: str) -> int:
        return len(self._session(session_id).token_ids)

    def token_ids(self, session_id: str) -> list[int]:
        return list(self._session(session_id).token_ids)

    def open(
        self, session_id: str, token_ids: Sequence[int], scope: str = ""
    ) -> torch.Tensor | None:
        """Start a session and prefill ``token_ids`` (may be empty), from a closed session's
        stream where one in ``scope`` shares a long enough prefix (``adopt_prefix``); the
        logits [V] after the last token, None for an empty prefill."""
        if session_id in self._sessions:
            raise KeyError(f"session {session_id!r} is already open")
        if len(self._sessions) >= self._seq_ids:
            raise RuntimeError(f"the engine holds at most {self._seq_ids} sessions at once")
        self._sessions[session_id] = _Session(scope=scope)
        if not token_ids:
            return None
        try:
            start = self.adopt_prefix(session_id, token_ids[:-1])  # the last row is asked for
            last: torch.Tensor | None = None
            for begin in range(start, len(token_ids), self.batch_tokens):
                chunk = token_ids[begin : begin + self.batch_tokens]
                last_chunk = begin + self.batch_tokens >= len(token_ids)
                rows = self.forward_new([(session_id, chunk)], keep_rows=[int(last_chunk)])
                last = rows[0][-1] if last_chunk else None
            return last
        except BaseException:
            self.close(session_id, retain=False)  # a failed prefill leaves no half-open session
            raise

    def adopt_prefix(self, session_id: str, token_ids: Sequence[int]) -> int:
        """Start an empty session from the closed session (in its scope) that shares the
        longest prefix with ``token_ids``; how many tokens the session now holds (0: none
        shared ``MIN_REUSE_TOKENS`` or more).

        While a stream is free, a closed session gives up its stream only where the shared
        prefix is most of the shorter of the two (``MOSTLY_SHARED``): the same prompt again,
        or a conversation's next round. Where less is shared (new chats that open with the
        same chat template and system prompt), the new session takes a free stream and a
        copy of the closed session's cells, cut to the shared prefix (``_copy_prefix``): the
        closed conversation keeps its cache for its own next round. With no stream free,
        the new session costs some closed session its stream anyway: the best match gives
        it up. A closed session whose stream went to another has its cells kept in host
        memory (``prefix_cache_bytes``), from where a later session that shares more than
        any stream does gets a copy (``_restore``)."""
        session = self._session(session_id)
        if session.token_ids:
            raise ValueError(f"session {session_id!r} is not empty: it cannot adopt a prefix")
        best, best_len = None, 0  # the closed session to take over
        copied, copied_len = None, 0  # the closed session to copy from
        for closed in self._retained.values():
            if closed.scope != session.scope:
                continue
            shared = common_prefix(closed.token_ids, token_ids)
            shorter = min(len(closed.token_ids), len(token_ids))
            if not self._free_seq_ids or shared >= MOSTLY_SHARED * shorter:
                if shared > best_len:
                    best, best_len = closed, shared
            elif shared > copied_len and _worth_copying(shared, len(closed.token_ids)):
                copied, copied_len = closed, shared
        saved_key, saved_len = None, 0  # the saved cells to copy from
        for key, saved in self._saved.items():
            shared = (
                common_prefix(saved.token_ids, token_ids) if saved.scope == session.scope else 0
            )
            if shared > saved_len and _worth_copying(shared, len(saved.token_ids)):
                saved_key, saved_len = key, shared
        if saved_key is not None and saved_len > max(best_len, copied_len, MIN_REUSE_TOKENS - 1):
            return self._restore(session, saved_key, saved_len)
        if copied is not None and copied_len > best_len and copied_len >= MIN_REUSE_TOKENS:
            return self._copy_prefix(session, copied, copied_len)
        if best is None or best_len < MIN_REUSE_TOKENS:
            return 0
        assert best.seq_id is not None  # a retained session held tokens
        if len(best.token_ids) - best_len >= MIN_REUSE_TOKENS:
            self._save(best)  # what the new session cuts off stays for its own next round
        del self._retained[best.seq_id]
        if not self._lib.llama_memory_seq_rm(self._memory, best.seq_id, best_len, -1):
            self._drop(best.seq_id)
            return 0
        if session.seq_id is not None:  # rolled back to empty: nothing to remove
            heapq.heappush(self._free_seq_ids, session.seq_id)
        session.seq_id, session.token_ids = best.seq_id, best.token_ids[:best_len]
        self.reused_tokens += best_len
        return best_len

    def _copy_prefix(self, session: _Session, closed: _Session, length: int) -> int:
        """Give an empty session a copy of ``closed``'s first ``length`` cells; the tokens
        it now holds (0 where llama.cpp refused the copy). Exact: the same keys and values
        at the same positions. llama.cpp copies between streams only a whole sequence's
        state (``llama_state_seq_get_data``, then ``_set_data`` and a rollback), so the
        cost grows with the closed session's length, not the prefix's."""
        assert closed.seq_id is not None  # a retained session held tokens
        state = self._state(closed.seq_id)
        if state is None or not self._load(session, state, closed.token_ids, length):
            return 0
        self._retained.move_to_end(closed.seq_id)  # it was of use: the last to give up
        return length

    def _restore(self, session: _Session, key: int, length: int) -> int:
        """Give an empty session the first ``length`` cells of a saved closed session."""
        saved = self._saved[key]
        if not self._load(session, saved.state, saved.token_ids, length):
            return 0
        self._saved.move_to_end(key)  # it was of use: the last to go
        return length

    def _state(self, seq_id: int) -> ctypes.Array[ctypes.c_ubyte] | None:
        """A stream's cells as bytes (``llama_state_seq_get_data``), None if refused."""
        size = self._lib.llama_state_seq_get_size(self._ctx, seq_id)
        state = (ctypes.c_ubyte * size)()
        if self._lib.llama_state_seq_get_data(self._ctx, state, size, seq_id) != size:
            return None
        return state

    def _load(
        self,
        session: _Session,
        state: ctypes.Array[ctypes.c_ubyte],
        token_ids: list[int],
        length: int,
    ) -> bool:
        """Load a stream's bytes (of ``token_ids``) into the session's own stream, cut to
        ``length`` cells, which the session then holds; False where llama.cpp refused."""
        if session.seq_id is None:
            session.seq_id = self._take_seq_id()
        loaded = self._lib.llama_state_seq_set_data(
            self._ctx, state, len(state), session.seq_id
        ) != 0 and self._lib.llama_memory_seq_rm(self._memory, session.seq_id, length, -1)
        if not loaded:
            self._lib.llama_memory_seq_rm(self._memory, session.seq_id, -1, -1)
            return False
        session.token_ids = token_ids[:length]
        self.reused_tokens += length
        return True

    def _save(self, closed: _Session) -> None:
        """Keep a closed session's cells in host memory as its stream goes to another, the
        least recently used saved ones given up to stay within ``prefix_cache_bytes``; one
        whose tokens begin a newer one's is dropped for it."""
        if not self.prefix_cache_bytes or closed.seq_id is None:
            return
        state = self._state(closed.seq_id)
        if state is None or len(state) > self.prefix_cache_bytes:
            return
        for key, saved in list(self._saved.items()):
            if saved.scope == closed.scope and (
                common_prefix(saved.token_ids, closed.token_ids) == len(saved.token_ids)
            ):
                self._forget(key)
        while self.saved_bytes + len(state) > self.prefix_cache_bytes:
            self._forget(next(iter(self._saved)))
        self._saved_ids += 1
        self._saved[self._saved_ids] = _Saved(list(closed.token_ids), closed.scope, state)
        self.saved_bytes += len(state)

    def _forget(self, key: int) -> None:
        self.saved_bytes -= len(self._saved.pop(key).state)

    def close(self, session_id: str, retain: bool = True) -> None:
        """End a session (idempotent); its stream is kept for ``adopt_prefix`` unless
        ``retain`` is False or it holds too few tokens to be worth it."""
        session = self._sessions.pop(session_id, None)
        if session is None or session.seq_id is None:
            return
        if retain and self.prefix_reuse and len(session.token_ids) >= MIN_REUSE_TOKENS:
            self._retained[session.seq_id] = session
        else:
            self._drop(session.seq_id)

    def _take_seq_id(self) -> int:
        """A free sequence id; else the least recently closed session's, its cells dropped."""
        if self._free_seq_ids:
            return heapq.heappop(self._free_seq_ids)
        if self._retained:
            seq_id, closed = self._retained.popitem(last=False)
            self._save(closed)
            self._lib.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
            return seq_id
        raise RuntimeError(f"the engine holds at most {self.max_sessions} sessions at once")

    def _drop(self, seq_id: int) -> None:
        self._lib.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
        heapq.heappush(self._free_seq_ids, seq_id)

    def truncate(self, session_id: str, new_length: int) -> None:
        """Roll back to the first ``new_length`` tokens (a confirmed prefix)."""
        session = self._session(session_id)
        if not 0 <= new_length <= len(session.token_ids):
            raise ValueError(
                f"cannot truncate a {len(session.token_ids)}-token session to {new_length}"
            )
        if new_length < len(session.token_ids):
            assert session.seq_id is not None  # it holds tokens
            if not self._lib.llama_memory_seq_rm(self._memory, session.seq_id, new_length, -1):
                raise RuntimeError(f"llama.cpp could not roll {session_id!r} back")
            del session.token_ids[new_length:]

    def _session(self, session_id: str) -> _Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise KeyError(f"unknown session {session_id!r}") from None

    # ------------------------------------------------------------------ forward

    def forward_new(
        self, batch: Sequence[NewTokens], keep_rows: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """One ``llama_decode`` over many sessions; appends each item's new tokens to its
        session. Returns per item the float32 logits [keep_rows[b], V] of its last rows
        (default: all); the last row predicts the token after the item's last new token."""
        if not batch:
            return []
        if len({session_id for session_id, _ in batch}) != len(batch):
            raise ValueError("a session appears twice in one batch")
        counts = [len(new_ids) for _, new_ids in batch]
        keeps = list(counts) if keep_rows is None else [int(k) for k in keep_rows]
        sessions = [self._session(session_id) for session_id, _ in batch]
        for session in sessions:
            if session.seq_id is None:
                session.seq_id = self._take_seq_id()
        for (session_id, _), n_new, keep in zip(batch, counts, keeps, strict=True):
            if n_new == 0:
                raise ValueError(f"session {session_id!r}: no new tokens to forward")
            if not 0 <= keep <= n_new:
                raise ValueError(f"session {session_id!r}: keep {keep} of {n_new} rows")
            if len(self._sessions[session_id].token_ids) + n_new > self.session_tokens:
                raise ValueError(
                    f"session {session_id!r}: {len(self._sessions[session_id].token_ids) + n_new}"
                    f" positions exceed the engine's {self.session_tokens} per session"
                )
        total = sum(counts)
        if total > self.batch_tokens:
            raise ValueError(f"{total} tokens in one forward; the engine takes {self.batch_tokens}")
        # llama.cpp splits a batch over KV streams into one pass per run of consecutive
        # sequence ids (``llama_passes``): in the caller's order 16 sessions could take 16
        # passes over the weights. In id order, with the lowest free ids handed out first
        # and the round padded where a pass costs more than the padding, they take one.
        order = sorted(range(len(batch)), key=lambda i: sessions[i].seq_id or 0)
        runs = [(sessions[i].seq_id or 0, counts[i]) for i in order]
        lengths = self._stream_lengths()
        # where each stream's real tokens end after this batch
        ends = lengths | {seq_id: lengths.get(seq_id, 0) + n_new for seq_id, n_new in runs}
        padding = (
            llama_passes.plan(
                runs,
                lambda seq_id: self.session_tokens - ends.get(seq_id, 0),
                self.micro_batch_tokens,
                self.batch_tokens,
            )
            if self.pad_rounds
            else llama_passes.NO_PADDING
        )
        self._fill_batch(
            [batch[i] for i in order],
            [sessions[i] for i in order],
            [counts[i] for i in order],
            [keeps[i] for i in order],
            padding,
            ends,
        )
        status = self._lib.llama_decode(self._ctx, self._batch)
        if status != 0:
            # 1: no free KV cells; the cache is as before the call (llama.h)
            raise RuntimeError(f"llama_decode returned {status}")
        self.padding_tokens += padding.rows
        for seq_id in padding.tokens:  # the throwaway tokens go
            if not self._lib.llama_memory_seq_rm(self._memory, seq_id, ends.get(seq_id, 0), -1):
                raise RuntimeError(f"llama.cpp could not roll stream {seq_id} back")
        for session, (_, new_ids) in zip(sessions, batch, strict=True):
            session.token_ids.extend(int(t) for t in new_ids)
        self.forward_calls += 1
        n_out = sum(keeps)
        if n_out == 0:
            empty = torch.empty((0, self._vocab_size), dtype=torch.float32)
            return [empty for _ in batch]
        pointer = self._lib.llama_get_logits(self._ctx)
        rows = np.ctypeslib.as_array(pointer, shape=(n_out, self._vocab_size))
        logits = torch.from_numpy(rows.copy())  # [n_out, V]: llama.cpp reuses its buffer
        in_order = logits.split([keeps[i] for i in order])
        out: list[torch.Tensor] = [in_order[0]] * len(batch)
        for position, i in enumerate(order):
            out[i] = in_order[position]
        return out

    def _stream_lengths(self) -> dict[int, int]:
        """Tokens held per stream that holds any (open and closed sessions alike)."""
        held = list(self._sessions.values()) + list(self._retained.values())
        return {
            session.seq_id: len(session.token_ids) for session in held if session.seq_id is not None
        }

    def _fill_batch(
        self,
        batch: Sequence[NewTokens],
        sessions: list[_Session],
        counts: list[int],
        keeps: list[int],
        padding: llama_passes.Padding,
        ends: dict[int, int],
    ) -> None:
        """Lay every item's tokens, then its padding, end to end in the reusable llama_batch,
        with the gap streams' throwaway runs in between, in ascending sequence ids."""
        b = self._batch
        tokens = np.ctypeslib.as_array(b.token, shape=(self.batch_tokens,))
        positions = np.ctypeslib.as_array(b.pos, shape=(self.batch_tokens,))
        n_seq = np.ctypeslib.as_array(b.n_seq_id, shape=(self.batch_tokens,))
        wants = np.ctypeslib.as_array(b.logits, shape=(self.batch_tokens,))
        # (sequence id, first position, token ids, rows wanted at the end)
        segments: list[tuple[int, int, Sequence[int] | np.ndarray, int]] = []
        items = set()
        for (_, new_ids), session, n_new, keep in zip(batch, sessions, counts, keeps, strict=True):
            assert session.seq_id is not None  # given one before the batch is filled
            items.add(session.seq_id)
            segments.append((session.seq_id, len(session.token_ids), new_ids, keep))
            extra = padding.tokens.get(session.seq_id, 0)
            if extra:
                segments.append((session.seq_id, len(session.token_ids) + n_new, [0] * extra, 0))
        for seq_id, extra in padding.tokens.items():
            if seq_id not in items:
                segments.append((seq_id, ends.get(seq_id, 0), [0] * extra, 0))
        segments.sort(key=lambda segment: (segment[0], segment[1]))
        row = 0
        for seq_id, start, ids, keep in segments:
            n = len(ids)
            tokens[row : row + n] = ids
            positions[row : row + n] = np.arange(start, start + n)
            wants[row : row + n - keep] = 0
            wants[row + n - keep : row + n] = 1
            for i in range(row, row + n):
                b.seq_id[i][0] = seq_id
            row += n
        n_seq[:row] = 1
        b.n_tokens = row
