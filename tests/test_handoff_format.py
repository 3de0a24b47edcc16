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
from tokend.core.claims import Claims, Tid
from tokend.core.handoff import (
    HANDOFF_VERSION,
    MAX_BATCH,
    BatchStatus,
    HandoffFormatError,
    Moving,
    Taken,
    batch_number,
    decode_batch,
    decode_reply,
    encode_batch,
    encode_reply,
)
from tokend.core.session import Ask, Close, Phase, Session, TokenBucket
from tokend.tokens.service import TokenService

__all__ = ["clock", "node", "session", "tokens"]  # fixtures of testkit

# What a session hands over (its rate bucket aside: handed_over reads its two numbers).
HANDED = (
    "conn",
    "since_ms",
    "phase",
    "claims",
    "tid_bytes",
    "key",
    "last_seq",
    "last_beat",
    "cadenced",
    "exp_ms",
    "iat_s",
    "token_exp_ms",
    "signed_digest",
    "resumed",
    "warned",
)


def moved(session: Session, **connection: Any) -> Moving:
    """``session`` handed over, with a connection's state (``connection`` overrides)."""
    record = Moving(
        session=session,
        stored_token="digest-to-store",
        peer=("203.0.113.9", 40123),
        unparsed=b"\x82\xb2half a frame",
        fragments=None,
        pings=(3.5, 999.0),
    )
    return record._replace(**connection)


def handed_over(session: Session) -> tuple[Any, ...]:
    frames = session.frames
    assert frames is not None
    return (*(getattr(session, name) for name in HANDED), frames.allowance, frames.checked)


def arrived(data: bytes, node: TokenNode, clock: FakeClock) -> list[Moving]:
    """The records of a batch as the new worker reads them."""
    return decode_batch(data, node, CADENCE, clock).records


def test_a_handed_over_session_acks_the_next_heartbeat_with_the_same_key_and_seq_rules(
    session: Session, tokens: TokenService, node: TokenNode, clock: FakeClock
) -> None:
    w = welcome(session, tokens)
    assert session.receive(heartbeat(w, 1)) is Ask.HEARTBEAT
    session.take_heartbeats()
    assert isinstance(session.stored(EXP_MS), list)
    clock.now += 2
    data = encode_batch(7, [moved(session)])

    batch = decode_batch(data, node, CADENCE, clock)
    assert batch.number == 7
    [record] = batch.records
    adopted = record.session
    assert adopted.conn == "node-a/1" and record.stored_token == "digest-to-store"
    assert adopted.phase is Phase.OPEN and adopted.since_ms == SINCE_MS
    adopted.conn, adopted.since_ms = "node-a.2/1", SINCE_MS + 5  # the new worker's own

    assert adopted.next_proof == session.next_proof  # the resume proof of the same key
    assert adopted.receive(heartbeat(w, 1)) == Close(p.CloseCode.BAD_HEARTBEAT, "old_seq")
    [record] = arrived(data, node, clock)
    adopted = record.session
    assert adopted.receive(heartbeat(w, 2)) is Ask.HEARTBEAT
    adopted.take_heartbeats()
    out = adopted.stored(EXP_MS)
    assert isinstance(out, list)
    ack = p.decode(out[0])
    assert isinstance(ack, p.HeartbeatAck) and ack.seq == 2 and ack.exp_ms == EXP_MS
    assert ack.token is None  # the client has the current token: none re-sent


def test_every_field_round_trips(
    session: Session, tokens: TokenService, node: TokenNode, clock: FakeClock
) -> None:
    w = welcome(session, tokens, resumed=True)
    clock.now += 1
    assert session.receive(heartbeat(w, 5)) is Ask.HEARTBEAT
    session.take_heartbeats()
    session.stored(EXP_MS)
    session.warned = True
    session.signed_digest = "signed"
    record = moved(session, fragments=b"first fragments", peer=None, pings=None)

    [back] = arrived(encode_batch(1, [record]), node, clock)

    assert back._replace(session=session) == record
    assert handed_over(back.session) == handed_over(session)
    assert back.session.key == w.session_key and back.session.resumed
    assert back.session.last_beat == clock.now


def test_a_session_without_a_heartbeat_yet_keeps_no_clock_reading(
    session: Session, tokens: TokenService, node: TokenNode, clock: FakeClock
) -> None:
    welcome(session, tokens)
    [back] = arrived(encode_batch(1, [moved(session)]), node, clock)
    assert back.session.last_beat == -math.inf


# Batch 5 of version 1, one record, as every release that speaks version 1 writes it (the
# fields of version_1_session and the connection's state of
# test_version_1_is_read_and_written_byte_for_byte).
VERSION_1_BATCH = bytes.fromhex(
    "746b686f0001000000050001000000006553f100000000006553ff100000018bcfe5680700000000"
    "000000290000018bd01c5680000000006553f1000000018bd01c568007fd0240c81cc00000000040"
    "4540000000000040c81a2000000000400c000000000000408f3800000000009cbb00240009000500"
    "0d000d0020000b000000060000000430663866616435622d643963622d343639662d613136352d37"
    "30383637373238393530656e6f64652d612f3137616c6963657369676e65642d6469676573747374"
    "6f7265642d646967657374000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c"
    "1d1e1f3230332e302e3131332e3982b268616c6666726167"
)


def version_1_session(node: TokenNode, clock: FakeClock) -> Session:
    session = Session(node, CADENCE, "node-a/17", clock)
    session.phase = Phase.OPEN
    tid = Tid("0f8fad5b-d9cb-469f-a165-70867728950e")
    session.claims = Claims(tid, "alice", 1_700_000_000, 1_700_003_600, 7)
    session.tid_bytes = tid.bytes
    session.key = bytes(range(32))
    session.last_seq = 41
    session.last_beat = 12345.5
    session.cadenced = session.resumed = True
    session.exp_ms = session.token_exp_ms = 1_700_003_600_000
    session.iat_s = 1_700_000_000
    session.signed_digest = "signed-digest"
    session.since_ms = 1_700_000_000_007
    session.frames = TokenBucket(CADENCE.max_frame_rate, 0.0)
    session.frames.allowance, session.frames.checked = 42.5, 12340.25
    return session


def test_version_1_is_read_and_written_byte_for_byte(node: TokenNode, clock: FakeClock) -> None:
    """Workers of two releases that speak version 1 hand over to each other: its layout
    does not change."""
    session = version_1_session(node, clock)
    record = Moving(
        session=session,
        stored_token="stored-digest",
        peer=("203.0.113.9", 40123),
        unparsed=b"\x82\xb2half",
        fragments=b"frag",
        pings=(3.5, 999.0),
        family=2,
    )
    assert encode_batch(5, [record]) == VERSION_1_BATCH

    [back] = arrived(VERSION_1_BATCH, node, clock)
    assert back._replace(session=session) == record
    assert handed_over(back.session) == handed_over(session)


def test_a_full_batch_round_trips_and_a_larger_one_is_refused(
    session: Session, tokens: TokenService, node: TokenNode, clock: FakeClock
) -> None:
    welcome(session, tokens)
    record = moved(session)
    assert len(arrived(encode_batch(3, [record] * MAX_BATCH), node, clock)) == MAX_BATCH
    with pytest.raises(ValueError, match="at most 253"):
        encode_batch(3, [record] * (MAX_BATCH + 1))


def test_a_version_the_reader_does_not_speak_is_refused_by_its_batch_number(
    session: Session, tokens: TokenService, node: TokenNode, clock: FakeClock
) -> None:
    welcome(session, tokens)
    data = encode_batch(42, [moved(session)], version=HANDOFF_VERSION + 1)
    assert batch_number(data) == (HANDOFF_VERSION + 1, 42)
    with pytest.raises(HandoffFormatError, match="version"):
        arrived(data, node, clock)


@pytest.mark.parametrize("cut", [3, 12, 40, -1])
def test_a_message_cut_short_or_damaged_is_refused(
    session: Session, tokens: TokenService, node: TokenNode, clock: FakeClock, cut: int
) -> None:
    welcome(session, tokens)
    data = encode_batch(1, [moved(session)])
    for damaged in (data[:cut], data + b"x", b"nope" + data[4:]):
        with pytest.raises(HandoffFormatError):
            arrived(damaged, node, clock)


def test_replies_round_trip_and_damaged_ones_are_refused() -> None:
    taken = [Taken.TAKEN, Taken.NOT_HELD, Taken.STORE_UNAVAILABLE]
    reply = decode_reply(encode_reply(9, BatchStatus.READ, taken))
    assert (reply.number, reply.status, reply.taken) == (9, BatchStatus.READ, taken)
    refused = decode_reply(encode_reply(10, BatchStatus.UNKNOWN_VERSION))
    assert refused.status is BatchStatus.UNKNOWN_VERSION and refused.taken == []
    data = encode_reply(9, BatchStatus.READ, taken)
    for damaged in (
        data[:-1],
        data + b"\0",
        data[:10] + b"\x09" + data[11:],  # no such status
        data[:-1] + b"\x03",  # no such outcome of a record
        b"tkho" + data[4:],
    ):
        with pytest.raises(HandoffFormatError):
            decode_reply(damaged)
