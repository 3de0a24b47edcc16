"""The session core (tokend/core/session.py), path by path: no Redis, no socket, a fake clock.

Frames go in as the codec decodes them, the store's answers as the store types them
(tokend/core/store_messages.py); what comes out is checked as bytes (decoded with the codec), as
an Ask, or as a Close with its code and reason (docs/protocol.md, "Close reasons").
Tokens are real: verified and signed by a TokenService on a key ring in tmp_path.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest

from testkit.pure import FakeClock, clock, tokens
from testkit.session_core import (
    CADENCE,
    EXP_MS,
    IAT_S,
    SESSION_S,
    SINCE_MS,
    TokenNode,
    heartbeat,
    node,
    session,
    welcome,
)
from testkit.tokens import WallClockTokens
from tokend.core import protocol as p
from tokend.core.lifecycle import serving_rank
from tokend.core.session import Ask, Close, Phase, Release, Session, Welcome
from tokend.core.store_messages import (
    Ended,
    HeartbeatAnswer,
    HeartbeatOutcome,
    HelloAnswer,
    HelloOutcome,
)
from tokend.tokens.service import TokenService, token_digest

__all__ = ["clock", "node", "session", "tokens"]  # fixtures of testkit

OK = HeartbeatOutcome.OK


def closed(out: object, code: p.CloseCode, reason: str) -> None:
    assert out == Close(code, reason)


def acks(out: object) -> list[p.HeartbeatAck]:
    assert isinstance(out, list)
    frames = [p.decode(data) for data in out]
    acked = [f for f in frames if isinstance(f, p.HeartbeatAck)]
    assert acked == frames
    return acked


def stored(exp_ms: int = EXP_MS, **flags: bool) -> HeartbeatAnswer:
    return HeartbeatAnswer(
        OK, flags.get("was_warn", False), flags.get("renewed", False), exp_ms, IAT_S
    )


def store_one(session: Session, answer: HeartbeatAnswer | int) -> list[p.HeartbeatAck]:
    session.take_heartbeats()
    return acks(session.stored(answer))


# Before WELCOME


@pytest.mark.parametrize("frame", [p.Heartbeat(bytes(16), 1, 0, bytes(16)), p.Bye()])
def test_only_hello_opens_a_connection(session: Session, frame: p.Frame) -> None:
    closed(session.receive(frame), p.CloseCode.PROTOCOL_ERROR, "hello_expected")


def test_a_server_frame_from_the_client_is_a_protocol_error(session: Session) -> None:
    closed(session.receive(p.Notice()), p.CloseCode.PROTOCOL_ERROR, "unexpected_frame")


def test_malformed_and_text_messages_close_4503(session: Session) -> None:
    closed(session.text_message(), p.CloseCode.PROTOCOL_ERROR, "text_message")
    assert session.phase is Phase.CLOSED
    other = Session(session.node, CADENCE, "node-a/2", time.monotonic)
    closed(other.malformed(), p.CloseCode.PROTOCOL_ERROR, "malformed_frame")


def test_a_valid_hello_asks_the_store_and_remembers_the_claims(
    session: Session, tokens: TokenService
) -> None:
    tid = uuid.uuid4()
    assert session.receive(p.Hello(tokens.mint("alice", tid=tid, prio=7))) is Ask.START
    assert session.phase is Phase.STARTING
    assert session.claims is not None and session.claims.tid == tid and session.claims.prio == 7


def test_an_invalid_token_closes_4501_with_its_reason(
    session: Session, tokens: TokenService
) -> None:
    token = tokens.mint("alice")
    forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    out = session.receive(p.Hello(forged))
    assert isinstance(out, Close) and out.code is p.CloseCode.INVALID_TOKEN and out.reason


def test_an_expired_token_closes_4502(session: Session, tokens: TokenService) -> None:
    old = tokens.mint("alice", iat=int(time.time()) - 3600, ttl_s=60)
    out = session.receive(p.Hello(old))
    assert isinstance(out, Close) and out.code is p.CloseCode.TOKEN_EXPIRED


def test_a_full_sub_is_rate_limited(
    session: Session, node: TokenNode, tokens: TokenService
) -> None:
    node.full.add("alice")
    closed(
        session.receive(p.Hello(tokens.mint("alice"))),
        p.CloseCode.RATE_LIMITED,
        "too_many_sessions",
    )


def test_a_frame_while_the_store_starts_the_session_is_a_protocol_error(
    session: Session, tokens: TokenService
) -> None:
    session.receive(p.Hello(tokens.mint("alice")))
    closed(
        session.receive(p.Hello(tokens.mint("alice"))), p.CloseCode.PROTOCOL_ERROR, "hello_expected"
    )


def test_hello_timeout_only_before_hello(session: Session, tokens: TokenService) -> None:
    welcome(session, tokens)
    assert session.hello_timed_out() is None
    fresh = Session(session.node, CADENCE, "node-a/2", time.monotonic)
    closed(fresh.hello_timed_out(), p.CloseCode.HELLO_TIMEOUT, "hello_timeout")


# WELCOME


def test_welcome_carries_the_session_and_the_clocks(session: Session, tokens: TokenService) -> None:
    w = welcome(session, tokens)
    assert session.claims is not None and w.tid == session.claims.tid.bytes
    assert (w.exp_ms, w.heartbeat_ms, w.warn_ms, w.expire_ms) == (EXP_MS, 1_000, 3_000, 4_000)
    assert len(w.session_key) == 32 and not w.resumed
    assert session.phase is Phase.OPEN


def test_each_connection_gets_its_own_session_key(node: TokenNode, tokens: TokenService) -> None:
    keys = {
        welcome(Session(node, CADENCE, f"n/{i}", time.monotonic), tokens).session_key
        for i in range(3)
    }
    assert len(keys) == 3


def test_a_resume_says_so(session: Session, tokens: TokenService) -> None:
    assert welcome(session, tokens, resumed=True).resumed


# The resume proof (spec "Resume proof", revision 2)


def test_the_key_is_made_before_the_store_is_asked_and_welcome_carries_it(
    session: Session, tokens: TokenService
) -> None:
    """The store keeps (a digest of) the proof the key makes, for the next resume: so the
    key exists when the HELLO goes to the store, and WELCOME hands over that very key."""
    assert session.receive(p.Hello(tokens.mint("alice"))) is Ask.START
    key = session.key
    assert len(key) == p.SESSION_KEY_LENGTH
    assert session.claims is not None
    assert session.next_proof == p.resume_proof(key, session.claims.tid.bytes)
    out = session.started(HelloAnswer(HelloOutcome.STARTED, EXP_MS, IAT_S, SINCE_MS))
    assert isinstance(out, Welcome)
    w = p.decode(out.frame)
    assert isinstance(w, p.Welcome) and w.session_key == key
    # The client proves with it: the proof its next HELLO shows is the one the store keeps.
    assert p.resume_proof(w.session_key, w.tid) == session.next_proof


def test_the_proof_a_hello_shows_goes_to_the_store_once(
    session: Session, tokens: TokenService
) -> None:
    proof = bytes(range(16))
    session.receive(p.Hello(tokens.mint("alice"), proof=proof))
    assert session.shown_proof == proof
    session.started(HelloAnswer(HelloOutcome.RESUMED, EXP_MS, IAT_S, SINCE_MS))
    assert session.shown_proof is None  # not kept by an idle session
    v1 = Session(session.node, CADENCE, "node-a/2", time.monotonic)
    v1.receive(p.Hello(tokens.mint("alice")))
    assert v1.shown_proof is None


def test_a_session_held_live_by_another_connection_is_4509(
    session: Session, tokens: TokenService
) -> None:
    session.receive(p.Hello(tokens.mint("alice"), proof=bytes(16)))
    answer = HelloAnswer(HelloOutcome.IN_USE)
    closed(session.started(answer), p.CloseCode.SESSION_IN_USE, "session_in_use")
    assert p.CloseCode.SESSION_IN_USE.reconnectable
    assert session.take_release() is None  # it never held the session


# How a session the store found ended (its tombstone) is closed, at HELLO or heartbeat.
ENDED_CLOSES = [
    (Ended.EXPIRED, p.CloseCode.SESSION_EXPIRED, "session_expired"),
    (Ended.REVOKED, p.CloseCode.TOKEN_REVOKED, "session_revoked"),
    (Ended.CLOSED, p.CloseCode.TOKEN_REVOKED, "session_closed"),
]


@pytest.mark.parametrize(
    ("answer", "code", "reason"),
    [
        *[(HelloAnswer(HelloOutcome.ENDED, ended=e), c, r) for e, c, r in ENDED_CLOSES],
        (HelloAnswer(HelloOutcome.EXPIRED), p.CloseCode.TOKEN_EXPIRED, "expired"),
        (HelloAnswer(HelloOutcome.MISMATCH), p.CloseCode.INVALID_TOKEN, "sub_mismatch"),
    ],
)
def test_the_store_refuses_a_hello(
    session: Session, tokens: TokenService, answer: HelloAnswer, code: p.CloseCode, reason: str
) -> None:
    session.receive(p.Hello(tokens.mint("alice")))
    closed(session.started(answer), code, reason)


def test_store_unavailable_at_hello_is_1013(session: Session, tokens: TokenService) -> None:
    session.receive(p.Hello(tokens.mint("alice")))
    closed(session.store_unavailable(), p.CloseCode.TRY_AGAIN_LATER, "store_unavailable")


# Heartbeats: mac, then tid, then seq


def test_a_valid_heartbeat_asks_the_store(session: Session, tokens: TokenService) -> None:
    w = welcome(session, tokens)
    assert session.receive(heartbeat(w, 1)) is Ask.HEARTBEAT
    assert [a.seq for a in store_one(session, stored())] == [1]


def test_the_mac_is_checked_before_the_tid(session: Session, tokens: TokenService) -> None:
    w = welcome(session, tokens)
    forged = p.make_heartbeat(bytes(32), bytes(16), 1, EXP_MS)  # wrong key and wrong tid
    closed(session.receive(forged), p.CloseCode.BAD_HEARTBEAT, "bad_mac")
    del w


def test_a_heartbeat_for_another_tid_is_refused(session: Session, tokens: TokenService) -> None:
    w = welcome(session, tokens)
    closed(session.receive(heartbeat(w, 1, tid=bytes(16))), p.CloseCode.BAD_HEARTBEAT, "wrong_tid")


@pytest.mark.parametrize("second", [1, 0])
def test_a_replayed_or_older_seq_is_refused(
    session: Session, tokens: TokenService, second: int
) -> None:
    w = welcome(session, tokens)
    session.receive(heartbeat(w, 1))
    closed(session.receive(heartbeat(w, second)), p.CloseCode.BAD_HEARTBEAT, "old_seq")


def test_hello_after_welcome_is_a_protocol_error(session: Session, tokens: TokenService) -> None:
    welcome(session, tokens)
    closed(
        session.receive(p.Hello(tokens.mint("alice"))),
        p.CloseCode.PROTOCOL_ERROR,
        "unexpected_frame",
    )


def test_the_frame_rate_is_limited_and_refills(
    session: Session, tokens: TokenService, clock: FakeClock
) -> None:
    w = welcome(session, tokens)
    burst = int(10 * CADENCE.max_frame_rate)
    for seq in range(1, burst + 1):
        assert session.receive(heartbeat(w, seq)) is Ask.HEARTBEAT
    clock.now += 1.0  # five more frames' worth
    for seq in range(burst + 1, burst + 6):
        assert session.receive(heartbeat(w, seq)) is Ask.HEARTBEAT
    closed(session.receive(heartbeat(w, burst + 6)), p.CloseCode.RATE_LIMITED, "too_many_frames")


# The store's answers to heartbeats


def test_a_stored_heartbeat_is_acknowledged(session: Session, tokens: TokenService) -> None:
    w = welcome(session, tokens)
    session.receive(heartbeat(w, 1))
    [ack] = store_one(session, stored())
    assert (ack.seq, ack.exp_ms, ack.token, ack.flags) == (1, EXP_MS, None, 0)
    assert store_one(session, stored()) == []  # answered once


def test_a_plain_ok_the_store_answers_with_the_exp_alone_is_acknowledged(
    session: Session, tokens: TokenService
) -> None:
    """heartbeat.lua's common reply is the session's exp_ms alone (answers.HeartbeatReply):
    stored, not renewed, not leaving WARN."""
    w = welcome(session, tokens)
    session.warn()  # an integer says the session is ACTIVE now
    session.receive(heartbeat(w, 1))
    [ack] = store_one(session, EXP_MS)
    assert (ack.seq, ack.exp_ms, ack.token, ack.flags) == (1, EXP_MS, None, 0)
    assert not session.warned
    # A newer exp (renewed by another node): the client lacks that token, re-sent.
    session.receive(heartbeat(w, 2))
    [ack] = store_one(session, EXP_MS + 60_000)
    assert (ack.seq, ack.exp_ms, ack.resent, ack.renewed) == (2, EXP_MS + 60_000, True, False)
    assert ack.token is not None


def test_a_renewal_hands_over_a_new_token(
    session: Session, node: TokenNode, tokens: WallClockTokens
) -> None:
    w = welcome(session, tokens)
    session.receive(heartbeat(w, 1))
    new_exp = EXP_MS + 900_000
    [ack] = store_one(session, stored(new_exp, renewed=True))
    assert ack.renewed and not ack.resent and ack.exp_ms == new_exp and ack.token
    claims = tokens.verify(ack.token)
    assert session.claims is not None
    assert (claims.tid, claims.sub, claims.exp, claims.iat) == (
        session.claims.tid,
        "alice",
        new_exp // 1000,
        IAT_S,
    )
    # Its digest, as the store keeps a token's, is handed over once, for the store.
    assert session.take_signed_digest() == token_digest(
        tokens.keys.raw_public_key(tokens.signing_kid(IAT_S)), ack.token
    )
    assert session.take_signed_digest() == ""
    # The next heartbeat, with the new exp, needs no token.
    session.receive(heartbeat(w, 2, new_exp))
    [ack] = store_one(session, stored(new_exp))
    assert ack.token is None and ack.flags == 0
    assert session.take_signed_digest() == ""


def test_a_client_with_a_stale_exp_gets_the_token_again(
    session: Session, tokens: TokenService
) -> None:
    w = welcome(session, tokens)
    session.receive(heartbeat(w, 1))
    new_exp = EXP_MS + 900_000
    store_one(session, stored(new_exp, renewed=True))
    session.receive(heartbeat(w, 2, EXP_MS))  # its renewal ACK was "lost"
    [ack] = store_one(session, stored(new_exp))
    assert ack.resent and not ack.renewed and ack.exp_ms == new_exp and ack.token


def test_a_resume_with_an_older_token_gets_the_current_one(
    session: Session, tokens: TokenService
) -> None:
    # The token's exp is older than the session's: the first ACK re-sends.
    w = welcome(session, tokens, resumed=True, ttl_s=SESSION_S // 2)
    session.receive(heartbeat(w, 1, EXP_MS))
    [ack] = store_one(session, stored())
    assert ack.resent and ack.token
    session.receive(heartbeat(w, 2, EXP_MS))
    [ack] = store_one(session, stored())
    assert ack.token is None


def test_heartbeats_taken_together_get_an_ack_each_in_order(
    session: Session, tokens: TokenService
) -> None:
    w = welcome(session, tokens)
    session.receive(heartbeat(w, 1))
    session.receive(heartbeat(w, 2))
    new_exp = EXP_MS + 900_000
    first, second = store_one(session, stored(new_exp, renewed=True, was_warn=True))
    assert (first.seq, first.renewed, first.was_warn) == (1, True, True)
    # The second was sent before the client saw the renewal: the token again, once.
    assert (second.seq, second.renewed, second.was_warn, second.resent) == (2, False, False, True)


def test_a_heartbeat_arriving_during_the_store_call_waits_for_the_next(
    session: Session, tokens: TokenService
) -> None:
    w = welcome(session, tokens)
    session.receive(heartbeat(w, 1))
    session.take_heartbeats()
    session.receive(heartbeat(w, 2))
    [ack] = acks(session.stored(stored()))
    assert ack.seq == 1
    assert [a.seq for a in store_one(session, stored())] == [2]


@pytest.mark.parametrize(
    ("answer", "code", "reason"),
    [
        (HeartbeatAnswer(HeartbeatOutcome.TAKEN), p.CloseCode.TAKEN_OVER, "taken_over"),
        *[(HeartbeatAnswer(HeartbeatOutcome.GONE, ended=e), c, r) for e, c, r in ENDED_CLOSES],
        (HeartbeatAnswer(HeartbeatOutcome.GONE), p.CloseCode.SESSION_EXPIRED, "session_ended"),
    ],
)
def test_the_store_ends_the_session(
    session: Session, tokens: TokenService, answer: HeartbeatAnswer, code: p.CloseCode, reason: str
) -> None:
    w = welcome(session, tokens)
    session.receive(heartbeat(w, 1))
    session.take_heartbeats()
    closed(session.stored(answer), code, reason)


# WARN and recovery


def test_warn_sends_a_notice_and_ranks_the_session_last(
    session: Session, tokens: TokenService
) -> None:
    w = welcome(session, tokens)
    assert session.rank == serving_rank(5, False)
    assert p.decode(session.warn() or b"") == p.Notice()
    assert session.warned and session.rank == serving_rank(5, True)
    session.receive(heartbeat(w, 1))
    [ack] = store_one(session, stored(was_warn=True))
    assert ack.was_warn and not session.warned


def test_no_notice_before_welcome(session: Session) -> None:
    assert session.warn() is None


# A store outage


def test_heartbeats_held_through_an_outage_are_acked_then_replayed(
    session: Session, tokens: TokenService
) -> None:
    w = welcome(session, tokens)
    session.warn()
    session.receive(heartbeat(w, 1))
    session.take_heartbeats()
    [ack] = [p.decode(a) for a in session.held_back() or []]
    assert isinstance(ack, p.HeartbeatAck)
    assert (ack.seq, ack.exp_ms, ack.was_warn, ack.token) == (1, EXP_MS, True, None)
    assert session.held
    new_exp = EXP_MS + 1000
    assert session.replayed(stored(new_exp)) is None
    assert not session.held and session.exp_ms == new_exp and not session.warned


def test_a_replay_can_find_the_session_gone(session: Session, tokens: TokenService) -> None:
    w = welcome(session, tokens)
    session.receive(heartbeat(w, 1))
    session.take_heartbeats()
    session.held_back()
    answer = HeartbeatAnswer(HeartbeatOutcome.GONE, ended=Ended.REVOKED)
    closed(session.replayed(answer), p.CloseCode.TOKEN_REVOKED, "session_revoked")


# BYE, other nodes, the end


def test_bye_asks_the_store_then_closes_1000(session: Session, tokens: TokenService) -> None:
    w = welcome(session, tokens)
    assert session.receive(p.Bye()) is Ask.BYE
    assert session.receive(heartbeat(w, 1)) is None  # after BYE: nothing until the close
    closed(session.ended(), p.CloseCode.NORMAL, "bye")


def test_bye_not_confirmed_by_the_replicas_is_1013(session: Session, tokens: TokenService) -> None:
    welcome(session, tokens)
    session.receive(p.Bye())
    closed(session.bye_unconfirmed(), p.CloseCode.TRY_AGAIN_LATER, "bye_not_confirmed")


def test_bye_not_recorded_is_1013(session: Session, tokens: TokenService) -> None:
    welcome(session, tokens)
    session.receive(p.Bye())
    closed(session.store_unavailable(), p.CloseCode.TRY_AGAIN_LATER, "bye_not_recorded")


@pytest.mark.parametrize(
    ("code", "expected", "reason"),
    [
        (4505, p.CloseCode.SESSION_EXPIRED, "session_expired"),
        (4506, p.CloseCode.TOKEN_REVOKED, "session_revoked"),
        (4507, p.CloseCode.TAKEN_OVER, "taken_over"),
        (4999, p.CloseCode.INTERNAL_ERROR, "internal_error"),
        (None, p.CloseCode.INTERNAL_ERROR, "internal_error"),
    ],
)
def test_told_to_close(
    session: Session, tokens: TokenService, code: int | None, expected: p.CloseCode, reason: str
) -> None:
    welcome(session, tokens)
    closed(session.told_to_close(code), expected, reason)


# The connection's end: what the store must record (docs/protocol.md §5)


def _abandoned(session: Session) -> None:
    assert session.abandon()


def _closed_by_the_drain(session: Session) -> None:
    session.close(p.CloseCode.GOING_AWAY, "going_away")


def _bad_heartbeat(session: Session) -> None:
    session.receive(p.Heartbeat(bytes(16), 1, 0, bytes(16)))


def _shed(session: Session) -> None:
    session.close(p.CloseCode.TRY_AGAIN_LATER, "overloaded")


def _taken_at_a_heartbeat(session: Session) -> None:
    assert session.claims is not None
    w = p.make_heartbeat(session.key, session.claims.tid.bytes, 1, EXP_MS)
    session.receive(w)
    session.take_heartbeats()
    session.stored(HeartbeatAnswer(HeartbeatOutcome.TAKEN))


def _logged_out(session: Session) -> None:
    session.receive(p.Bye())
    session.ended()


def _dropped_during_bye(session: Session) -> None:
    session.receive(p.Bye())
    session.abandon()


@pytest.mark.parametrize(
    ("end", "release"),
    [
        (_abandoned, Release("")),  # the client left, the network dropped it
        (_closed_by_the_drain, Release("going_away")),  # planned: the session is parked
        (_bad_heartbeat, Release("")),
        (_shed, Release("")),
        # Dropped while its BYE is on the way: released; end.lua still takes the BYE.
        (_dropped_during_bye, Release("")),
        (_taken_at_a_heartbeat, None),
        (_logged_out, None),
        *[(lambda s, c=code: s.told_to_close(c), None) for code in (4505, 4506, 4507)],
    ],
    ids=[
        "abandoned",
        "drain",
        "bad-heartbeat",
        "shed",
        "dropped-during-bye",
        "taken",
        "bye",
        "expired",
        "revoked",
        "taken-over",
    ],
)
def test_a_connection_that_held_its_session_releases_it_unless_it_lost_it(
    session: Session,
    tokens: TokenService,
    end: Callable[[Session], object],
    release: Release | None,
) -> None:
    welcome(session, tokens)
    assert session.take_release() is None  # open: nothing yet
    end(session)
    assert session.phase is Phase.CLOSED
    assert session.take_release() == release
    assert session.take_release() is None  # asked once


def test_a_connection_closed_before_welcome_releases_nothing(
    session: Session, tokens: TokenService
) -> None:
    session.receive(p.Hello(tokens.mint("alice")))
    session.close(p.CloseCode.GOING_AWAY, "going_away")
    assert session.take_release() is None


def test_a_session_the_store_gave_after_the_close_is_released(
    session: Session, tokens: TokenService
) -> None:
    """The client gave up waiting (1013 hello_unanswered) and its HELLO was stored anyway:
    the session is released at once, not held by a connection that is gone."""
    session.receive(p.Hello(tokens.mint("alice")))
    closed(session.hello_timed_out(), p.CloseCode.TRY_AGAIN_LATER, "hello_unanswered")
    assert session.started(HelloAnswer(HelloOutcome.RESUMED, EXP_MS, IAT_S, SINCE_MS)) is None
    assert session.since_ms == SINCE_MS
    assert session.take_release() == Release("")


def test_nothing_comes_out_after_the_close(session: Session, tokens: TokenService) -> None:
    w = welcome(session, tokens)
    session.receive(heartbeat(w, 1))
    session.take_heartbeats()
    assert session.close(p.CloseCode.GOING_AWAY, "going_away") == Close(
        p.CloseCode.GOING_AWAY, "going_away"
    )
    assert session.receive(heartbeat(w, 2)) is None
    assert session.stored(stored()) is None
    assert session.held_back() is None
    assert session.warn() is None
    assert session.told_to_close(4505) is None
    assert session.malformed() is None
    assert session.close(p.CloseCode.GOING_AWAY, "again") is None
