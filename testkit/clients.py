"""Protocol v1 clients for tests: :class:`RawClient`, built from the spec's bytes alone
(no SDK), and :class:`WireClient`, which sends frames exactly as given."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import socket
import ssl as ssl_module
import uuid
from collections.abc import AsyncIterator

from websockets.asyncio.client import ClientConnection, connect
from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosed
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.typing import Subprotocol
from websockets.uri import parse_uri

from testkit.net import LOOPBACK
from tokend.core import protocol as p


def upgrade_request() -> bytes:
    """A client's opening handshake request for tokend's path and subprotocol, as bytes
    (for a connection fed by hand, without a socket)."""
    key = base64.b64encode(os.urandom(16)).decode()
    return (
        f"GET {p.WS_PATH} HTTP/1.1\r\nHost: test\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
        f"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: {p.SUBPROTOCOL}\r\n\r\n"
    ).encode()


class Closed(Exception):
    def __init__(self, code: int | None, reason: str) -> None:
        super().__init__(f"closed {code} {reason}")
        self.code = code
        self.reason = reason


def tid_of(welcome: p.Welcome) -> str:
    """The tid a WELCOME names, as the canonical UUID string events carry."""
    return str(uuid.UUID(bytes=welcome.tid))


def proof_of(welcome: p.Welcome) -> bytes:
    """The resume proof a client shows after ``welcome`` (docs/protocol.md §3, "Takeover")."""
    return p.resume_proof(welcome.session_key, welcome.tid)


async def open_socket(
    port: int, *, source: str | None = None, preface: bytes = b""
) -> socket.socket:
    """A non-blocking TCP socket connected to ``port`` on loopback, from the loopback
    address ``source`` (127.0.0.2, ...: any 127/8 address is this host's) if given, with
    ``preface`` already written: what a load balancer's connection to a node looks like."""
    sock = socket.socket()
    try:
        if source is not None:
            sock.bind((source, 0))
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, (LOOPBACK, port))
        if preface:
            await loop.sock_sendall(sock, preface)
    except BaseException:
        sock.close()
        raise
    return sock


class RawClient:
    """A client built from the spec's bytes alone (no SDK), for conformance tests."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.welcome: p.Welcome | None = None
        self.seq = 0
        self.exp_ms = 0

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(
        cls,
        port: int,
        subprotocols: list[str] | None = None,
        *,
        source: str | None = None,
        preface: bytes = b"",
        ssl: ssl_module.SSLContext | None = None,
    ) -> AsyncIterator[RawClient]:
        """Connect (``wss://`` with ``ssl``), from the loopback address ``source`` if
        given, after writing ``preface`` (a PROXY protocol header) if given."""
        sock = (
            await open_socket(port, source=source, preface=preface) if source or preface else None
        )
        offered = [p.SUBPROTOCOL] if subprotocols is None else subprotocols
        async with connect(
            f"{'wss' if ssl else 'ws'}://{LOOPBACK}:{port}{p.WS_PATH}",
            subprotocols=[Subprotocol(name) for name in offered] or None,
            compression=None,
            open_timeout=5,
            close_timeout=2,
            sock=sock,
            ssl=ssl,
        ) as ws:
            yield cls(ws)

    async def send(self, data: bytes | str) -> None:
        await self.ws.send(data)

    async def recv(self, timeout: float = 5.0) -> p.Frame:
        try:
            async with asyncio.timeout(timeout):
                data = await self.ws.recv()
        except ConnectionClosed as exc:
            rcvd = exc.rcvd
            raise Closed(rcvd.code if rcvd else None, rcvd.reason if rcvd else "") from None
        assert isinstance(data, bytes), "server sent a text message"
        return p.decode(data)

    async def hello(self, token: str, proof: bytes | None = None) -> p.Welcome:
        """HELLO, with the resume ``proof`` after the token when given (spec revision 2)."""
        await self.send(p.encode(p.Hello(token, proof=proof)))
        frame = await self.recv()
        assert isinstance(frame, p.Welcome), frame
        self.welcome = frame
        self.exp_ms = frame.exp_ms
        return frame

    def heartbeat_bytes(self, seq: int | None = None, exp_ms: int | None = None) -> bytes:
        assert self.welcome is not None
        if seq is None:
            self.seq += 1
            seq = self.seq
        return p.encode(
            p.make_heartbeat(
                self.welcome.session_key,
                self.welcome.tid,
                seq,
                self.exp_ms if exp_ms is None else exp_ms,
            )
        )

    async def heartbeat(self, exp_ms: int | None = None) -> p.HeartbeatAck:
        await self.send(self.heartbeat_bytes(exp_ms=exp_ms))
        while True:
            frame = await self.recv()
            if isinstance(frame, p.HeartbeatAck):
                if frame.token:
                    self.exp_ms = frame.exp_ms
                return frame

    async def expect_close(self, timeout: float = 5.0) -> Closed:
        """Read (skipping frames) until the server closes; return the close."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    await self.recv(timeout)
        except Closed as closed:
            return closed


async def resumes(port: int, token: str) -> bool:
    """A HELLO with ``token`` on a new connection: whether it resumed; False when refused
    4509 (the session held live elsewhere), any other close raises."""
    async with RawClient.connect(port) as client:
        try:
            return (await client.hello(token)).resumed
        except Closed as closed:
            assert closed.code == p.CloseCode.SESSION_IN_USE, closed
            return False


class WireClient:
    """A WebSocket client on a plain non-blocking socket, reading only when told to.

    websockets' sans-I/O :class:`ClientProtocol` does the handshake and parses what the
    server sends; frames go out as built, so a test can send what a well-behaved client
    library never would: fragments of its choosing, ping floods, continuation frames out
    of place, or keep sending while never reading (``rcvbuf`` shrinks the socket's
    receive buffer before connecting).
    """

    def __init__(self, sock: socket.socket, protocol: ClientProtocol) -> None:
        self.sock = sock
        self.protocol = protocol
        self.response: Response | None = None
        self.frames: list[Frame] = []  # data frames received

    @classmethod
    async def open(
        cls, port: int, *, rcvbuf: int | None = None, subprotocols: list[str] | None = None
    ) -> WireClient:
        """Connect and do the opening handshake; ``response`` is the server's answer."""
        sock = socket.socket()
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        offered = [p.SUBPROTOCOL] if subprotocols is None else subprotocols
        protocol = ClientProtocol(
            parse_uri(f"ws://{LOOPBACK}:{port}{p.WS_PATH}"),
            subprotocols=[Subprotocol(s) for s in offered] or None,
            max_size=None,
        )
        client = cls(sock, protocol)
        try:
            await asyncio.get_running_loop().sock_connect(sock, (LOOPBACK, port))
            protocol.send_request(protocol.connect())
            await client._flush()
            async with asyncio.timeout(5):
                while client.response is None and await client._read():
                    pass
        except BaseException:
            sock.close()
            raise
        return client

    @property
    def status(self) -> int | None:
        """HTTP status of the handshake response (101 when the WebSocket opened)."""
        return self.response.status_code if self.response else None

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        for data in self.protocol.data_to_send():
            if data:
                with contextlib.suppress(OSError):
                    await loop.sock_sendall(self.sock, data)

    async def _read(self) -> bool:
        """Read once and take in what came; False at the end of the stream."""
        try:
            data = await asyncio.get_running_loop().sock_recv(self.sock, 65536)
        except OSError:
            data = b""
        if data:
            self.protocol.receive_data(data)
        else:
            self.protocol.receive_eof()
        for event in self.protocol.events_received():
            if isinstance(event, Response):
                self.response = event
            elif isinstance(event, Frame) and event.opcode in (Opcode.BINARY, Opcode.TEXT):
                self.frames.append(event)
        await self._flush()  # the protocol answers pings and close frames by itself
        return bool(data)

    async def welcome(self, timeout: float = 5.0) -> p.Welcome:
        """Read until the first message, which must be WELCOME (send HELLO first)."""
        async with asyncio.timeout(timeout):
            while not self.frames:
                assert await self._read(), "closed before WELCOME"
        frame = p.decode(bytes(self.frames[0].data))
        assert isinstance(frame, p.Welcome), frame
        return frame

    async def send(self, *frames: Frame) -> None:
        """Send frames exactly as given (masked, as from any client)."""
        await self.send_raw(b"".join(f.serialize(mask=True) for f in frames))

    async def send_raw(self, data: bytes) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def close_code(self, timeout: float = 5.0) -> int | None:
        """Read until the server ends the connection: its close code, or None without one."""
        async with asyncio.timeout(timeout):
            while await self._read():
                pass
        return self.protocol.close_rcvd.code if self.protocol.close_rcvd else None

    def close(self) -> None:
        self.sock.close()
