"""Real parts for tests: a redis-server process, tokend processes, a raw v1 client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import redis
from redis import asyncio as aioredis
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from tokend import protocol as p
from tokend.embedded import find_server_binary

LOOPBACK = "127.0.0.1"
T = TypeVar("T")


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


class TokendProcess:
    """``tokend serve`` as a child process on a loopback port."""

    def __init__(self, env: dict[str, str], port: int | None = None) -> None:
        self.port = port or free_port()
        self.admin_port = free_port()
        self.env = {
            **os.environ,
            "TOKEND_ADMIN_PORT": str(self.admin_port),
            **env,
            "TOKEND_PORT": str(self.port),
            "TOKEND_HOST": LOOPBACK,
            "TOKEND_LOG_FORMAT": "json",
        }
        self.process: subprocess.Popen[bytes] | None = None
        self.log_lines: list[dict[str, Any]] = []
        self.log_reader: threading.Thread | None = None

    def start(self, timeout: float = 20) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tokend", "serve"],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
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

    def follow_log(self) -> None:
        """Keep reading the log after start (into ``log_lines``), so a chatty child never
        blocks on a full stderr pipe."""
        assert self.process is not None and self.process.stderr is not None
        stderr = self.process.stderr

        def read() -> None:
            for line in stderr:
                with contextlib.suppress(ValueError):
                    self.log_lines.append(json.loads(line))

        self.log_reader = threading.Thread(target=read, daemon=True)
        self.log_reader.start()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
        status = self.process.wait(timeout=timeout)
        if self.log_reader is not None:
            self.log_reader.join(timeout)  # every line the child wrote is in log_lines
        return status


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


async def stream_events(client: aioredis.Redis, prefix: str) -> list[dict[str, Any]]:
    """Every event in the durable stream shards, oldest first."""
    from tokend.store import Keyspace

    out = []
    for stream in Keyspace(prefix).streams():
        out += [json.loads(fields["event"]) for _, fields in await client.xrange(stream)]
    return sorted(out, key=lambda e: e["at"])
