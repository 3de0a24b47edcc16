"""TCP proxies on loopback for tests: a slow link (:class:`LatencyProxy`) and a load
balancer (:class:`RoundRobinProxy`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass
from typing import Any, Self

from testkit.net import LOOPBACK, url_of


class LatencyProxy:
    """A TCP proxy on loopback that delays what the client sends by ``delay`` seconds.

    Put between tokend and Redis, it makes Redis slow without touching it; order and
    content are kept. Set ``delay`` at any time; it applies to data read from then on.
    It counts the chunks the clients sent (``received``) and those passed on upstream
    (``forwarded``): with one delay, they are passed on in the order they came.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.delay = 0.0
        self.received = 0
        self.forwarded = 0
        self.server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    async def __aenter__(self) -> Self:
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
                    if delayed:
                        self.forwarded += 1
                    await writer.drain()
            writer.close()

        delivery = asyncio.create_task(deliver())
        try:
            with contextlib.suppress(OSError):
                while chunk := await reader.read(65536):
                    if delayed:
                        self.received += 1
                    queue.put_nowait((loop.time() + (self.delay if delayed else 0.0), chunk))
            queue.put_nowait((loop.time() + (self.delay if delayed else 0.0), b""))
            await delivery
        finally:
            delivery.cancel()
            writer.close()


class _Listener:
    """A TCP listener on a free loopback port, whose connections :meth:`_relay` takes;
    leaving it closes the listener and the streams :meth:`_streams` names."""

    port = 0
    _server: asyncio.Server | None = None

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._relay, LOOPBACK, 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._streams():
            writer.close()
        await self._server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    def _streams(self) -> list[asyncio.StreamWriter]:
        raise NotImplementedError


class RoundRobinProxy(_Listener):
    """A TCP load balancer on loopback, as a test's stand-in for HAProxy.

    Each connection goes to the next backend in turn; one that refuses is skipped
    (as a failed health check would take it out). Bytes pass through untouched, so
    WebSocket upgrades do too; when either side closes, both are closed.
    """

    def __init__(self, backends: list[int]) -> None:
        self.backends = backends
        self._turn = itertools.count()
        self._writers: set[asyncio.StreamWriter] = set()

    def _streams(self) -> list[asyncio.StreamWriter]:
        return list(self._writers)

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


@dataclass
class _Relayed:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    broken: bool = False  # bytes are dropped, and neither side is closed by the relay


class Link(_Listener):
    """A TCP relay to a tokend port whose open connections a test can break as a network
    does. :meth:`cut` resets the client's side and leaves the server's open and silent
    (it notices nothing, as when a phone loses its network); :meth:`blackhole` leaves
    both open and silent. New connections pass as before."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self._relayed: list[_Relayed] = []

    @property
    def url(self) -> str:
        return url_of(self.port)

    def _streams(self) -> list[asyncio.StreamWriter]:
        return [writer for r in self._relayed for writer in (r.client, r.server)]

    def cut(self) -> None:
        for relayed in self._relayed:
            relayed.broken = True
            relayed.client.transport.abort()

    def blackhole(self) -> None:
        for relayed in self._relayed:
            relayed.broken = True

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(LOOPBACK, self.upstream)
        relayed = _Relayed(writer, up_writer)
        self._relayed.append(relayed)
        await asyncio.gather(
            self._pump(reader, up_writer, relayed), self._pump(up_reader, writer, relayed)
        )

    @staticmethod
    async def _pump(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, relayed: _Relayed
    ) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                if not relayed.broken:
                    writer.write(data)
                    await writer.drain()
        if not relayed.broken:
            writer.close()
