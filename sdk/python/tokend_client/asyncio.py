"""The asyncio client: a :class:`ClientSession` drives a :class:`~tokend_client.core.ClientCore`
over websockets' asyncio client.

This shell owns only I/O: opening connections (TLS included, and what their failures
mean to the core), reading messages into the core, sending what it gives, sleeping until
its deadline, and handing its lifecycle changes to every :meth:`ClientSession.changes`
iterator. Every protocol rule is the core's. This is the only client-side module that
imports websockets' asyncio client. See ``docs/client.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl as ssl_module
import uuid
from collections import deque
from collections.abc import AsyncIterator
from types import TracebackType

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

from tokend_client import protocol as p
from tokend_client.backoff import Backoff
from tokend_client.core import (
    MAX_SERVER_MESSAGE,
    ON_A_CONNECTION,
    Change,
    ClientCore,
    Lifecycle,
    Phase,
    SessionStats,
)
from tokend_client.errors import CertificateError, ProtocolViolation, TokendError


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


class ClientSession:
    """A tokend session held open over as many connections as it takes.

    Use it as ``async with ClientSession(url, token) as session:`` (or
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
    instead (client certificates, pinning). ``cadence`` (seconds) replaces the heartbeat
    interval WELCOME gives, for tests and load generators: a server that sheds load
    leaves heartbeats faster than half its interval unanswered (spec revision 3), and the
    session waits ``warn_after`` for an ACK as always.

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
        cadence: float | None = None,
    ) -> None:
        secure = parse_uri(url).secure  # raises InvalidURI now rather than later
        self.url = url
        self._core = ClientCore(
            token,
            clock=self._now,
            backoff=backoff,
            session_key=session_key,
            open_timeout=open_timeout,
            close_timeout=close_timeout,
            cadence=cadence,
        )
        self._ssl = _tls_context(secure, ca_file, ssl)
        self._history: deque[Lifecycle] = deque(maxlen=history)
        self._listeners: set[asyncio.Queue[Lifecycle]] = set()
        self._runner: asyncio.Task[None] | None = None
        self._opening = False  # the runner is in the opening handshake
        self._poked = asyncio.Event()  # an input reached the core: act on what it says
        self._settled = asyncio.Event()  # first WELCOME, or the end
        self._welcomed = False  # a WELCOME came before the end
        self._ended = asyncio.Event()

    @staticmethod
    def _now() -> float:
        """The core's clock: the event loop's, on which the shell sleeps until deadlines."""
        return asyncio.get_running_loop().time()

    # The session's state, as the core keeps it

    @property
    def token(self) -> str:
        return self._core.token

    @property
    def session_key(self) -> bytes | None:
        return self._core.session_key

    @property
    def exp(self) -> int:
        return self._core.exp

    @property
    def tid(self) -> uuid.UUID:
        return self._core.tid

    @property
    def sub(self) -> str:
        return self._core.sub

    @property
    def state(self) -> p.SessionState:
        return self._core.state

    @property
    def heartbeat_interval(self) -> float | None:
        return self._core.heartbeat_interval

    @property
    def stats(self) -> SessionStats:
        return self._core.stats

    @property
    def error(self) -> TokendError | None:
        return self._core.error

    @property
    def backoff(self) -> Backoff:
        return self._core.backoff

    @property
    def connected(self) -> bool:
        """True while a connection is open and welcomed."""
        return self._core.connected

    @property
    def ended(self) -> bool:
        """True once the session is over (see ``error`` for why)."""
        return self._ended.is_set()

    # Public API

    def open(self) -> None:
        """Start connecting in the background; :meth:`changes` reports how it goes."""
        if self._runner is not None:
            raise RuntimeError("session already opened")
        self._runner = asyncio.create_task(self._run(), name=f"tokend-session-{self.tid}")

    async def start(self) -> ClientSession:
        """Open and wait for the first WELCOME; raises the error if the session ends before."""
        self.open()
        try:
            await self._settled.wait()
        except BaseException:
            assert self._runner is not None
            self._runner.cancel()
            raise
        if self.error is not None and not self._welcomed:
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
        self._core.close()
        self._poked.set()
        if self._opening:  # not connected yet: nothing to log out on, stop the handshake
            runner.cancel()
        # The core ends the logout by close_timeout at the latest.
        await asyncio.wait([runner])

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

    async def __aenter__(self) -> ClientSession:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # Driving the core

    def _publish(self) -> None:
        """Hand the core's new lifecycle changes to every listener."""
        for change in self._core.take_changes():
            self._history.append(change)
            for queue in self._listeners:
                queue.put_nowait(change)
            if change.kind in (Change.CONNECTED, Change.RESUMED):
                self._welcomed = True
                self._settled.set()
            elif change.kind is Change.ENDED:
                self._settled.set()
                self._ended.set()

    async def _sleep(self) -> None:
        """Until the core's deadline, or until an input reaches it; then tick it."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(self._core.deadline):
                await self._poked.wait()
        self._poked.clear()
        self._core.tick()

    async def _run(self) -> None:
        """Connect, serve, wait and reconnect, as the core says, until it ends."""
        try:
            while not self._core.ended:
                if self._core.phase is Phase.CONNECT:
                    await self._connection()
                else:
                    await self._sleep()
                self._publish()
        except Exception as exc:
            self._failed(exc)
        finally:
            self._publish()

    async def _connection(self) -> None:
        """One connection: the opening handshake, then the core's frames until it lets go."""
        core = self._core
        self._opening = True
        try:
            ws = await ws_connect(
                self.url,
                subprotocols=[Subprotocol(p.SUBPROTOCOL)],
                compression=None,
                open_timeout=core.open_timeout,
                ping_interval=None,  # heartbeats and their ACKs are the liveness check
                close_timeout=core.close_timeout,
                max_size=MAX_SERVER_MESSAGE,
                ssl=self._ssl,
            )
        except InvalidStatus as exc:
            core.refused(exc.response.status_code, exc.response.headers.get("Retry-After"))
            return
        except InvalidMessage as exc:  # the connection broke during the handshake
            core.lost(f"handshake failed: {exc}")
            return
        except InvalidHandshake as exc:
            core.abandon(ProtocolViolation(None, f"handshake refused: {exc}"))
            return
        except ssl_module.SSLCertVerificationError as exc:
            detail = f"the server's certificate is not trusted: {exc.verify_message}"
            core.abandon(CertificateError(None, detail))
            return
        except (OSError, TimeoutError) as exc:
            core.lost(f"cannot connect: {exc or type(exc).__name__}")
            return
        finally:
            self._opening = False
        reader = asyncio.create_task(self._read(ws))
        try:
            core.opened(ws.subprotocol)
            while True:
                self._publish()
                await self._send(ws)
                if core.phase not in ON_A_CONNECTION:
                    return
                await self._sleep()
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            await ws.close()

    async def _read(self, ws: ClientConnection) -> None:
        """Every message into the core, then how the connection closed."""
        try:
            while True:
                self._core.receive(await ws.recv())
                self._poked.set()
        except ConnectionClosed as exc:
            self._core.closed(exc.rcvd, exc.sent)
            self._poked.set()
        except Exception as exc:
            self._failed(exc)
            self._poked.set()

    def _failed(self, exc: Exception) -> None:
        """A bug of the client: it must end the session visibly, not hang it."""
        self._core.abandon(TokendError(None, f"client failure: {exc!r}"))

    async def _send(self, ws: ClientConnection) -> None:
        """What the core has for the connection: frames, then perhaps letting it go."""
        for item in self._core.take_outgoing():
            if isinstance(item, bytes):
                with contextlib.suppress(ConnectionClosed):  # the reader reports the close
                    await ws.send(item)
            elif item.code is None:
                ws.transport.abort()
            else:
                await ws.close(item.code, item.reason)


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
) -> ClientSession:
    """A :class:`ClientSession` for ``async with connect(url, token) as session:``."""
    return ClientSession(
        url,
        token,
        backoff=backoff,
        open_timeout=open_timeout,
        close_timeout=close_timeout,
        session_key=session_key,
        ca_file=ca_file,
        ssl=ssl,
    )
