"""The handoff format (tokend/core/handoff.py): a session handed to another process goes on
with the same key, seq rules, clocks and token; batches and replies round-trip; a version
the reader does not speak is refused by its batch number; damaged messages are refused."""

from __future__ import annotations

import math
from typing import Any

import pytest

from testkit.pure import FakeClock, clock, tokens
from testkit.session_core import (
    CADENCE,
    EXP_MS,
    SINCE_MS,
    TokenNode,
    heartbeat,
    node,
    session,
    welcome,
)
from tokend.core import protocol as p
from tokend.core.handoff import (
    HANDOFF_VERSION,
    MAX_BATCH,
    BatchStatus,
    HandoffFormatError,
    Moving,
    Taken,
    adopt_session,
    batch_number,
    decode_batch,
    decode_reply,
    encode_batch,
    encode_reply,
    export_session,
)
from tokend.core.session import Ask, Close, Phase, Session
from tokend.tokens.service import TokenService

__all__ = ["clock", "node", "session", "tokens"]  # fixtures of testkit


def moved(session: Session, **connection: Any) -> Moving:
    """``session`` handed over, with a connection's state (``connection`` overrides)."""
    record = Moving(
        session=export_session(session, "digest-to-store"),
        peer=("203.0.113.9", 40123),
        unparsed=b"\x82\xb2half a frame",
        fragments=None,
        pings=(3.5, 999.0),
    )
    return record._replace(**connection)


def test_a_handed_over_session_acks_the_next_heartbeat_with_the_same_key_and_seq_rules(
    session: Session, tokens: TokenService, node: TokenNode, clock: FakeClock
) -> None:
    w = welcome(session, tokens)
    assert session.receive(heartbeat(w, 1)) is Ask.HEARTBEAT
    session.take_heartbeats()
    assert isinstance(session.stored(EXP_MS), list)
    clock.now += 2

    batch = decode_batch(encode_batch(7, [moved(session)]))
    assert batch.number == 7
    state = batch.records[0].session
    assert state.conn == "node-a/1" and state.stored_token == "digest-to-store"
    adopted = adopt_session(state, node, CADENCE, "node-a.2/1", SINCE_MS + 5, clock)

    assert adopted.phase is Phase.OPEN and adopted.conn == "node-a.2/1"
    assert adopted.since_ms == SINCE_MS + 5
    assert adopted.next_proof == session.next_proof  # the resume proof of the same key
    assert adopted.receive(heartbeat(w, 1)) == Close(p.CloseCode.BAD_HEARTBEAT, "old_seq")
    adopted = adopt_session(state, node, CADENCE, "node-a.2/1", SINCE_MS + 5, clock)
    assert adopted.receive(heartbeat(w, 2)) is Ask.HEARTBEAT
    adopted.take_heartbeats()
    out = adopted.stored(EXP_MS)
    assert isinstance(out, list)
    ack = p.decode(out[0])
    assert isinstance(ack, p.HeartbeatAck) and ack.seq == 2 and ack.exp_ms == EXP_MS
    assert ack.token is None  # the client has the current token: none re-sent


def test_every_field_round_trips(session: Session, tokens: TokenService, clock: FakeClock) -> None:
    w = welcome(session, tokens, resumed=True)
    clock.now += 1
    assert session.receive(heartbeat(w, 5)) is Ask.HEARTBEAT
    session.take_heartbeats()
    session.stored(EXP_MS)
    session.warned = True
    session.signed_digest = "signed"
    record = moved(session, fragments=b"first fragments", peer=None, pings=None)

    [back] = decode_batch(encode_batch(1, [record])).records

    assert back == record
    assert back.session.key == w.session_key and back.session.resumed
    assert back.session.last_beat == clock.now and back.session.frames is not None


def test_a_session_without_a_heartbeat_yet_keeps_no_clock_reading(
    session: Session, tokens: TokenService
) -> None:
    welcome(session, tokens)
    [back] = decode_batch(encode_batch(1, [moved(session)])).records
    assert back.session.last_beat == -math.inf


def test_a_full_batch_round_trips_and_a_larger_one_is_refused(
    session: Session, tokens: TokenService
) -> None:
    welcome(session, tokens)
    record = moved(session)
    assert len(decode_batch(encode_batch(3, [record] * MAX_BATCH)).records) == MAX_BATCH
    with pytest.raises(ValueError, match="at most 253"):
        encode_batch(3, [record] * (MAX_BATCH + 1))


def test_a_version_the_reader_does_not_speak_is_refused_by_its_batch_number(
    session: Session, tokens: TokenService
) -> None:
    welcome(session, tokens)
    data = encode_batch(42, [moved(session)], version=HANDOFF_VERSION + 1)
    assert batch_number(data) == (HANDOFF_VERSION + 1, 42)
    with pytest.raises(HandoffFormatError, match="version"):
        decode_batch(data)


@pytest.mark.parametrize("cut", [3, 12, 40, -1])
def test_a_message_cut_short_or_damaged_is_refused(
    session: Session, tokens: TokenService, cut: int
) -> None:
    welcome(session, tokens)
    data = encode_batch(1, [moved(session)])
    with pytest.raises(HandoffFormatError):
        decode_batch(data[:cut])
    with pytest.raises(HandoffFormatError):
        decode_batch(data + b"x")
    with pytest.raises(HandoffFormatError):
        decode_batch(b"nope" + data[4:])


def test_replies_round_trip_and_damaged_ones_are_refused() -> None:
    taken = [Taken.TAKEN, Taken.NOT_HELD, Taken.STORE_UNAVAILABLE]
    reply = decode_reply(encode_reply(9, BatchStatus.READ, taken))
    assert (reply.number, reply.status, reply.taken) == (9, BatchStatus.READ, taken)
    refused = decode_reply(encode_reply(10, BatchStatus.UNKNOWN_VERSION))
    assert refused.status is BatchStatus.UNKNOWN_VERSION and refused.taken == []
    data = encode_reply(9, BatchStatus.READ, taken)
    for damaged in (data[:-1], data + b"\0", data[:10] + b"\x09" + data[11:], b"tkho" + data[4:]):
        with pytest.raises(HandoffFormatError):
            decode_reply(damaged)
