"""Real parts for tests: a redis-server process, tokend processes, a raw v1 client,
a load balancer."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import redis
from redis.cluster import key_slot
from websockets.asyncio.client import ClientConnection, connect
from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosed
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.typing import Subprotocol
from websockets.uri import parse_uri

from tokend import config
from tokend import protocol as p
from tokend.config import Settings
from tokend.embedded import find_server_binary
from tokend.store.keyspace import Keyspace
from tokend.store.redis_client import Client, subscription

LOOPBACK = "127.0.0.1"
T = TypeVar("T")

# Clocks no test step outlasts (a subprocess's start-up included): no WARN or expiry
# where a test is about something else.
CALM_CLOCKS: dict[str, Any] = {"heartbeat_interval": 5.0, "warn_after": 20.0, "expire_after": 30.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


class RedisProcess:
    """A private redis-server on a loopback port, never the machine's shared one."""

    def __init__(
        self, directory: Path, *, aof: bool = False, extra_args: Sequence[str] = ()
    ) -> None:
        self.directory = directory
        self.port = free_port()
        self.aof = aof
        self.extra_args = extra_args
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
                *self.extra_args,
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

    def client(self) -> redis.Redis:
        return redis.Redis(host=LOOPBACK, port=self.port, socket_timeout=2, decode_responses=True)


def node_env(settings: Settings) -> dict[str, str]:
    """Every setting as its ``TOKEND_*`` variable: a tokend process configured like ``settings``."""
    return {config.env_name(name): str(getattr(settings, name)) for name in config.FIELDS}


class RedisClusterProcess:
    """Three cluster-enabled masters on loopback ports, no replicas, all slots assigned."""

    SLOTS = 16384

    def __init__(self, directory: Path, masters: int = 3) -> None:
        self.directory = directory
        self.bus_ports = [free_port() for _ in range(masters)]
        self.nodes = [self._node(f"node-{n}", self.bus_ports[n]) for n in range(masters)]
        self.replicas: list[RedisProcess] = []

    def _node(self, name: str, bus_port: int) -> RedisProcess:
        return RedisProcess(
            self.directory / name,
            # An explicit bus port: the default (port + 10000) may be taken or too high.
            extra_args=(
                "--cluster-enabled",
                "yes",
                "--cluster-port",
                str(bus_port),
                "--cluster-node-timeout",
                "5000",
                # A new replica's first sync starts at once, not 5 s later.
                "--repl-diskless-sync-delay",
                "0",
            ),
        )

    def master_of(self, key: str) -> int:
        """Which node (index) serves ``key``'s slot, as :meth:`start` assigned them."""
        share = self.SLOTS // len(self.nodes)
        return min(key_slot(key.encode()) // share, len(self.nodes) - 1)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{LOOPBACK}:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 20) -> None:
        for node in self.nodes:
            node.start()
        clients = [redis.Redis(host=LOOPBACK, port=n.port, socket_timeout=2) for n in self.nodes]
        share = self.SLOTS // len(self.nodes)  # the split master_of() assumes
        for n, client in enumerate(clients):
            last = self.SLOTS - 1 if n == len(clients) - 1 else (n + 1) * share - 1
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", n * share, last)
            client.execute_command(
                "CLUSTER", "MEET", LOOPBACK, self.nodes[0].port, self.bus_ports[0]
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(c.cluster("INFO")["cluster_state"] == "ok" for c in clients):
                return
            time.sleep(0.05)
        raise RuntimeError("redis cluster did not reach cluster_state:ok")

    def add_replica(self, master: int, timeout: float = 20) -> RedisProcess:
        """A new node replicating ``self.nodes[master]``, returned once it is in sync and
        every master lists it as that master's replica."""
        replica = self._node(f"replica-{len(self.replicas)}", free_port())
        self.replicas.append(replica)
        replica.start()
        client = redis.Redis(host=LOOPBACK, port=replica.port, socket_timeout=2)
        masters = [redis.Redis(host=LOOPBACK, port=n.port, socket_timeout=2) for n in self.nodes]
        master_id = masters[master].execute_command("CLUSTER", "MYID").decode()
        client.execute_command("CLUSTER", "MEET", LOOPBACK, self.nodes[0].port, self.bus_ports[0])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.ResponseError):  # the master is not known yet
                client.execute_command("CLUSTER", "REPLICATE", master_id)
                break
            time.sleep(0.05)
        # Each master's node table names it as this master's replica (gossip takes a moment).
        row = b" slave " + master_id.encode() + b" "
        while time.monotonic() < deadline:
            synced = client.info("replication").get("master_link_status") == "up"
            if synced and all(row in m.execute_command("CLUSTER", "NODES") for m in masters):
                return replica
            time.sleep(0.05)
        raise RuntimeError("cluster replica did not sync")

    def stop(self) -> None:
        for node in self.nodes + self.replicas:
            node.stop()


class RedisSentinelProcess:
    """A redis-server in sentinel mode watching ``master`` as service ``service``."""

    def __init__(
        self,
        directory: Path,
        master: RedisProcess,
        service: str = "tokend",
        *,
        quorum: int = 1,
        options: dict[str, int] | None = None,
    ) -> None:
        self.directory = directory
        self.master = master
        self.service = service
        self.quorum = quorum
        # Per-service settings: down-after-milliseconds, failover-timeout...
        self.options = options or {}
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis+sentinel://{LOOPBACK}:{self.port}/{self.service}/0"

    def start(self, timeout: float = 10) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        conf = self.directory / "sentinel.conf"  # sentinel rewrites its config file
        conf.write_text(
            f"port {self.port}\nbind {LOOPBACK}\ndir {self.directory}\n"
            f"logfile {self.directory / 'sentinel.log'}\n"
            f"sentinel monitor {self.service} {LOOPBACK} {self.master.port} {self.quorum}\n"
            + "".join(f"sentinel {k} {self.service} {v}\n" for k, v in self.options.items())
        )
        self.process = subprocess.Popen(
            [find_server_binary(), str(conf), "--sentinel"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        client = redis.Redis(host=LOOPBACK, port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError((self.directory / "sentinel.log").read_text())
            with contextlib.suppress(redis.RedisError):
                if client.sentinel_get_master_addr_by_name(self.service):
                    return
            time.sleep(0.02)
        raise RuntimeError("redis sentinel did not start")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)

    def client(self) -> redis.Redis:
        return redis.Redis(host=LOOPBACK, port=self.port, socket_timeout=2, decode_responses=True)


class TokendProcess:
    """``tokend serve`` as a child process on a loopback port.

    Its stderr (JSON log lines) is read all along by a thread into ``log_lines``, so
    that a busy node never blocks on a full pipe; a line that is not JSON is kept as
    ``{"raw": line}``.
    """

    def __init__(
        self, env: dict[str, str], port: int | None = None, *, max_open_files: int | None = None
    ) -> None:
        self.port = port or free_port()
        # A known admin port, unless the test names one (-1: off) or runs workers (then
        # 0: each worker takes a free one; consecutive ports may not be free).
        admin_port = env.get("TOKEND_ADMIN_PORT", "0")
        workers = int(env.get("TOKEND_WORKERS", "1"))
        self.admin_port = free_port() if admin_port == "0" and workers == 1 else int(admin_port)
        self.max_open_files = max_open_files  # RLIMIT_NOFILE of the child, if set
        self.env = {
            **os.environ,
            **env,
            "TOKEND_ADMIN_PORT": str(self.admin_port),
            "TOKEND_PORT": str(self.port),
            "TOKEND_HOST": LOOPBACK,
            "TOKEND_LOG_FORMAT": "json",
        }
        # A supervisor's workers each log their own `listening` line.
        self.listeners = workers
        self.process: subprocess.Popen[bytes] | None = None
        self.log_lines: list[dict[str, Any]] = []
        self._logged = threading.Condition()
        self._output_ended = False
        self._reader: threading.Thread | None = None

    def launch(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tokend", "serve"],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=self._limit if self.max_open_files else None,
        )
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()

    def _read_log(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        for line in self.process.stderr:
            try:
                entry = json.loads(line)
            except ValueError:
                entry = {"raw": line.decode(errors="replace")}
            with self._logged:
                self.log_lines.append(entry)
                self._logged.notify_all()
        with self._logged:
            self._output_ended = True
            self._logged.notify_all()

    def logged(self, event: str) -> list[dict[str, Any]]:
        return [entry for entry in self.log_lines if entry.get("event") == event]

    def wait_logged(self, event: str, count: int = 1, timeout: float = 20) -> list[dict[str, Any]]:
        """The log lines of ``event`` once there are ``count``; raises if tokend exits first."""
        assert self.process is not None
        with self._logged:
            if not self._logged.wait_for(
                lambda: len(self.logged(event)) >= count or self._output_ended, timeout
            ):
                raise RuntimeError(f"tokend did not log {event!r}; log: {self.log_lines[-5:]}")
            if len(self.logged(event)) < count:
                raise RuntimeError(f"tokend exited: {self.process.wait(timeout)}")
            return self.logged(event)

    def start(self, timeout: float = 20) -> None:
        self.launch()
        self.wait_listening(timeout)

    def wait_listening(self, timeout: float = 20) -> None:
        self.wait_logged("listening", self.listeners, timeout)

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
        status = self.process.wait(timeout=timeout)
        if self._reader is not None:
            # Output ends when the last process holding the pipe (a child too) exits.
            self._reader.join(timeout=timeout)
        return status

    def kill(self) -> int:
        return self.stop(signal.SIGKILL)


@contextlib.contextmanager
def running_nodes(settings: Settings, *names: str) -> Iterator[list[TokendProcess]]:
    """One tokend process per name, configured like ``settings``, started together;
    each is stopped (SIGTERM) at the end unless the test already stopped it."""
    nodes = [TokendProcess({**node_env(settings), "TOKEND_NODE_NAME": name}) for name in names]
    try:
        for node in nodes:
            node.launch()
        for node in nodes:
            node.wait_listening()
        yield nodes
    finally:
        for node in nodes:
            if node.process is not None:
                node.stop()


class RoundRobinProxy:
    """A TCP load balancer on loopback, as a test's stand-in for HAProxy.

    Each connection goes to the next backend in turn; one that refuses is skipped
    (as a failed health check would take it out). Bytes pass through untouched, so
    WebSocket upgrades do too; when either side closes, both are closed.
    """

    def __init__(self, backends: list[int]) -> None:
        self.backends = backends
        self._turn = itertools.count()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def __aenter__(self) -> RoundRobinProxy:
        self._server = await asyncio.start_server(self._relay, LOOPBACK, 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        upstream = await self._open_next()
        if upstream is None:
            writer.close()
            self._writers.discard(writer)
            return
        up_reader, up_writer = upstream
        self._writers.add(up_writer)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self._writers -= {writer, up_writer}

    async def _open_next(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A connection to the next backend that accepts one, if any does."""
        for _ in self.backends:
            port = self.backends[next(self._turn) % len(self.backends)]
            with contextlib.suppress(OSError):
                return await asyncio.open_connection(LOOPBACK, port)
        return None

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()


class Closed(Exception):
    def __init__(self, code: int | None, reason: str) -> None:
        super().__init__(f"closed {code} {reason}")
        self.code = code
        self.reason = reason


def tid_of(welcome: p.Welcome) -> str:
    """The tid a WELCOME names, as the canonical UUID string events carry."""
    return str(uuid.UUID(bytes=welcome.tid))


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

    def __init__(self, client: Client, channel: str) -> None:
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
            try:
                pubsub = await subscription(self.client)
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
        await self.wait_until(lambda: len(self.of(kind, tid)) >= count, timeout)
        return self.of(kind, tid)

    async def wait_until(self, condition: Callable[[], bool], timeout: float = 5.0) -> None:
        """Until ``condition()`` holds over the messages received (``self.events``)."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(condition)


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


async def eventually(
    check: Callable[[], Awaitable[T]], timeout: float = 5.0, interval: float = 0.02
) -> T:
    """Poll ``check`` until its result is truthy: for state in another process (Redis,
    an HTTP endpoint) that offers nothing to await."""
    async with asyncio.timeout(timeout):
        while not (result := await check()):  # noqa: ASYNC110 - nothing to await instead
            await asyncio.sleep(interval)
    return result


@dataclass
class HttpReply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def http_request(
    port: int,
    method: str,
    path: str,
    *,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
    timeout: float = 5.0,
) -> HttpReply:
    """One HTTP/1.1 request over a fresh connection (or ``raw`` bytes as they are),
    read until the server closes; for the admin listener, which closes after each."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    try:
        if raw is None:
            lines = [f"{method} {path} HTTP/1.1", f"Host: {LOOPBACK}:{port}"]
            lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
            if body:
                lines.append(f"Content-Length: {len(body)}")
            raw = ("\r\n".join(lines) + "\r\n\r\n").encode() + body
        writer.write(raw)
        async with asyncio.timeout(timeout):
            data = await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, content = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in header_lines)
    return HttpReply(
        int(status_line.split(" ")[1]), {k.lower(): v for k, v in fields.items()}, content
    )


async def stream_events(client: Client, prefix: str) -> list[dict[str, Any]]:
    """Every event in the durable stream shards, oldest first."""
    out = []
    for stream in Keyspace(prefix).streams():
        out += [json.loads(fields["event"]) for _, fields in await client.xrange(stream)]
    return sorted(out, key=lambda e: e["at"])


async def sweeps_begun(admin_port: int) -> int:
    """How many sweeps a node has begun, from its metrics: one claim.lua round trip each."""
    metrics = (await http_request(admin_port, "GET", "/metrics")).body.decode()
    found = re.search(r'^tokend_redis_call_seconds_count\{script="claim"\} (\S+)$', metrics, re.M)
    return int(float(found[1])) if found else 0


async def after_a_full_sweep(*admin_ports: int, timeout: float = 10.0) -> None:
    """Return once each node has made a whole sweep begun after this call.

    A node sweeps one claim and its transitions at a time, so by then whatever any
    sweep had claimed earlier has been judged, and each event it made is in the
    streams. With :func:`left_to_judge` empty too, no script can emit for those
    sessions again: the fence to count their events at, instead of a pause "long enough
    for a duplicate to show".
    """
    # b + 1: the sweep under way (claimed, judging) has finished; b + 2: a later one too.
    begun = {port: await sweeps_begun(port) for port in admin_ports}

    async def swept() -> bool:
        return all([await sweeps_begun(port) >= b + 2 for port, b in begun.items()])

    await eventually(swept, timeout)


async def left_to_judge(client: Client, prefix: str, tids: Sequence[str]) -> list[str]:
    """Of ``tids``, those with a session hash or a deadline entry still in Redis: the
    only things a sweep, and so a duplicate event, could come from."""
    keys = Keyspace(prefix)
    left = []
    for tid in tids:
        shard = keys.shard_of(tid)
        session_key = keys.session_keys_of(shard, tid)[0]
        due = keys.shard_keys(shard)[0]
        if await client.exists(session_key) or await client.zscore(due, tid) is not None:
            left.append(tid)
    return left
