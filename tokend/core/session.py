"""The protocol v1 state machine of one connection, Sans-I/O.

Decoded frames, the store's answers and timer events go in; frames to send, what to
ask the store, and the close (code and reason) come out. Nothing here waits, reads
a socket or talks to Redis: :mod:`tokend.server.connection` drives a :class:`Session` from
a WebSocket, ``tests/test_session.py`` from lists of frames and a fake clock.

Every check of the protocol (``docs/protocol.md``) that concerns one
connection lives here: frame order, token verification, the sub's session cap, the
frame rate, the heartbeat proof (mac, then tid, then seq), the renew / re-send
decision, WARN notice and recovery, heartbeats held through a store outage, the resume
proof a HELLO shows and the one the next resume must show (spec "Resume proof",
revision 2), what the store must record when the connection ends (its release), and
the close code of every failure (docs/protocol.md, "Close reasons").
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Literal, NamedTuple, Protocol

from tokend.core import protocol as p
from tokend.core.claims import Claims, TokenError
from tokend.core.lifecycle import RANKS, serving_rank
from tokend.core.protocol import (
    HeartbeatMacKey,
    encode_ok_ack,
    encode_plain_ack,
    heartbeat_fields,
    heartbeat_mac_key,
    heartbeat_proof_holds,
)
from tokend.core.store_messages import (
    Ended,
    HeartbeatAnswer,
    HeartbeatOutcome,
    HeartbeatReply,
    HelloAnswer,
    HelloOutcome,
)

# Tombstone -> close code, for a HELLO or heartbeat on a session that ended.
ENDED_CODES = {
    Ended.EXPIRED: p.CloseCode.SESSION_EXPIRED,
    Ended.REVOKED: p.CloseCode.TOKEN_REVOKED,
    Ended.CLOSED: p.CloseCode.TOKEN_REVOKED,
}


class Close(NamedTuple):
    """End the connection with this close code and (stable, documented) reason."""

    code: p.CloseCode
    reason: str

    @property
    def routine(self) -> bool:
        """Part of normal operation (logged at info rather than warning)."""
        return self.code in _ROUTINE_CLOSES


_ROUTINE_CLOSES = frozenset({p.CloseCode.NORMAL, p.CloseCode.GOING_AWAY, p.CloseCode.TAKEN_OVER})
# The reason of a 1013 given because the node sheds load (tokend.server.shedding).
OVERLOADED = "overloaded"
# The reason of a 1001, a planned close: the server drains, reloads or shuts down.
GOING_AWAY = "going_away"
# Closes after which the connection no longer holds its session in the store: logged out,
# ended, or taken by another connection. Nothing is released for them.
_NOT_HELD_AFTER = frozenset(
    {
        p.CloseCode.NORMAL,
        p.CloseCode.SESSION_EXPIRED,
        p.CloseCode.TOKEN_REVOKED,
        p.CloseCode.TAKEN_OVER,
    }
)


class Welcome(NamedTuple):
    """The store gave this connection its session: send the WELCOME ``frame`` (encoded)."""

    frame: bytes


class Release(NamedTuple):
    """A connection that held its session ended: the store is to record that no connection
    holds it now (docs/protocol.md §5, "When a connection ends")."""

    # The close's reason when the server itself closed it with 1001 (a planned close: drain,
    # reload, shutdown; the session is parked, tokend.core.lifecycle.parked_heartbeat); else "".
    reason: str


class Ask(Enum):
    """What a session needs from the store after a frame."""

    START = "start"  # start or resume the session of ``Session.claims``
    HEARTBEAT = "heartbeat"  # store the heartbeats in ``Session.unanswered``
    BYE = "bye"  # end the session (logout)


class Unanswered(Enum):
    """A heartbeat checked and left unanswered (spec "Shedding without closing", revision
    3): its seq is consumed, nothing is recorded, no ACK is sent, the connection stays."""

    SHED = "shed"


# since_ms of a connection whose HELLO went unanswered (the store call failed after it was
# sent): its release frees the session only if this connection holds it (release.lua).
SINCE_UNKNOWN = -1


class Phase(Enum):
    HELLO = "hello"  # waiting for HELLO
    STARTING = "starting"  # HELLO verified; the store has been asked
    OPEN = "open"  # WELCOME sent: heartbeats and BYE
    ENDING = "ending"  # BYE sent to the store
    CLOSED = "closed"  # a close was decided: nothing more comes out


class Node(Protocol):
    """The node that runs a session, as the session sees it: what it asks, answered at
    once (:class:`tokend.server.seams.Node` is the node as its connections see it)."""

    def check(self, token: str, signature: bool) -> tuple[Claims, str]:
        """The token's claims, checked (its signature too if ``signature``), and its
        digest (tokend.tokens.service.TokenService.check); raises TokenError."""
        ...

    def sign(self, claims: Claims, iat_s: int, exp_s: int) -> tuple[bytes, str]:
        """The token of ``claims`` with this iat and exp, signed: ASCII bytes, as the
        renewed ACK carries it; and its digest for the store
        (tokend.tokens.service.TokenService.reissue)."""
        ...

    def sub_is_full(self, claims: Claims) -> bool:
        """True when the token's sub may open no further session (``max_sessions_per_sub``)."""
        ...


@dataclass(frozen=True, slots=True)
class Cadence:
    """The clocks WELCOME announces, and the frame rate a connection may use."""

    heartbeat_ms: int
    warn_ms: int
    expire_ms: int
    max_frame_rate: float  # frames per second after WELCOME; 0 for no limit


class TokenBucket:
    """A rate limit: refills at ``rate`` per second and holds at most ten times that.
    Times are the caller's clock readings (seconds), ``now`` the first."""

    __slots__ = ("allowance", "burst", "checked", "rate")

    def __init__(self, rate: float, now: float) -> None:
        self.rate = rate
        self.burst = 10 * rate
        self.allowance = self.burst
        self.checked = now

    def take(self, now: float) -> bool:
        """Spend one at ``now``; False when the bucket is empty (the caller is over the rate)."""
        self.allowance = min(self.burst, self.allowance + (now - self.checked) * self.rate) - 1
        self.checked = now
        return self.allowance >= 0


class Session:
    """Protocol state of one connection; ``conn`` names it across the cluster.

    Invariants: ``unanswered`` holds, oldest first, the (seq, exp) of every heartbeat
    verified and not yet acknowledged; the first ``storing`` of them are in the
    store's hands. Once :attr:`phase` is CLOSED every input returns nothing. ``since_ms``
    is set once the store gave this connection the session.
    """

    __slots__ = (
        "cadence",
        "cadenced",
        "claims",
        "clock",
        "conn",
        "ended_by",
        "exp_ms",
        "frames",
        "held",
        "iat_s",
        "key",
        "last_beat",
        "last_seq",
        "mac_key",
        "node",
        "phase",
        "released",
        "resumed",
        "shown_proof",
        "signed_digest",
        "since_ms",
        "storing",
        "tid_bytes",
        "token_digest",
        "token_exp_ms",
        "unanswered",
        "unverified",
        "warned",
    )

    def __init__(self, node: Node, cadence: Cadence, conn: str, clock: Callable[[], float]) -> None:
        self.node = node
        self.cadence = cadence
        self.conn = conn
        self.clock = clock
        self.phase = Phase.HELLO
        self.claims: Claims | None = None
        self.tid_bytes = b""
        self.key = b""  # the session key, made at HELLO; WELCOME carries it
        # The key made ready for the heartbeats' macs, at the first (heartbeat_mac_key).
        self.mac_key: HeartbeatMacKey | None = None
        self.shown_proof: bytes | None = None  # the HELLO's resume proof, until the answer
        # The HELLO's token digest for the store, and the token while its signature is
        # unchecked (see _hello), until the answer.
        self.token_digest = ""
        self.unverified: str | None = None
        self.last_seq = 0
        # clock() at the last heartbeat recorded (given to the store), -inf before the
        # first of the connection; a shed heartbeat is checked but not recorded.
        self.last_beat = -math.inf
        self.cadenced = False  # that heartbeat came on cadence (see receive_heartbeat)
        self.exp_ms = 0  # the session's current exp, as the store last said
        self.iat_s = 0
        self.token_exp_ms = 0  # exp of the newest token this connection was given
        # That token's digest, when this node signed it, until taken for the store
        # (take_signed_digest): the next resume with it then skips the signature.
        self.signed_digest = ""
        self.resumed = False
        self.since_ms = 0  # Redis time at which this connection took the session
        self.warned = False
        self.held = False  # a heartbeat was acknowledged that the store has not recorded
        self.ended_by: Close | None = None  # the close decided; None if abandoned (or open)
        self.released = False  # take_release() was asked
        self.frames: TokenBucket | None = None
        # A tuple: an idle session holds the shared empty one, not a list of its own.
        self.unanswered: tuple[tuple[int, int], ...] = ()
        self.storing = 0

    @property
    def rank(self) -> int:
        """Serving order under overload (:func:`tokend.core.lifecycle.serving_rank`)."""
        assert self.claims is not None
        return serving_rank(self.claims.prio, self.warned)

    @property
    def batch_rank(self) -> int:
        """Order in which its waiting heartbeats are stored when more wait than one batch:
        those that came on cadence first (one heartbeat's work keeps a session alive,
        and behind floods of better-ranked sessions it would wait until the session
        expired), then the others; each by :attr:`rank`."""
        return self.rank - RANKS if self.cadenced else self.rank

    @property
    def recorded_from(self) -> float:
        """The clock() reading from which this connection's next heartbeat is recorded and
        answered whatever the shedding: half an interval after the last one recorded."""
        return self.last_beat + self.cadence.heartbeat_ms / 2000

    # Frames from the client

    def receive(self, frame: p.Frame, shed_from: int = RANKS) -> Ask | Close | Unanswered | None:
        """A decoded message from the client: what to ask the store, or how to close.

        ``shed_from`` is the node's load shedding (:mod:`tokend.server.shedding`). A HELLO
        whose token would rank there or worse is refused with 1013 before any work is
        done for it. A heartbeat of a session ranked there or worse that comes sooner
        than :attr:`recorded_from` (faster than the cadence) is checked and left
        unanswered (:attr:`Unanswered.SHED`, spec revision 3). A heartbeat at the cadence
        (the first of its connection, as clients send one on WELCOME, or half an
        interval or more after the last one recorded) is always recorded: a client that
        keeps its cadence costs one heartbeat per interval, and is never expired by
        shedding.
        """
        if isinstance(frame, p.Heartbeat):
            return self.receive_heartbeat(p.encode(frame), shed_from)
        if self.phase is Phase.OPEN:
            if self.frames is not None and not self.frames.take(self.clock()):
                return self._close(p.CloseCode.RATE_LIMITED, "too_many_frames")
            if isinstance(frame, p.Bye):
                self.phase = Phase.ENDING
                return Ask.BYE
            if isinstance(frame, p.Hello):
                return self._close(p.CloseCode.PROTOCOL_ERROR, "unexpected_frame")
            return self._close(p.CloseCode.PROTOCOL_ERROR, "unexpected_frame")
        if self.phase is Phase.HELLO:
            if isinstance(frame, p.Hello):
                return self._hello(frame, shed_from)
            if isinstance(frame, p.CLIENT_FRAMES):
                return self._close(p.CloseCode.PROTOCOL_ERROR, "hello_expected")
            return self._close(p.CloseCode.PROTOCOL_ERROR, "unexpected_frame")
        if self.phase is Phase.STARTING:
            # The client has no WELCOME yet, so nothing but HELLO was valid, once.
            return self._close(p.CloseCode.PROTOCOL_ERROR, "hello_expected")
        return None  # ENDING (BYE is being stored) or CLOSED: the close follows

    def receive_heartbeat(
        self, data: bytes, shed_from: int = RANKS
    ) -> Ask | Close | Unanswered | None:
        """A well-formed HEARTBEAT message (:func:`tokend.core.protocol.is_heartbeat`), read as
        it came: :meth:`receive` of its frame, without making one (one per interval per
        session: the server's most frequent message)."""
        if self.phase is not _OPEN:
            if self.phase is Phase.HELLO or self.phase is Phase.STARTING:
                return self._close(p.CloseCode.PROTOCOL_ERROR, "hello_expected")
            return None  # ENDING (BYE is being stored) or CLOSED: the close follows
        now = self.clock()
        frames = self.frames
        if frames is not None and not frames.take(now):
            return self._close(p.CloseCode.RATE_LIMITED, "too_many_frames")
        # On cadence: the first heartbeat on this connection, or one that comes half an
        # interval or more after the last one recorded.
        cadenced = now >= self.last_beat + self.cadence.heartbeat_ms / 2000
        shed = shed_from < RANKS and not cadenced and self.rank >= shed_from
        # Spec 0x03: the mac first (constant time), then the tid, then the seq.
        mac_key = self.mac_key
        if mac_key is None:
            mac_key = self.mac_key = heartbeat_mac_key(self.key)
        if not heartbeat_proof_holds(data, mac_key):
            return self._close(p.CloseCode.BAD_HEARTBEAT, "bad_mac")
        tid, seq, exp_ms = heartbeat_fields(data)
        if tid != self.tid_bytes:
            return self._close(p.CloseCode.BAD_HEARTBEAT, "wrong_tid")
        if seq <= self.last_seq:
            return self._close(p.CloseCode.BAD_HEARTBEAT, "old_seq")
        self.last_seq = seq
        if shed:  # checked, its seq consumed; not recorded, not answered
            return _SHED
        self.cadenced = cadenced
        self.last_beat = now
        self.unanswered += ((seq, exp_ms),)
        return _HEARTBEAT

    def malformed(self) -> Close | None:
        """A binary message that is not a protocol v1 frame (the codec refused it): 4503."""
        return self._close(p.CloseCode.PROTOCOL_ERROR, "malformed_frame")

    def text_message(self) -> Close | None:
        """Spec "Transport": every application frame is binary; a text message is 4503."""
        return self._close(p.CloseCode.PROTOCOL_ERROR, "text_message")

    def _hello(self, hello: p.Hello, shed_from: int) -> Ask | Close | None:
        """Check the token and ask the store to start or resume its session.

        A HELLO with a resume proof comes back to a session the store likely knows: its
        token is checked in every way but the signature, and the store goes on only if
        the session keeps this token's digest, the token it was last verified with
        (else it answers VERIFY, see :meth:`started`). A fresh login (no proof) is
        verified in full at once: it pays no second round trip (docs/security.md, "A
        resume skips the signature of a token the store knows").
        """
        fresh = hello.proof is None
        # While the node sheds load, a fresh login too has its claims checked first: one
        # ranked among the shed is refused before its signature costs anything (the
        # connect storm that meets a node already late), one served is verified at once.
        signature = fresh and shed_from >= RANKS
        self.unverified = None if signature else hello.token
        try:
            claims, self.token_digest = self.node.check(hello.token, signature)
        except TokenError as exc:
            # Refused with the reason a HELLO verified at once gets (its signature first).
            return self._verify() or self._refused(exc)
        self.claims = claims
        # A HELLO counts as a heartbeat: the session would be ACTIVE.
        if serving_rank(claims.prio, warned=False) >= shed_from:
            return self._close(p.CloseCode.TRY_AGAIN_LATER, OVERLOADED)
        if fresh and not signature:
            refused = self._verify()
            if refused is not None:
                return refused
        if self.node.sub_is_full(claims):
            # Told to a token whose signature verified only: it tells of others' sessions.
            return self._verify() or self._close(p.CloseCode.RATE_LIMITED, "too_many_sessions")
        # Made before the store is asked: the store keeps (a digest of) the resume proof it
        # makes, for the next resume of the session to show, on whatever node (spec "Resume
        # proof").
        self.key = os.urandom(p.SESSION_KEY_LENGTH)
        self.shown_proof = hello.proof
        self.phase = Phase.STARTING
        return Ask.START

    @property
    def verified(self) -> bool:
        """Whether the claims are those of a token whose signature was checked (or that
        the store knows): not so for a HELLO refused before its signature was."""
        return self.claims is not None and self.unverified is None

    def _refused(self, exc: TokenError) -> Close | None:
        code = p.CloseCode.TOKEN_EXPIRED if exc.expired else p.CloseCode.INVALID_TOKEN
        return self._close(code, exc.reason)

    def _verify(self) -> Close | None:
        """Verify now the signature of a token checked without it (the refusal, if any,
        is the one a HELLO verified at once would have had); None when it verified."""
        token, self.unverified = self.unverified, None
        if token is None:
            return None
        try:
            _, self.token_digest = self.node.check(token, True)
        except TokenError as exc:
            return self._refused(exc)
        return None

    @property
    def next_proof(self) -> bytes:
        """The resume proof this connection's session key makes (spec "Resume proof"): what
        the next resume of the session must show while this connection holds it live."""
        assert self.claims is not None
        return p.resume_proof(self.key, self.claims.tid.bytes)

    # The store's answers

    def started(self, answer: HelloAnswer) -> Welcome | Literal[Ask.START] | Close | None:
        """The store's answer to :attr:`Ask.START`: :class:`Welcome`, the refusal, or
        (VERIFY) :attr:`Ask.START` again once the token is verified; None once closed.

        (:meth:`stored`, on the heartbeat path, answers its ACK frames as a plain list: a
        typed wrapper would cost an object per connection per flush.)"""
        outcome = answer.outcome
        if outcome is HelloOutcome.VERIFY and self.phase is Phase.STARTING:
            # The store does not know the token: verified now, then asked again.
            return self._verify() or Ask.START
        self.shown_proof = self.unverified = None
        self.token_digest = ""
        if self.phase is not Phase.STARTING:
            if self.phase is Phase.CLOSED and outcome in _HELD:
                # The store gave this connection the session after it closed (its client
                # gave up waiting, or left): it is released (take_release).
                self.since_ms = answer.since_ms
            return None
        if outcome is HelloOutcome.IN_USE:
            return self._close(p.CloseCode.SESSION_IN_USE, "session_in_use")
        if outcome is HelloOutcome.ENDED:
            ended = answer.ended or Ended.REVOKED
            return self._close(ENDED_CODES[ended], f"session_{ended}")
        if outcome is HelloOutcome.EXPIRED:
            return self._close(p.CloseCode.TOKEN_EXPIRED, "expired")
        if outcome is HelloOutcome.MISMATCH:
            return self._close(p.CloseCode.INVALID_TOKEN, "sub_mismatch")
        assert self.claims is not None
        self.phase = Phase.OPEN
        self.resumed = outcome is HelloOutcome.RESUMED
        self.tid_bytes = self.claims.tid.bytes
        self.exp_ms, self.iat_s, self.since_ms = answer.exp_ms, answer.iat_s, answer.since_ms
        self.token_exp_ms = self.claims.exp * 1000
        if self.cadence.max_frame_rate:
            self.frames = TokenBucket(self.cadence.max_frame_rate, self.clock())
        cadence = self.cadence
        return Welcome(
            p.encode(
                p.Welcome(
                    self.tid_bytes,
                    self.exp_ms,
                    cadence.heartbeat_ms,
                    cadence.warn_ms,
                    cadence.expire_ms,
                    self.key,
                    resumed=self.resumed,
                )
            )
        )

    def take_heartbeats(self) -> None:
        """The unanswered heartbeats go to the store now (one request covers them all)."""
        self.storing = len(self.unanswered)

    def stored(self, answer: HeartbeatReply) -> list[bytes] | Close | None:
        """The store recorded the heartbeats taken: their ACKs, or the close it implies."""
        if self.phase is _CLOSED:
            return None
        if isinstance(answer, int):  # stored, nothing else changed: the common answer
            self.warned = False
            self.exp_ms = exp_ms = answer
            renewed = was_warn = False
        else:
            close = self._apply(answer)
            if close is not None:
                return close
            exp_ms, renewed, was_warn = self.exp_ms, answer.renewed, answer.was_warn
        acks = []
        token_exp_ms = self.token_exp_ms
        # The first ACK carries the renewal and the WARN recovery, if any.
        for seq, client_exp_ms in self._answered():
            # The client lacks the current token if it says so (its exp), or if it was
            # never given it on this connection (resumed with an older token).
            if renewed or client_exp_ms != exp_ms or exp_ms != token_exp_ms:
                acks.append(self._token_ack(seq, renewed, was_warn))
                token_exp_ms = exp_ms
            elif was_warn:
                acks.append(encode_plain_ack(seq, exp_ms, was_warn))
            else:
                acks.append(encode_ok_ack(seq, exp_ms))
            renewed = was_warn = False
        return acks

    def _token_ack(self, seq: int, renewed: bool, was_warn: bool) -> bytes:
        """An ACK that carries the session's current token: renewed, or re-sent."""
        claims = self.claims
        assert claims is not None
        token, self.signed_digest = self.node.sign(claims, self.iat_s, self.exp_ms // 1000)
        self.token_exp_ms = self.exp_ms
        return p.encode_ack(
            seq, self.exp_ms, token, renewed=renewed, resent=not renewed, was_warn=was_warn
        )

    def take_signed_digest(self) -> str:
        """The digest of the newest token an ACK gave, once ("" when none since): for the
        store to keep with the session (tokend.core.store_messages.HeartbeatRequest.token)."""
        digest, self.signed_digest = self.signed_digest, ""
        return digest

    def held_back(self) -> list[bytes] | None:
        """The store is unavailable: acknowledge from what is known, replay later.

        The heartbeats were received in time; the node stores them (marked as replayed,
        so not judged late) once Redis answers again.
        """
        if self.phase is Phase.CLOSED:
            return None
        self.held = True
        return [p.encode_ack(seq, self.exp_ms, was_warn=self.warned) for seq, _ in self._answered()]

    def replayed(self, answer: HeartbeatReply) -> Close | None:
        """A heartbeat held through an outage was stored at last."""
        self.held = False
        if self.phase is Phase.CLOSED:
            return None
        if isinstance(answer, int):
            self.warned = False
            self.exp_ms = answer
            return None
        return self._apply(answer)

    def _answered(self) -> tuple[tuple[int, int], ...]:
        unanswered, n = self.unanswered, self.storing
        self.storing = 0
        self.unanswered = unanswered[n:]
        return unanswered[:n]

    def _apply(self, answer: HeartbeatAnswer) -> Close | None:
        if answer.outcome is HeartbeatOutcome.TAKEN:
            return self._close(p.CloseCode.TAKEN_OVER, "taken_over")
        if answer.outcome is HeartbeatOutcome.GONE:
            if answer.ended is None:
                return self._close(p.CloseCode.SESSION_EXPIRED, "session_ended")
            return self._close(ENDED_CODES[answer.ended], f"session_{answer.ended}")
        self.warned = False
        self.exp_ms = answer.exp_ms
        if answer.iat_s:
            self.iat_s = answer.iat_s
        return None

    def ended(self) -> Close | None:
        """The store took :attr:`Ask.BYE` (logged out, or the session had already ended)."""
        return self._close(p.CloseCode.NORMAL, "bye")

    def bye_unconfirmed(self) -> Close | None:
        """The master recorded BYE, but its replicas did not confirm it in time (a failover
        may undo it, docs/scaling.md): the client is told to log out again (1013)."""
        return self._close(p.CloseCode.TRY_AGAIN_LATER, "bye_not_confirmed")

    def store_unavailable(self) -> Close | None:
        """The store could not take HELLO or BYE: the client should retry (1013).

        After BYE the logout did not happen: the session stays, and the client is told.
        """
        if self.phase is Phase.ENDING:
            return self._close(p.CloseCode.TRY_AGAIN_LATER, "bye_not_recorded")
        return self._close(p.CloseCode.TRY_AGAIN_LATER, "store_unavailable")

    def hello_lost(self) -> Close | None:
        """The store call of this connection's HELLO failed after it was sent (1013): Redis
        may have run it all the same, giving this connection the session with no answer to
        say so. Its release is owed (on ``conn`` alone: :data:`SINCE_UNKNOWN`) whether the
        connection is still open or was closed while the HELLO was out (hello_timeout, or
        the client left)."""
        self.since_ms = SINCE_UNKNOWN
        return self.store_unavailable()

    # Timers and other nodes

    def hello_timed_out(self) -> Close | None:
        """``hello_timeout`` passed: since the handshake without HELLO (4008), or since
        HELLO without the store's answer (1013). A client that gave up waiting has
        reconnected by then; its stale HELLO, stored later, would take the session over
        from its new connection."""
        if self.phase is Phase.HELLO:
            return self._close(p.CloseCode.HELLO_TIMEOUT, "hello_timeout")
        if self.phase is Phase.STARTING:
            return self._close(p.CloseCode.TRY_AGAIN_LATER, "hello_unanswered")
        return None

    def warn(self) -> bytes | None:
        """The session entered WARN (swept by some node): the client is told (NOTICE)."""
        if self.phase is not Phase.OPEN:
            return None
        self.warned = True
        return p.encode(p.Notice())

    def told_to_close(self, code: int | None) -> Close | None:
        """Another node, through the store, ends this connection's session."""
        try:
            close_code = p.CloseCode(code) if code is not None else p.CloseCode.INTERNAL_ERROR
        except ValueError:
            close_code = p.CloseCode.INTERNAL_ERROR
        return self._close(close_code, close_code.reason)

    def abandon(self) -> bool:
        """The connection is gone or failed below the protocol (the client left, the
        WebSocket layer failed it, it was dropped): nothing more comes out. True when
        this ended a session that was not closed yet."""
        if self.phase is Phase.CLOSED:
            return False
        self.phase = Phase.CLOSED
        return True

    def close(self, code: p.CloseCode, reason: str) -> Close | None:
        """Close for a reason from outside the connection (another node, a drain)."""
        return self._close(code, reason)

    def _close(self, code: p.CloseCode, reason: str) -> Close | None:
        if self.phase is Phase.CLOSED:
            return None
        self.phase = Phase.CLOSED
        self.ended_by = Close(code, reason)
        return self.ended_by

    def take_release(self) -> Release | None:
        """Once closed: what the store must record now that this connection no longer serves
        its session, asked once (docs/protocol.md §5, "When a connection ends").

        None when the store never gave it the session, or when the close says the session
        is not this connection's any more (BYE, ended, taken over). Otherwise a
        :class:`Release`: planned when the server itself closed it with 1001.
        """
        if self.phase is not Phase.CLOSED or not self.since_ms or self.released:
            return None
        self.released = True
        close = self.ended_by
        if close is None:  # abandoned: the client left, the network dropped it
            return Release("")
        if close.code in _NOT_HELD_AFTER:
            return None
        return Release(close.reason if close.code is p.CloseCode.GOING_AWAY else "")


_HELD = frozenset({HelloOutcome.STARTED, HelloOutcome.RESUMED})
# The members the heartbeat path uses, as module globals: on Python 3.11 an Enum class's
# attribute is read through EnumType.__getattr__'s hook.
_OPEN = Phase.OPEN
_CLOSED = Phase.CLOSED
_HEARTBEAT = Ask.HEARTBEAT
_SHED = Unanswered.SHED
