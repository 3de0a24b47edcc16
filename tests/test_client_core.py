"""The client core (sdk/python/tokend_client/core.py), rule by rule: no socket, no event
loop, a fake clock.

What the server says goes in as bytes made with the codec, how the connection went as
the shell would say it (opened, refused, lost, closed); what comes out is decoded back
(frames, a Disconnect), read as lifecycle changes, and timed against the fake clock
through ``deadline``. Tokens are real (signed by a WallClockTokens in tmp_path; the core
reads them without verifying). Waits are drawn by ``longest`` (the top of each range)
unless a test draws otherwise, so that every delay is exact.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
from websockets.frames import Close

from testkit.pure import FakeClock, clock, tokens
from testkit.tokens import WallClockTokens
from tokend.core import protocol as p
from tokend_client.backoff import Backoff, going_away_limit, retry_after
from tokend_client.core import ON_A_CONNECTION, Change, ClientCore, Disconnect, Lifecycle, Phase
from tokend_client.errors import (
    AuthError,
    CertificateError,
    ProtocolViolation,
    RetriesExhausted,
    Revoked,
    SessionExpired,
    TakenOver,
    TokendError,
    classify,
)
from tokend_client.protocol import CloseCode, SessionState

# WELCOME's clocks: a heartbeat a second, WARN after 3 s, expiry after 4 s. A session
# can then spare (4 - 1) / 2 = 1.5 s for a spread reconnect after 1001.
HEARTBEAT_MS, WARN_MS, EXPIRE_MS = 1_000, 3_000, 4_000
__all__ = ["clock", "tokens"]  # fixtures of testkit

SPARE_S = 1.5
KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


def longest(low: float, high: float) -> float:
    """A draw at the top of its range: the longest wait each rule allows."""
    return high


BACKOFF = Backoff(base=0.5, cap=8.0, going_away_window=5.0, draw=longest)


@pytest.fixture
def token(tokens: WallClockTokens) -> str:
    return tokens.mint("alice", ttl_s=600)


@pytest.fixture
def core(token: str, clock: FakeClock) -> ClientCore:
    return ClientCore(token, clock=clock, backoff=BACKOFF)


def sent(core: ClientCore) -> list[p.Frame | Disconnect]:
    """What the core gives the shell for the connection, frames decoded."""
    return [p.decode(o) if isinstance(o, bytes) else o for o in core.take_outgoing()]


def changes(core: ClientCore) -> list[Lifecycle]:
    return core.take_changes()


def kinds(core: ClientCore) -> list[Change]:
    return [change.kind for change in core.take_changes()]


def welcome_of(
    core: ClientCore,
    key: bytes = KEY,
    *,
    resumed: bool = False,
    heartbeat_ms: int = HEARTBEAT_MS,
    tid: bytes | None = None,
) -> bytes:
    return p.encode(
        p.Welcome(tid or core.tid.bytes, core.exp, heartbeat_ms, WARN_MS, EXPIRE_MS, key, resumed)
    )


def ack(seq: int, exp_ms: int, token: str | None = None, **flags: bool) -> bytes:
    return p.encode(p.HeartbeatAck(seq, exp_ms, token, **flags))


def hello_on_open(core: ClientCore) -> p.Hello:
    """The connection opens: the one frame the core says is its HELLO."""
    core.opened(p.SUBPROTOCOL)
    assert core.phase is Phase.HELLO
    (hello,) = sent(core)
    assert isinstance(hello, p.Hello)
    return hello


def welcomed(core: ClientCore, key: bytes = KEY, *, resumed: bool = False) -> p.Heartbeat:
    """Open, HELLO, WELCOME: the heartbeat the core sends at once."""
    hello_on_open(core)
    core.receive(welcome_of(core, key, resumed=resumed))
    assert core.phase is Phase.OPEN
    (beat,) = sent(core)
    assert isinstance(beat, p.Heartbeat)
    return beat


def until_deadline(core: ClientCore, clock: FakeClock) -> float:
    """Move the clock to the core's deadline and tick; the seconds that took."""
    deadline = core.deadline
    assert deadline is not None
    waited = deadline - clock.now
    clock.now = deadline
    core.tick()
    return waited


def reconnecting(core: ClientCore) -> Lifecycle:
    """The one RECONNECTING change the core just made (changes before it are dropped)."""
    *_, change = changes(core)
    assert change.kind is Change.RECONNECTING
    assert core.phase is Phase.WAITING
    return change


def ended(core: ClientCore) -> Lifecycle:
    *_, change = changes(core)
    assert change.kind is Change.ENDED and core.ended
    return change


# HELLO and the resume proof (spec "Resume proof", revision 2)


def test_the_first_hello_has_the_token_and_no_proof(core: ClientCore, token: str):
    assert core.phase is Phase.CONNECT and core.deadline is None
    hello = hello_on_open(core)
    assert (hello.token, hello.proof, hello.version) == (token, None, p.VERSION)


def test_every_later_hello_proves_with_the_key_of_the_last_welcome(
    core: ClientCore, clock: FakeClock
):
    welcomed(core, KEY)
    core.closed(Close(CloseCode.INTERNAL_ERROR, ""))
    until_deadline(core, clock)
    assert core.phase is Phase.CONNECT
    assert hello_on_open(core).proof == p.resume_proof(KEY, core.tid.bytes)
    # Refused 4509 (another connection holds it live): the next HELLO proves alike.
    core.closed(Close(CloseCode.SESSION_IN_USE, "session_in_use"))
    until_deadline(core, clock)
    assert hello_on_open(core).proof == p.resume_proof(KEY, core.tid.bytes)
    core.receive(welcome_of(core, OTHER_KEY, resumed=True))
    assert core.session_key == OTHER_KEY
    core.closed(None)
    until_deadline(core, clock)
    assert hello_on_open(core).proof == p.resume_proof(OTHER_KEY, core.tid.bytes)


def test_a_session_key_kept_from_before_proves_the_first_hello(token: str, clock: FakeClock):
    core = ClientCore(token, clock=clock, session_key=KEY)
    assert hello_on_open(core).proof == p.resume_proof(KEY, core.tid.bytes)
    with pytest.raises(ValueError):
        ClientCore(token, clock=clock, session_key=b"short")


def test_a_hello_after_a_renewal_has_the_newest_token(
    core: ClientCore, clock: FakeClock, tokens: WallClockTokens
):
    welcomed(core)
    renewed = renew(tokens, core.token, by_s=60)
    core.receive(ack(1, core.exp + 60_000, renewed, renewed=True))
    core.closed(Close(CloseCode.GOING_AWAY, ""))
    until_deadline(core, clock)
    assert hello_on_open(core).token == renewed


def test_a_token_that_is_not_a_jwt_is_refused_before_anything(clock: FakeClock):
    with pytest.raises(AuthError) as refused:
        ClientCore("not-a-token", clock=clock)
    assert refused.value.code is None and "not a JWT" in refused.value.reason


def test_a_server_without_the_subprotocol_is_not_spoken_to(core: ClientCore):
    core.opened(None)
    assert sent(core) == []
    change = ended(core)
    assert isinstance(change.error, ProtocolViolation)
    assert change.detail == f"the server did not select subprotocol {p.SUBPROTOCOL}"


# WELCOME


def test_welcome_connects_then_resumes(core: ClientCore, clock: FakeClock):
    welcomed(core, resumed=False)
    (connected,) = changes(core)
    assert (connected.kind, connected.detail) == (Change.CONNECTED, "new session")
    assert core.connected and core.session_key == KEY and core.heartbeat_interval == 1.0
    core.closed(Close(CloseCode.GOING_AWAY, ""))
    until_deadline(core, clock)
    welcomed(core, resumed=True)
    assert [(c.kind, c.detail) for c in changes(core)][-1] == (
        Change.RESUMED,
        "the same session goes on",
    )
    core.closed(Close(CloseCode.GOING_AWAY, ""))
    until_deadline(core, clock)
    welcomed(core, resumed=False)  # the server lost it: a new session of the same token
    assert changes(core)[-1].detail == "the server no longer had the session: new one"


def test_a_session_resumed_at_start_says_so(core: ClientCore):
    welcomed(core, resumed=True)
    assert [(c.kind, c.detail) for c in changes(core)] == [
        (Change.CONNECTED, "resumed an existing session")
    ]


@pytest.mark.parametrize(
    ("message", "detail"),
    [
        (p.encode(p.Notice()), "expected WELCOME, got Notice"),
        (b"\x09", "unknown frame type 0x09"),
        ("text", "text message"),
        (p.encode(p.Bye()), "client frame Bye from the server"),
    ],
)
def test_anything_but_welcome_first_is_a_protocol_violation(
    core: ClientCore, message: bytes | str, detail: str
):
    hello_on_open(core)
    core.receive(message)
    assert sent(core) == [Disconnect(1002, "protocol error")]
    change = ended(core)
    assert isinstance(change.error, ProtocolViolation) and change.detail == detail
    assert core.stats.reconnects == 0


def test_a_welcome_for_another_tid_is_a_protocol_violation(core: ClientCore):
    hello_on_open(core)
    core.receive(welcome_of(core, tid=os.urandom(16)))
    assert sent(core) == [Disconnect(1002, "protocol error")]
    assert ended(core).detail == "WELCOME names another tid"


def test_no_welcome_within_the_open_timeout_reconnects(token: str, clock: FakeClock):
    core = ClientCore(token, clock=clock, backoff=BACKOFF, open_timeout=7.0)
    hello_on_open(core)
    clock.now += 6.9
    core.tick()
    assert core.phase is Phase.HELLO
    assert until_deadline(core, clock) == pytest.approx(0.1)
    change = reconnecting(core)
    assert change.code is None and change.detail.startswith("no WELCOME in time")


# Heartbeats: cadence, seq, proof, exp


def test_heartbeats_keep_the_cadence_with_the_next_seq_and_their_proof(
    core: ClientCore, clock: FakeClock
):
    first = welcomed(core)  # at once after WELCOME
    beats = [first]
    for _ in range(3):
        assert until_deadline(core, clock) == pytest.approx(1.0)
        (beat,) = sent(core)
        assert isinstance(beat, p.Heartbeat)
        beats.append(beat)
        core.receive(ack(beat.seq, core.exp))
    assert [b.seq for b in beats] == [1, 2, 3, 4]
    for beat in beats:
        assert (beat.tid, beat.exp_ms) == (core.tid.bytes, core.exp)
        assert beat.mac_is_valid(KEY) and not beat.mac_is_valid(OTHER_KEY)
    assert core.stats.heartbeats == 4 and core.stats.max_lag == 0


def test_a_late_tick_sends_one_heartbeat_and_restarts_the_cadence(
    core: ClientCore, clock: FakeClock
):
    welcomed(core)
    core.receive(ack(1, core.exp))
    clock.now += 5.5  # blocked for four and a half intervals past the next heartbeat
    core.tick()
    (beat,) = sent(core)  # one, not five
    assert isinstance(beat, p.Heartbeat) and beat.seq == 2
    assert core.stats.max_lag == pytest.approx(4.5)
    assert core.deadline == pytest.approx(clock.now + 1.0)


def test_an_early_tick_sends_nothing(core: ClientCore, clock: FakeClock):
    welcomed(core)
    clock.now += 0.99
    core.tick()
    assert sent(core) == []


def test_each_connection_counts_seq_from_one(core: ClientCore, clock: FakeClock):
    welcomed(core)
    until_deadline(core, clock)
    assert [f.seq for f in sent(core) if isinstance(f, p.Heartbeat)] == [2]
    core.closed(Close(CloseCode.INTERNAL_ERROR, ""))
    until_deadline(core, clock)
    assert welcomed(core).seq == 1


def test_a_cadence_of_the_clients_own_replaces_welcomes(token: str, clock: FakeClock):
    core = ClientCore(token, clock=clock, cadence=0.25)
    welcomed(core)
    assert core.heartbeat_interval == 0.25
    assert core.deadline == pytest.approx(clock.now + 0.25)


def test_no_heartbeat_before_welcome_nor_after_bye(core: ClientCore, clock: FakeClock):
    hello_on_open(core)
    clock.now += 5
    core.tick()
    assert sent(core) == []
    core.receive(welcome_of(core))
    assert [type(f) for f in sent(core)] == [p.Heartbeat]
    core.close()
    assert sent(core) == [p.Bye()]
    clock.now += 1.0  # a heartbeat would be due
    core.tick()
    assert sent(core) == []


# ACKs: round trips, renewed and re-sent tokens


def renew(tokens: WallClockTokens, token: str, by_s: int) -> str:
    """The token of the same session, its exp later by ``by_s`` (as a renewal signs it)."""
    claims = tokens.verify(token)
    return tokens.sign(dataclasses.replace(claims, exp=claims.exp + by_s))


def test_an_ack_measures_the_round_trip(core: ClientCore, clock: FakeClock):
    welcomed(core)
    clock.now += 0.125
    core.receive(ack(1, core.exp))
    assert core.stats.acks == 1 and core.stats.last_rtt == pytest.approx(0.125)


def test_a_renewed_token_is_taken_and_the_next_heartbeat_says_its_exp(
    core: ClientCore, clock: FakeClock, tokens: WallClockTokens
):
    welcomed(core)
    changes(core)
    renewed = renew(tokens, core.token, by_s=300)
    new_exp = core.exp + 300_000
    core.receive(ack(1, new_exp, renewed, renewed=True))
    (change,) = changes(core)
    assert (change.kind, change.detail, change.token, change.exp) == (
        Change.RENEWED,
        "renewed",
        renewed,
        new_exp,
    )
    assert (core.token, core.exp, core.stats.renewals) == (renewed, new_exp, 1)
    until_deadline(core, clock)
    (beat,) = sent(core)
    assert isinstance(beat, p.Heartbeat) and beat.exp_ms == new_exp


def test_a_resent_token_replaces_a_stale_one_without_counting_a_renewal(
    core: ClientCore, tokens: WallClockTokens
):
    welcomed(core)
    changes(core)
    current = renew(tokens, core.token, by_s=120)  # the session's: our renewal ACK was lost
    core.receive(ack(1, core.exp + 120_000, current, resent=True))
    (change,) = changes(core)
    assert (change.kind, change.detail) == (Change.RENEWED, "token re-sent (we held an older one)")
    assert core.token == current and core.stats.renewals == 0


@pytest.mark.parametrize(
    ("foreign", "detail"),
    [
        ("not-a-jwt", "ACK token unreadable: not a JWT"),
        ("other-session", "ACK token names another tid"),
    ],
)
def test_an_ack_token_not_of_this_session_is_a_protocol_violation(
    core: ClientCore, tokens: WallClockTokens, foreign: str, detail: str
):
    welcomed(core)
    token = tokens.mint("alice") if foreign == "other-session" else "x.y.z"
    core.receive(ack(1, core.exp, token, renewed=True))
    assert sent(core) == [Disconnect(1002, "protocol error")]
    change = ended(core)
    assert change.detail.startswith(detail) and isinstance(change.error, ProtocolViolation)
    assert core.token != token


# NOTICE and recovery


def test_notice_warns_and_an_ack_recovers(core: ClientCore):
    welcomed(core)
    changes(core)
    core.receive(p.encode(p.Notice()))
    assert (core.state, kinds(core)) == (SessionState.WARN, [Change.WARNED])
    core.receive(ack(1, core.exp, was_warn=True))
    assert (core.state, kinds(core)) == (SessionState.ACTIVE, [Change.RECOVERED])
    core.receive(ack(2, core.exp))
    assert kinds(core) == []


def test_an_ack_saying_was_warn_recovers_without_a_notice_seen(core: ClientCore):
    welcomed(core)
    changes(core)
    core.receive(ack(1, core.exp, was_warn=True))
    assert kinds(core) == [Change.RECOVERED]


def test_a_second_welcome_is_a_protocol_violation(core: ClientCore):
    welcomed(core)
    core.receive(welcome_of(core))
    assert ended(core).detail == "unexpected Welcome"


# A link that stops answering


def test_no_ack_for_warn_after_drops_the_link_and_reconnects(core: ClientCore, clock: FakeClock):
    welcomed(core)  # heartbeat 1 at t0, never acknowledged
    waited = 0.0
    while core.phase is Phase.OPEN:
        waited += until_deadline(core, clock)
    assert waited == pytest.approx(WARN_MS / 1000)  # exactly warn_after after heartbeat 1
    assert sent(core)[-1] == Disconnect(None)
    change = reconnecting(core)
    assert change.code is None and change.detail.startswith("no heartbeat ACK for 3 s")


def test_acks_keep_a_slow_link(core: ClientCore, clock: FakeClock):
    welcomed(core)
    for seq in range(2, 12):
        clock.now += 1.0
        core.receive(ack(seq - 1, core.exp))  # each ACK a whole interval late
        core.tick()
    assert core.phase is Phase.OPEN and core.stats.acks == 10


def test_a_late_tick_does_not_judge_the_silence_before_the_frames_that_came_meanwhile(
    core: ClientCore, clock: FakeClock
):
    welcomed(core)
    clock.now += 10.0  # blocked: the ACK of heartbeat 1 waits in the socket
    core.tick()
    assert core.phase is Phase.OPEN
    assert [type(f) for f in sent(core)] == [p.Heartbeat]
    core.receive(ack(2, core.exp))  # read once the shell runs again
    clock.now += 0.5
    core.tick()
    assert core.phase is Phase.OPEN and Disconnect(None) not in sent(core)


def test_a_late_tick_still_drops_a_link_that_stays_silent(core: ClientCore, clock: FakeClock):
    welcomed(core)
    clock.now += 10.0
    core.tick()
    sent(core)
    assert until_deadline(core, clock) == pytest.approx(0.5)  # half an interval's patience
    assert sent(core) == [Disconnect(None)]
    assert reconnecting(core).detail.startswith("no heartbeat ACK")


# BYE and the end of a logout


def test_bye_then_the_servers_close_logs_out(core: ClientCore):
    welcomed(core)
    core.close()
    assert sent(core) == [p.Bye()] and core.phase is Phase.CLOSING
    core.closed(Close(CloseCode.NORMAL, "bye"))
    change = ended(core)
    assert (change.code, change.detail, change.error, change.reason) == (
        1000,
        "logged out (BYE)",
        None,
        "bye",
    )


def test_acks_during_a_logout_still_count(core: ClientCore, tokens: WallClockTokens):
    welcomed(core)
    core.close()
    renewed = renew(tokens, core.token, by_s=60)
    core.receive(ack(1, core.exp + 60_000, renewed, renewed=True))
    assert core.token == renewed


def test_no_close_after_bye_gives_up_at_the_close_timeout(token: str, clock: FakeClock):
    core = ClientCore(token, clock=clock, close_timeout=2.0)
    welcomed(core)
    core.close()
    sent(core)
    assert until_deadline(core, clock) == pytest.approx(2.0)
    assert sent(core) == [Disconnect(None)]
    change = ended(core)
    assert change.error is None and change.detail.startswith("no close from the server after BYE")


def test_a_logout_ended_by_another_close_has_no_error(core: ClientCore):
    welcomed(core)
    core.close()
    core.closed(Close(CloseCode.TOKEN_REVOKED, "session_revoked"))
    change = ended(core)
    assert change.error is None and core.error is None
    assert change.detail.startswith("closed during logout: token revoked")


def test_a_close_before_any_welcome_sends_nothing(core: ClientCore, clock: FakeClock):
    core.close()
    assert sent(core) == [] and ended(core).detail == "closed before a session was made"
    core.tick()
    core.close()
    assert sent(core) == [] and changes(core) == []


def test_a_close_while_reconnecting_leaves_the_session_resumable(
    core: ClientCore, clock: FakeClock
):
    welcomed(core)
    core.closed(Close(CloseCode.GOING_AWAY, ""))
    core.close()
    assert sent(core) == [] and core.deadline is None
    assert ended(core).detail == "closed while not connected; the session stays until it expires"


# Which closes end the session, and with which error


@pytest.mark.parametrize("code", sorted(p.RECONNECTABLE))
def test_reconnectable_codes_reconnect(core: ClientCore, code: int):
    welcomed(core)
    core.closed(Close(code, "why"))
    change = reconnecting(core)
    assert (change.code, change.reason, change.error) == (code, "why", None)
    assert change.meaning == CloseCode(code).describe()


@pytest.mark.parametrize(
    ("code", "family"),
    [
        (4501, AuthError),
        (4502, AuthError),
        (4503, ProtocolViolation),
        (4504, ProtocolViolation),
        (4505, SessionExpired),
        (4506, Revoked),
        (4507, TakenOver),
        (1009, ProtocolViolation),
        (1000, TokendError),  # a logout we did not ask for
        (4999, TokendError),
    ],
)
def test_terminal_codes_end_with_their_family(
    core: ClientCore, code: int, family: type[TokendError]
):
    welcomed(core)
    core.closed(Close(code, "reason_word"))
    change = ended(core)
    assert type(change.error) is family and change.error is core.error
    assert (change.error.code, change.error.reason, change.reason) == (
        code,
        "reason_word",
        "reason_word",
    )
    assert core.stats.reconnects == 0


def test_a_refused_hello_is_terminal_too(core: ClientCore):
    hello_on_open(core)
    core.closed(Close(CloseCode.INVALID_TOKEN, "bad_signature"))
    assert isinstance(ended(core).error, AuthError)


def test_a_lost_connection_reconnects(core: ClientCore):
    welcomed(core)
    core.closed(None)
    change = reconnecting(core)
    assert change.code is None and change.detail.startswith("connection lost")


def test_a_close_the_clients_websocket_sent_on_a_broken_frame_is_terminal(core: ClientCore):
    welcomed(core)
    core.closed(None, sent=Close(1009, "over size limit"))
    change = ended(core)
    assert isinstance(change.error, ProtocolViolation) and change.code == 1009
    assert change.detail == "closed by the client: 1009 over size limit"


def test_what_the_shell_found_ends_the_session(core: ClientCore):
    core.abandon(CertificateError(None, "the server's certificate is not trusted: x"))
    change = ended(core)
    assert isinstance(change.error, CertificateError)
    assert change.detail == "the server's certificate is not trusted: x"


def test_a_connection_let_go_says_nothing_more(core: ClientCore, clock: FakeClock):
    welcomed(core)
    while core.phase is Phase.OPEN:  # heartbeats, never acknowledged: dropped
        until_deadline(core, clock)
    changes(core)
    assert sent(core) == [Disconnect(None)]
    for late in (ack(1, core.exp), p.encode(p.Notice()), b"\x09"):
        core.receive(late)
    core.closed(Close(CloseCode.TOKEN_REVOKED, ""))
    assert (sent(core), changes(core), core.phase) == ([], [], Phase.WAITING)


def test_frames_not_sent_before_the_connection_closed_are_not_for_the_next(
    core: ClientCore, clock: FakeClock
):
    hello_on_open(core)
    core.receive(welcome_of(core))  # its first heartbeat waits to be sent ...
    core.closed(Close(CloseCode.INTERNAL_ERROR, ""))  # ... when the connection closes
    until_deadline(core, clock)
    assert sent(core) == []
    hello_on_open(core)  # the HELLO alone


def test_the_close_codes_map_to_reconnect_or_an_error_family():
    for code in p.RECONNECTABLE:
        assert classify(code) is None
    assert classify(None) is None
    assert classify(CloseCode.INVALID_TOKEN) is AuthError
    assert classify(CloseCode.TOKEN_EXPIRED) is AuthError
    assert classify(CloseCode.SESSION_EXPIRED) is SessionExpired
    assert classify(CloseCode.TOKEN_REVOKED) is Revoked
    assert classify(CloseCode.TAKEN_OVER) is TakenOver
    for violation in (CloseCode.MESSAGE_TOO_BIG, CloseCode.PROTOCOL_ERROR, CloseCode.BAD_HEARTBEAT):
        assert classify(violation) is ProtocolViolation
    assert classify(CloseCode.SESSION_IN_USE) is None  # 4509: another connection holds it
    assert classify(1000) is TokendError
    assert classify(4999) is TokendError
    assert str(Revoked(4506, "session revoked")) == "4506 token revoked: session revoked"


# The reconnect decision and its delay


def test_reconnects_back_off_exponentially_with_full_jitter_up_to_the_cap(
    core: ClientCore, clock: FakeClock
):
    delays = []
    for _ in range(7):
        core.lost("cannot connect: refused")
        change = reconnecting(core)
        assert change.delay is not None and core.deadline == clock.now + change.delay
        delays.append(until_deadline(core, clock))
        assert change.delay == delays[-1] and core.phase is Phase.CONNECT
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]  # the ceilings: draws at the top
    assert core.stats.reconnects == 7
    assert change.detail == "cannot connect: refused; attempt 7 in 8.00 s"


def test_the_jitter_is_full_from_zero(token: str, clock: FakeClock):
    bounds: list[float] = []

    def shortest_noted(low: float, high: float) -> float:
        bounds.append(high)
        return low

    shortest = Backoff(base=0.5, cap=8.0, draw=shortest_noted)
    core = ClientCore(token, clock=clock, backoff=shortest)
    for _ in range(3):
        core.lost("refused")
        assert reconnecting(core).delay == 0.0
        core.tick()  # a wait of 0: the next attempt is due at once
        assert core.phase is Phase.CONNECT
    assert bounds == [0.5, 1.0, 2.0]


def test_a_wait_is_not_cut_short(core: ClientCore, clock: FakeClock):
    core.lost("refused")
    clock.now += 0.49
    core.tick()
    assert core.phase is Phase.WAITING


def test_the_count_starts_again_after_an_ack_not_at_welcome(core: ClientCore, clock: FakeClock):
    for _ in range(3):
        core.lost("refused")
        until_deadline(core, clock)
    welcomed(core)
    core.closed(Close(CloseCode.INTERNAL_ERROR, ""))  # welcomed, then failed at once: no reset
    assert reconnecting(core).delay == 4.0
    until_deadline(core, clock)
    welcomed(core)
    core.receive(ack(1, core.exp))
    core.closed(Close(CloseCode.INTERNAL_ERROR, ""))
    assert reconnecting(core).delay == 0.5


def test_max_attempts_in_a_row_then_it_gives_up(token: str, clock: FakeClock):
    core = ClientCore(token, clock=clock, backoff=Backoff(max_attempts=2, draw=longest))
    for _ in range(2):
        core.lost("cannot connect: refused")
        until_deadline(core, clock)
    core.lost("cannot connect: refused")
    change = ended(core)
    assert isinstance(change.error, RetriesExhausted) and change.code is None
    assert change.detail == "gave up after 2 reconnect attempts; last: cannot connect: refused"
    assert core.stats.reconnects == 2


def test_after_1001_the_first_reconnect_spreads_over_what_the_session_can_spare(
    core: ClientCore, clock: FakeClock
):
    welcomed(core)
    welcome = p.decode(welcome_of(core))
    assert isinstance(welcome, p.Welcome) and going_away_limit(welcome) == SPARE_S
    core.closed(Close(CloseCode.GOING_AWAY, "going_away"))
    # The window is 5 s, but the session can spare 1.5 s only.
    assert reconnecting(core).delay == SPARE_S


def test_after_1001_the_window_applies_when_the_session_can_spare_it(token: str, clock: FakeClock):
    core = ClientCore(token, clock=clock, backoff=dataclasses.replace(BACKOFF, going_away_window=1))
    welcomed(core)
    core.closed(Close(CloseCode.GOING_AWAY, ""))
    assert reconnecting(core).delay == 1.0


def test_after_1001_the_wait_is_never_shorter_than_the_attempts_backoff(
    core: ClientCore, clock: FakeClock
):
    for _ in range(5):
        core.lost("refused")
        until_deadline(core, clock)
    welcomed(core)
    core.closed(Close(CloseCode.GOING_AWAY, ""))
    assert reconnecting(core).delay == 8.0  # attempt 5's ceiling, above the 1.5 s spare


def test_before_any_welcome_a_1001_spreads_over_the_whole_window(core: ClientCore):
    hello_on_open(core)
    core.closed(Close(CloseCode.GOING_AWAY, ""))
    assert reconnecting(core).delay == 5.0


def test_a_503_with_retry_after_is_waited_out_jittered(core: ClientCore, clock: FakeClock):
    core.refused(503, "2")
    change = reconnecting(core)
    assert change.code is None and change.detail.startswith("HTTP 503 at the opening handshake")
    assert change.delay == 4.0  # 2 s, plus at most as long again
    assert until_deadline(core, clock) == 4.0


def test_a_429_with_retry_after_is_waited_out_too(token: str, clock: FakeClock):
    shortest = dataclasses.replace(BACKOFF, draw=lambda low, high: low)
    core = ClientCore(token, clock=clock, backoff=shortest)
    core.refused(429, " 3 ")
    assert reconnecting(core).delay == 3.0  # never sooner than asked


def test_a_503_without_retry_after_backs_off_as_usual(core: ClientCore):
    core.refused(503, "Wed, 21 Oct 2015 07:28:00 GMT")  # an HTTP-date: not read
    assert reconnecting(core).delay == 0.5


def test_other_http_refusals_are_terminal(core: ClientCore):
    core.refused(403)
    change = ended(core)
    assert isinstance(change.error, ProtocolViolation)
    assert change.detail == "HTTP 403 at the opening handshake"


def test_only_a_connection_attempt_can_be_refused_or_lost(core: ClientCore):
    welcomed(core)
    core.refused(503)
    core.lost("stale")
    assert core.phase is Phase.OPEN and core.phase in ON_A_CONNECTION


# Backoff itself, with the real random draw


def test_backoff_is_full_jitter_exponential_and_capped():
    backoff = Backoff(base=0.5, cap=4.0)
    assert [backoff.ceiling(n) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff.ceiling(100_000) == 4.0
    draws = [backoff.delay(2) for _ in range(4000)]
    assert all(0.0 <= d <= 2.0 for d in draws)
    assert 0.9 < sum(draws) / len(draws) < 1.1  # uniform(0, 2) has mean 1
    assert min(draws) < 0.1 and max(draws) > 1.9
    with pytest.raises(ValueError):
        Backoff(base=0)
    with pytest.raises(ValueError):
        Backoff(base=2, cap=1)


def test_after_going_away_the_wait_spreads_over_the_window_the_session_can_spare():
    backoff = Backoff(base=0.5, cap=30.0, going_away_window=5.0)
    draws = [backoff.after_going_away(0) for _ in range(4000)]
    assert all(0.0 <= d <= 5.0 for d in draws)
    assert 2.3 < sum(draws) / len(draws) < 2.7  # uniform(0, 5) has mean 2.5
    assert min(draws) < 0.1 and max(draws) > 4.9
    # No longer than the session can spare (from WELCOME's clocks) ...
    assert max(backoff.after_going_away(0, limit=0.5) for _ in range(1000)) <= 0.5
    # ... but never less patient than the attempt's own backoff.
    assert max(backoff.after_going_away(8, limit=0.5) for _ in range(1000)) > 25.0
    assert Backoff(going_away_window=0).after_going_away(0) <= 0.5
    with pytest.raises(ValueError):
        Backoff(going_away_window=-1)


def test_a_refusal_with_retry_after_waits_at_least_that_long_jittered():
    backoff = Backoff(base=0.5, cap=30.0)
    draws = [backoff.after_refusal(0, 2.0) for _ in range(4000)]
    assert all(2.0 <= d <= 4.0 for d in draws)  # 2 s, plus up to 2 s more
    assert min(draws) < 2.1 and max(draws) > 3.9
    assert all(1.0 <= backoff.after_refusal(4, 1.0) <= 9.0 for _ in range(100))  # ceiling 8
    assert 3600.0 <= backoff.after_refusal(0, 3600.0) <= 7200.0  # above cap too: as asked
    assert (retry_after("1"), retry_after(" 120 "), retry_after(None)) == (1.0, 120.0, None)
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None  # HTTP-dates: backoff
    assert retry_after("²") is None and retry_after("-1") is None and retry_after("") is None
