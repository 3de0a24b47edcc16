"""TCP relays on loopback whose links a fault run (load_tests/faults.py) cuts, delays and
blackholes: :class:`ClientFront`, the clients' way to the nodes (a round-robin balancer
with a health check, that skips a node cut from its clients), and :class:`RedisLink`, one
node's way to the current Redis master."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

from testkit.net import LOOPBACK

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass(eq=False)
class Pair:
    """One relayed connection: the side that dialled in, the upstream side, the node."""

    inside: asyncio.StreamWriter
    outside: asyncio.StreamWriter
    node: int
    broken: bool = False  # bytes are dropped both ways; neither side is closed

    def abort(self, *, both: bool) -> None:
        """Reset the dialling side (and the upstream side too, if ``both``): bytes stop."""
        self.broken = True
        self.inside.transport.abort()
        if both:
            self.outside.transport.abort()


class Faults:
    """The faults of each node's links: ``cut`` (no new connection passes), ``down`` (the
    node is dead or frozen: a balancer's health check takes it out, so no new connection
    goes there), ``delay`` (seconds added to what the dialling side sends)."""

    def __init__(self, nodes: int) -> None:
        self.cut = [False] * nodes
        self.down = [False] * nodes
        self.delay = [0.0] * nodes
        self.pairs: set[Pair] = set()

    def sever(self, node: int, *, both: bool) -> None:
        """Reset every open connection of ``node`` (the upstream side left open and silent
        unless ``both``), and refuse new ones until :meth:`mend`."""
        self.cut[node] = True
        for pair in [p for p in self.pairs if p.node == node]:
            pair.abort(both=both)

    def mend(self, node: int) -> None:
        self.cut[node] = False

    def blackhole(self, node: int) -> None:
        """Every open connection of ``node`` drops what either side sends from now on."""
        for pair in self.pairs:
            if pair.node == node:
                pair.broken = True


async def relay(faults: Faults, pair: Pair, inside: Streams, outside: Streams) -> None:
    faults.pairs.add(pair)
    try:
        await asyncio.gather(
            _pump(faults, pair, inside[0], outside[1], delayed=True),
            _pump(faults, pair, outside[0], inside[1], delayed=False),
        )
    finally:
        faults.pairs.discard(pair)


async def _pump(
    faults: Faults,
    pair: Pair,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    delayed: bool,
) -> None:
    """Copy ``reader`` to ``writer``; a delayed direction keeps order (a queue, each chunk
    held until its own time) as a slow link would."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while True:
                due, chunk = await queue.get()
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                if not chunk:
                    break
                if not pair.broken:
                    writer.write(chunk)
                    await writer.drain()
        if not pair.broken:
            writer.close()

    delivery = asyncio.create_task(deliver())
    try:
        with contextlib.suppress(OSError, ConnectionError):
            while chunk := await reader.read(65536):
                delay = faults.delay[pair.node] if delayed else 0.0
                queue.put_nowait((loop.time() + delay, chunk))
        queue.put_nowait((loop.time(), b""))
        await delivery
    finally:
        delivery.cancel()


class _Listener:
    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._guarded, LOOPBACK, 0, backlog=4096)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _guarded(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A relay cancelled as the run ends is no error of the callback's.
        with contextlib.suppress(asyncio.CancelledError):
            await self._accept(reader, writer)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


# Seconds between a balancer's health checks of a node, and each check's deadline.
HEALTH_CHECK_INTERVAL = 0.5


class ClientFront(_Listener):
    """The clients' one address: each connection goes to the next node in turn that is
    not cut from its clients, passed its last health check and accepts it (any node not
    cut or down when none passed). ``node_of[client port]`` names the node.

    Its health check is a balancer's (HAProxy's ``option httpchk GET /readyz``, at
    :data:`HEALTH_CHECK_INTERVAL`, one failure out and one success back in): it takes out
    a node that cannot reach Redis, or not within ``redis_timeout``, which only ``/readyz``
    tells from outside."""

    def __init__(self, nodes: int) -> None:
        super().__init__()
        self.nodes = [0] * nodes  # each node's port, set before the first client comes
        self.faults = Faults(nodes)
        self.ready = [True] * nodes  # each node's last health check passed
        self.node_of: dict[int, int] = {}
        self._turn = itertools.count()
        self._checks: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        await super().__aenter__()
        self._checks = asyncio.create_task(self._check_health())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._checks is not None:
            self._checks.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checks
        await super().__aexit__(*exc)

    async def _check_health(self) -> None:
        while True:
            await asyncio.gather(*(self._check(node) for node in range(len(self.nodes))))
            await asyncio.sleep(HEALTH_CHECK_INTERVAL)

    async def _check(self, node: int) -> None:
        ready = False
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(HEALTH_CHECK_INTERVAL):
                reader, writer = await asyncio.open_connection(LOOPBACK, self.nodes[node])
                try:
                    writer.write(
                        b"GET /readyz HTTP/1.1\r\nHost: front\r\nConnection: close\r\n\r\n"
                    )
                    ready = (await reader.readline()).split()[1:2] == [b"200"]
                finally:
                    writer.transport.abort()
        self.ready[node] = ready

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client_port = int(writer.get_extra_info("peername")[1])
        faults = self.faults
        open_nodes = [n for n in range(len(self.nodes)) if not (faults.cut[n] or faults.down[n])]
        candidates = [n for n in open_nodes if self.ready[n]] or open_nodes
        turn = next(self._turn)
        for k in range(len(candidates)):
            node = candidates[(turn + k) % len(candidates)]
            with contextlib.suppress(OSError):
                upstream = await asyncio.open_connection(LOOPBACK, self.nodes[node])
                break
        else:
            writer.transport.abort()
            return
        self.node_of[client_port] = node
        await relay(self.faults, Pair(writer, upstream[1], node), (reader, writer), upstream)


class RedisLink(_Listener):
    """Node ``node``'s way to Redis: each connection goes to ``master()``'s port at the
    time (as a Redis address that follows Sentinel's choice would), through ``faults``."""

    def __init__(self, node: int, faults: Faults, master: Callable[[], int]) -> None:
        super().__init__()
        self.node = node
        self.faults = faults
        self.master = master

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.faults.cut[self.node]:
            writer.transport.abort()
            return
        try:
            upstream = await asyncio.open_connection(LOOPBACK, self.master())
        except OSError:
            writer.transport.abort()
            return
        await relay(self.faults, Pair(writer, upstream[1], self.node), (reader, writer), upstream)
