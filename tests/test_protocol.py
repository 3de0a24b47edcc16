"""Unit tests of the protocol v1 frame codec (tokend/core/protocol.py), against the spec's
tables."""

from __future__ import annotations

import ast
import hashlib
import hmac
import re
import struct
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokend.core import protocol as p
from tokend.core import session
from tokend.core.claims import REFUSALS
from tokend.core.protocol import (
    Bye,
    CloseCode,
    Frame,
    Heartbeat,
    HeartbeatAck,
    Hello,
    Notice,
    ProtocolError,
    SessionState,
    Welcome,
    decode,
    encode,
    heartbeat_fields,
    heartbeat_mac_key,
    heartbeat_proof_holds,
    is_heartbeat,
    make_heartbeat,
)
from tokend.ops import app as server
from tokend.server import connection, node

TID = bytes(range(0x10, 0x20))
KEY = bytes(range(0xA0, 0xC0))
TOKEN = "eyJhbGciOiJFZERTQSJ9.eyJzdWIiOiJhbGljZSJ9.c2lnbmF0dXJl"

PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- strategies -------------------------------------------------------------------------------

u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)
tids = st.binary(min_size=16, max_size=16)
keys = st.binary(min_size=32, max_size=32)
macs = st.binary(min_size=16, max_size=16)
# Compact JWS characters, plus the rest of printable ASCII: the codec only requires ASCII.
tokens = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=127), min_size=1)


@st.composite
def acks(draw: st.DrawFn) -> HeartbeatAck:
    renewed, resent = draw(st.booleans()), draw(st.booleans())
    token = draw(tokens) if renewed or resent else None
    return HeartbeatAck(
        draw(u64), draw(u64), token, renewed=renewed, resent=resent, was_warn=draw(st.booleans())
    )


frames: st.SearchStrategy[Frame] = st.one_of(
    st.builds(Hello, tokens, proof=st.none() | st.binary(min_size=16, max_size=16)),
    st.builds(Welcome, tids, u64, u32, u32, u32, keys, resumed=st.booleans()),
    st.builds(Heartbeat, tids, u64, u64, macs),
    acks(),
    st.just(Bye()),
    st.just(Notice()),
)


def sample_frames() -> list[Frame]:
    """One of each frame type, with distinct field values so that misplaced bytes show."""
    return [
        Hello(TOKEN),
        Hello(TOKEN, proof=bytes(range(16))),
        Welcome(TID, 1_764_680_000_123, 30_000, 90_000, 120_000, KEY, resumed=True),
        Welcome(TID, 1, 2, 3, 4, KEY),
        make_heartbeat(KEY, TID, 7, 1_764_680_900_000),
        HeartbeatAck(3, 1_764_681_000_000),
        HeartbeatAck(4, 5, TOKEN, renewed=True),
        HeartbeatAck(4, 5, TOKEN, resent=True, was_warn=True),
        HeartbeatAck(4, 5, TOKEN, renewed=True, resent=True, was_warn=True),
        HeartbeatAck(9, 10, was_warn=True),
        Bye(),
        Notice(),
    ]


def assert_decode_is_total(data: bytes) -> None:
    """decode() either refuses with ProtocolError or returns a frame that re-encodes to data."""
    try:
        frame = decode(data)
    except ProtocolError:
        return
    assert encode(frame) == data


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("frame", sample_frames(), ids=lambda f: type(f).__name__)
def test_round_trip_of_each_frame_type(frame: Frame) -> None:
    data = encode(frame)
    assert isinstance(data, bytes)
    assert decode(data) == frame
    assert encode(decode(data)) == data


@PROPS
@given(frames)
def test_round_trip_property(frame: Frame) -> None:
    assert decode(encode(frame)) == frame


# --- byte layouts (spec "Frames") -------------------------------------------------------------


def test_hello_layout() -> None:
    data = encode(Hello(TOKEN))
    assert len(data) == 4 + len(TOKEN)
    assert data[0] == 0x01
    assert data[1] == 1
    assert data[2:4] == len(TOKEN).to_bytes(2, "big")
    assert data[4:] == TOKEN.encode("ascii")


def test_hello_with_a_resume_proof_layout() -> None:
    # Spec 0x01 "Resume proof" (revision 2): 4 + L + 16 bytes, the proof last.
    proof = bytes(range(100, 116))
    data = encode(Hello(TOKEN, proof=proof))
    assert len(data) == 4 + len(TOKEN) + 16
    assert data[: 4 + len(TOKEN)] == encode(Hello(TOKEN))
    assert data[-16:] == proof


def test_resume_proof_is_the_spec_hmac() -> None:
    key = bytes(range(32))
    expected = hmac.new(key, b"tokend-resume" + TID, hashlib.sha256).digest()[:16]
    assert p.resume_proof(key, TID) == expected
    assert p.resume_proof(key, bytes(16)) != expected


def test_hello_length_is_big_endian() -> None:
    data = encode(Hello("x" * 0x0102))
    assert data[:4] == b"\x01\x01\x01\x02"


def test_welcome_layout() -> None:
    frame = Welcome(TID, 0x0102030405060708, 0x11121314, 0x21222324, 0x31323334, KEY, resumed=True)
    data = encode(frame)
    assert len(data) == 72 == p.WELCOME_LENGTH
    assert data[0] == 0x02
    assert data[1] == 1  # version
    assert data[2] == 0  # state ACTIVE
    assert data[3] == 0x01  # flags: resumed
    assert data[4:20] == TID
    assert data[20:28] == bytes([1, 2, 3, 4, 5, 6, 7, 8])
    assert data[28:32] == bytes([0x11, 0x12, 0x13, 0x14])
    assert data[32:36] == bytes([0x21, 0x22, 0x23, 0x24])
    assert data[36:40] == bytes([0x31, 0x32, 0x33, 0x34])
    assert data[40:72] == KEY


def test_welcome_not_resumed_has_no_flags() -> None:
    assert encode(Welcome(TID, 1, 2, 3, 4, KEY))[3] == 0


def test_heartbeat_layout() -> None:
    hb = Heartbeat(TID, 0x0102030405060708, 0x1112131415161718, b"M" * 16)
    data = encode(hb)
    assert len(data) == 50 == p.HEARTBEAT_LENGTH
    assert data[0] == 0x03
    assert data[1] == 0  # flags
    assert data[2:18] == TID
    assert data[18:26] == bytes([1, 2, 3, 4, 5, 6, 7, 8])
    assert data[26:34] == bytes([0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18])
    assert data[34:50] == b"M" * 16
    assert hb.signed_part() == data[:34]


@pytest.mark.parametrize(
    ("ack", "flags"),
    [
        (HeartbeatAck(1, 2), 0),
        (HeartbeatAck(1, 2, "t", renewed=True), 0b001),
        (HeartbeatAck(1, 2, "t", resent=True), 0b010),
        (HeartbeatAck(1, 2, was_warn=True), 0b100),
        (HeartbeatAck(1, 2, "t", renewed=True, resent=True, was_warn=True), 0b111),
    ],
)
def test_ack_flag_bits(ack: HeartbeatAck, flags: int) -> None:
    assert ack.flags == flags
    assert encode(ack)[1] == flags


def test_ack_layout_with_token() -> None:
    ack = HeartbeatAck(0x0102030405060708, 0x1112131415161718, TOKEN, renewed=True)
    data = encode(ack)
    assert len(data) == 20 + len(TOKEN)
    assert data[0] == 0x04
    assert data[1] == 0x01
    assert data[2:10] == bytes([1, 2, 3, 4, 5, 6, 7, 8])
    assert data[10:18] == bytes([0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18])
    assert data[18:20] == len(TOKEN).to_bytes(2, "big")
    assert data[20:] == TOKEN.encode("ascii")


def test_ack_layout_without_token() -> None:
    data = encode(HeartbeatAck(5, 6))
    assert data == b"\x04\x00" + (5).to_bytes(8, "big") + (6).to_bytes(8, "big") + b"\x00\x00"
    assert len(data) == 20 == p.ACK_HEAD_LENGTH


@pytest.mark.parametrize(("seq", "exp_ms"), [(5, 6), (0x0102030405060708, 2**64 - 1), (1, 0)])
def test_the_flagless_ack_is_the_codecs(seq: int, exp_ms: int) -> None:
    """encode_ok_ack (the struct's own method, the common ACK) writes what encode does."""
    assert p.encode_ok_ack(seq, exp_ms) == encode(HeartbeatAck(seq, exp_ms))
    assert p.encode_ok_ack(seq, exp_ms) == p.encode_plain_ack(seq, exp_ms, False)


def test_bye_layout() -> None:
    assert encode(Bye()) == b"\x05"


def test_notice_layout() -> None:
    assert encode(Notice()) == b"\x06\x01"
    assert decode(b"\x06\x01") == Notice(SessionState.WARN)


def test_frame_type_values_match_spec() -> None:
    assert {t.name: t.value for t in p.FrameType} == {
        "HELLO": 1,
        "WELCOME": 2,
        "HEARTBEAT": 3,
        "HEARTBEAT_ACK": 4,
        "BYE": 5,
        "NOTICE": 6,
    }
    assert p.VERSION == 1
    assert p.SUBPROTOCOL == "tokend.v1"
    assert p.WS_PATH == "/v1/ws"


def test_max_u64_values_round_trip() -> None:
    top = 2**64 - 1
    for frame in (
        Heartbeat(TID, top, top, b"\xff" * 16),
        HeartbeatAck(top, top),
        Welcome(TID, top, 2**32 - 1, 2**32 - 1, 2**32 - 1, KEY),
    ):
        assert decode(encode(frame)) == frame


def test_token_of_maximum_length_is_accepted() -> None:
    token = "a" * p.MAX_TOKEN_LENGTH
    assert decode(encode(Hello(token))) == Hello(token)
    ack = HeartbeatAck(1, 2, token, resent=True)
    assert decode(encode(ack)) == ack


# --- malformed messages -----------------------------------------------------------------------


def _welcome_with(offset: int, value: int) -> bytes:
    """A valid WELCOME with the byte at ``offset`` replaced."""
    data = bytearray(encode(Welcome(TID, 1, 2, 3, 4, KEY)))
    data[offset] = value
    return bytes(data)


def _ack_bytes(flags: int, token: bytes) -> bytes:
    return struct.pack(">BBQQH", 0x04, flags, 1, 2, len(token)) + token


def _hello_bytes(version: int, length: int, token: bytes) -> bytes:
    return struct.pack(">BBH", 0x01, version, length) + token


MALFORMED: dict[str, bytes] = {
    "empty": b"",
    "type 0x00": b"\x00",
    "type 0x07": b"\x07",
    "type 0xff": b"\xff" + bytes(71),
    "type 0x00 welcome-sized": b"\x00" + bytes(71),
    # HELLO
    "hello type byte only": b"\x01",
    "hello no length": b"\x01\x01",
    "hello half length": b"\x01\x01\x00",
    "hello version 0": _hello_bytes(0, 3, b"abc"),
    "hello version 2": _hello_bytes(2, 3, b"abc"),
    "hello version 255": _hello_bytes(255, 3, b"abc"),
    "hello L=0": _hello_bytes(1, 0, b""),
    "hello L=0 with bytes": _hello_bytes(1, 0, b"abc"),
    "hello L>8192": _hello_bytes(1, 8193, b"a" * 8193),
    "hello L=0xffff": _hello_bytes(1, 0xFFFF, b"a" * 0xFFFF),
    "hello L too big for message": _hello_bytes(1, 4, b"abc"),
    "hello L too small for message": _hello_bytes(1, 2, b"abc"),
    "hello non-ASCII token": _hello_bytes(1, 2, "é".encode()),
    "hello 0x80 byte": _hello_bytes(1, 3, b"a\x80b"),
    "hello 0xff byte": _hello_bytes(1, 1, b"\xff"),
    "hello proof 15 bytes": _hello_bytes(1, 3, b"abc" + b"p" * 15),
    "hello proof 17 bytes": _hello_bytes(1, 3, b"abc" + b"p" * 17),
    "hello proof 1 byte": _hello_bytes(1, 3, b"abc" + b"p"),
    # WELCOME
    "welcome one byte short": encode(Welcome(TID, 1, 2, 3, 4, KEY))[:-1],
    "welcome one byte long": encode(Welcome(TID, 1, 2, 3, 4, KEY)) + b"\x00",
    "welcome type byte only": b"\x02",
    "welcome version 0": _welcome_with(1, 0),
    "welcome version 2": _welcome_with(1, 2),
    "welcome state WARN": _welcome_with(2, 1),
    "welcome state 2": _welcome_with(2, 2),
    "welcome state 255": _welcome_with(2, 255),
    "welcome flag bit 1": _welcome_with(3, 0x02),
    "welcome flag bit 7": _welcome_with(3, 0x80),
    "welcome resumed plus reserved": _welcome_with(3, 0x03),
    # HEARTBEAT
    "heartbeat one byte short": encode(make_heartbeat(KEY, TID, 1, 2))[:-1],
    "heartbeat one byte long": encode(make_heartbeat(KEY, TID, 1, 2)) + b"\x00",
    "heartbeat type byte only": b"\x03",
    **{
        f"heartbeat flags 0x{bit:02x}": b"\x03"
        + bytes([bit])
        + encode(make_heartbeat(KEY, TID, 1, 2))[2:]
        for bit in (0x01, 0x02, 0x04, 0x80, 0xFF)
    },
    # HEARTBEAT_ACK
    "ack type byte only": b"\x04",
    "ack header one byte short": _ack_bytes(0, b"")[:-1],
    "ack no token one byte long": _ack_bytes(0, b"") + b"x",
    "ack token one byte short": _ack_bytes(1, b"abc")[:-1],
    "ack token one byte long": _ack_bytes(1, b"abc") + b"d",
    "ack token without flag": _ack_bytes(0, b"abc"),
    "ack token with only was_warn flag": _ack_bytes(0x04, b"abc"),
    "ack renewed flag without token": _ack_bytes(0x01, b""),
    "ack resent flag without token": _ack_bytes(0x02, b""),
    "ack both flags without token": _ack_bytes(0x03, b""),
    **{f"ack reserved bit 0x{bit:02x}": _ack_bytes(bit, b"") for bit in (0x08, 0x10, 0x40, 0x80)},
    "ack reserved bit with token": _ack_bytes(0x09, b"abc"),
    "ack L>8192": _ack_bytes(0x01, b"a" * 8193),
    "ack non-ASCII token": _ack_bytes(0x01, "ü".encode()),
    # BYE
    "bye one byte long": b"\x05\x00",
    "bye two bytes long": b"\x05\x05\x05",
    # NOTICE
    "notice one byte short": b"\x06",
    "notice one byte long": b"\x06\x01\x00",
    "notice state ACTIVE": b"\x06\x00",
    "notice state 2": b"\x06\x02",
    "notice state 255": b"\x06\xff",
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_message_is_a_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(data)


def test_protocol_error_is_a_value_error() -> None:
    assert issubclass(ProtocolError, ValueError)


def test_the_malformed_table_differs_from_valid_frames_only_where_intended() -> None:
    # Guards the table above: the near-miss bases really are valid.
    assert decode(_hello_bytes(1, 3, b"abc")) == Hello("abc")
    assert decode(_hello_bytes(1, 3, b"abc" + b"p" * 16)) == Hello("abc", proof=b"p" * 16)
    assert decode(_welcome_with(3, 0x00)) == Welcome(TID, 1, 2, 3, 4, KEY)
    assert decode(_welcome_with(3, 0x01)) == Welcome(TID, 1, 2, 3, 4, KEY, resumed=True)
    assert decode(_ack_bytes(0x01, b"abc")) == HeartbeatAck(1, 2, "abc", renewed=True)
    assert decode(_ack_bytes(0x04, b"")) == HeartbeatAck(1, 2, was_warn=True)
    assert decode(_ack_bytes(0x01, b"a" * 8192)) == HeartbeatAck(1, 2, "a" * 8192, renewed=True)


@pytest.mark.parametrize(
    "frame",
    [
        Hello(""),
        Hello("a" * (p.MAX_TOKEN_LENGTH + 1)),
        Hello("tökén"),
        Hello("abc", proof=b"p" * 15),
        Welcome(TID[:15], 1, 2, 3, 4, KEY),
        Welcome(TID, 1, 2, 3, 4, KEY[:31]),
        Welcome(TID, -1, 2, 3, 4, KEY),
        Welcome(TID, 1, 2**32, 3, 4, KEY),
        Heartbeat(TID, 1, 2, b"short"),
        Heartbeat(TID + b"x", 1, 2, b"m" * 16),
        Heartbeat(TID, 2**64, 2, b"m" * 16),
        Heartbeat(TID, -1, 2, b"m" * 16),
        HeartbeatAck(1, 2, "token"),
        HeartbeatAck(1, 2, None, renewed=True),
        HeartbeatAck(1, 2, "", resent=True),
        HeartbeatAck(1, 2, "a" * (p.MAX_TOKEN_LENGTH + 1), renewed=True),
        HeartbeatAck(1, 2, "ñ", renewed=True),
        HeartbeatAck(2**64, 2),
    ],
    ids=repr,
)
def test_encode_refuses_values_out_of_range(frame: Frame) -> None:
    with pytest.raises(ProtocolError):
        encode(frame)


def test_encode_refuses_a_non_frame() -> None:
    not_a_frame: Any = "hello"  # what an unchecked caller may pass
    with pytest.raises(ProtocolError):
        encode(not_a_frame)


# --- heartbeat proof --------------------------------------------------------------------------


def test_heartbeat_mac_matches_an_independent_hmac() -> None:
    hb = make_heartbeat(KEY, TID, 42, 1_764_680_900_000)
    data = encode(hb)
    first34 = b"\x03\x00" + TID + (42).to_bytes(8, "big") + (1_764_680_900_000).to_bytes(8, "big")
    assert data[:34] == first34
    expected = hmac.new(KEY, first34, hashlib.sha256).digest()[:16]
    assert hb.mac == expected
    assert data[34:] == expected


@pytest.mark.parametrize("key_length", [0, 16, 32, 64, 65, 200])
def test_a_mac_key_checks_many_heartbeats_as_hmac_would(key_length: int) -> None:
    """The session's mac key is made once and checks each of its heartbeats (its hashes
    are copied, never spent), with any key length HMAC takes (RFC 2104)."""
    key = bytes(range(key_length))
    mac_key = heartbeat_mac_key(key)
    for seq in (1, 2, 3):
        data = encode(make_heartbeat(key, TID, seq, 7))
        assert data[34:] == hmac.new(key, data[:34], hashlib.sha256).digest()[:16]
        assert heartbeat_proof_holds(data, mac_key)
        assert not heartbeat_proof_holds(data[:-1] + bytes([data[-1] ^ 1]), mac_key)


def proof_holds(hb: Heartbeat, key: bytes) -> bool:
    """The server's check of a heartbeat's mac, on its bytes as they come."""
    data = encode(hb)
    return is_heartbeat(data) and heartbeat_proof_holds(data, heartbeat_mac_key(key))


def test_a_heartbeat_is_read_in_place_as_decode_reads_it() -> None:
    data = encode(make_heartbeat(KEY, TID, 42, 7))
    assert is_heartbeat(data) and heartbeat_fields(data) == (TID, 42, 7)
    assert not is_heartbeat(data[:-1]) and not is_heartbeat(data + b"\x00")
    assert not is_heartbeat(b"\x03\x01" + data[2:])  # flags
    assert not is_heartbeat(b"\x04" + data[1:])  # another type


@PROPS
@given(st.binary(min_size=0, max_size=60))
def test_is_heartbeat_is_decode_giving_a_heartbeat(tail: bytes) -> None:
    for data in (tail, b"\x03" + tail, b"\x03\x00" + tail):
        try:
            decoded: object = decode(data)
        except ProtocolError:
            decoded = None
        assert is_heartbeat(data) == isinstance(decoded, Heartbeat)


def test_the_proof_holds_with_the_right_key_only() -> None:
    hb = make_heartbeat(KEY, TID, 1, 2)
    assert proof_holds(hb, KEY)
    assert not proof_holds(hb, bytes(32))
    assert not proof_holds(hb, KEY[:-1] + bytes([KEY[-1] ^ 1]))
    # The frame's own check (a client's, tests/test_client_core.py) agrees.
    assert hb.mac_is_valid(KEY) and not hb.mac_is_valid(bytes(32))


@pytest.mark.parametrize("index", range(16))
def test_mac_with_a_flipped_byte_is_invalid(index: int) -> None:
    hb = make_heartbeat(KEY, TID, 1, 2)
    mac = bytearray(hb.mac)
    mac[index] ^= 0x01
    assert not proof_holds(Heartbeat(hb.tid, hb.seq, hb.exp_ms, bytes(mac)), KEY)


@pytest.mark.parametrize("index", range(50))
def test_any_flipped_byte_of_a_heartbeat_fails_decode_or_mac(index: int) -> None:
    data = bytearray(encode(make_heartbeat(KEY, TID, 7, 99)))
    data[index] ^= 0x20
    try:
        frame = decode(bytes(data))
    except ProtocolError:
        assert index in (0, 1)  # type or flags
        return
    assert isinstance(frame, Heartbeat)
    assert not proof_holds(frame, KEY)


def test_changed_fields_invalidate_the_mac() -> None:
    hb = make_heartbeat(KEY, TID, 5, 6)
    assert not proof_holds(Heartbeat(hb.tid, 6, 6, hb.mac), KEY)
    assert not proof_holds(Heartbeat(hb.tid, 5, 7, hb.mac), KEY)
    assert not proof_holds(Heartbeat(bytes(16), 5, 6, hb.mac), KEY)


def test_decoded_heartbeat_mac_verifies() -> None:
    hb = decode(encode(make_heartbeat(KEY, TID, 3, 4)))
    assert isinstance(hb, Heartbeat)
    assert proof_holds(hb, KEY)


@PROPS
@given(keys, tids, u64, u64)
def test_mac_property(key: bytes, tid: bytes, seq: int, exp_ms: int) -> None:
    hb = make_heartbeat(key, tid, seq, exp_ms)
    signed = struct.pack(">BB16sQQ", 3, 0, tid, seq, exp_ms)
    assert hb.mac == hmac.new(key, signed, hashlib.sha256).digest()[:16]
    assert proof_holds(hb, key)
    assert not proof_holds(hb, bytes(b ^ 0xFF for b in key))


# --- decode is total: ProtocolError or a frame that re-encodes to the input ------------------


@PROPS
@given(st.binary(max_size=120))
def test_decode_random_bytes(data: bytes) -> None:
    assert_decode_is_total(data)


@PROPS
@given(st.integers(0, 8), st.binary(max_size=100))
def test_decode_random_bytes_after_a_plausible_type(kind: int, rest: bytes) -> None:
    assert_decode_is_total(bytes([kind]) + rest)


@PROPS
@given(
    st.sampled_from([1, 4]),
    st.integers(0, 8),
    st.binary(max_size=60),
    st.one_of(st.none(), st.integers(0, 0xFFFF)),
)
def test_decode_random_variable_length_frames(
    kind: int, second: int, body: bytes, length: int | None
) -> None:
    # HELLO / HEARTBEAT_ACK with random bodies whose L field matches (None) or not.
    size = len(body) if length is None else length
    if kind == 1:
        head = struct.pack(">BBH", kind, second, size)
    else:
        head = struct.pack(">BBQQH", kind, second, 1, 2, size)
    assert_decode_is_total(head + body)


@PROPS
@given(frames, st.data())
def test_decode_flipped_frame(frame: Frame, data: st.DataObject) -> None:
    raw = bytearray(encode(frame))
    index = data.draw(st.integers(0, len(raw) - 1))
    raw[index] ^= data.draw(st.integers(1, 255))
    assert_decode_is_total(bytes(raw))


@PROPS
@given(frames, st.data())
def test_decode_truncated_frame(frame: Frame, data: st.DataObject) -> None:
    raw = encode(frame)
    cut = data.draw(st.integers(0, len(raw) - 1))
    if isinstance(frame, Hello) and frame.proof and cut == len(raw) - p.RESUME_PROOF_LENGTH:
        # Spec "Resume proof" (revision 2, additive): without its proof, a v1 HELLO.
        assert decode(raw[:cut]) == Hello(frame.token, frame.version)
        return
    with pytest.raises(ProtocolError):
        decode(raw[:cut])


@PROPS
@given(frames, st.binary(min_size=1, max_size=40))
def test_decode_extended_frame(frame: Frame, extra: bytes) -> None:
    if isinstance(frame, Hello) and not frame.proof and len(extra) == p.RESUME_PROOF_LENGTH:
        # Spec "Resume proof": 16 more bytes after a v1 HELLO's token are its proof.
        assert decode(encode(frame) + extra) == Hello(frame.token, frame.version, extra)
        return
    with pytest.raises(ProtocolError):
        decode(encode(frame) + extra)


# --- close codes ------------------------------------------------------------------------------

SPEC_CLOSE_CODES = {
    1000,
    1001,
    1009,
    1011,
    1013,
    4008,
    4029,
    4501,
    4502,
    4503,
    4504,
    4505,
    4506,
    4507,
    4509,
}


def test_close_codes_match_the_spec_table() -> None:
    assert {int(c) for c in CloseCode} == SPEC_CLOSE_CODES


@pytest.mark.parametrize("code", list(CloseCode), ids=lambda c: str(int(c)))
def test_reconnectable_exactly_for_the_spec_codes(code: CloseCode) -> None:
    assert code.reconnectable is (int(code) in {1001, 1011, 1013, 4008, 4029, 4509})


@pytest.mark.parametrize("code", list(CloseCode), ids=lambda c: str(int(c)))
def test_every_close_code_has_a_description(code: CloseCode) -> None:
    text = code.describe()
    assert isinstance(text, str)
    assert text.strip()
    # A close frame's reason must fit in 123 bytes of UTF-8 (RFC 6455 5.5).
    assert len(text.encode()) <= 123


def test_close_descriptions_are_distinct() -> None:
    texts = [c.describe() for c in CloseCode]
    assert len(set(texts)) == len(texts)


# Close reasons: docs/protocol.md §7 "Close reasons" against the code that sends them

DOCS = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
# What a close ordered by a control message (tokend/store/lua: hello, transition, end) says.
CONTROL_CODES = (CloseCode.SESSION_EXPIRED, CloseCode.TOKEN_REVOKED, CloseCode.TAKEN_OVER)


def documented_close_reasons() -> dict[str, int]:
    section = DOCS.read_text().split("### Close reasons", 1)[1].split("\n## ", 1)[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^\| `(\w+)` \| (\d+) \|", section, re.M)}


def reasons_sent_by(module: ModuleType) -> dict[str, int | None]:
    """The reasons of every ``Close(code, reason)`` and ``.close(code, reason)`` in a
    module's source, with their code where it is written out (else None)."""
    found: dict[str, int | None] = {}
    assert module.__file__ is not None
    tree = ast.parse(Path(module.__file__).read_text())
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call) or len(call.args) != 2:
            continue
        name = getattr(call.func, "id", None) or getattr(call.func, "attr", None)
        if name not in ("Close", "close", "_close"):
            continue
        code_node, reason_node = call.args
        code = None
        if isinstance(code_node, ast.Attribute) and code_node.attr in CloseCode.__members__:
            code = int(CloseCode[code_node.attr])
        if isinstance(reason_node, ast.Constant) and isinstance(reason_node.value, str):
            found[reason_node.value] = code
        elif isinstance(reason_node, ast.Name) and hasattr(module, reason_node.id):
            found[getattr(module, reason_node.id)] = code
        elif isinstance(reason_node, ast.JoinedStr):  # f"session_{tombstone}"
            prefix = reason_node.values[0]
            assert isinstance(prefix, ast.Constant), ast.unparse(reason_node)
            assert isinstance(prefix.value, str), ast.unparse(reason_node)
            for tomb, tomb_code in session.ENDED_CODES.items():
                found[prefix.value + tomb] = tomb_code and int(tomb_code)
        else:  # passed on: a TokenError's reason (below), or a Close's own
            # (close_code.reason: a control message's close, CONTROL_CODES below)
            assert ast.unparse(reason_node) in (
                "exc.reason",
                "close.reason",
                "reason",
                "close_code.reason",
            )
    return found


def test_every_close_reason_sent_is_documented_and_every_documented_one_is_sent() -> None:
    documented = documented_close_reasons()
    sent = {
        **reasons_sent_by(session),
        **reasons_sent_by(connection),
        **reasons_sent_by(node),
        **reasons_sent_by(server),
    }
    sent |= {refusal: 4502 if refusal == "expired" else 4501 for refusal in REFUSALS}
    sent |= {code.reason: int(code) for code in CONTROL_CODES}
    assert sorted(sent) == sorted(documented)
    for reason, code in sent.items():
        assert code is None or documented[reason] == code, reason
    assert all(re.fullmatch(r"[a-z]+(_[a-z]+)*", reason) for reason in documented)
