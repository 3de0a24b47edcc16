"""Python client SDK for tokend protocol v1 (asyncio).

::

    from tokend.client import connect

    async with connect("ws://127.0.0.1:8765/v1/ws", token) as session:
        async for change in session.changes():
            print(change.kind, session.state.name, session.exp)

A :class:`Session` says HELLO, keeps the heartbeat cadence the server gave in
WELCOME (each heartbeat carrying its HMAC proof and the next ``seq``), takes in
renewed tokens (``session.token`` and ``session.exp`` are always the newest),
follows WARN notices, and reports every step as a :class:`Lifecycle` change.

On the close codes the spec marks reconnectable (1001, 1011, 1013, 4008, 4029,
4509) and on network loss it reconnects with full-jitter exponential backoff
(:class:`Backoff`) and resumes with its newest token, proving with the session key
of its last WELCOME that it is the session's rightful client (spec "Resume proof",
revision 2). After a 1001 (the server drains, reloads or stops) the first reconnect
is spread over a window, and an HTTP 503 or 429 with ``Retry-After`` is honoured,
so that the clients of a restarting server do not all come back at once. Any
other close ends the session for good with a :class:`TokendError` subclass naming
the family: :class:`AuthError`, :class:`SessionExpired`, :class:`Revoked` (and
:class:`TakenOver`), :class:`ProtocolViolation`, :class:`CertificateError`.

The frames come from :mod:`tokend.protocol`. This is the only client-side module
that imports websockets' asyncio client. See ``docs/client.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import ssl as ssl_module
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import StrEnum
from types import TracebackType

import jwt
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidMessage,
    InvalidStatus,
)
from websockets.typing import Subprotocol
from websockets.uri import parse_uri

from tokend import protocol as p
from tokend.protocol import CloseCode, SessionState

# The largest frame a v1 server sends is an ACK with an 8192-byte token.
MAX_SERVER_MESSAGE = p.ACK_HEAD_LENGTH + p.MAX_TOKEN_LENGTH
# Close codes the client itself sends when the server breaks the protocol.
_CLIENT_SIDE_VIOLATIONS = frozenset({1002, 1007, 1009})


# Errors


class TokendError(Exception):
    """Why a session ended for good.

    ``code`` is the close code that decided it, or None when no close frame did
    (a malformed frame, a refused handshake, reconnect attempts used up). ``reason``
    is then the close frame's reason (tokend's are stable words, docs/protocol.md §7,
    e.g. "bad_signature"), or else what went wrong, in words.
    """

    def __init__(self, code: int | None, reason: str = "") -> None:
        self.code = code
        self.reason = reason
        super().__init__(code, reason)

    @property
    def meaning(self) -> str:
        """The close code in words, e.g. "token revoked"; the reason when there is no code."""
        return self.reason if self.code is None else describe(self.code)

    def __str__(self) -> str:
        if self.code is None:
            return self.reason
        head = f"{self.code} {self.meaning}"
        return f"{head}: {self.reason}" if self.reason and self.reason != self.meaning else head


class AuthError(TokendError):
    """The token was refused: 4501 invalid token, 4502 token expired at HELLO. Get a new one."""


class SessionExpired(TokendError):
    """4505: the session expired (heartbeats missed, or the token's exp passed)."""


class Revoked(TokendError):
    """4506: the token was revoked, or its session logged out (BYE) elsewhere."""


class TakenOver(Revoked):
    """4507: a newer connection resumed this session; this one stops."""


class ProtocolViolation(TokendError):
    """1009, 4503, 4504, or a server that does not speak protocol v1: a bug, not retried."""


class CertificateError(TokendError):
    """The server's TLS certificate failed verification (unknown CA, wrong host name,
    expired): not retried, since trying again cannot make it trusted. ``ca_file`` (or an
    ``ssl`` context) names what to trust."""


class RetriesExhausted(TokendError):
    """``Backoff.max_attempts`` reconnect attempts in a row failed; ``code`` is the last one."""


_TERMINAL: dict[int, type[TokendError]] = {
    CloseCode.INVALID_TOKEN: AuthError,
    CloseCode.TOKEN_EXPIRED: AuthError,
    CloseCode.SESSION_EXPIRED: SessionExpired,
    CloseCode.TOKEN_REVOKED: Revoked,
    CloseCode.TAKEN_OVER: TakenOver,
    CloseCode.MESSAGE_TOO_BIG: ProtocolViolation,
    CloseCode.PROTOCOL_ERROR: ProtocolViolation,
    CloseCode.BAD_HEARTBEAT: ProtocolViolation,
    **{code: ProtocolViolation for code in _CLIENT_SIDE_VIOLATIONS},
}


def classify(code: int | None) -> type[TokendError] | None:
    """The error family a close ends the session with; None when it invites a reconnect.

    None (no close frame: the network or the server process went away) and the
    spec's reconnectable codes reconnect. Codes outside the spec's table are
    terminal too, as plain :class:`TokendError`.
    """
    if code is None or code in p.RECONNECTABLE:
        return None
    return _TERMINAL.get(code, TokendError)


def describe(code: int | None) -> str:
    """A close code in words; None is a connection lost without a close frame."""
    if code is None:
        return "connection lost"
    try:
        return CloseCode(code).describe()
    except ValueError:
        return f"close code {code}"


# Configuration and reports


@dataclass(frozen=True, slots=True)
class Backoff:
    """Full-jitter exponential backoff between reconnect attempts.

    Attempt ``n`` (0 for the first retry) waits ``uniform(0, min(cap, base * 2**n))``
    seconds. The count starts again once a connection has had a heartbeat
    acknowledged. ``max_attempts`` bounds failed attempts in a row (None: retry
    for as long as the failures are reconnectable; a terminal code always stops).

    Two refusals say more than "try again" and are waited out longer, so that the
    clients of a restarting server do not come back all at once:

    - a close 1001 (the server drains, reloads or stops: all its clients at once)
      waits ``uniform(0, going_away_window)`` (:meth:`after_going_away`);
    - an HTTP 503 or 429 with ``Retry-After`` waits those seconds and more
      (:meth:`after_refusal`).
    """

    base: float = 0.5
    cap: float = 30.0
    max_attempts: int | None = None
    going_away_window: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.base <= self.cap:
            raise ValueError("backoff needs 0 < base <= cap")
        if self.max_attempts is not None and self.max_attempts < 0:
            raise ValueError("max_attempts must be None or >= 0")
        if self.going_away_window < 0:
            raise ValueError("going_away_window must be >= 0")

    def ceiling(self, attempt: int) -> float:
        """The longest wait of attempt ``attempt``."""
        return min(self.cap, self.base * 2.0 ** min(attempt, 64))

    def delay(self, attempt: int) -> float:
        """A random wait for attempt ``attempt``, in seconds."""
        return random.uniform(0.0, self.ceiling(attempt))

    def after_going_away(self, attempt: int, limit: float = float("inf")) -> float:
        """The wait after a close 1001: uniform over ``going_away_window`` (at most
        ``limit``: what the session can spare), or over the attempt's ceiling if longer."""
        return random.uniform(0.0, max(min(self.going_away_window, limit), self.ceiling(attempt)))

    def after_refusal(self, attempt: int, retry_after: float) -> float:
        """The wait after an HTTP refusal that said ``Retry-After``: never sooner than its
        seconds, plus a random share of as long again (or of the attempt's ceiling, if
        longer) so that the clients refused together do not return together."""
        return retry_after + random.uniform(0.0, max(retry_after, self.ceiling(attempt)))


def going_away_limit(welcome: p.Welcome) -> float:
    """The most seconds a first reconnect after 1001 may wait: half of what the session of
    ``welcome`` has left at worst when the close comes (expire_after, less the heartbeat
    interval it may already be behind), so that a spread reconnect cannot expire it."""
    return (welcome.expire_ms - welcome.heartbeat_ms) / 2000


def retry_after(value: str | None) -> float | None:
    """The seconds of a ``Retry-After`` header (RFC 9110 §10.2.3, delay-seconds; tokend
    sends those); None when absent or not a number of seconds (an HTTP-date)."""
    if value is None:
        return None
    value = value.strip()
    # isascii(): str.isdigit() also accepts digits such as "²" that int() refuses.
    return float(value) if value.isascii() and value.isdigit() else None


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
    """One change of a session's life, as yielded by :meth:`Session.changes`.

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


@dataclass(frozen=True, slots=True)
class _End:
    """How one connection ended: its close code, words for it, the error if terminal,
    the close frame's reason, and the seconds of the Retry-After of a refused handshake."""

    code: int | None
    detail: str
    error: TokendError | None = None
    reason: str = ""
    retry_after: float | None = None


class _Violation(Exception):
    """The server sent something protocol v1 does not allow."""


def _tls_context(
    secure: bool, ca_file: str | os.PathLike[str] | None, context: ssl_module.SSLContext | None
) -> ssl_module.SSLContext | None:
    """The TLS context of a session's connections, None for ``ws://``. Without options,
    the server's certificate and host name are verified against the system's CAs."""
    if ca_file is not None and context is not None:
        raise ValueError("give ca_file or ssl, not both")
    if not secure:
        if ca_file is not None or context is not None:
            raise ValueError("ca_file and ssl are for wss:// URLs")
        return None
    if context is not None:
        return context
    return ssl_module.create_default_context(cafile=None if ca_file is None else os.fspath(ca_file))


def _token_claims(token: str) -> tuple[uuid.UUID, str, int]:
    """``(tid, sub, exp ms)`` read from a token without verifying it (the server does)."""
    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError as exc:
        raise AuthError(None, f"not a JWT: {exc}") from None
    try:
        tid = uuid.UUID(claims["jti"])
    except (KeyError, TypeError, ValueError, AttributeError):
        raise AuthError(None, "the token's jti is not a UUID") from None
    exp = claims.get("exp")
    if not isinstance(exp, int) or isinstance(exp, bool):
        raise AuthError(None, "the token has no integer exp claim")
    return tid, str(claims.get("sub", "")), exp * 1000


# The session


class Session:
    """A tokend session held open over as many connections as it takes.

    Use it as ``async with Session(url, token) as session:`` (or
    :func:`connect`), or call :meth:`start` and :meth:`close` yourself. Entering
    waits for the first WELCOME and raises the :class:`TokendError` if the
    session cannot start; leaving sends BYE (logout).

    Attributes, always current: ``token`` (the newest token), ``session_key`` (the
    session key of the last WELCOME, None before the first), ``exp`` (the token's
    expiry, epoch ms), ``tid`` (the token id), ``sub``, ``state`` (ACTIVE or WARN),
    ``heartbeat_interval`` (seconds, from WELCOME), ``stats``, and ``error`` (why
    it ended, once it has).

    Every HELLO after a WELCOME carries the resume proof made with ``session_key``
    (spec "Resume proof"): a session whose connection the server still holds live
    goes to the client that proves, and a HELLO with the token alone is refused 4509
    meanwhile. A program that keeps a session across its own restarts keeps
    ``session_key`` beside ``token`` and passes both back (``session_key=``).

    ``wss://`` URLs verify the server's certificate against the system's trusted CAs,
    or against ``ca_file`` (a PEM file) if given; ``ssl`` is a context of your own
    instead (client certificates, pinning).

    The constructor only checks its arguments: :class:`AuthError` for a token
    that is not a JWT with a UUID ``jti`` and an ``exp``,
    ``websockets.exceptions.InvalidURI`` for a bad URL, ``ValueError`` for TLS
    options with a ``ws://`` URL or a session key that is not 32 bytes,
    ``OSError``/``ssl.SSLError`` for a CA file that cannot be read. Nothing connects
    before :meth:`open` or :meth:`start`.
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        backoff: Backoff | None = None,
        open_timeout: float = 10.0,
        close_timeout: float = 5.0,
        history: int = 256,
        session_key: bytes | None = None,
        ca_file: str | os.PathLike[str] | None = None,
        ssl: ssl_module.SSLContext | None = None,
    ) -> None:
        secure = parse_uri(url).secure  # raises InvalidURI now rather than later
        self.url = url
        self.tid, self.sub, self.exp = _token_claims(token)
        self.token = token
        if session_key is not None and len(session_key) != p.SESSION_KEY_LENGTH:
            raise ValueError(f"a session key is {p.SESSION_KEY_LENGTH} bytes")
        self.session_key = session_key
        self._ssl = _tls_context(secure, ca_file, ssl)
        self.state = SessionState.ACTIVE
        self.heartbeat_interval: float | None = None
        self.stats = SessionStats()
        self.error: TokendError | None = None
        self.backoff = backoff or Backoff()
        self.open_timeout = open_timeout
        self.close_timeout = close_timeout
        self._history: deque[Lifecycle] = deque(maxlen=history)
        self._listeners: set[asyncio.Queue[Lifecycle]] = set()
        self._runner: asyncio.Task[None] | None = None
        self._ws: ClientConnection | None = None
        self._live = False  # the current connection got its WELCOME
        self._welcomed_once = False
        self._healthy = False  # the current connection got a heartbeat ACK
        self._closing = False
        self._drop_reason = ""
        self._sent: dict[int, float] = {}  # seq -> loop time sent, until ACKed
        self._spare = float("inf")  # seconds a reconnect after 1001 may wait at most
        self._settled = asyncio.Event()  # first WELCOME, or the end
        self._ended = asyncio.Event()

    # Public API

    @property
    def connected(self) -> bool:
        """True while a connection is open and welcomed."""
        return self._live

    @property
    def ended(self) -> bool:
        """True once the session is over (see ``error`` for why)."""
        return self._ended.is_set()

    def open(self) -> None:
        """Start connecting in the background; :meth:`changes` reports how it goes."""
        if self._runner is not None:
            raise RuntimeError("session already opened")
        self._runner = asyncio.create_task(self._run(), name=f"tokend-session-{self.tid}")

    async def start(self) -> Session:
        """Open and wait for the first WELCOME; raises the error if the session ends first."""
        self.open()
        try:
            await self._settled.wait()
        except BaseException:
            assert self._runner is not None
            self._runner.cancel()
            raise
        if self.error is not None:
            raise self.error
        return self

    async def wait(self) -> None:
        """Wait until the session ends; raises its error unless it ended by :meth:`close`."""
        await self._ended.wait()
        if self.error is not None:
            raise self.error

    async def close(self) -> None:
        """Log out: send BYE and wait for the server's close. Safe to call more than once.

        If no connection is open at that moment (reconnecting), no BYE can be sent:
        the session is left on the server, resumable until its clocks run out.
        """
        runner = self._runner
        if runner is None:
            return
        if self.ended:
            await asyncio.wait([runner])  # it is finishing already
            return
        self._closing = True
        detail = self._unconnected_close()
        ws = self._ws
        if ws is not None and self._live:
            detail = "no close from the server after BYE; the session may stay until it expires"
            with contextlib.suppress(ConnectionClosed):
                await ws.send(p.encode(p.Bye()))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.close_timeout):
                    await asyncio.shield(runner)
        if not runner.done():
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner
        self._finish(None, detail)

    def _unconnected_close(self) -> str:
        """What a close with no connection to send BYE on leaves behind."""
        if not self._welcomed_once:
            return "closed before a session was made"
        return "closed while not connected; the session stays until it expires"

    async def changes(self) -> AsyncIterator[Lifecycle]:
        """Every change so far (the latest ``history`` of them), then each new one.

        The iteration ends after the ENDED change. Each call iterates on its own.
        """
        queue: asyncio.Queue[Lifecycle] = asyncio.Queue()
        backlog = list(self._history)
        self._listeners.add(queue)
        try:
            for change in backlog:
                yield change
                if change.kind is Change.ENDED:
                    return
            while True:
                change = await queue.get()
                yield change
                if change.kind is Change.ENDED:
                    return
        finally:
            self._listeners.discard(queue)

    async def __aenter__(self) -> Session:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # Reporting

    def _emit(
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
        change = Lifecycle(kind, self.exp, code, detail, delay, error, token, reason)
        self._history.append(change)
        for queue in self._listeners:
            queue.put_nowait(change)

    def _finish(
        self, code: int | None, detail: str, error: TokendError | None = None, reason: str = ""
    ) -> None:
        if self.ended:
            return
        self.error = error
        self._emit(Change.ENDED, code=code, detail=detail, error=error, reason=reason)
        self._ended.set()
        self._settled.set()

    # The connection loop

    async def _run(self) -> None:
        """Connect, serve, and reconnect until something terminal happens."""
        failures = 0  # attempts in a row that did not reach a heartbeat ACK
        try:
            while True:
                end = await self._connection()
                if self._closing:
                    self._finish(end.code, _closing_detail(end), reason=end.reason)
                    return
                if end.error is not None:
                    self._finish(end.code, end.detail, end.error, end.reason)
                    return
                if self._healthy:
                    failures = 0
                limit = self.backoff.max_attempts
                if limit is not None and failures >= limit:
                    reason = f"gave up after {failures} reconnect attempts; last: {end.detail}"
                    self._finish(end.code, reason, RetriesExhausted(end.code, reason), end.reason)
                    return
                delay = self._delay(end, failures)
                failures += 1
                self.stats.reconnects += 1
                self._emit(
                    Change.RECONNECTING,
                    code=end.code,
                    detail=f"{end.detail}; attempt {failures} in {delay:.2f} s",
                    delay=delay,
                    reason=end.reason,
                )
                await asyncio.sleep(delay)
        except Exception as exc:  # a bug here must end the session visibly, not hang it
            self._finish(None, f"client failure: {exc!r}", TokendError(None, repr(exc)))

    def _delay(self, end: _End, attempt: int) -> float:
        """The wait before reconnect attempt ``attempt`` after ``end`` (:class:`Backoff`)."""
        if end.retry_after is not None:
            return self.backoff.after_refusal(attempt, end.retry_after)
        if end.code == CloseCode.GOING_AWAY:
            return self.backoff.after_going_away(attempt, self._spare)
        return self.backoff.delay(attempt)

    async def _connection(self) -> _End:
        """One connection: handshake, HELLO, then frames until it closes."""
        self._healthy = False
        self._drop_reason = ""
        try:
            ws = await ws_connect(
                self.url,
                subprotocols=[Subprotocol(p.SUBPROTOCOL)],
                compression=None,
                open_timeout=self.open_timeout,
                ping_interval=None,  # heartbeats and their ACKs are the liveness check
                close_timeout=self.close_timeout,
                max_size=MAX_SERVER_MESSAGE,
                ssl=self._ssl,
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            detail = f"HTTP {status} at the opening handshake"
            if status >= 500 or status == 429:
                return _End(
                    None, detail, retry_after=retry_after(exc.response.headers.get("Retry-After"))
                )
            return _End(None, detail, ProtocolViolation(None, detail))
        except InvalidMessage as exc:  # the connection broke during the handshake
            return _End(None, f"handshake failed: {exc}")
        except InvalidHandshake as exc:
            return _End(None, str(exc), ProtocolViolation(None, f"handshake refused: {exc}"))
        except ssl_module.SSLCertVerificationError as exc:
            detail = f"the server's certificate is not trusted: {exc.verify_message}"
            return _End(None, detail, CertificateError(None, detail))
        except (OSError, TimeoutError) as exc:
            return _End(None, f"cannot connect: {exc or type(exc).__name__}")
        self._ws = ws
        try:
            return await self._serve(ws)
        finally:
            self._ws = None
            self._live = False
            await ws.close()

    async def _serve(self, ws: ClientConnection) -> _End:
        if ws.subprotocol != p.SUBPROTOCOL:
            detail = f"the server did not select subprotocol {p.SUBPROTOCOL}"
            return _End(None, detail, ProtocolViolation(None, detail))
        heartbeats: asyncio.Task[None] | None = None
        try:
            await ws.send(p.encode(self._hello()))
            async with asyncio.timeout(self.open_timeout):
                welcome = await self._recv(ws)
            if not isinstance(welcome, p.Welcome):
                raise _Violation(f"expected WELCOME, got {type(welcome).__name__}")
            if welcome.tid != self.tid.bytes:
                raise _Violation("WELCOME names another tid")
            self._welcome(welcome)
            heartbeats = asyncio.create_task(self._heartbeats(ws, welcome))
            while True:
                self._handle(await self._recv(ws))
        except ConnectionClosed as exc:
            return self._closed(exc)
        except TimeoutError:
            return _End(None, "no WELCOME in time")
        except _Violation as exc:
            await ws.close(1002, "protocol error")
            return _End(None, str(exc), ProtocolViolation(None, str(exc)))
        finally:
            if heartbeats is not None:
                heartbeats.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await heartbeats

    async def _recv(self, ws: ClientConnection) -> p.Frame:
        data = await ws.recv()
        if isinstance(data, str):
            raise _Violation("text message")
        try:
            frame = p.decode(data)
        except p.ProtocolError as exc:
            raise _Violation(str(exc)) from None
        if not isinstance(frame, p.SERVER_FRAMES):
            raise _Violation(f"client frame {type(frame).__name__} from the server")
        return frame

    def _closed(self, exc: ConnectionClosed) -> _End:
        if exc.rcvd is None:
            if exc.sent is not None and exc.sent.code in _CLIENT_SIDE_VIOLATIONS:
                detail = f"closed by the client: {exc.sent.code} {exc.sent.reason}"
                return _End(exc.sent.code, detail, ProtocolViolation(exc.sent.code, detail))
            return _End(None, self._drop_reason or "connection lost")
        code, reason = exc.rcvd.code, exc.rcvd.reason
        family = classify(code)
        return _End(code, describe(code), None if family is None else family(code, reason), reason)

    # Frames

    def _hello(self) -> p.Hello:
        """HELLO with the newest token, and the resume proof once a WELCOME gave a key."""
        key = self.session_key
        proof = None if key is None else p.resume_proof(key, self.tid.bytes)
        return p.Hello(self.token, proof=proof)

    def _welcome(self, welcome: p.Welcome) -> None:
        self.session_key = welcome.session_key
        self._spare = going_away_limit(welcome)
        self.heartbeat_interval = welcome.heartbeat_ms / 1000
        self.state = SessionState.ACTIVE
        self._sent.clear()
        self._live = True
        if not self._welcomed_once:
            self._welcomed_once = True
            detail = "resumed an existing session" if welcome.resumed else "new session"
            self._emit(Change.CONNECTED, detail=detail)
        elif welcome.resumed:
            self._emit(Change.RESUMED, detail="the same session goes on")
        else:
            self._emit(Change.CONNECTED, detail="the server no longer had the session: new one")
        self._settled.set()

    def _handle(self, frame: p.Frame) -> None:
        if isinstance(frame, p.HeartbeatAck):
            self._ack(frame)
        elif isinstance(frame, p.Notice):
            self.state = SessionState.WARN
            self._emit(Change.WARNED, detail="the server missed our heartbeats")
        else:
            raise _Violation(f"unexpected {type(frame).__name__}")

    def _ack(self, ack: p.HeartbeatAck) -> None:
        sent_at = self._sent.get(ack.seq)
        if sent_at is not None:
            self.stats.last_rtt = asyncio.get_running_loop().time() - sent_at
        for seq in [s for s in self._sent if s <= ack.seq]:
            del self._sent[seq]
        self.stats.acks += 1
        self._healthy = True
        if ack.was_warn or self.state is SessionState.WARN:
            self.state = SessionState.ACTIVE
            self._emit(Change.RECOVERED, detail="heartbeat accepted, session ACTIVE again")
        if ack.token is not None:
            try:
                tid, _, exp = _token_claims(ack.token)
            except AuthError as exc:
                raise _Violation(f"ACK token unreadable: {exc.reason}") from None
            if tid != self.tid:
                raise _Violation("ACK token names another tid")
            self.token, self.exp = ack.token, exp
            if ack.renewed:
                self.stats.renewals += 1
                self._emit(Change.RENEWED, detail="renewed", token=ack.token)
            else:
                detail = "token re-sent (we held an older one)"
                self._emit(Change.RENEWED, detail=detail, token=ack.token)

    async def _heartbeats(self, ws: ClientConnection, welcome: p.Welcome) -> None:
        """Send a heartbeat now, then every interval; drop the link if ACKs stop.

        A late wake-up (the event loop was blocked) sends one heartbeat at once and
        keeps the cadence from there; it never sends a burst, and never raises.
        """
        loop = asyncio.get_running_loop()
        interval = welcome.heartbeat_ms / 1000
        ack_timeout = welcome.warn_ms / 1000
        seq = 0
        due = loop.time()
        while not self._closing:
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            now = loop.time()
            lag = now - due
            self.stats.max_lag = max(self.stats.max_lag, lag)
            oldest = next(iter(self._sent.values()), None)
            # After a blocked loop the reader has not yet seen the ACKs that came
            # meanwhile: judge silence only on a tick that is on time.
            if oldest is not None and lag < interval / 2 and now - oldest > ack_timeout:
                self._drop_reason = f"no heartbeat ACK for {ack_timeout:g} s"
                ws.transport.abort()
                return
            seq += 1
            self._sent[seq] = now
            self.stats.heartbeats += 1
            frame = p.make_heartbeat(welcome.session_key, welcome.tid, seq, self.exp)
            try:
                await ws.send(p.encode(frame))
            except ConnectionClosed:
                return
            due += interval
            if due <= now:
                due = now + interval


def _closing_detail(end: _End) -> str:
    if end.code == CloseCode.NORMAL:
        return "logged out (BYE)"
    return f"closed during logout: {end.detail}; the session stays until it expires"


def connect(
    url: str,
    token: str,
    *,
    backoff: Backoff | None = None,
    open_timeout: float = 10.0,
    close_timeout: float = 5.0,
    session_key: bytes | None = None,
    ca_file: str | os.PathLike[str] | None = None,
    ssl: ssl_module.SSLContext | None = None,
) -> Session:
    """A :class:`Session` for ``async with connect(url, token) as session:``."""
    return Session(
        url,
        token,
        backoff=backoff,
        open_timeout=open_timeout,
        close_timeout=close_timeout,
        session_key=session_key,
        ca_file=ca_file,
        ssl=ssl,
    )
