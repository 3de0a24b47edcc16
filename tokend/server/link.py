"""A connection's session, linked to its node: the client's messages to the session core
and the store's answers back, each outcome carried out through the connection or the node.

:class:`SessionLink` is what the node sees of a connection that holds a session
(:class:`tokend.server.seams.SessionLink`); it knows its connection
(:class:`tokend.server.connection.Connection`) for writes, closes and flow control, and
the node only through :class:`tokend.server.seams.Node`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from tokend.core import protocol as p
from tokend.core.session import OVERLOADED, Ask, Close, Session, Unanswered, Welcome
from tokend.core.store_messages import HeartbeatReply, HeartbeatRequest, HelloAnswer, Known
from tokend.metrics import STAGE_SAMPLE_EVERY
from tokend.server import seams
from tokend.server.stage_sample import StageSample

if TYPE_CHECKING:
    from tokend.server.connection import Connection

_log: structlog.typing.FilteringBoundLogger = structlog.get_logger("tokend.connection")
_HEARTBEAT_TYPE = p.FrameType.HEARTBEAT.value
# As a module global: on Python 3.11 an Enum class's attribute is read through
# EnumType.__getattr__'s hook, once per heartbeat here.
_ASK_HEARTBEAT = Ask.HEARTBEAT
# Heartbeats of one connection verified and not yet answered at which its reading
# pauses until the store answers: a client keeps one out at a time, and one that sends
# faster than the store answers is held back as TCP holds back a slow reader.
READ_PAUSE_AT = 16


class SessionLink:
    """The session of one WebSocket connection, linked to the node: what the node sees of
    the connection (:class:`tokend.server.seams.SessionLink`).

    Hands the client's binary messages, decoded, to its :class:`Session`, and the node's
    answers (the store's) too; carries out what the session decides through its
    connection (frames to send, a close) and through the node
    (:class:`tokend.server.seams.Node`: a HELLO, heartbeats or a BYE to store).
    """

    __slots__ = ("connection", "heartbeat_request", "log", "node", "sample", "session")

    def __init__(self, connection: Connection, node: seams.Node, session: Session) -> None:
        self.connection = connection
        self.node = node
        self.session = session
        self.heartbeat_request: HeartbeatRequest | None = None  # the store's, once WELCOMEd
        # The session's logger (peer, conn, tid, sub), bound once at WELCOME.
        self.log: structlog.typing.FilteringBoundLogger | None = None
        # A heartbeat sampled for the stage histogram, from its verification to its ACK.
        self.sample: StageSample | None = None

    # The client's messages

    def message(self, data: bytes) -> None:
        """A binary message from the client (docs/protocol.md §3). A heartbeat is handed
        to the session as it came (Session.receive_heartbeat); any other, decoded."""
        session = self.session
        node = self.node
        # One message in STAGE_SAMPLE_EVERY has its stages timed (counted down in place).
        metrics = node.metrics
        metrics.until_sample -= 1
        if metrics.until_sample:
            sample = None
        else:
            metrics.until_sample = STAGE_SAMPLE_EVERY
            sample = StageSample()
        # p.is_heartbeat(data), inlined: one call less per heartbeat.
        if len(data) == p.HEARTBEAT_LENGTH and data[0] == _HEARTBEAT_TYPE and not data[1]:
            if sample is not None:
                sample.decode_ended()
            outcome = session.receive_heartbeat(data, node.shedder.shed_from)
            if sample is not None and outcome is _ASK_HEARTBEAT:
                sample.verify_ended()
                self.sample = sample
        else:
            try:
                frame = p.decode(data)
            except p.ProtocolError as exc:
                self.connection.log.info("malformed message", error=str(exc))
                self.connection.close_with(session.malformed())
                return
            if (
                type(frame) is p.Hello
                and session.claims is None
                and self.connection.gate.refuses_hello(frame.token)
            ):
                self.connection.close_with(session.close(p.CloseCode.TRY_AGAIN_LATER, OVERLOADED))
                return
            outcome = session.receive(frame, node.shedder.shed_from)
        if outcome is _ASK_HEARTBEAT:
            node.submit_heartbeat(self)
            if len(session.unanswered) >= READ_PAUSE_AT:
                self.connection.pause_reading()
        else:
            self.outcome(outcome)

    def outcome(self, outcome: Ask | Close | Unanswered | None) -> None:
        """Carry out what the session answered a message."""
        if outcome is Unanswered.SHED:
            self._shed()
        elif outcome is Ask.HEARTBEAT:
            self.node.submit_heartbeat(self)
            if len(self.session.unanswered) >= READ_PAUSE_AT:
                self.connection.pause_reading()
        elif outcome is Ask.START:
            self.node.submit_hello(self)
            self.connection.arm_hello_timer()
        elif outcome is Ask.BYE:
            self.node.end(self)
        elif outcome is not None:
            self.connection.close_with(outcome)

    def _shed(self) -> None:
        """The session left a heartbeat unanswered (the node sheds its class): counted, in
        the metrics and in the shedder's load. A node that sheds every class but its best
        and is still overloaded stops reading the connection for ``shed_pause`` (0: closes
        it, 1013), at most until the session's next heartbeat is due to be recorded."""
        session = self.session
        node = self.node
        assert session.claims is not None
        node.metrics.shed_heartbeats[session.claims.prio] += 1
        shedder = node.shedder
        shedder.shed_heartbeat(session.rank)
        if not shedder.saturated:
            return
        connection = self.connection
        pause = connection.gate.settings.shed_pause
        if not pause:
            connection.close_with(session.close(p.CloseCode.TRY_AGAIN_LATER, OVERLOADED))
            return
        pause = min(pause, session.recorded_from - session.clock())
        if pause > 0 and connection.hold_reading(pause):
            node.metrics.shed_pauses += 1

    # The store's answers (called by the node)

    def hello_answered(self, answer: HelloAnswer) -> None:
        match self.session.started(answer):
            case Welcome(frame):
                self._welcome(frame)
            case Ask.START:  # the store asks for the token verified first
                self.outcome(Ask.START)
            case refused:
                self.connection.close_with(refused)
                # Closed before the answer came, which gave it the session: released at once.
                self.node.release(self)

    def _welcome(self, frame: bytes) -> None:
        """The store gave this connection its session: WELCOME, and the node holds it."""
        session = self.session
        connection = self.connection
        transport = connection.transport
        if transport is not None and not transport.is_closing():
            connection.disarm()
            self.log = bound_logger(connection.peer, session)
            self.node.attach(self)
            connection.send([frame])
            # debug: in a connect storm an info line per session costs a tenth of the
            # work; SESSION_STARTED / SESSION_RESUMED on the event stream are the record.
            connection.log.debug(
                "session resumed" if session.resumed else "session started", exp=session.exp_ms
            )

    def hello_failed(self, unavailable: bool) -> None:
        if unavailable:
            self.connection.close_with(self.session.hello_lost())
            self.node.release(self)  # Redis may have run the HELLO all the same
        else:
            self.connection.close_with(
                self.session.close(p.CloseCode.INTERNAL_ERROR, "internal_error")
            )

    def heartbeats_stored(self, answer: HeartbeatReply) -> None:
        """The batch flush stored this connection's heartbeats: send their ACKs."""
        connection = self.connection
        sample = self.sample
        if sample is not None:
            sample.store_ended()
        session = self.session
        out = session.stored(answer)
        if connection.paused:
            connection.resume_reading()
        if isinstance(out, list):
            connection.send(out)
            request = self.heartbeat_request
            if session.signed_digest or (request is not None and request.token):
                self._record_signed_token()
            renewed = False
            if not isinstance(answer, int):  # not a plain OK
                if answer.was_warn:
                    connection.log.info("session recovered")
                renewed = answer.renewed
            metrics = self.node.metrics
            metrics.acked_heartbeats += len(out)
            if renewed:
                metrics.renewals += 1
            if sample is not None:
                sample.send_ended(metrics)
                self.sample = None
        elif out is not None:
            connection.close_with(out)

    def _record_signed_token(self) -> None:
        """Keep the store's copy of the token this connection was last given: the flight
        after the ACK that gave a token carries its digest, that flight only (stored
        now: this one did, if it carried it)."""
        request = self.heartbeat_request
        assert request is not None
        self.heartbeat_request = request._replace(token=self.session.take_signed_digest())

    def heartbeats_held(self) -> None:
        """The store is unavailable: ACK from what the session knows (replayed later)."""
        acks = self.session.held_back()
        connection = self.connection
        if connection.paused:
            connection.resume_reading()
        if acks:
            connection.send(acks)

    def leave(self) -> None:
        """Its node has been off Redis too long: close 1013 (settings.off_redis)."""
        self.connection.close_with(self.session.store_unavailable())

    def replayed(self, answer: HeartbeatReply) -> None:
        """A heartbeat held through an outage was stored at last."""
        self.connection.close_with(self.session.replayed(answer))

    def known(self) -> Known | None:
        """What this connection knows of its session, to restore it with should Redis have
        lost it (tokend.core.store_messages.Known); None before WELCOME."""
        session = self.session
        claims = session.claims
        if claims is None or not session.since_ms:
            return None
        return Known(
            claims.sub,
            claims.prio,
            session.iat_s,
            session.exp_ms,
            session.since_ms,
            session.next_proof,
        )

    def bye_answered(self, confirmed: bool) -> None:
        session = self.session
        self.connection.close_with(session.ended() if confirmed else session.bye_unconfirmed())

    def bye_failed(self) -> None:
        self.connection.close_with(self.session.store_unavailable())

    # Other nodes, the sweeper, the drain

    def warn(self) -> None:
        """The session entered WARN: NOTICE."""
        notice = self.session.warn()
        if notice is not None:
            self.connection.log.info("notice sent: session in WARN")
            self.connection.send([notice])

    def told_to_close(self, code: int | None) -> None:
        """The store (another node's script, a sweep) ends this session."""
        self.connection.close_with(self.session.told_to_close(code))

    def close(self, code: p.CloseCode, reason: str) -> None:
        """Close from outside the client's messages: a drain, a failed flush."""
        self.connection.close_with(self.session.close(code, reason))

    def send_close(self, close: Close | None) -> None:
        """Carry out a close the session decided (the node's planned close sends it once
        the session's release is recorded: Node.going_away)."""
        self.connection.close_with(close)


def bound_logger(peer: str, session: Session | None) -> structlog.typing.FilteringBoundLogger:
    """A logger with a connection's fields: its peer, and its session's conn, tid and sub
    as far as they are known."""
    fields = {"peer": peer}
    if session is not None:
        fields["conn"] = session.conn
        if session.claims is not None:
            fields |= {"tid": str(session.claims.tid), "sub": session.claims.sub}
    return _log.bind(**fields)
