"""Real parts for tests: a redis-server process, tokend processes, a raw v1 client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import redis
from redis import asyncio as aioredis
from websockets.asyncio.client import ClientConnection, connect
from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosed
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.typing import Subprotocol
from websockets.uri import parse_uri

from tokend import protocol as p
from tokend.config import Settings
from tokend.embedded import find_server_binary

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


class RedisProcess:
    """A private redis-server on a loopback port, never the machine's shared one."""

    def __init__(self, directory: Path, *, aof: bool = False) -> None:
        self.directory = directory
        self.port = free_port()
        self.aof = aof
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                find_server_binary(),
                "--port",
                str(self.port),
                "--bind",
                LOOPBACK,
                "--dir",
                str(self.directory),
                "--save",
                "",
                "--appendonly",
                "yes" if self.aof else "no",
                "--appendfsync",
                "always",
                "--logfile",
                str(self.directory / "redis.log"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        client = redis.Redis(host=LOOPBACK, port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError((self.directory / "redis.log").read_text())
            with contextlib.suppress(redis.RedisError):
                if client.ping():
                    return
            time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=10)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


def process_env(settings: Settings, data_dir: Path) -> dict[str, str]:
    """``TOKEND_*`` variables for a ``tokend serve`` on the same Redis, prefix and keys."""
    return {
        "TOKEND_REDIS_URL": settings.redis_url,
        "TOKEND_KEY_PREFIX": settings.key_prefix,
        "TOKEND_KEYS_DIR": settings.keys_dir,
        "TOKEND_DATA_DIR": str(data_dir),
    }


class TokendProcess:
    """``tokend serve`` as a child process on a loopback port."""

    def __init__(
        self, env: dict[str, str], port: int | None = None, *, max_open_files: int | None = None
    ) -> None:
        self.port = port or free_port()
        self.max_open_files = max_open_files  # RLIMIT_NOFILE of the child, if set
        self.env = {
            **os.environ,
            **env,
            "TOKEND_PORT": str(self.port),
            "TOKEND_HOST": LOOPBACK,
            "TOKEND_LOG_FORMAT": "json",
        }
        self.process: subprocess.Popen[bytes] | None = None
        self.log_lines: list[dict[str, Any]] = []

    def start(self, timeout: float = 20) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tokend", "serve"],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=self._limit if self.max_open_files else None,
        )
        deadline = time.monotonic() + timeout
        assert self.process.stderr is not None
        while time.monotonic() < deadline:
            line = self.process.stderr.readline()
            if not line:
                raise RuntimeError(f"tokend exited: {self.process.wait()}")
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                self.log_lines.append(entry)
                if entry.get("event") == "listening":
                    return
        raise RuntimeError("tokend did not start listening")

    def _limit(self) -> None:
        assert self.max_open_files is not None
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.max_open_files, self.max_open_files))

    def read_log(self, timeout: float) -> dict[str, Any] | None:
        """The next JSON log line within ``timeout`` seconds (kept in log_lines), or None."""
        import select

        assert self.process is not None and self.process.stderr is not None
        if not select.select([self.process.stderr], [], [], timeout)[0]:
            return None
        line = self.process.stderr.readline()
        with contextlib.suppress(ValueError):
            entry: dict[str, Any] = json.loads(line)
            self.log_lines.append(entry)
            return entry
        return None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout)


class Closed(Exception):
    def __init__(self, code: int | None, reason: str) -> None:
        super().__init__(f"closed {code} {reason}")
        self.code = code
        self.reason = reason


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
        cls, port: int, subprotocols: list[str] | None = None
    ) -> AsyncIterator[RawClient]:
        async with connect(
            f"ws://{LOOPBACK}:{port}{p.WS_PATH}",
            subprotocols=[p.SUBPROTOCOL] if subprotocols is None else (subprotocols or None),
            compression=None,
            open_timeout=5,
            close_timeout=2,
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

    async def hello(self, token: str) -> p.Welcome:
        await self.send(p.encode(p.Hello(token)))
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
        frame = p.decode(self.frames[0].data)
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


class LatencyProxy:
    """A TCP proxy on loopback that delays what the client sends by ``delay`` seconds.

    Put between tokend and Redis, it makes Redis slow without touching it; order and
    content are kept. Set ``delay`` at any time; it applies to data read from then on.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.delay = 0.0
        self.server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    async def __aenter__(self) -> LatencyProxy:
        self.server = await asyncio.start_server(self._serve, LOOPBACK, 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(LOOPBACK, self.upstream_port)
        except OSError:
            writer.close()
            return
        self._spawn(self._pump(reader, up_writer, delayed=True))
        self._spawn(self._pump(up_reader, writer, delayed=False))

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, delayed: bool
    ) -> None:
        # Delayed chunks wait in a queue (each until its own time) so that a delay
        # holds back every later chunk too, as a slow link would.
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def deliver() -> None:
            with contextlib.suppress(OSError):
                while True:
                    due, chunk = await queue.get()
                    await asyncio.sleep(max(0.0, due - loop.time()))
                    if not chunk:
                        break
                    writer.write(chunk)
                    await writer.drain()
            writer.close()

        delivery = asyncio.create_task(deliver())
        try:
            with contextlib.suppress(OSError):
                while chunk := await reader.read(65536):
                    queue.put_nowait((loop.time() + (self.delay if delayed else 0.0), chunk))
            queue.put_nowait((loop.time() + (self.delay if delayed else 0.0), b""))
            await delivery
        finally:
            delivery.cancel()
            writer.close()


class EventLog:
    """Collects the events published on the channel, for awaiting and counting."""

    def __init__(self, client: aioredis.Redis, channel: str) -> None:
        self.client = client
        self.channel = channel
        self.events: list[dict[str, Any]] = []
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> EventLog:
        subscribed = asyncio.Event()
        self._task = asyncio.create_task(self._run(subscribed))
        await subscribed.wait()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self, subscribed: asyncio.Event) -> None:
        """Collect events; resubscribe if Redis goes away (events meanwhile are missed)."""
        while True:
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                subscribed.set()
                async for message in pubsub.listen():
                    async with self._changed:
                        self.events.append(json.loads(message["data"]))
                        self._changed.notify_all()
            except (redis.ConnectionError, OSError):
                await asyncio.sleep(0.1)

    def of(self, kind: str, tid: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind and (tid is None or e["tid"] == tid)]

    async def wait_for(
        self, kind: str, tid: str | None = None, count: int = 1, timeout: float = 5.0
    ) -> list[dict[str, Any]]:
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: len(self.of(kind, tid)) >= count)
        return self.of(kind, tid)


async def http_get(port: int, path: str) -> tuple[int, Any]:
    """GET a tokend HTTP route; returns (status, decoded JSON body)."""
    import urllib.error
    import urllib.request

    def get() -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(f"http://{LOOPBACK}:{port}{path}", timeout=5) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"null")

    return await asyncio.to_thread(get)


async def stream_events(client: aioredis.Redis, prefix: str) -> list[dict[str, Any]]:
    """Every event in the durable stream shards, oldest first."""
    from tokend.store import Keyspace

    out = []
    for stream in Keyspace(prefix).streams():
        out += [json.loads(fields["event"]) for _, fields in await client.xrange(stream)]
    return sorted(out, key=lambda e: e["at"])
