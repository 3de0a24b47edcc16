"""One client connection speaking protocol v1, over an abstract :class:`Link`.

This module drives the spec's frame sequence (HELLO, then HEARTBEATs, then BYE
or a close) and maps every failure to its close code. It knows nothing about
websockets: ``tokend.server`` adapts a websockets connection to :class:`Link`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Protocol

import structlog

from tokend import protocol as p
from tokend.clocks import serving_rank
from tokend.store import HeartbeatRequest, HeartbeatResult, StoreUnavailable
from tokend.tokens import Claims, TokenError

if TYPE_CHECKING:
    from tokend.node import Node

_log = structlog.get_logger("tokend.session")
_conn_ids = itertools.count(1)

# Tombstone reason -> close code for a HELLO or heartbeat on an ended session.
TOMBSTONE_CODES = {
    "expired": p.CloseCode.SESSION_EXPIRED,
    "revoked": p.CloseCode.TOKEN_REVOKED,
    "closed": p.CloseCode.TOKEN_REVOKED,
}


class Link(Protocol):
    """What a session needs from its transport."""

    #: Raised by ``recv`` and ``send`` once the peer has gone away.
    closed: type[Exception]

    def recv(self) -> Awaitable[bytes | str]:
        """Next message, str for a text message (which the session refuses with 4503)."""
        ...

    def send(self, data: bytes) -> Awaitable[None]: ...

    async def close(self, code: int, reason: str) -> None: ...


class TokenBucket:
    """A rate limit: refills at ``rate`` per second and holds at most ten times that."""

    __slots__ = ("allowance", "burst", "checked", "rate")

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.burst = 10 * rate
        self.allowance = self.burst
        self.checked = time.monotonic()

    def take(self) -> bool:
        """Spend one; False when the bucket is empty (the caller is over the rate)."""
        now = time.monotonic()
        self.allowance = min(self.burst, self.allowance + (now - self.checked) * self.rate) - 1
        self.checked = now
        return self.allowance >= 0


class Close(Exception):
    """End the connection with this close code."""

    def __init__(self, code: p.CloseCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class Session:
    """Protocol state of one connection; ``conn`` names it across the cluster."""

    __slots__ = (
        "claims",
        "conn",
        "exp_ms",
        "heartbeat_request",
        "iat_s",
        "key",
        "last_seq",
        "link",
        "node",
        "peer",
        "tid_bytes",
        "token_exp_ms",
        "warned",
    )

    def __init__(self, node: Node, link: Link, peer: str) -> None:
        self.node = node
        self.link = link
        self.conn = f"{node.name}/{next(_conn_ids)}"
        self.peer = peer
        self.claims: Claims | None = None
        self.heartbeat_request: HeartbeatRequest | None = None
        self.tid_bytes = b""
        self.key = b""
        self.last_seq = 0
        self.exp_ms = 0
        self.iat_s = 0
        self.token_exp_ms = 0  # exp of the newest token this connection was given
        self.warned = False

    @property
    def log(self) -> structlog.typing.FilteringBoundLogger:
        """This connection's logger, built per line rather than kept: an idle session
        should cost little more than its socket (docs/performance.md, idle memory)."""
        fields = {"node": self.node.name, "conn": self.conn, "peer": self.peer}
        if self.claims is not None:
            fields |= {"tid": str(self.claims.tid), "sub": self.claims.sub}
        return _log.bind(**fields)

    async def run(self) -> None:
        """Serve the connection until it closes; never raises."""
        try:
            await self._hello()
            await self._serve()
        except Close as close:
            await self.close(close)
        except self.link.closed:
            self.log.info("connection dropped")
        except Exception:
            self.log.exception("session failed")
            await self.link.close(p.CloseCode.INTERNAL_ERROR, "internal error")
        finally:
            self.node.detach(self)

    @staticmethod
    def _decode(data: bytes | str) -> p.Frame:
        if isinstance(data, str):
            raise Close(p.CloseCode.PROTOCOL_ERROR, "text message")
        try:
            frame = p.decode(data)
        except p.ProtocolError as exc:
            raise Close(p.CloseCode.PROTOCOL_ERROR, str(exc)) from None
        if not isinstance(frame, p.CLIENT_FRAMES):
            raise Close(p.CloseCode.PROTOCOL_ERROR, "server frame from client")
        return frame

    async def _hello(self) -> None:
        try:
            async with asyncio.timeout(self.node.settings.hello_timeout):
                frame = self._decode(await self.link.recv())
        except TimeoutError:
            raise Close(p.CloseCode.HELLO_TIMEOUT, "no HELLO in time") from None
        if not isinstance(frame, p.Hello):
            raise Close(p.CloseCode.PROTOCOL_ERROR, "first frame must be HELLO")
        try:
            claims = self.node.tokens.verify(frame.token)
        except TokenError as exc:
            code = p.CloseCode.TOKEN_EXPIRED if exc.expired else p.CloseCode.INVALID_TOKEN
            raise Close(code, exc.reason) from None
        self.claims = claims
        cap = self.node.settings.max_sessions_per_sub
        if cap and self.node.other_sessions_of(claims.sub, claims.tid) >= cap:
            raise Close(p.CloseCode.RATE_LIMITED, "too many sessions for this sub")
        try:
            result = await self.node.store.hello(
                claims.tid, claims.sub, claims.prio, claims.iat, claims.exp, self.conn
            )
        except StoreUnavailable as exc:
            raise Close(p.CloseCode.TRY_AGAIN_LATER, "store unavailable") from exc
        if result.outcome == "tomb":
            raise Close(
                TOMBSTONE_CODES.get(result.tomb, p.CloseCode.TOKEN_REVOKED),
                f"session {result.tomb}",
            )
        if result.outcome == "expired":
            raise Close(p.CloseCode.TOKEN_EXPIRED, "token expired")
        if result.outcome == "mismatch":
            raise Close(p.CloseCode.INVALID_TOKEN, "sub does not match the session")
        self.heartbeat_request = self.node.store.heartbeat_request(
            claims.tid, self.conn, sub=claims.sub, prio=claims.prio, hello=result
        )
        self.tid_bytes = claims.tid.bytes
        self.exp_ms, self.iat_s = result.exp_ms, result.iat_s
        self.token_exp_ms = claims.exp * 1000
        self.key = os.urandom(p.SESSION_KEY_LENGTH)
        resumed = result.outcome == "resumed"
        self.node.attach(self)
        settings = self.node.settings
        await self.link.send(
            p.encode(
                p.Welcome(
                    self.tid_bytes,
                    self.exp_ms,
                    settings.ms("heartbeat_interval"),
                    settings.ms("warn_after"),
                    settings.ms("expire_after"),
                    self.key,
                    resumed=resumed,
                )
            )
        )
        self.log.info("session resumed" if resumed else "session started", exp=self.exp_ms)

    async def _serve(self) -> None:
        rate = self.node.settings.max_frame_rate
        frames = TokenBucket(rate) if rate else None
        link = self.link
        while True:
            # Awaited here, not in a helper: one coroutine frame less per idle session.
            data = await link.recv()
            received = time.perf_counter()  # the heartbeat's decode stage starts
            frame = self._decode(data)
            if frames is not None and not frames.take():
                raise Close(p.CloseCode.RATE_LIMITED, "too many frames")
            if isinstance(frame, p.Heartbeat):
                await self._heartbeat(frame, received)
            elif isinstance(frame, p.Bye):
                await self._bye()
            else:
                raise Close(p.CloseCode.PROTOCOL_ERROR, "HELLO after WELCOME")

    async def _heartbeat(self, hb: p.Heartbeat, received: float) -> None:
        decoded = time.perf_counter()
        # Spec 0x03: mac first (constant time), then tid, then seq.
        if not hb.mac_is_valid(self.key):
            raise Close(p.CloseCode.BAD_HEARTBEAT, "bad mac")
        if hb.tid != self.tid_bytes:
            raise Close(p.CloseCode.BAD_HEARTBEAT, "wrong tid")
        if hb.seq <= self.last_seq:
            raise Close(p.CloseCode.BAD_HEARTBEAT, "replayed or old seq")
        self.last_seq = hb.seq
        verified = time.perf_counter()
        assert self.claims is not None
        try:
            assert self.heartbeat_request is not None
            result = await self.node.heartbeats.submit(
                self.heartbeat_request, serving_rank(self.claims.prio, self.warned)
            )
        except StoreUnavailable:
            # Not lost: the node replays it when Redis is back. Answer from what we know.
            self.log.warning("heartbeat not yet stored: store unavailable")
            await self.link.send(
                p.encode(p.HeartbeatAck(hb.seq, self.exp_ms, was_warn=self.warned))
            )
            return
        stored = time.perf_counter()
        self.apply(result)
        # The client lacks the current token if it says so (its exp), or if it was
        # never given it on this connection (resumed with an older token).
        client_is_current = hb.exp_ms == self.exp_ms == self.token_exp_ms
        resend = not result.renewed and not client_is_current

        token = None
        if result.renewed or resend:
            token = self.node.tokens.sign(
                Claims(
                    self.claims.tid,
                    self.claims.sub,
                    self.iat_s,
                    self.exp_ms // 1000,
                    self.claims.prio,
                )
            )
            self.token_exp_ms = self.exp_ms
            # debug: at renewal-storm rates an info line per renewal costs a quarter of the
            # work; TOKEN_RENEWED on the event channel is the record of each renewal.
            self.log.debug("token renewed" if result.renewed else "token re-sent", exp=self.exp_ms)
        await self.link.send(
            p.encode(
                p.HeartbeatAck(
                    hb.seq,
                    self.exp_ms,
                    token,
                    renewed=result.renewed,
                    resent=resend,
                    was_warn=result.was_warn,
                )
            )
        )
        self.node.metrics.heartbeat(received, decoded, verified, stored, result.renewed)

    def apply(self, result: HeartbeatResult) -> None:
        """Take in the store's answer to a heartbeat (also a replayed one).

        Raises :class:`Close` when the store says the session is no longer ours.
        """
        if result.outcome == "taken":
            raise Close(p.CloseCode.TAKEN_OVER, "session taken over")
        if result.outcome == "gone":
            raise Close(
                TOMBSTONE_CODES.get(result.tomb, p.CloseCode.SESSION_EXPIRED),
                f"session {result.tomb or 'ended'}",
            )
        if result.was_warn:
            self.log.info("session recovered")
        self.warned = False
        if result.exp_ms != self.exp_ms and self.heartbeat_request is not None:
            # What the store restores the session with, should Redis lose it, is current.
            self.heartbeat_request = self.heartbeat_request.renewed(result.iat_s, result.exp_ms)
        self.exp_ms, self.iat_s = result.exp_ms, result.iat_s

    async def _bye(self) -> None:
        assert self.claims is not None
        try:
            await self.node.store.end(
                self.claims.tid, conn=self.conn, event="SESSION_CLOSED", tomb="closed", code=None
            )
        except StoreUnavailable as exc:
            # Also when the replicas did not confirm it (NotConfirmed): the client may retry.
            raise Close(
                p.CloseCode.TRY_AGAIN_LATER, "store unavailable, BYE not confirmed"
            ) from exc
        raise Close(p.CloseCode.NORMAL, "bye")

    async def notify_warn(self) -> None:
        """The session entered WARN (swept by some node): tell the client."""
        self.warned = True
        self.log.info("notice sent: session in WARN")
        await self.link.send(p.encode(p.Notice()))

    async def close(self, close: Close) -> None:
        if close.code in _ROUTINE_CLOSES:
            self.log.info("closing", code=int(close.code), reason=close.reason)
        else:
            self.log.warning("closing", code=int(close.code), reason=close.reason)
        await self.link.close(close.code, close.reason)


# Closes that are part of normal operation, logged at info rather than warning.
_ROUTINE_CLOSES = frozenset({p.CloseCode.NORMAL, p.CloseCode.GOING_AWAY, p.CloseCode.TAKEN_OVER})
