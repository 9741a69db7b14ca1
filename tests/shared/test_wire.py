"""Wire protocol: exact round trips, bit-exact floats, frame sizes, and a decoder fuzz."""

from __future__ import annotations

import random
import struct
import time
import typing
import zlib
from dataclasses import replace
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asymspec import wire
from asymspec.sampling_params import Penalties, SamplingParams
from asymspec.wire import (
    MAX_PROMPT_TOKENS,
    PROTOCOL_VERSION,
    BlockId,
    CloseSession,
    CorrectionKind,
    CorrectionRequest,
    CorrectionResponse,
    ErrorCode,
    ErrorFrame,
    FullRow,
    GenerateRequest,
    GenerateTokens,
    Hello,
    HelloAck,
    Logprobs,
    Message,
    MessageType,
    OpenSession,
    Proposals,
    SamplingConfig,
    SessionOpened,
    StopGeneration,
    TargetCost,
    TopK,
    VerifyBlock,
    VerifyBlockFull,
    VerifyResult,
    WireError,
    config_digest,
    decode,
    encode,
)

MESSAGE_TYPES = typing.get_args(Message)
U32_MAX = 2**32 - 1
SAMPLING = SamplingConfig(SamplingParams(temperature=0.7, top_k=50, top_p=0.95), seed=1234)
CONSTRAINED = SamplingConfig(
    SamplingParams(0.7, 0, 1.0, min_p=0.1, logit_bias=((3, 1.5), (17, -100.0))),
    seed=99,
    penalties=Penalties(repetition=1.2, presence=0.5, frequency=0.25),
    grammar='start: "yes" | "no"',
    prompt_len=2,
    logprobs=3,
)
BLOCK = BlockId(session_id=3, seq=7, base_len=512, config_digest=config_digest(SAMPLING))


def u32(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint32)


def f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


# bf16 bit patterns of 5 positions x hidden 3 (NaN and -0.0 included: bits travel as they are)
FEATURES = np.array(
    [[0x3F80, 0xBF80, 0x8000], [0x7FC1, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 0xFFFF]],
    dtype=np.uint16,
)


def raw_frame(*items: Any, version: int = PROTOCOL_VERSION) -> bytes:
    """A frame built by hand, bypassing encode's checks."""
    return msgpack.packb([version, *items], use_bin_type=True)


def assert_wire_error(data: bytes, code: ErrorCode) -> WireError:
    with pytest.raises(WireError) as info:
        decode(data)
    assert info.value.code is code, info.value
    return info.value


def sample_messages() -> list[Message]:
    """One or more instances of every message type, covering optional fields."""
    topk = TopK(u32(5, 9, 0), f32(0.5, 0.25, 0.125), np.float32(0.125))
    rows = np.arange(4 * 6, dtype=np.float16).reshape(4, 6) / np.float16(24)
    return [
        Hello("edge-1", "s3cret"),
        HelloAck("cloud-α"),
        OpenSession(2**40, u32(1, 2, 3, U32_MAX), SAMPLING),
        OpenSession(0, u32(), SamplingConfig(SamplingParams(0.0, 0, 1.0), 0)),
        OpenSession(5, u32(1), SAMPLING, CorrectionKind.PROPOSALS, 8),
        OpenSession(6, u32(1), SAMPLING, CorrectionKind.FULL, 0),
        SessionOpened(3, 4),
        SessionOpened(3, 4, FEATURES[:3]),  # h of positions 0 .. 2 (the prompt's all but last)
        SessionOpened(3, 1, FEATURES[:0]),  # a one-token prompt: no position fed
        SessionOpened(3, 4, None, TargetCost(0.034, 0.0017)),  # the verifier's fitted cost
        OpenSession(7, u32(1, 2), SAMPLING, wants_features=True),
        OpenSession(8, u32(1, 2), CONSTRAINED),  # the whole transform: extras and a grammar
        CloseSession(3),
        VerifyBlock(BLOCK, u32(10, 11, 12, 13), f32(0.9, 0.5, 1e-30, 1.0), u32()),
        VerifyBlock(BLOCK, u32(0), f32(0.25), u32(U32_MAX)),
        VerifyBlock(BLOCK, u32(), f32(), u32()),  # γ = 0: the target decodes one bonus token
        VerifyBlockFull(BLOCK, u32(1, 2, 3, 4), rows, u32(7)),
        VerifyResult(BLOCK, 4, 42, None),  # all accepted: bonus token
        VerifyResult(BLOCK, 1, None, topk),  # rejected at 1: first top-K correction
        VerifyResult(BLOCK, 0, 17, None),  # rejected at 0: cloud-sampled recovered token
        VerifyResult(BLOCK, 2, None, Proposals(u32(3, 3), f32(0.5, 0.5))),  # exact mode
        VerifyResult(BLOCK, 4, 42, None, FEATURES),  # tail + 4 accepted: 5 feature rows
        VerifyResult(BLOCK, 1, None, topk, FEATURES[:2]),
        CorrectionRequest(BLOCK, CorrectionKind.TOPK, 32),
        CorrectionRequest(BLOCK, CorrectionKind.PROPOSALS, 4, rung=3),
        CorrectionRequest(BLOCK, CorrectionKind.FULL, 0),
        CorrectionResponse(BLOCK, topk),
        CorrectionResponse(BLOCK, Proposals(u32(8, 8, 1), f32(0.1, 0.1, 0.3))),
        CorrectionResponse(BLOCK, FullRow(f32(0.25, 0.75, 0.0))),
        GenerateRequest(3, 128, u32(0, 2), u32()),
        GenerateRequest(3, 16, u32(0, 2), u32(9)),  # speculation paused after a recovery
        GenerateTokens(3, u32(5, 6, 7), False),
        GenerateTokens(3, u32(), True),
        StopGeneration(3),
        GenerateTokens(
            3,
            u32(5, 6),
            False,
            Logprobs(f32(-0.5, -1.0), u32(5, 1, 6, 2), f32(-0.5, -2.0, -1.0, -1.5)),
        ),
        ErrorFrame(ErrorCode.STALE_BLOCK, "base_len 512 != committed 515", 3, BLOCK),
        ErrorFrame(ErrorCode.OVERLOADED, "queue full"),
    ]


# --- hand round trips -------------------------------------------------------------------------


def test_samples_cover_every_message_type() -> None:
    assert {type(m) for m in sample_messages()} == set(MESSAGE_TYPES)
    assert {m.TYPE for m in sample_messages()} == set(MessageType)


@pytest.mark.parametrize("msg", sample_messages(), ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    data = encode(msg)
    out = decode(data)
    assert type(out) is type(msg)
    assert out == msg
    assert encode(out) == data  # canonical: re-encoding is byte-identical
    assert decode(bytearray(data)) == msg and decode(memoryview(data)) == msg


def test_fields_survive_exactly() -> None:
    msg = VerifyBlock(BLOCK, u32(10, 11, 12, 13), f32(0.9, 0.5, 0.25, 1.0), u32())
    out = decode(encode(msg))
    assert isinstance(out, VerifyBlock)
    assert out.block == BLOCK
    assert out.draft_tokens.dtype == np.uint32 and out.draft_probs.dtype == np.float32
    assert out.draft_tokens.tolist() == [10, 11, 12, 13]
    assert out.draft_probs.tolist() == [np.float32(x) for x in (0.9, 0.5, 0.25, 1.0)]
    assert out.committed_tail.shape == (0,)


def test_full_rows_keep_shape_and_bits() -> None:
    rows = np.random.default_rng(0).random((3, 7)).astype(np.float16)
    out = decode(encode(VerifyBlockFull(BLOCK, u32(1, 2, 3), rows, u32())))
    assert isinstance(out, VerifyBlockFull)
    assert out.draft_rows.shape == (3, 7) and out.draft_rows.dtype == np.float16
    assert np.array_equal(out.draft_rows.view(np.uint16), rows.view(np.uint16))


def test_decoded_arrays_are_read_only() -> None:
    out = decode(encode(VerifyBlock(BLOCK, u32(1), f32(0.5), u32(2))))
    assert isinstance(out, VerifyBlock)
    for arr in (out.draft_tokens, out.draft_probs, out.committed_tail):
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr[0] = 0


def test_topk_delta_p_is_float32_scalar() -> None:
    out = decode(encode(CorrectionResponse(BLOCK, TopK(u32(1), f32(0.75), np.float32(0.25)))))
    assert isinstance(out, CorrectionResponse) and isinstance(out.payload, TopK)
    assert isinstance(out.payload.delta_p, np.float32) and out.payload.delta_p == 0.25


def test_error_code_and_correction_kind_are_enums() -> None:
    err = decode(encode(ErrorFrame(ErrorCode.DUPLICATE, "seen", None, None)))
    req = decode(encode(CorrectionRequest(BLOCK, CorrectionKind.PROPOSALS, 4)))
    assert isinstance(err, ErrorFrame) and err.code is ErrorCode.DUPLICATE
    assert isinstance(req, CorrectionRequest) and req.kind is CorrectionKind.PROPOSALS


def test_every_transform_parameter_is_in_the_digest() -> None:
    """A block drafted under one transform can never be verified under another."""
    base = config_digest(CONSTRAINED)
    params = CONSTRAINED.params
    changed = [
        replace(CONSTRAINED, params=replace(params, min_p=0.2)),
        replace(CONSTRAINED, params=replace(params, logit_bias=((3, 1.5), (17, -2.0)))),
        replace(CONSTRAINED, params=replace(params, logit_bias=((3, 1.5),))),
        replace(CONSTRAINED, penalties=Penalties(1.3, 0.5, 0.25)),
        replace(CONSTRAINED, penalties=Penalties(1.2, 0.0, 0.25)),
        replace(CONSTRAINED, penalties=Penalties(1.2, 0.5, 0.0)),
        replace(CONSTRAINED, grammar='start: "no"'),
        replace(CONSTRAINED, grammar=""),
        replace(CONSTRAINED, prompt_len=3),
    ]
    digests = {config_digest(c) for c in changed}
    assert base not in digests and len(digests) == len(changed)
    # a plain config keeps the digest it had before the extras existed
    assert config_digest(SamplingConfig(SamplingParams(0.7, 50, 0.95), 1234)) == zlib.crc32(
        struct.pack("<dQdQ", 0.7, 50, 0.95, 1234)
    )


def test_config_digest_is_stable_uint32() -> None:
    digest = config_digest(SAMPLING)
    assert 0 <= digest <= U32_MAX
    assert digest == config_digest(SamplingConfig(SamplingParams(0.7, 50, 0.95), 1234))
    assert digest != config_digest(SamplingConfig(SamplingParams(0.7, 50, 0.95), 1235))
    assert digest != config_digest(SamplingConfig(SamplingParams(0.8, 50, 0.95), 1234))
    assert config_digest(SamplingConfig(SamplingParams(-0.0, 0, 1.0), 0)) == config_digest(
        SamplingConfig(SamplingParams(0.0, 0, 1.0), 0)
    )


def test_encode_rejects_wrong_dtypes() -> None:
    with pytest.raises(TypeError):
        encode(VerifyBlock(BLOCK, np.array([1], dtype=np.int64), f32(0.5), u32()))
    with pytest.raises(TypeError):
        encode(VerifyBlock(BLOCK, u32(1), np.array([0.5]), u32()))  # float64 probabilities
    with pytest.raises(TypeError):
        encode(VerifyBlock(BLOCK, u32(1), [0.5], u32()))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        encode(CorrectionResponse(BLOCK, TopK(u32(1), f32(0.5), 0.5)))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        encode(VerifyBlockFull(BLOCK, u32(1), np.zeros(4, dtype=np.float16), u32()))  # 1-D
    with pytest.raises(TypeError):
        encode(TopK(u32(1), f32(0.5), np.float32(0.5)))  # type: ignore[arg-type]  # no TYPE


# --- bit-exact floats and full-range token ids (hypothesis) ---------------------------------


@given(st.lists(st.floats(width=32, allow_nan=True), max_size=64))
def test_float32_round_trip_bit_exact(values: list[float]) -> None:
    probs = np.array(values, dtype=np.float32)
    tokens = np.arange(len(values), dtype=np.uint32)
    out = decode(encode(VerifyBlock(BLOCK, tokens, probs, u32())))
    assert isinstance(out, VerifyBlock)
    assert np.array_equal(out.draft_probs.view(np.uint32), probs.view(np.uint32))


@given(st.lists(st.integers(0, U32_MAX), min_size=1, max_size=64), st.integers(0, U32_MAX))
def test_every_float32_bit_pattern_survives(bits: list[int], delta_bits: int) -> None:
    # Raw bit patterns reach NaN payloads (quiet and signalling), -0.0, subnormals and inf.
    probs = np.array(bits, dtype=np.uint32).view(np.float32)
    delta_p = np.array([delta_bits], dtype=np.uint32).view(np.float32)[0]
    msg = CorrectionResponse(BLOCK, TopK(u32(*range(len(bits))), probs, delta_p))
    out = decode(encode(msg))
    assert isinstance(out, CorrectionResponse) and isinstance(out.payload, TopK)
    assert np.array_equal(out.payload.probs.view(np.uint32), probs.view(np.uint32))
    assert np.float32(out.payload.delta_p).view(np.uint32) == delta_bits


def test_float32_specials_bit_exact() -> None:
    zeros = [0x00000000, 0x80000000]  # +0.0, -0.0
    subnormals = [0x00000001, 0x007FFFFF]  # smallest and largest
    infinities = [0x7F800000, 0xFF800000]
    nans = [0x7FC00000, 0x7F800001, 0xFFFFFFFF]  # quiet, signalling, negative full payload
    specials = np.array(zeros + subnormals + infinities + nans, dtype=np.uint32)
    out = decode(encode(CorrectionResponse(BLOCK, FullRow(specials.view(np.float32)))))
    assert isinstance(out, CorrectionResponse) and isinstance(out.payload, FullRow)
    assert out.payload.probs.view(np.uint32).tolist() == specials.tolist()


@given(st.lists(st.integers(0, U32_MAX), max_size=64))
def test_token_ids_full_uint32_range(ids: list[int]) -> None:
    tokens = np.array([0, U32_MAX, *ids], dtype=np.uint32)
    out = decode(encode(GenerateTokens(2**64 - 1, tokens, False)))
    assert isinstance(out, GenerateTokens)
    assert out.tokens.tolist() == tokens.tolist() and out.session_id == 2**64 - 1


# --- sizes ---------------------------------------------------------------------------------


def test_compact_uplink_gamma4_fits_80_bytes_with_websocket_header() -> None:
    msg = VerifyBlock(BLOCK, u32(1000, 1001, 1002, 1003), f32(0.9, 0.7, 0.5, 0.3), u32())
    frame_bytes = len(encode(msg))
    ws_header = wire.websocket_header_bytes(frame_bytes, masked=True)
    assert ws_header == 6  # 2-byte header + 4-byte client mask, payload < 126
    assert frame_bytes + ws_header <= 80


def test_full_upload_gamma4_is_about_393_kb() -> None:
    rows = np.full((4, 49_152), 1 / 49_152, dtype=np.float16)
    msg = VerifyBlockFull(BLOCK, u32(1, 2, 3, 4), rows, u32())
    assert 390_000 <= len(encode(msg)) <= 400_000


def test_websocket_header_sizes() -> None:
    assert wire.websocket_header_bytes(125, masked=False) == 2
    assert wire.websocket_header_bytes(126, masked=True) == 8
    assert wire.websocket_header_bytes(2**16, masked=True) == 14


def test_main_prints_size_table(capsys: pytest.CaptureFixture[str]) -> None:
    wire.main()
    out = capsys.readouterr().out
    assert "VerifyBlock γ=4" in out and "VerifyBlockFull" in out and "TopK K=8" in out


# --- typed errors ------------------------------------------------------------------------------


def test_version_mismatch_names_both_versions() -> None:
    other = PROTOCOL_VERSION + 1
    err = assert_wire_error(
        raw_frame(MessageType.HELLO, "e", "t", version=other), ErrorCode.VERSION_MISMATCH
    )
    assert str(other) in err.message and str(PROTOCOL_VERSION) in err.message
    # A version-1 peer (uncompressed prompts) is refused, not misread.
    assert_wire_error(raw_frame(MessageType.HELLO, "e", "t", version=1), ErrorCode.VERSION_MISMATCH)


def test_oversized_frame_rejected_before_parsing() -> None:
    with pytest.raises(WireError) as info:
        decode(b"\xc1" * 101, max_frame_bytes=100)  # 0xc1 is never valid msgpack
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE
    data = encode(Hello("edge", "x" * 200))
    with pytest.raises(WireError) as info:
        decode(data, max_frame_bytes=len(data) - 1)
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE
    assert decode(data, max_frame_bytes=len(data)) == Hello("edge", "x" * 200)


def test_small_frame_claiming_huge_lengths_is_malformed() -> None:
    header = bytes([0x96, PROTOCOL_VERSION, MessageType.VERIFY_BLOCK])
    assert_wire_error(header + b"\xc6\xff\xff\xff\xff", ErrorCode.MALFORMED)  # bin32
    assert_wire_error(header + b"\xdd\xff\xff\xff\xff", ErrorCode.MALFORMED)  # array32
    assert_wire_error(header + b"\xdb\x7f\xff\xff\xff", ErrorCode.MALFORMED)  # str32


def _vb(*fields: Any) -> bytes:
    return raw_frame(MessageType.VERIFY_BLOCK, *fields)


GOOD_BLOCK = [3, 7, 512, 99]
NO_PROMPT = zlib.compress(b"")  # a valid (empty) compressed prompt
GOOD_SAMPLING = [0.7, 0, 1.0, 1, None]
TOK4 = u32(1, 2, 3, 4).tobytes()
PROB4 = f32(0.1, 0.2, 0.3, 0.4).tobytes()


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "empty"),
        (b"\x01", "not an array"),
        (msgpack.packb([PROTOCOL_VERSION]), "no type"),
        (raw_frame(99), "unknown type"),
        (raw_frame(True, "e", "t"), "bool as type"),
        (raw_frame(MessageType.HELLO, "e"), "too few fields"),
        (raw_frame(MessageType.HELLO, "e", "t", "x"), "too many fields"),
        (raw_frame(MessageType.HELLO, b"e", "t"), "bin for str"),
        (encode(Hello("e", "t")) + b"\x00", "trailing bytes"),
        (encode(Hello("e", "t"))[:-1], "truncated"),
        (msgpack.packb({"v": 1}), "map"),
        (_vb(GOOD_BLOCK, TOK4, PROB4[:-4], b""), "γ mismatch"),
        (_vb(GOOD_BLOCK, TOK4[:-1], PROB4, b""), "not a multiple of 4"),
        (_vb(GOOD_BLOCK, TOK4, PROB4, u32(1, 2).tobytes()), "tail of 2"),
        (_vb([3, 7, 512], TOK4, PROB4, b""), "short block id"),
        (_vb([3, -7, 512, 99], TOK4, PROB4, b""), "negative seq"),
        (_vb([3, 7, 2**32, 99], TOK4, PROB4, b""), "base_len above uint32"),
        (_vb([3, 7, 512, True], TOK4, PROB4, b""), "bool digest"),
        (_vb([3, 7, 512, 1.0], TOK4, PROB4, b""), "float digest"),
        (_vb(GOOD_BLOCK, list(range(4)), PROB4, b""), "array for bin"),
        (
            raw_frame(MessageType.VERIFY_BLOCK_FULL, GOOD_BLOCK, TOK4, b"\x00" * 10, b""),
            "rows not γ × V",
        ),
        (raw_frame(MessageType.VERIFY_BLOCK_FULL, GOOD_BLOCK, b"", b"\x00\x00", b""), "γ=0 rows"),
        (raw_frame(MessageType.VERIFY_BLOCK_FULL, GOOD_BLOCK, TOK4, b"", b""), "V = 0"),
        (raw_frame(MessageType.VERIFY_RESULT, GOOD_BLOCK, 4, None, None, None), "neither outcome"),
        (
            raw_frame(MessageType.VERIFY_RESULT, GOOD_BLOCK, 1, 5, None, [3, b"\0" * 18]),
            "3 feature rows for 1 accepted",
        ),
        (raw_frame(MessageType.VERIFY_RESULT, GOOD_BLOCK, 0, 5, None, [3, b"\0" * 5]), "odd bytes"),
        (raw_frame(MessageType.VERIFY_RESULT, GOOD_BLOCK, 0, 5, None, [0, b""]), "hidden 0"),
        (
            raw_frame(MessageType.SESSION_OPENED, 3, 4, [3, b"\0" * 6], None),
            "1 row for 3 positions",
        ),
        (raw_frame(MessageType.SESSION_OPENED, 3, 4, None, [0.03, -1e-3]), "negative row cost"),
        (raw_frame(MessageType.SESSION_OPENED, 3, 4, None, [0.03]), "one cost field"),
        (raw_frame(MessageType.SESSION_OPENED, 3, 4, None, [0.03, "x"]), "cost not a number"),
        (
            raw_frame(
                MessageType.VERIFY_RESULT, GOOD_BLOCK, 1, 5, [1, TOK4, PROB4, b"\0" * 4], None
            ),
            "both outcomes",
        ),
        (
            raw_frame(MessageType.CORRECTION_RESPONSE, GOOD_BLOCK, [1, TOK4, PROB4, b"\0"]),
            "delta_p",
        ),
        (raw_frame(MessageType.CORRECTION_RESPONSE, GOOD_BLOCK, [4, PROB4]), "unknown kind"),
        (raw_frame(MessageType.CORRECTION_RESPONSE, GOOD_BLOCK, []), "empty payload"),
        (raw_frame(MessageType.CORRECTION_REQUEST, GOOD_BLOCK, 3, 8, 1), "full with size"),
        (raw_frame(MessageType.CORRECTION_REQUEST, GOOD_BLOCK, 1, 0, 1), "top-0"),
        (raw_frame(MessageType.CORRECTION_REQUEST, GOOD_BLOCK, 1, 8, 0), "rung 0"),
        (
            raw_frame(MessageType.OPEN_SESSION, 1, NO_PROMPT, [0.7, 50, 0.95], [1, 16], False),
            "short sampling",
        ),
        (
            raw_frame(MessageType.OPEN_SESSION, 1, NO_PROMPT, [-1.0, 50, 0.95, 1], [1, 16], False),
            "negative temp",
        ),
        (
            raw_frame(
                MessageType.OPEN_SESSION,
                1,
                NO_PROMPT,
                [float("nan"), 0, 1.0, 1, None],
                [1, 16],
                False,
            ),
            "nan temp",
        ),
        (
            raw_frame(MessageType.OPEN_SESSION, 1, NO_PROMPT, [0.7, 0, 1.5, 1], [1, 16], False),
            "top_p > 1",
        ),
        (
            raw_frame(
                MessageType.OPEN_SESSION, -1, NO_PROMPT, [0.7, 0, 1.0, 1, None], [1, 16], False
            ),
            "negative sid",
        ),
        (
            raw_frame(
                MessageType.OPEN_SESSION, 1, NO_PROMPT, [0.7, 0, 1.0, 1, None], [3, 16], False
            ),
            "full with size",
        ),
        (
            raw_frame(
                MessageType.OPEN_SESSION, 1, NO_PROMPT, [0.7, 0, 1.0, 1, None], [9, 16], False
            ),
            "bad kind",
        ),
        (raw_frame(MessageType.OPEN_SESSION, 1, TOK4, GOOD_SAMPLING, [1, 16], False), "raw prompt"),
        (
            raw_frame(
                MessageType.OPEN_SESSION, 1, zlib.compress(TOK4)[:-2], GOOD_SAMPLING, [1, 16], False
            ),
            "truncated prompt",
        ),
        (
            raw_frame(
                MessageType.OPEN_SESSION,
                1,
                zlib.compress(TOK4) + b"x",
                GOOD_SAMPLING,
                [1, 16],
                False,
            ),
            "bytes after the prompt",
        ),
        (
            raw_frame(
                MessageType.OPEN_SESSION, 1, zlib.compress(TOK4[:-1]), GOOD_SAMPLING, [1, 16], False
            ),
            "prompt not a multiple of 4",
        ),
        (raw_frame(MessageType.GENERATE_TOKENS, 1, b"", 1, None), "int for bool"),
        (raw_frame(MessageType.ERROR, 99, "x", None, None), "unknown error code"),
    ],
)
def test_malformed_frames(data: bytes, why: str) -> None:
    assert_wire_error(data, ErrorCode.MALFORMED)


def test_compressed_prompt_is_capped_against_zip_bombs() -> None:
    # 4 MiB + 4 bytes of zeros compress to a few KiB: one token over the cap is refused
    # without inflating more than the cap allows.
    bomb = zlib.compress(bytes(4 * (MAX_PROMPT_TOKENS + 1)), 9)
    assert len(bomb) < 8192
    frame = raw_frame(MessageType.OPEN_SESSION, 1, bomb, GOOD_SAMPLING, [1, 16], False)
    err = assert_wire_error(frame, ErrorCode.MALFORMED)
    assert str(MAX_PROMPT_TOKENS) in err.message
    at_cap = zlib.compress(bytes(4 * MAX_PROMPT_TOKENS), 9)
    msg = decode(raw_frame(MessageType.OPEN_SESSION, 1, at_cap, GOOD_SAMPLING, [1, 16], False))
    assert isinstance(msg, OpenSession) and len(msg.prompt_tokens) == MAX_PROMPT_TOKENS


def test_prompt_ids_below_65536_compress_to_under_half() -> None:
    rng = np.random.default_rng(0)
    # Token ids of a 49,152-token vocabulary, with the repetition real code has.
    words = rng.integers(0, 49_152, size=300)
    prompt = words[rng.zipf(1.3, size=2000) % 300].astype(np.uint32)
    frame = encode(OpenSession(1, prompt, SAMPLING))
    assert len(frame) < 2 * len(prompt)  # vs 4 bytes a token uncompressed
    decoded = decode(frame)
    assert isinstance(decoded, OpenSession)
    np.testing.assert_array_equal(decoded.prompt_tokens, prompt)


def test_non_bytes_input_is_a_wire_error() -> None:
    with pytest.raises(WireError):
        decode("not bytes")  # type: ignore[arg-type]


# --- fuzz --------------------------------------------------------------------------------------


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.randrange(9 if depth < 2 else 7)
    if choice == 0:
        return rng.choice([0, 1, 2, 255, 2**32 - 1, 2**32, 2**64 - 1, -1, -(2**63)])
    if choice == 1:
        return rng.randrange(-5, 20)
    if choice == 2:
        return rng.choice([0.0, -0.0, 0.5, 1.5, float("nan"), float("inf")])
    if choice == 3:
        return rng.randbytes(rng.choice([0, 1, 3, 4, 8, 16]))
    if choice == 4:
        return rng.choice(["", "x", "é"])
    if choice == 5:
        return rng.choice([None, True, False])
    if choice == 6:
        return rng.randbytes(2)
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(6))]


def _mutate_structure(rng: random.Random, frame: bytes) -> bytes:
    """Decode a valid frame with msgpack, replace/drop/add one (possibly nested) item."""
    items = msgpack.unpackb(frame)
    target = items
    while True:  # walk into a nested array now and then
        nested = [x for x in target if isinstance(x, list)]
        if not nested or rng.random() < 0.5:
            break
        target = rng.choice(nested)
    op = rng.randrange(3)
    if op == 0 and target:
        target[rng.randrange(len(target))] = _random_value(rng)
    elif op == 1 and target:
        del target[rng.randrange(len(target))]
    else:
        target.insert(rng.randrange(len(target) + 1), _random_value(rng))
    return msgpack.packb(items, use_bin_type=True)


def _mutate_bytes(rng: random.Random, frame: bytes) -> bytes:
    data = bytearray(frame)
    op = rng.randrange(6)
    if op == 0:  # truncate
        return bytes(data[: rng.randrange(len(data))])
    if op == 1:  # flip 1-3 bits
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif op == 2:  # insert bytes
        for _ in range(rng.randint(1, 3)):
            data.insert(rng.randrange(len(data) + 1), rng.randrange(256))
    elif op == 3 and len(data) > 1:  # delete bytes
        for _ in range(rng.randint(1, min(3, len(data) - 1))):
            del data[rng.randrange(len(data))]
    elif op == 4:  # wrong version
        data[1] = rng.choice([0, 2, 3, 0x7F, 0xC0, 0xFF])
    else:  # a length claim far beyond the frame: bin32 / array32 / str32 header spliced in
        at = rng.randrange(len(data) + 1)
        data[at:at] = bytes([rng.choice([0xC6, 0xDD, 0xDB])]) + rng.randbytes(4)
    return bytes(data)


def test_fuzz_decode_raises_only_wire_error() -> None:
    rng = random.Random(20240521)
    corpus = [encode(m) for m in sample_messages()]
    outcomes = {"ok": 0, **{code.name: 0 for code in ErrorCode}}
    n_cases = 100_000
    started = time.perf_counter()
    for i in range(n_cases):
        kind = i % 4
        if kind == 0:
            data = rng.randbytes(rng.randrange(64))
        elif kind == 1:
            data = _mutate_bytes(rng, rng.choice(corpus))
        elif kind == 2:
            data = _mutate_structure(rng, rng.choice(corpus))
        else:  # random structures that look like frames: right version, real type code
            fields = [_random_value(rng) for _ in range(rng.randrange(6))]
            data = raw_frame(rng.randrange(16), *fields)
        try:
            msg = decode(data, max_frame_bytes=4096)
        except WireError as exc:
            outcomes[exc.code.name] += 1
            continue
        except Exception as exc:  # pragma: no cover - the failure this test exists to catch
            pytest.fail(f"case {i}: decode({data!r}) raised {type(exc).__name__}: {exc}")
        outcomes["ok"] += 1
        assert isinstance(msg, MESSAGE_TYPES)
        assert decode(encode(msg)) == msg  # whatever decodes is a well-formed message
    elapsed_s = time.perf_counter() - started
    assert elapsed_s < 10, f"fuzz took {elapsed_s:.1f}s"
    # Every mutation family was exercised, not short-circuited by one early check.
    assert outcomes["ok"] > 100 and outcomes["MALFORMED"] > 1000
    assert outcomes["VERSION_MISMATCH"] > 100
