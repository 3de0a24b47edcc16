"""The SDK's codec (tokend_client.protocol) against the server's (tokend.core.protocol): the
same frames make the same bytes, the same bytes read as the same frames or are refused
by both, and the close codes mean the same. The SDK is its own distribution, so it keeps
its own copy of the client's half of the codec; this differential test keeps the two
copies from drifting apart.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import tokend_client.protocol as client
from tokend.core import protocol as server

U64 = st.integers(0, 2**64 - 1)
U32 = st.integers(0, 2**32 - 1)
# Tokens as they come (base64url and dots), at the edges of their length too.
TOKENS = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
TOKENS = st.one_of(
    TOKENS.filter(bool), st.sampled_from(["", "t" * 8192, "t" * 8193, "é", "a\u00ff"])
)
PROOFS = st.one_of(st.none(), st.binary(min_size=16, max_size=16), st.binary(max_size=20))


def fields(frame: Any) -> tuple[str, tuple[Any, ...]]:
    """A frame as its type's name and its field values, whichever codec made it."""
    return type(frame).__name__, dataclasses.astuple(frame)


def outcome(encode: Any, frame: Any) -> bytes | str:
    """The frame's bytes, or the name of the error the codec raised."""
    try:
        return encode(frame)
    except Exception as exc:
        return type(exc).__name__


@given(token=TOKENS, proof=PROOFS)
def test_a_hello_is_the_same_bytes_from_both(token: str, proof: bytes | None) -> None:
    ours = outcome(client.encode, client.Hello(token, proof=proof))
    assert ours == outcome(server.encode, server.Hello(token, proof=proof))
    valid = token.isascii() and 1 <= len(token) <= 8192 and (proof is None or len(proof) == 16)
    assert isinstance(ours, bytes) == valid


@given(
    key=st.binary(min_size=32, max_size=32),
    tid=st.binary(min_size=16, max_size=16),
    seq=U64,
    exp_ms=U64,
)
def test_a_heartbeat_and_its_proof_are_the_same_bytes_from_both(
    key: bytes, tid: bytes, seq: int, exp_ms: int
) -> None:
    ours = client.encode(client.make_heartbeat(key, tid, seq, exp_ms))
    assert ours == server.encode(server.make_heartbeat(key, tid, seq, exp_ms))
    assert client.resume_proof(key, tid) == server.resume_proof(key, tid)


@given(tid=st.binary(max_size=17), seq=st.integers(-1, 2**64), mac=st.binary(max_size=17))
def test_a_heartbeat_out_of_range_is_refused_by_both(tid: bytes, seq: int, mac: bytes) -> None:
    assert outcome(client.encode, client.Heartbeat(tid, seq, 0, mac)) == outcome(
        server.encode, server.Heartbeat(tid, seq, 0, mac)
    )


def test_a_bye_is_the_same_byte_from_both() -> None:
    assert client.encode(client.Bye()) == server.encode(server.Bye()) == b"\x05"


WELCOMES = st.builds(
    server.Welcome,
    tid=st.binary(min_size=16, max_size=16),
    exp_ms=U64,
    heartbeat_ms=U32,
    warn_ms=U32,
    expire_ms=U32,
    session_key=st.binary(min_size=32, max_size=32),
    resumed=st.booleans(),
)
ACKS = st.one_of(
    st.builds(server.HeartbeatAck, seq=U64, exp_ms=U64, was_warn=st.booleans()),
    st.builds(
        lambda seq, exp_ms, token, resent, was_warn: server.HeartbeatAck(
            seq, exp_ms, token, renewed=not resent, resent=resent, was_warn=was_warn
        ),
        U64,
        U64,
        TOKENS.filter(lambda t: 1 <= len(t) <= 8192 and t.isascii()),
        st.booleans(),
        st.booleans(),
    ),
)
SERVER_FRAMES = st.one_of(WELCOMES, ACKS, st.just(server.Notice()))


@given(frame=SERVER_FRAMES)
def test_what_the_server_sends_reads_as_the_same_frame(frame: server.Frame) -> None:
    assert fields(client.decode(server.encode(frame))) == fields(frame)


# Messages near every layout: a known type byte, then bytes up to past the longest head.
MESSAGES = st.one_of(
    st.binary(max_size=80),
    st.tuples(st.integers(0, 7), st.binary(max_size=80)).map(lambda t: bytes([t[0]]) + t[1]),
    SERVER_FRAMES.map(server.encode)
    .flatmap(
        lambda data: st.tuples(st.just(data), st.integers(0, len(data)), st.binary(max_size=3))
    )
    .map(lambda t: t[0][: t[1]] + t[2]),
)


@given(data=MESSAGES)
def test_any_message_is_read_alike_or_refused_by_both(data: bytes) -> None:
    try:
        theirs = server.decode(data)
    except server.ProtocolError:
        theirs = None
    if theirs is None or not isinstance(theirs, server.SERVER_FRAMES):
        with pytest.raises(client.ProtocolError):
            client.decode(data)
    else:
        assert fields(client.decode(data)) == fields(theirs)


def test_the_close_codes_and_constants_mean_the_same() -> None:
    assert {c.name: (c.value, c.describe()) for c in client.CloseCode} == {
        c.name: (c.value, c.describe()) for c in server.CloseCode
    }
    assert set(map(int, client.RECONNECTABLE)) == set(map(int, server.RECONNECTABLE))
    assert {s.name: s.value for s in client.SessionState} == {
        s.name: s.value for s in server.SessionState
    }
    names = [
        "VERSION",
        "SUBPROTOCOL",
        "WS_PATH",
        "MAX_TOKEN_LENGTH",
        "SESSION_KEY_LENGTH",
        "RESUME_PROOF_LENGTH",
        "ACK_HEAD_LENGTH",
        "WELCOME_LENGTH",
        "HEARTBEAT_LENGTH",
    ]
    assert [getattr(client, n) for n in names] == [getattr(server, n) for n in names]
