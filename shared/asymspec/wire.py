"""Binary wire protocol between the edge gateway and the cloud verifier.

One persistent binary channel (a WebSocket) carries frames for many requests; every frame
is self-describing and independent of the others, so blocks of different sessions interleave.

Frame layout (one msgpack value per frame, positional, no field names)::

    frame    = array [version, type, field_1, ..., field_n]
    version  = PROTOCOL_VERSION (1 byte); a mismatch is ErrorCode.VERSION_MISMATCH
    type     = MessageType code (1 byte)
    BlockId  = array [session_id, seq, base_len, config_digest]
    Sampling = array [temperature, top_k, top_p, seed, Extras | nil]  (not p or q)
    Extras   = array [min_p, logit_bias ids (uint32), logit_bias values (float32),
               repetition_penalty, presence_penalty, frequency_penalty, grammar (str,
               "" for none), prompt_len, logprobs]: the rest of the request's transform,
               sent once per session; prompt_len says where the output starts in a
               session's tokens (a session reopened mid-request sends prompt + output);
               logprobs is 0 for none, else 1 + how many top alternatives the cloud
               reports beside each token it samples
    Logprobs = array [token logprobs (float32, n), top ids (uint32, n × k), top logprobs
               (float32, n × k)]: the target's raw log-softmax at each of n tokens
               (nil when the request uses none of it, so a plain request pays one byte)
    payload  = array [CorrectionKind, field_1, ...]      (TopK, Proposals, FullRow)
    arrays   = bin of raw little-endian bytes: token ids uint32, probabilities float32
               (bit-exact: NaN payloads, -0.0, subnormals, inf), full-upload q rows float16
               (row-major γ × V, V = byte length / 2 / γ)
    prompt   = the same uint32 bytes, zlib-compressed: sent once per request, the prompt is
               most of the uplink a compact-mode request costs, and token ids compress
               ~2.2x (the high bytes of ids below 65,536 are zero); lossless, so exact
    Features = array [hidden, bin of bf16 bit patterns as little-endian uint16, row-major
               rows × hidden]: the target's last hidden states of confirmed positions, for
               a feature draft (``asymspec_engine.feature_draft``). Downlink only, and
               only to an edge that asked: they are a draft's input, never a probability,
               so bf16 rounding changes which q the edge proposes from, not exactness
    absent   = nil

    type  message            fields after [version, type]
    1     Hello              edge_id, auth_token
    2     HelloAck           server_id
    3     OpenSession        session_id, prompt_tokens, Sampling, [first_kind, first_size],
                             wants_features
    4     SessionOpened      session_id, prefix_len, Features | nil (positions 0 .. prefix_len-2)
    5     CloseSession       session_id
    6     VerifyBlock        BlockId, draft_tokens, draft_probs, committed_tail
    7     VerifyBlockFull    BlockId, draft_tokens, draft_rows, committed_tail
    8     VerifyResult       BlockId, n_accepted, next_token | nil, payload | nil,
                             Features | nil (the block's tail and accepted drafts: n_accepted+1)
    9     CorrectionRequest  BlockId, kind, size, rung
    10    CorrectionResponse BlockId, payload
    11    (retired: Commit; the recovered token rides in the next block's tail)
    12    GenerateRequest    session_id, max_tokens, stop_token_ids, committed_tail
    13    GenerateTokens     session_id, tokens, done, Logprobs | nil (when the session asked)
    14    ErrorFrame         code, message, session_id | nil, BlockId | nil
    15    StopGeneration     session_id

`decode` raises only `WireError`. Decoded arrays are zero-copy, read-only numpy views over
the bytes objects msgpack allocated for each bin field (`.copy()` before mutating). `encode`
insists on the exact array kinds and shapes and raises TypeError otherwise: a wrong dtype is
a bug in the caller, not something to cast silently (an int64 token id may not fit uint32).
Messages compare equal when their encoded fields are equal, so float comparison is bitwise.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum
from types import MappingProxyType
from typing import Any, ClassVar, TypeAlias

import msgpack
import numpy as np
import numpy.typing as npt

from asymspec.sampling_params import NO_PENALTIES, Penalties, SamplingParams

# 2: the OpenSession prompt travels zlib-compressed; 3: features; 4: SessionOpened.target_cost;
# 5: GenerateRequest.committed_tail (a speculative session handed to the cloud's decoding);
# 6: the sampling config's extras (min-p, logit bias, penalties, a grammar); 7: StopGeneration
PROTOCOL_VERSION = 7
DEFAULT_MAX_FRAME_BYTES = 8 * 1024 * 1024  # a full-upload block at γ=8, |V|=152k is ~2.4 MB
MAX_PROMPT_TOKENS = 1 << 20  # a decompressed prompt may not exceed this (zip-bomb guard)

_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1  # session ids and seeds: wide enough to pick at random
# Wire dtypes are explicitly little-endian; decoded arrays are converted to native order.
_WIRE_U32 = np.dtype("<u4")
_WIRE_F32 = np.dtype("<f4")
_WIRE_F16 = np.dtype("<f2")
_WIRE_BF16_BITS = np.dtype("<u2")

TokenIds: TypeAlias = npt.NDArray[np.uint32]  # (n,)
Probs: TypeAlias = npt.NDArray[np.float32]  # (n,)
HalfRows: TypeAlias = npt.NDArray[np.float16]  # (γ, V)
Features: TypeAlias = npt.NDArray[np.uint16]  # (rows, hidden) bf16 bit patterns


class MessageType(IntEnum):
    HELLO = 1
    HELLO_ACK = 2
    OPEN_SESSION = 3
    SESSION_OPENED = 4
    CLOSE_SESSION = 5
    VERIFY_BLOCK = 6
    VERIFY_BLOCK_FULL = 7
    VERIFY_RESULT = 8
    CORRECTION_REQUEST = 9
    CORRECTION_RESPONSE = 10
    # 11 was Commit, never sent: a block's committed_tail carries the recovered token.
    GENERATE_REQUEST = 12
    GENERATE_TOKENS = 13
    ERROR = 14
    STOP_GENERATION = 15


class CorrectionKind(IntEnum):
    """Escalation ladder after a rejection; also the tag of the matching payload."""

    TOPK = 1
    PROPOSALS = 2
    FULL = 3

    @property
    def label(self) -> str:
        """The name metrics and per-request stats use: topk, proposals, full."""
        return self.name.lower()


class ErrorCode(IntEnum):
    VERSION_MISMATCH = 1
    MALFORMED = 2
    FRAME_TOO_LARGE = 3
    UNAUTHORIZED = 4
    UNKNOWN_SESSION = 5
    STALE_BLOCK = 6  # the block's base prefix is no longer the session's committed prefix
    DUPLICATE = 7
    OVERLOADED = 8
    INTERNAL = 9
    UNSUPPORTED = 10  # asked of a peer that cannot do it (e.g. features of a CachedLM target)


class WireError(ValueError):
    """The only exception `decode` raises; `code` is what to send back in an ErrorFrame."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def _malformed(message: str) -> WireError:
    return WireError(ErrorCode.MALFORMED, message)


# --- value types (plain dataclass equality: no arrays inside) ------------------------------


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """A request's sampling settings (validated where they are made) and its seed; the
    penalties and the grammar (an ``asymspec.grammar`` text, "" for none) are the part of
    the transform that reads the tokens before each row (``asymspec.constraint``)."""

    params: SamplingParams
    seed: int
    penalties: Penalties = NO_PENALTIES
    grammar: str = ""
    # where the request's output starts (its prompt's length): penalties and the grammar
    # read the output, and a session reopened mid-request is opened from prompt + output
    prompt_len: int = 0
    # the cloud reports the target's log-probabilities of each token it samples and of
    # this many top alternatives (None: it reports none). Not part of the transform.
    logprobs: int | None = None

    @property
    def reads_history(self) -> bool:
        """Whether a row's transform depends on the tokens before it (penalties, grammar)."""
        return self.penalties.active or bool(self.grammar)


def _extras(sampling: SamplingConfig) -> list[Any] | None:
    """The Extras array, or None when the config has none of them."""
    p, pen = sampling.params, sampling.penalties
    extras = p.min_p or p.logit_bias or pen.active or sampling.grammar
    if not extras and sampling.logprobs is None:
        return None
    ids = np.asarray([token for token, _ in p.logit_bias], dtype=_WIRE_U32)
    values = np.asarray([bias for _, bias in p.logit_bias], dtype=_WIRE_F32)
    return [
        float(p.min_p),
        _u32s(ids),
        _f32s(values),
        float(pen.repetition),
        float(pen.presence),
        float(pen.frequency),
        _str(sampling.grammar),
        int(sampling.prompt_len),
        0 if sampling.logprobs is None else 1 + int(sampling.logprobs),
    ]


def config_digest(sampling: SamplingConfig) -> int:
    """Stable uint32 naming a sampling config, so a block cannot be verified under another."""
    # + 0.0 folds -0.0 into 0.0: both mean the same config and must digest the same.
    p = sampling.params
    canonical = struct.pack("<dQdQ", p.temperature + 0.0, p.top_k, p.top_p + 0.0, sampling.seed)
    extras = _extras(sampling)
    if extras is not None:
        folded = [x + 0.0 if isinstance(x, float) else x for x in extras]
        canonical += _packb(folded)
    return zlib.crc32(canonical)


@dataclass(frozen=True, slots=True)
class BlockId:
    """Binds a block's messages to a request, its base-prefix length, a sequence number and
    the sampling config, so delayed, duplicated or stale messages are detectable."""

    session_id: int
    seq: int
    base_len: int  # committed prefix length the block's drafts extend
    config_digest: int


@dataclass(frozen=True, slots=True)
class TargetCost:
    """The verifier's fitted forward cost, ``base_s + row_s × rows`` (its batcher's online
    fit): what the edge needs to choose γ for goodput (``edge_gateway.draft_length``)."""

    base_s: float
    row_s: float


# --- messages --------------------------------------------------------------------------------


class _Wire:
    """Equality and hashing by encoded fields: arrays compare bitwise (NaN == same NaN)."""

    __slots__ = ()

    def _fields(self) -> list[Any]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, _Wire)
        return _packb(self._fields()) == _packb(other._fields())

    def __hash__(self) -> int:
        return hash((type(self), _packb(self._fields())))


@dataclass(frozen=True, slots=True, eq=False)
class TopK(_Wire):
    """Target top-K of the rejected position, ordered by probability, and delta_p = 1 - Σ_S p."""

    KIND: ClassVar[CorrectionKind] = CorrectionKind.TOPK
    token_ids: TokenIds  # (K,)
    probs: Probs  # (K,)
    delta_p: np.float32

    def _fields(self) -> list[Any]:
        if not isinstance(self.delta_p, np.float32):
            raise TypeError(f"TopK.delta_p: expected np.float32, got {type(self.delta_p)}")
        # delta_p travels as 4 raw bytes like every other probability.
        delta_p = np.asarray(self.delta_p, dtype=_WIRE_F32).tobytes()
        return [self.KIND, _u32s(self.token_ids), _f32s(self.probs), delta_p]


@dataclass(frozen=True, slots=True, eq=False)
class Proposals(_Wire):
    """Exact recovery: N draws Y ~ p with their p(Y)."""

    KIND: ClassVar[CorrectionKind] = CorrectionKind.PROPOSALS
    token_ids: TokenIds  # (N,)
    probs: Probs  # (N,)

    def _fields(self) -> list[Any]:
        return [self.KIND, _u32s(self.token_ids), _f32s(self.probs)]


@dataclass(frozen=True, slots=True, eq=False)
class FullRow(_Wire):
    """Full fallback: the whole target row p of the rejected position."""

    KIND: ClassVar[CorrectionKind] = CorrectionKind.FULL
    probs: Probs  # (V,)

    def _fields(self) -> list[Any]:
        return [self.KIND, _f32s(self.probs)]


Payload: TypeAlias = TopK | Proposals | FullRow


@dataclass(frozen=True, slots=True, eq=False)
class Hello(_Wire):
    TYPE: ClassVar[MessageType] = MessageType.HELLO
    edge_id: str
    auth_token: str

    def _fields(self) -> list[Any]:
        return [_str(self.edge_id), _str(self.auth_token)]


@dataclass(frozen=True, slots=True, eq=False)
class HelloAck(_Wire):
    TYPE: ClassVar[MessageType] = MessageType.HELLO_ACK
    server_id: str

    def _fields(self) -> list[Any]:
        return [_str(self.server_id)]


@dataclass(frozen=True, slots=True, eq=False)
class OpenSession(_Wire):
    """Open a request's session; first_kind/first_size = the correction the cloud sends with
    a rejection (rung 0 of the edge's ladder: a top-K in the progressive mode, proposals in
    the exact mode)."""

    TYPE: ClassVar[MessageType] = MessageType.OPEN_SESSION
    session_id: int
    prompt_tokens: TokenIds  # (prompt_len,)
    sampling: SamplingConfig
    first_kind: CorrectionKind = CorrectionKind.TOPK
    first_size: int = 16
    wants_features: bool = False  # the edge drafts with a feature draft: send the target's h

    def _fields(self) -> list[Any]:
        p, seed = self.sampling.params, self.sampling.seed
        extras = _extras(self.sampling)
        sampling = [float(p.temperature), int(p.top_k), float(p.top_p), int(seed), extras]
        first = [int(self.first_kind), self.first_size]
        prompt = zlib.compress(_u32s(self.prompt_tokens), 6)
        return [self.session_id, prompt, sampling, first, bool(self.wants_features)]


@dataclass(frozen=True, slots=True, eq=False)
class SessionOpened(_Wire):
    """The prompt is in the target's cache; ``features`` (when the edge asked) are its h of
    positions 0 .. prefix_len - 2, the positions it fed (the last token is the first
    block's tail)."""

    TYPE: ClassVar[MessageType] = MessageType.SESSION_OPENED
    session_id: int
    prefix_len: int
    features: Features | None = None  # (prefix_len - 1, hidden)
    target_cost: TargetCost | None = None  # None until the verifier has timed a forward

    def _fields(self) -> list[Any]:
        cost = self.target_cost
        return [
            self.session_id,
            self.prefix_len,
            _features(self.features),
            None if cost is None else [cost.base_s, cost.row_s],
        ]


@dataclass(frozen=True, slots=True, eq=False)
class CloseSession(_Wire):
    TYPE: ClassVar[MessageType] = MessageType.CLOSE_SESSION
    session_id: int

    def _fields(self) -> list[Any]:
        return [self.session_id]


@dataclass(frozen=True, slots=True, eq=False)
class VerifyBlock(_Wire):
    """Compact AsymSpec uplink: γ draft tokens and their q(x_i), never the q rows."""

    TYPE: ClassVar[MessageType] = MessageType.VERIFY_BLOCK
    block: BlockId
    draft_tokens: TokenIds  # (γ,)
    draft_probs: Probs  # (γ,) q_i(x_i)
    committed_tail: TokenIds  # (0..1,) recovered token the cloud has not seen yet

    def _fields(self) -> list[Any]:
        return [
            _block(self.block),
            _u32s(self.draft_tokens),
            _f32s(self.draft_probs),
            _u32s(self.committed_tail),
        ]


@dataclass(frozen=True, slots=True, eq=False)
class VerifyBlockFull(_Wire):
    """Full-upload baseline: the whole q row per draft position in float16 (paper Table I)."""

    TYPE: ClassVar[MessageType] = MessageType.VERIFY_BLOCK_FULL
    block: BlockId
    draft_tokens: TokenIds  # (γ,)
    draft_rows: HalfRows  # (γ, V)
    committed_tail: TokenIds  # (0..1,)

    def _fields(self) -> list[Any]:
        rows = _array_bytes(self.draft_rows, _WIRE_F16, 2, "draft_rows")
        return [_block(self.block), _u32s(self.draft_tokens), rows, _u32s(self.committed_tail)]


@dataclass(frozen=True, slots=True, eq=False)
class VerifyResult(_Wire):
    """All accepted: n_accepted = γ, next_token = bonus. First rejection at i: n_accepted = i
    and either correction (the answer to the ladder's first rung: a top-K in the progressive
    mode, proposals in the exact mode) or next_token (cloud-sampled recovered token, in the
    modes where the cloud holds q). Exactly one of the two is set."""

    TYPE: ClassVar[MessageType] = MessageType.VERIFY_RESULT
    block: BlockId
    n_accepted: int
    next_token: int | None
    correction: Payload | None
    # When the edge asked: the target's h of the block's tail and its accepted drafts, the
    # confirmed positions this forward fed (n_accepted + 1, hidden)
    features: Features | None = None

    def _fields(self) -> list[Any]:
        correction = None if self.correction is None else self.correction._fields()
        return [
            _block(self.block),
            self.n_accepted,
            self.next_token,
            correction,
            _features(self.features),
        ]


@dataclass(frozen=True, slots=True, eq=False)
class CorrectionRequest(_Wire):
    """Edge escalation after a failed certificate; size = K, N proposals, or 0 for FULL.

    rung = the ladder step asked for (1, 2, ...; step 0 came with the VerifyResult). It tells
    a retransmission (same rung: the cloud replays its cached answer, same random draws)
    from a second round of proposals of the same size (next rung: fresh draws)."""

    TYPE: ClassVar[MessageType] = MessageType.CORRECTION_REQUEST
    block: BlockId
    kind: CorrectionKind
    size: int
    rung: int = 1

    def _fields(self) -> list[Any]:
        return [_block(self.block), int(self.kind), self.size, self.rung]


@dataclass(frozen=True, slots=True, eq=False)
class CorrectionResponse(_Wire):
    TYPE: ClassVar[MessageType] = MessageType.CORRECTION_RESPONSE
    block: BlockId
    payload: Payload

    def _fields(self) -> list[Any]:
        return [_block(self.block), self.payload._fields()]


@dataclass(frozen=True, slots=True, eq=False)
class GenerateRequest(_Wire):
    """The cloud decodes the session alone, streaming GenerateTokens back: target-only
    mode (SPADE's "Target" baseline), and a speculative session while speculation is paused
    (the goodput rule's pause, or the batch above ``speculative_disable_by_batch_size``),
    which asks for all its remaining tokens and ends the generation with StopGeneration.
    ``committed_tail`` is the edge's recovered token the cloud does not know yet (as in a
    block's)."""

    TYPE: ClassVar[MessageType] = MessageType.GENERATE_REQUEST
    session_id: int
    max_tokens: int
    stop_token_ids: TokenIds  # (n_stop,)
    committed_tail: TokenIds  # (0 or 1,)

    def _fields(self) -> list[Any]:
        return [
            self.session_id,
            self.max_tokens,
            _u32s(self.stop_token_ids),
            _u32s(self.committed_tail),
        ]


@dataclass(frozen=True, slots=True, eq=False)
class StopGeneration(_Wire):
    """End the session's generation soon: the token of the cloud's next round (after the
    one under way, if any) is its last, marked done. A paused speculative session asks for
    all its remaining tokens at once and sends this when it wants to speculate again, so
    that the cloud's decoding never waits on an ask. Every token the cloud sent stays
    confirmed (each is a sample of p); a stop that finds no generation under way (it ended
    meanwhile) is dropped."""

    TYPE: ClassVar[MessageType] = MessageType.STOP_GENERATION
    session_id: int

    def _fields(self) -> list[Any]:
        return [self.session_id]


@dataclass(frozen=True, slots=True, eq=False)
class Logprobs:
    """The target's raw log-softmax at n sampled tokens: each token's own and its k most
    probable alternatives' (ordered), as exact float32."""

    token_logprobs: Probs  # (n,)
    top_ids: TokenIds  # (n, k) flattened row-major
    top_logprobs: Probs  # (n, k) flattened row-major

    def _fields(self) -> list[Any]:
        return [_f32s(self.token_logprobs), _u32s(self.top_ids), _f32s(self.top_logprobs)]


MAX_TOP_LOGPROBS = 20  # OpenAI's limit


@dataclass(frozen=True, slots=True, eq=False)
class GenerateTokens(_Wire):
    TYPE: ClassVar[MessageType] = MessageType.GENERATE_TOKENS
    session_id: int
    tokens: TokenIds  # (n,)
    done: bool
    logprobs: Logprobs | None = None  # only for a session whose config asked for them

    def _fields(self) -> list[Any]:
        logprobs = None if self.logprobs is None else self.logprobs._fields()
        return [self.session_id, _u32s(self.tokens), bool(self.done), logprobs]


@dataclass(frozen=True, slots=True, eq=False)
class ErrorFrame(_Wire):
    TYPE: ClassVar[MessageType] = MessageType.ERROR
    code: ErrorCode
    message: str
    session_id: int | None = None
    block: BlockId | None = None

    def _fields(self) -> list[Any]:
        block = None if self.block is None else _block(self.block)
        return [int(self.code), _str(self.message), self.session_id, block]


Message: TypeAlias = (
    Hello
    | HelloAck
    | OpenSession
    | SessionOpened
    | CloseSession
    | VerifyBlock
    | VerifyBlockFull
    | VerifyResult
    | CorrectionRequest
    | CorrectionResponse
    | GenerateRequest
    | GenerateTokens
    | StopGeneration
    | ErrorFrame
)


# --- encoding ------------------------------------------------------------------------------


def _packb(obj: Any) -> bytes:
    # use_bin_type keeps bytes as bin (not str); floats stay float64 (only sampling knobs).
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def _array_bytes(arr: Any, wire: np.dtype[Any], ndim: int, what: str) -> bytes:
    ok = isinstance(arr, np.ndarray) and arr.ndim == ndim
    if not ok or arr.dtype.kind != wire.kind or arr.dtype.itemsize != wire.itemsize:
        got = f"{arr.dtype} ndim={arr.ndim}" if isinstance(arr, np.ndarray) else type(arr)
        raise TypeError(f"{what}: expected a {ndim}-D {wire.name} numpy array, got {got}")
    # astype to the explicit little-endian dtype is a no-op on LE hosts and a bit-exact
    # byteswap elsewhere; tobytes() emits C order, so a (γ, V) row block is row-major.
    return arr.astype(wire, copy=False).tobytes()


def _u32s(arr: Any) -> bytes:
    return _array_bytes(arr, _WIRE_U32, 1, "token ids")


def _f32s(arr: Any) -> bytes:
    return _array_bytes(arr, _WIRE_F32, 1, "probabilities")


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected str, got {type(value)}")
    return value


def _features(features: Any) -> list[Any] | None:
    if features is None:
        return None
    if not isinstance(features, np.ndarray) or features.ndim != 2 or features.shape[1] == 0:
        raise TypeError("features: expected a 2-D uint16 (bf16 bits) array with hidden > 0")
    return [int(features.shape[1]), _array_bytes(features, _WIRE_BF16_BITS, 2, "features")]


def _block(block: BlockId) -> list[int]:
    return [block.session_id, block.seq, block.base_len, block.config_digest]


def encode(msg: Message) -> bytes:
    """One frame for `msg`. Range checks are the decoder's: it rejects what it cannot trust."""
    if not isinstance(msg, _Wire) or not hasattr(msg, "TYPE"):
        raise TypeError(f"not a wire message: {type(msg)}")
    return _packb([PROTOCOL_VERSION, int(msg.TYPE), *msg._fields()])


# --- decoding ------------------------------------------------------------------------------


class _Fields:
    """One message's (or nested array's) positional fields; every bad value -> WireError."""

    __slots__ = ("_items", "_pos", "_what")

    def __init__(self, raw: Any, count: int, what: str) -> None:
        if type(raw) is not list:
            raise _malformed(f"{what}: expected an array, got {type(raw).__name__}")
        if len(raw) != count:
            raise _malformed(f"{what}: expected {count} fields, got {len(raw)}")
        self._items: list[Any] = raw
        self._pos = 0
        self._what = what

    def _next(self) -> tuple[Any, str]:
        value = self._items[self._pos]
        self._pos += 1
        return value, f"{self._what} field {self._pos}"

    def peek_none(self) -> bool:
        return self._items[self._pos] is None

    def skip(self) -> None:
        self._pos += 1

    def uint(self, max_value: int = _U32_MAX) -> int:
        value, where = self._next()
        # type() rather than isinstance(): msgpack booleans are Python bools, a subclass of int.
        if type(value) is not int or not 0 <= value <= max_value:
            raise _malformed(f"{where}: expected an integer in 0..{max_value}, got {value!r:.40}")
        return value

    def opt_uint(self, max_value: int = _U32_MAX) -> int | None:
        if self.peek_none():
            self.skip()
            return None
        return self.uint(max_value)

    def real(self) -> float:
        value, where = self._next()
        if type(value) not in (int, float) or not math.isfinite(value):
            raise _malformed(f"{where}: expected a finite number, got {value!r:.40}")
        return float(value)

    def boolean(self) -> bool:
        value, where = self._next()
        if type(value) is not bool:
            raise _malformed(f"{where}: expected a bool, got {type(value).__name__}")
        return value

    def text(self) -> str:
        value, where = self._next()
        if type(value) is not str:
            raise _malformed(f"{where}: expected a str, got {type(value).__name__}")
        return value

    def raw_bytes(self) -> tuple[bytes, str]:
        value, where = self._next()
        if type(value) is not bytes:
            raise _malformed(f"{where}: expected bin, got {type(value).__name__}")
        return value, where

    def array(self, wire: np.dtype[Any]) -> npt.NDArray[Any]:
        raw, where = self.raw_bytes()
        if len(raw) % wire.itemsize:
            raise _malformed(f"{where}: {len(raw)} bytes is not a multiple of {wire.itemsize}")
        # frombuffer over immutable bytes is a read-only zero-copy view; the astype is a
        # no-op on little-endian hosts and a copy elsewhere, so force read-only either way.
        arr = np.frombuffer(raw, dtype=wire).astype(wire.newbyteorder("="), copy=False)
        arr.flags.writeable = False
        return arr

    def tokens(self) -> TokenIds:
        return self.array(_WIRE_U32)

    def compressed_tokens(self, max_tokens: int) -> TokenIds:
        raw, where = self.raw_bytes()
        inflate = zlib.decompressobj()
        limit = max_tokens * _WIRE_U32.itemsize
        try:
            data = inflate.decompress(raw, limit + 1)  # one byte more than allowed: too long
        except zlib.error as exc:
            raise _malformed(f"{where}: not zlib data: {exc}") from None
        if len(data) > limit or inflate.unconsumed_tail:
            raise _malformed(f"{where}: more than {max_tokens} tokens once decompressed")
        if not inflate.eof or inflate.unused_data:
            raise _malformed(f"{where}: truncated or trailing zlib data")
        return _Fields([data], 1, where).tokens()

    def probs(self) -> Probs:
        return self.array(_WIRE_F32)

    def nested(self, count: int, what: str) -> _Fields:
        value, where = self._next()
        return _Fields(value, count, f"{where} ({what})")

    def opt_features(self, rows: int | None = None) -> Features | None:
        """Features or nil; ``rows``: how many rows the message says there must be."""
        if self.peek_none():
            self.skip()
            return None
        f = self.nested(2, "Features")
        hidden = f.uint()
        raw, where = f.raw_bytes()
        if hidden == 0 or len(raw) % (2 * hidden):
            raise _malformed(f"{where}: {len(raw)} bytes is not rows of {hidden} bf16 values")
        count = len(raw) // (2 * hidden)
        if rows is not None and count != rows:
            raise _malformed(f"{where}: {count} feature rows; expected {rows}")
        arr = np.frombuffer(raw, dtype=_WIRE_BF16_BITS)
        arr = arr.astype(_WIRE_BF16_BITS.newbyteorder("="), copy=False).reshape(count, hidden)
        arr.flags.writeable = False
        return arr

    def block(self) -> BlockId:
        f = self.nested(4, "BlockId")
        return BlockId(f.uint(_U64_MAX), f.uint(), f.uint(), f.uint())

    def opt_block(self) -> BlockId | None:
        if self.peek_none():
            self.skip()
            return None
        return self.block()

    def sampling(self) -> SamplingConfig:
        f = self.nested(5, "SamplingConfig")
        temperature, top_k, top_p, seed = f.real(), f.uint(), f.real(), f.uint(_U64_MAX)
        if f.peek_none():
            f.skip()
            try:
                return SamplingConfig(SamplingParams(temperature, top_k, top_p), seed)
            except ValueError as exc:
                raise _malformed(f"bad sampling config: {exc}") from None
        x = f.nested(9, "Extras")
        min_p, ids, values = x.real(), x.tokens(), x.probs()
        _same_length(ids, values, "logit_bias")
        repetition, presence, frequency, grammar = x.real(), x.real(), x.real(), x.text()
        prompt_len, logprobs = x.uint(), x.uint(MAX_TOP_LOGPROBS + 1)
        bias = tuple((int(t), float(v)) for t, v in zip(ids, values, strict=True))
        try:
            params = SamplingParams(temperature, top_k, top_p, min_p, bias)
            penalties = Penalties(repetition, presence, frequency)
        except ValueError as exc:
            raise _malformed(f"bad sampling config: {exc}") from None
        top = None if logprobs == 0 else logprobs - 1
        return SamplingConfig(params, seed, penalties, grammar, prompt_len, top)

    def payload(self) -> Payload:
        value, where = self._next()
        if type(value) is not list or not value:
            raise _malformed(f"{where}: expected a tagged payload array")
        kind = _enum(CorrectionKind, value[0], where)
        if kind is CorrectionKind.TOPK:
            f = _Fields(value, 4, f"{where} (TopK)")
            f.skip()
            ids, probs = f.tokens(), f.probs()
            raw, raw_where = f.raw_bytes()
            if len(raw) != 4:
                raise _malformed(f"{raw_where}: delta_p must be 4 bytes, got {len(raw)}")
            _same_length(ids, probs, "TopK")
            return TopK(ids, probs, np.frombuffer(raw, dtype=_WIRE_F32)[0])
        if kind is CorrectionKind.PROPOSALS:
            f = _Fields(value, 3, f"{where} (Proposals)")
            f.skip()
            ids, probs = f.tokens(), f.probs()
            _same_length(ids, probs, "Proposals")
            return Proposals(ids, probs)
        f = _Fields(value, 2, f"{where} (FullRow)")
        f.skip()
        return FullRow(f.probs())


def _enum(enum: type[IntEnum], value: Any, where: str) -> Any:
    if type(value) is not int or value not in enum._value2member_map_:
        raise _malformed(f"{where}: {value!r:.40} is not a valid {enum.__name__}")
    return enum(value)


def _same_length(tokens: npt.NDArray[Any], values: npt.NDArray[Any], what: str) -> None:
    if len(tokens) != len(values):
        raise _malformed(f"{what}: {len(tokens)} token ids but {len(values)} probabilities")


def _tail(f: _Fields) -> TokenIds:
    tail = f.tokens()
    if len(tail) > 1:
        raise _malformed(f"committed_tail holds {len(tail)} tokens; at most 1 is allowed")
    return tail


def _generate_tokens(f: _Fields) -> GenerateTokens:
    session_id, tokens, done = f.uint(_U64_MAX), f.tokens(), f.boolean()
    if f.peek_none():
        f.skip()
        return GenerateTokens(session_id, tokens, done)
    x = f.nested(3, "Logprobs")
    token_logprobs, top_ids, top_logprobs = x.probs(), x.tokens(), x.probs()
    _same_length(tokens, token_logprobs, "Logprobs")
    _same_length(top_ids, top_logprobs, "Logprobs top")
    if len(tokens) and len(top_ids) % len(tokens):
        raise _malformed(f"Logprobs: {len(top_ids)} top entries for {len(tokens)} tokens")
    return GenerateTokens(session_id, tokens, done, Logprobs(token_logprobs, top_ids, top_logprobs))


def _verify_block_full(f: _Fields) -> VerifyBlockFull:
    block, tokens = f.block(), f.tokens()
    raw, where = f.raw_bytes()
    gamma = len(tokens)
    if gamma == 0:
        if raw:
            raise _malformed(f"{where}: γ = 0 but draft_rows holds {len(raw)} bytes")
        vocab = 0
    else:
        vocab, rest = divmod(len(raw), _WIRE_F16.itemsize * gamma)
        if rest or vocab == 0:
            raise _malformed(f"{where}: {len(raw)} bytes is not γ={gamma} non-empty f16 rows")
    rows = np.frombuffer(raw, dtype=_WIRE_F16).astype(_WIRE_F16.newbyteorder("="), copy=False)
    rows = rows.reshape(gamma, vocab)  # (γ, V)
    rows.flags.writeable = False
    return VerifyBlockFull(block, tokens, rows, _tail(f))


def _verify_result(f: _Fields) -> VerifyResult:
    block, n_accepted, next_token = f.block(), f.uint(), f.opt_uint()
    correction = None
    if f.peek_none():
        f.skip()
    else:
        correction = f.payload()
    if (next_token is None) == (correction is None):
        raise _malformed("VerifyResult needs exactly one of next_token and correction")
    features = f.opt_features(n_accepted + 1)
    return VerifyResult(block, n_accepted, next_token, correction, features)


def _open_session(f: _Fields) -> OpenSession:
    session_id = f.uint(_U64_MAX)
    prompt, sampling = f.compressed_tokens(MAX_PROMPT_TOKENS), f.sampling()
    first = f.nested(2, "OpenSession first correction")
    kind: CorrectionKind = _enum(CorrectionKind, first.uint(), "OpenSession first_kind")
    size = first.uint()
    if (kind is CorrectionKind.FULL) != (size == 0):
        raise _malformed(f"OpenSession first correction {kind.name} with size {size}")
    return OpenSession(session_id, prompt, sampling, kind, size, f.boolean())


def _session_opened(f: _Fields) -> SessionOpened:
    session_id, prefix_len = f.uint(_U64_MAX), f.uint()
    features = f.opt_features(max(prefix_len - 1, 0))
    cost = None
    if f.peek_none():
        f.skip()
    else:
        fit = f.nested(2, "SessionOpened target_cost")
        base_s, row_s = fit.real(), fit.real()
        if base_s < 0.0 or row_s < 0.0:
            raise _malformed(f"SessionOpened target_cost ({base_s}, {row_s}) is negative")
        cost = TargetCost(base_s, row_s)
    return SessionOpened(session_id, prefix_len, features, cost)


def _correction_request(f: _Fields) -> CorrectionRequest:
    block = f.block()
    kind: CorrectionKind = _enum(CorrectionKind, f.uint(), "CorrectionRequest kind")
    size, rung = f.uint(), f.uint()
    if (kind is CorrectionKind.FULL) != (size == 0):
        raise _malformed(f"CorrectionRequest {kind.name} with size {size}")
    if rung == 0:
        raise _malformed("CorrectionRequest rung must be >= 1 (rung 0 is the verify result)")
    return CorrectionRequest(block, kind, size, rung)


def _verify_block(f: _Fields) -> VerifyBlock:
    block, tokens, probs = f.block(), f.tokens(), f.probs()
    _same_length(tokens, probs, "VerifyBlock")
    return VerifyBlock(block, tokens, probs, _tail(f))


# Read-only: fields per message after [version, type].
_FIELD_COUNTS = MappingProxyType(
    {
        MessageType.HELLO: 2,
        MessageType.HELLO_ACK: 1,
        MessageType.OPEN_SESSION: 5,
        MessageType.SESSION_OPENED: 4,
        MessageType.CLOSE_SESSION: 1,
        MessageType.VERIFY_BLOCK: 4,
        MessageType.VERIFY_BLOCK_FULL: 4,
        MessageType.VERIFY_RESULT: 5,
        MessageType.CORRECTION_REQUEST: 4,
        MessageType.CORRECTION_RESPONSE: 2,
        MessageType.GENERATE_REQUEST: 4,
        MessageType.GENERATE_TOKENS: 4,
        MessageType.ERROR: 4,
        MessageType.STOP_GENERATION: 1,
    }
)


def _fields_of(msg_type: MessageType, raw: list[Any]) -> Message:
    """Parse the fields after [version, type]; one line per message type."""
    # A field-count mismatch is malformed before any field is read.
    f = _Fields(raw, _FIELD_COUNTS[msg_type], msg_type.name)
    match msg_type:
        case MessageType.HELLO:
            return Hello(f.text(), f.text())
        case MessageType.HELLO_ACK:
            return HelloAck(f.text())
        case MessageType.OPEN_SESSION:
            return _open_session(f)
        case MessageType.SESSION_OPENED:
            return _session_opened(f)
        case MessageType.CLOSE_SESSION:
            return CloseSession(f.uint(_U64_MAX))
        case MessageType.VERIFY_BLOCK:
            return _verify_block(f)
        case MessageType.VERIFY_BLOCK_FULL:
            return _verify_block_full(f)
        case MessageType.VERIFY_RESULT:
            return _verify_result(f)
        case MessageType.CORRECTION_REQUEST:
            return _correction_request(f)
        case MessageType.CORRECTION_RESPONSE:
            return CorrectionResponse(f.block(), f.payload())
        case MessageType.GENERATE_REQUEST:
            return GenerateRequest(f.uint(_U64_MAX), f.uint(), f.tokens(), f.tokens())
        case MessageType.GENERATE_TOKENS:
            return _generate_tokens(f)
        case MessageType.ERROR:
            code: ErrorCode = _enum(ErrorCode, f.uint(), "ErrorFrame code")
            return ErrorFrame(code, f.text(), f.opt_uint(_U64_MAX), f.opt_block())
        case MessageType.STOP_GENERATION:
            return StopGeneration(f.uint(_U64_MAX))
    raise AssertionError(f"unhandled message type {msg_type!r}")  # pragma: no cover


def decode(
    data: bytes | bytearray | memoryview, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> Message:
    """Parse one frame. Raises WireError (and nothing else) for any frame it cannot trust."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise _malformed(f"frame must be bytes, got {type(data).__name__}")
    n_bytes = memoryview(data).nbytes
    # Checked before unpacking so an oversized frame costs nothing to refuse.
    if n_bytes > max_frame_bytes:
        raise WireError(
            ErrorCode.FRAME_TOO_LARGE, f"frame of {n_bytes} bytes exceeds {max_frame_bytes}"
        )
    try:
        # Every length claim is capped by the frame's own size, so a tiny frame cannot make
        # msgpack allocate a huge buffer; maps and ext types never occur in this protocol.
        frame = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            max_bin_len=n_bytes,
            max_str_len=n_bytes,
            max_array_len=n_bytes,
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types; all mean "malformed"
        raise _malformed(f"not a msgpack frame: {type(exc).__name__}: {exc}") from None
    if type(frame) is not list or len(frame) < 2:
        raise _malformed("frame must be an array [version, type, ...fields]")
    version = frame[0]
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise WireError(
            ErrorCode.VERSION_MISMATCH,
            f"peer speaks protocol version {version!r:.20}, this side speaks {PROTOCOL_VERSION}",
        )
    msg_type: MessageType = _enum(MessageType, frame[1], "message type")
    return _fields_of(msg_type, frame[2:])


def websocket_header_bytes(payload_bytes: int, masked: bool) -> int:
    """RFC 6455 frame header size; client-to-server frames carry a 4-byte mask."""
    if payload_bytes < 126:
        length_bytes = 0
    elif payload_bytes < 2**16:
        length_bytes = 2
    else:
        length_bytes = 8
    return 2 + length_bytes + (4 if masked else 0)


# --- sizes table (`make sizes`) -------------------------------------------------------------


def _example_block(session_id: int = 1, seq: int = 1, base_len: int = 512) -> BlockId:
    sampling = SamplingConfig(SamplingParams(temperature=0.7, top_k=50, top_p=0.95), seed=1234)
    return BlockId(session_id, seq, base_len, config_digest(sampling))


def _example_verify_block(gamma: int) -> VerifyBlock:
    tokens = np.arange(1000, 1000 + gamma, dtype=np.uint32)
    probs = np.linspace(0.9, 0.3, gamma, dtype=np.float32)
    return VerifyBlock(_example_block(), tokens, probs, np.zeros(0, dtype=np.uint32))


def _size_rows() -> list[tuple[str, str, int, int]]:
    """(message, direction, frame bytes, frame + WebSocket header bytes)."""
    block = _example_block()
    gamma, vocab, k = 4, 49_152, 8
    topk = TopK(
        np.arange(8, dtype=np.uint32) + 40_000,
        np.linspace(0.5, 0.01, k, dtype=np.float32),
        np.float32(0.12),
    )
    full = VerifyBlockFull(
        block,
        np.arange(gamma, dtype=np.uint32),
        np.full((gamma, vocab), 1 / vocab, dtype=np.float16),
        np.zeros(0, dtype=np.uint32),
    )
    cases: list[tuple[str, str, Message]] = [
        *((f"VerifyBlock γ={g}", "up", _example_verify_block(g)) for g in (1, 4, 8)),
        ("VerifyResult all accepted (γ=4)", "down", VerifyResult(block, gamma, 40_123, None)),
        (f"VerifyResult reject + TopK K={k}", "down", VerifyResult(block, 2, None, topk)),
        (
            "VerifyResult + features (h=576)",
            "down",
            VerifyResult(block, gamma, 40_123, None, np.zeros((gamma + 1, 576), np.uint16)),
        ),
        (f"VerifyBlockFull γ={gamma} V={vocab:,}", "up", full),
    ]
    rows = []
    for name, direction, msg in cases:
        n = len(encode(msg))
        rows.append((name, direction, n, n + websocket_header_bytes(n, masked=direction == "up")))
    return rows


def main() -> None:
    print(f"asymspec wire protocol v{PROTOCOL_VERSION}: encoded frame sizes (bytes)")
    print("uplink = client frame (masked); downlink = server frame (unmasked)\n")
    print(f"{'message':<36} {'dir':<5} {'msgpack':>10} {'+ WebSocket':>12}")
    for name, direction, frame_bytes, ws_bytes in _size_rows():
        print(f"{name:<36} {direction:<5} {frame_bytes:>10,} {ws_bytes:>12,}")


if __name__ == "__main__":
    main()
