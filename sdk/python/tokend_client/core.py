"""The protocol v1 state machine of a client's session, Sans-I/O.

What happens to the connection (opened, refused, lost, a message, a close), clock ticks
and the application's logout go in; frames to send, what to do with the connection,
when to tick next and the session's :class:`Lifecycle` changes come out. Nothing here
waits, reads a clock of its own or touches a socket: :mod:`tokend_client.asyncio`
drives a :class:`ClientCore` over websockets' asyncio client, the locust user
(load_tests/locustfile.py) over websockets' sync client, and tests/test_client_core.py
from lists of frames and a fake clock.

Every rule of the client's side of the protocol (docs/protocol.md) lives here: HELLO
with the newest token, and from the first WELCOME on with the resume proof made with the
last WELCOME's session key (§2 0x01, "Resume proof", revision 2); WELCOME naming our tid
(§2 0x02); heartbeats on WELCOME's cadence with the next ``seq`` and their HMAC proof
(§2 0x03, §3); ACKs with renewed and re-sent tokens and WARN recovery (§2 0x04, §4),
NOTICE (§2 0x06, §5), BYE (§2 0x05); a server that breaks the protocol (closed 1002,
never retried); a link that stops answering (no ACK for ``warn_after``: dropped,
reconnected); which closes reconnect and which end the session with which
:mod:`~tokend_client.errors` family (§7); and how long to wait before the next
attempt (:class:`~tokend_client.backoff.Backoff`: full jitter, the first reconnect after
a 1001 spread over a window no longer than the session can spare, an HTTP 503 or 429
waited out for its ``Retry-After``).

The shell's loop, in every :class:`Phase`: send what :meth:`ClientCore.take_outgoing`
gives (frames, then perhaps a :class:`Disconnect`), hand out
:meth:`ClientCore.take_changes`, and call :meth:`ClientCore.tick` at
:attr:`ClientCore.deadline` (earlier is harmless). In CONNECT it opens a connection and
says how that went (:meth:`~ClientCore.opened`, :meth:`~ClientCore.refused`,
:meth:`~ClientCore.lost`, :meth:`~ClientCore.abandon`); on a connection (HELLO, OPEN,
CLOSING) it feeds :meth:`~ClientCore.receive` and :meth:`~ClientCore.closed`, and once
the phase is none of those it lets the connection go (closing it if still open).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import NamedTuple, Protocol

from tokend_client import protocol as p
from tokend_client.backoff import Backoff, going_away_limit, retry_after
from tokend_client.claims import TokenClaims, TokenClaimsError, read_claims
from tokend_client.errors import (
    CLIENT_SIDE_VIOLATIONS,
    AuthError,
    ProtocolViolation,
    RetriesExhausted,
    TokendError,
    classify,
    describe,
)
from tokend_client.protocol import CloseCode, SessionState


class Change(StrEnum):
    """Kinds of :class:`Lifecycle` change."""

    CONNECTED = "connected"  # WELCOME of a new session (or of one resumed at start)
    RENEWED = "renewed"  # a new token arrived (renewed, or re-sent after an exp mismatch)
    WARNED = "warned"  # NOTICE: the server missed our heartbeats, session in WARN
    RECOVERED = "recovered"  # a heartbeat brought the session back from WARN
    RECONNECTING = "reconnecting"  # connection lost or closed with a reconnectable code
    RESUMED = "resumed"  # WELCOME after a reconnect: the same session goes on
    ENDED = "ended"  # the session is over; ``error`` says why unless we logged out


@dataclass(frozen=True, slots=True)
class Lifecycle:
    """One change of a session's life.

    ``exp`` is the expiry (epoch ms) of the token the client holds at that point;
    ``code`` the close code behind a RECONNECTING or ENDED change (None: no close
    frame) and ``reason`` its close reason (tokend's are stable words, docs/protocol.md
    §7); ``delay`` the wait before the next attempt of a RECONNECTING change;
    ``token`` the new token of a RENEWED change (left out of the repr).
    """

    kind: Change
    exp: int
    code: int | None = None
    detail: str = ""
    delay: float | None = None
    error: TokendError | None = None
    token: str | None = field(default=None, repr=False)
    reason: str = ""

    @property
    def meaning(self) -> str:
        """The close code in words, for RECONNECTING and ENDED changes."""
        return describe(self.code) if self.kind in (Change.RECONNECTING, Change.ENDED) else ""


@dataclass(slots=True)
class SessionStats:
    """Counters of one session, across its connections."""

    heartbeats: int = 0  # heartbeats sent
    acks: int = 0  # heartbeat ACKs received
    renewals: int = 0  # ACKs that carried a renewed token
    reconnects: int = 0  # reconnect attempts scheduled
    last_rtt: float | None = None  # seconds from the latest ACKed heartbeat to its ACK
    max_lag: float = 0.0  # seconds the latest-sent heartbeat was behind its schedule


class Phase(Enum):
    """Where a client's session is, and so what its shell does."""

    CONNECT = "connect"  # no connection: open one now
    HELLO = "hello"  # connected, HELLO sent: WELCOME awaited until the open timeout
    OPEN = "open"  # WELCOME received: heartbeats on its cadence
    CLOSING = "closing"  # BYE sent: the server's close awaited until the close timeout
    WAITING = "waiting"  # no connection: the next attempt is due at the deadline
    ENDED = "ended"  # over for good: ``error`` says why, None after a logout


# The largest message a v1 server sends: an ACK with an 8192-byte token. A shell caps
# what its WebSocket takes at this (a larger one is the server's bug: 1009).
MAX_SERVER_MESSAGE = p.ACK_HEAD_LENGTH + p.MAX_TOKEN_LENGTH
# The phases in which the session has a connection.
ON_A_CONNECTION = frozenset({Phase.HELLO, Phase.OPEN, Phase.CLOSING})


class Disconnect(NamedTuple):
    """Let the connection go: close it with ``code`` and ``reason`` (a server that broke
    the protocol gets 1002), or, ``code`` None, abort it at once (the server stopped
    answering: a closing handshake would wait for nothing)."""

    code: int | None
    reason: str = ""


Outgoing = bytes | Disconnect


class CloseFrame(Protocol):
    """A WebSocket close frame as the shell's WebSocket reports it (websockets' ``Close``,
    from ``ConnectionClosed.rcvd`` and ``.sent``)."""

    @property
    def code(self) -> int: ...

    @property
    def reason(self) -> str: ...


# A server that broke the protocol: RFC 6455 §7.4.1's 1002.
PROTOCOL_VIOLATED = Disconnect(1002, "protocol error")
# The server stopped answering.
ABORT = Disconnect(None)


def token_claims(token: str) -> TokenClaims:
    """``(tid, sub, exp ms)`` read from a token without verifying it (the server does).

    Raises :class:`AuthError` for a token that is not a JWT with a UUID ``jti`` and an
    integer ``exp``.
    """
    try:
        return read_claims(token)
    except TokenClaimsError as exc:
        raise AuthError(None, str(exc)) from None


class _Violation(Exception):
    """The server sent something protocol v1 does not allow."""


class ClientCore:
    """The client's side of one tokend session, over as many connections as it takes.

    Always current: ``token`` (the newest), ``session_key`` (of the last WELCOME, or
    the one given; None before), ``exp`` (the token's expiry, epoch ms), ``tid``,
    ``sub``, ``state`` (ACTIVE or WARN), ``heartbeat_interval`` (seconds, None before
    the first WELCOME), ``stats``, ``phase`` and ``error`` (why it ended, once it has).

    ``clock()`` is a monotonic time in seconds, read only inside the inputs: every
    time here (deadlines, RTTs, lag) is on it. ``cadence`` replaces WELCOME's
    heartbeat interval (seconds; a load test's choice). The constructor raises
    :class:`AuthError` for a token that is not a JWT with a UUID ``jti`` and an
    ``exp``, ``ValueError`` for a session key that is not 32 bytes.

    Invariants: ``_sent`` holds, oldest first, the clock time of every heartbeat of
    this connection not yet acknowledged; outside :data:`ON_A_CONNECTION` it is empty
    and nothing received counts (it came on a connection the core has let go).
    """

    def __init__(
        self,
        token: str,
        *,
        clock: Callable[[], float],
        backoff: Backoff | None = None,
        session_key: bytes | None = None,
        open_timeout: float = 10.0,
        close_timeout: float = 5.0,
        cadence: float | None = None,
    ) -> None:
        self.tid, self.sub, self.exp = token_claims(token)
        self.token = token
        if session_key is not None and len(session_key) != p.SESSION_KEY_LENGTH:
            raise ValueError(f"a session key is {p.SESSION_KEY_LENGTH} bytes")
        self.session_key = session_key
        self.clock = clock
        self.backoff = backoff or Backoff()
        self.open_timeout = open_timeout
        self.close_timeout = close_timeout
        self.cadence = cadence
        self.phase = Phase.CONNECT
        self.state = SessionState.ACTIVE
        self.heartbeat_interval: float | None = None
        self.stats = SessionStats()
        self.error: TokendError | None = None
        self._outgoing: list[Outgoing] = []
        self._changes: list[Lifecycle] = []
        self._welcomed_once = False
        self._healthy = False  # this connection had a heartbeat ACKed
        self._failures = 0  # attempts in a row that did not reach a heartbeat ACK
        self._spare = float("inf")  # seconds a reconnect after 1001 may wait at most
        self._due = 0.0  # HELLO: the open timeout; OPEN: the next heartbeat; CLOSING, WAITING
        self._ack_timeout = 0.0  # silence after which the link counts as dead (warn_after)
        self._patient_until = 0.0  # silence is not judged before (after a late tick)
        self._seq = 0
        self._sent: dict[int, float] = {}  # seq -> clock() when sent, until ACKed

    # What the shell reads

    @property
    def connected(self) -> bool:
        """True while a connection is open and welcomed."""
        return self.phase in (Phase.OPEN, Phase.CLOSING)

    @property
    def ended(self) -> bool:
        return self.phase is Phase.ENDED

    @property
    def deadline(self) -> float | None:
        """When :meth:`tick` is due next (on ``clock``); None: only an input moves it on."""
        if self.phase is Phase.OPEN:
            silence = self._silence_deadline()
            return self._due if silence is None else min(self._due, silence)
        if self.phase in (Phase.HELLO, Phase.CLOSING, Phase.WAITING):
            return self._due
        return None

    def take_outgoing(self) -> list[Outgoing]:
        """Frames to send on the connection, in order; a :class:`Disconnect` comes last."""
        out, self._outgoing = self._outgoing, []
        return out

    def take_changes(self) -> list[Lifecycle]:
        """The lifecycle changes since the last call, in order."""
        out, self._changes = self._changes, []
        return out

    # The connection, as the shell saw it open

    def opened(self, subprotocol: str | None) -> None:
        """The connection is open, with the subprotocol the server chose: say HELLO."""
        if self.phase is not Phase.CONNECT:
            return
        if subprotocol != p.SUBPROTOCOL:
            detail = f"the server did not select subprotocol {p.SUBPROTOCOL}"
            self._end(None, detail, ProtocolViolation(None, detail))
            return
        self._healthy = False
        key = self.session_key
        proof = None if key is None else p.resume_proof(key, self.tid.bytes)
        self._outgoing.append(p.encode(p.Hello(self.token, proof=proof)))
        self.phase = Phase.HELLO
        self._due = self.clock() + self.open_timeout

    def refused(self, status: int, retry_after_header: str | None = None) -> None:
        """The opening handshake got HTTP ``status``: a 5xx or 429 is retried (not before
        its ``Retry-After``), anything else is not a tokend to talk to."""
        if self.phase is not Phase.CONNECT:
            return
        detail = f"HTTP {status} at the opening handshake"
        if status >= 500 or status == 429:
            self._retry(None, detail, asked=retry_after(retry_after_header))
        else:
            self._end(None, detail, ProtocolViolation(None, detail))

    def lost(self, detail: str) -> None:
        """No connection could be opened (refused, unreachable, the handshake broke or
        timed out): try again."""
        if self.phase is Phase.CONNECT:
            self._retry(None, detail)

    def abandon(self, error: TokendError) -> None:
        """End the session for good, for a reason the shell found (a certificate that
        cannot be trusted, a handshake refused, a failure of its own)."""
        if self.phase is not Phase.ENDED:
            self._end(error.code, error.reason, error)

    # On a connection

    def receive(self, data: bytes | str) -> None:
        """A message from the server."""
        if self.phase not in ON_A_CONNECTION:
            return
        try:
            frame = self._decode(data)
            if self.phase is Phase.HELLO:
                self._welcome(frame)
            elif isinstance(frame, p.HeartbeatAck):
                self._ack(frame)
            elif isinstance(frame, p.Notice):
                self.state = SessionState.WARN
                self._change(Change.WARNED, detail="the server missed our heartbeats")
            else:
                raise _Violation(f"unexpected {type(frame).__name__}")
        except _Violation as exc:
            violation = ProtocolViolation(None, str(exc))
            self._connection_ended(None, str(exc), violation, drop=PROTOCOL_VIOLATED)

    def closed(self, received: CloseFrame | None, sent: CloseFrame | None = None) -> None:
        """The connection closed: after the server's close frame ``received``, or without one
        (None), perhaps after a close the client's WebSocket layer ``sent`` itself because
        the server broke RFC 6455 (1002, 1007, 1009)."""
        if self.phase not in ON_A_CONNECTION:
            return
        if received is None:
            if sent is not None and sent.code in CLIENT_SIDE_VIOLATIONS:
                detail = f"closed by the client: {sent.code} {sent.reason}"
                self._connection_ended(sent.code, detail, ProtocolViolation(sent.code, detail))
            else:
                self._connection_ended(None, describe(None))
            return
        code, reason = received.code, received.reason
        family = classify(code)
        error = None if family is None else family(code, reason)
        self._connection_ended(code, describe(code), error, reason)

    def tick(self) -> None:
        """The clock moved on: what is due now happens (a heartbeat, a timeout, the next
        attempt). Safe to call at any time."""
        now = self.clock()
        if self.phase is Phase.OPEN:
            self._open_tick(now)
        elif now < self._due:
            return
        elif self.phase is Phase.HELLO:
            self._connection_ended(None, "no WELCOME in time")
        elif self.phase is Phase.CLOSING:
            detail = "no close from the server after BYE; the session may stay until it expires"
            self._end(None, detail, drop=ABORT)
        elif self.phase is Phase.WAITING:
            self.phase = Phase.CONNECT

    # The application

    def close(self) -> None:
        """Log out: BYE on the open connection, then the server's close is awaited (until
        ``close_timeout``). With no welcomed connection no BYE can be sent: the session
        ends at once, left on the server, resumable until its clocks run out."""
        if self.phase is Phase.OPEN:
            self._outgoing.append(p.encode(p.Bye()))
            self.phase = Phase.CLOSING
            self._due = self.clock() + self.close_timeout
        elif self.phase not in (Phase.CLOSING, Phase.ENDED):
            if self._welcomed_once:
                self._end(None, "closed while not connected; the session stays until it expires")
            else:
                self._end(None, "closed before a session was made")

    # Frames

    def _decode(self, data: bytes | str) -> p.ServerFrame:
        if isinstance(data, str):
            raise _Violation("text message")
        try:
            return p.decode(data)
        except p.ProtocolError as exc:
            raise _Violation(str(exc)) from None

    def _welcome(self, welcome: p.ServerFrame) -> None:
        if not isinstance(welcome, p.Welcome):
            raise _Violation(f"expected WELCOME, got {type(welcome).__name__}")
        if welcome.tid != self.tid.bytes:
            raise _Violation("WELCOME names another tid")
        self.session_key = welcome.session_key
        self._spare = going_away_limit(welcome)
        self.heartbeat_interval = self.cadence or welcome.heartbeat_ms / 1000
        self._ack_timeout = welcome.warn_ms / 1000
        self.state = SessionState.ACTIVE
        self.phase = Phase.OPEN
        if not self._welcomed_once:
            self._welcomed_once = True
            detail = "resumed an existing session" if welcome.resumed else "new session"
            self._change(Change.CONNECTED, detail=detail)
        elif welcome.resumed:
            self._change(Change.RESUMED, detail="the same session goes on")
        else:
            self._change(Change.CONNECTED, detail="the server no longer had the session: new one")
        # The first heartbeat goes at once: it picks up a renewal due now, or the current
        # token after a resume with an older one.
        self._seq = 0
        now = self.clock()
        self._due = now
        self._patient_until = now
        self._heartbeat(now)

    def _ack(self, ack: p.HeartbeatAck) -> None:
        now = self.clock()
        sent_at = self._sent.get(ack.seq)
        if sent_at is not None:
            self.stats.last_rtt = now - sent_at
        for seq in [s for s in self._sent if s <= ack.seq]:
            del self._sent[seq]
        self.stats.acks += 1
        self._healthy = True
        if ack.was_warn or self.state is SessionState.WARN:
            self.state = SessionState.ACTIVE
            self._change(Change.RECOVERED, detail="heartbeat accepted, session ACTIVE again")
        if ack.token is None:
            return
        try:
            tid, _, exp = token_claims(ack.token)
        except AuthError as exc:
            raise _Violation(f"ACK token unreadable: {exc.reason}") from None
        if tid != self.tid:
            raise _Violation("ACK token names another tid")
        self.token, self.exp = ack.token, exp
        if ack.renewed:
            self.stats.renewals += 1
            detail = "renewed"
        else:
            detail = "token re-sent (we held an older one)"
        self._change(Change.RENEWED, detail=detail, token=ack.token)

    # Heartbeats

    def _silence_deadline(self) -> float | None:
        """When the oldest unacknowledged heartbeat has waited ``warn_after``: the link is
        then dead (the server would WARN the session by now)."""
        oldest = next(iter(self._sent.values()), None)
        if oldest is None:
            return None
        return max(oldest + self._ack_timeout, self._patient_until)

    def _open_tick(self, now: float) -> None:
        """Judge the silence, then send the heartbeat if it is due.

        A late tick (the shell was blocked, e.g. an event loop busy elsewhere) has not
        seen the ACKs that came meanwhile: silence is judged only on a tick that comes on
        time, and a late one gives the frames waiting half an interval to come in first.
        """
        assert self.heartbeat_interval is not None
        half = self.heartbeat_interval / 2
        silence = self._silence_deadline()
        if silence is not None and now >= silence:
            if now - silence < half:
                detail = f"no heartbeat ACK for {self._ack_timeout:g} s"
                self._connection_ended(None, detail, drop=ABORT)
                return
            self._patient_until = now + half
        if now >= self._due:
            self._heartbeat(now)

    def _heartbeat(self, now: float) -> None:
        """Send the next heartbeat; the cadence is absolute, and a late one (blocked past
        its time) goes once and starts the cadence again from now: never a burst."""
        assert self.heartbeat_interval is not None and self.session_key is not None
        self.stats.max_lag = max(self.stats.max_lag, now - self._due)
        self._seq += 1
        self._sent[self._seq] = now
        self.stats.heartbeats += 1
        beat = p.make_heartbeat(self.session_key, self.tid.bytes, self._seq, self.exp)
        self._outgoing.append(p.encode(beat))
        self._due += self.heartbeat_interval
        if self._due <= now:
            self._due = now + self.heartbeat_interval

    # Ends of connections, and of the session

    def _connection_ended(
        self,
        code: int | None,
        detail: str,
        error: TokendError | None = None,
        reason: str = "",
        *,
        drop: Disconnect | None = None,
    ) -> None:
        """The connection is over (let go with ``drop``, if the core ends it): during a
        logout the session ends with it (no error: the application asked); otherwise a
        terminal ``error`` ends it, else reconnect."""
        if self.phase is Phase.CLOSING:
            if code == CloseCode.NORMAL:
                self._end(code, "logged out (BYE)", reason=reason, drop=drop)
            else:
                why = f"closed during logout: {detail}; the session stays until it expires"
                self._end(code, why, reason=reason, drop=drop)
        elif error is not None:
            self._end(code, detail, error, reason, drop=drop)
        else:
            self._retry(code, detail, reason, drop=drop)

    def _retry(
        self,
        code: int | None,
        detail: str,
        reason: str = "",
        *,
        asked: float | None = None,
        drop: Disconnect | None = None,
    ) -> None:
        """Schedule the next attempt (:class:`Backoff`), or give up after ``max_attempts``
        in a row; a connection that had a heartbeat ACKed starts the count again."""
        if self._healthy:
            self._failures = 0
        self._healthy = False
        limit = self.backoff.max_attempts
        if limit is not None and self._failures >= limit:
            why = f"gave up after {self._failures} reconnect attempts; last: {detail}"
            self._end(code, why, RetriesExhausted(code, why), reason, drop=drop)
            return
        if asked is not None:
            delay = self.backoff.after_refusal(self._failures, asked)
        elif code == CloseCode.GOING_AWAY:
            delay = self.backoff.after_going_away(self._failures, self._spare)
        else:
            delay = self.backoff.delay(self._failures)
        self._let_go(drop)
        self._failures += 1
        self.stats.reconnects += 1
        self.phase = Phase.WAITING
        self._due = self.clock() + delay
        attempt = f"{detail}; attempt {self._failures} in {delay:.2f} s"
        self._change(Change.RECONNECTING, code=code, detail=attempt, delay=delay, reason=reason)

    def _let_go(self, drop: Disconnect | None) -> None:
        """Forget the connection: frames not sent yet are not for the next one."""
        self._outgoing = [] if drop is None else [drop]
        self._sent.clear()

    def _end(
        self,
        code: int | None,
        detail: str,
        error: TokendError | None = None,
        reason: str = "",
        *,
        drop: Disconnect | None = None,
    ) -> None:
        self._let_go(drop)
        self.phase = Phase.ENDED
        self.error = error
        self._change(Change.ENDED, code=code, detail=detail, error=error, reason=reason)

    def _change(
        self,
        kind: Change,
        *,
        code: int | None = None,
        detail: str = "",
        delay: float | None = None,
        error: TokendError | None = None,
        token: str | None = None,
        reason: str = "",
    ) -> None:
        self._changes.append(Lifecycle(kind, self.exp, code, detail, delay, error, token, reason))
