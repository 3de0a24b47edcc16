"""The fault run's balancer (testkit.fault_proxies.ClientFront): it sends clients to the
nodes whose ``/readyz`` answers 200, and to any node it can reach when none does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

from testkit.fault_proxies import ClientFront
from testkit.net import LOOPBACK
from testkit.waiting import eventually


class Backend:
    """A node as the balancer sees it: ``/readyz`` answers ``status``; any other
    connection is told the backend's name."""

    def __init__(self, name: bytes, status: int) -> None:
        self.name = name
        self.status = status

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readline()
        if line.startswith(b"GET /readyz "):
            writer.write(b"HTTP/1.1 %d -\r\nContent-Length: 0\r\n\r\n" % self.status)
        else:
            writer.write(self.name)
        await writer.drain()
        writer.close()


@asynccontextmanager
async def front_of(backends: list[Backend]) -> AsyncIterator[ClientFront]:
    async with AsyncExitStack() as stack:
        front = ClientFront(len(backends))
        for n, backend in enumerate(backends):
            server = await asyncio.start_server(backend.serve, LOOPBACK, 0)
            stack.push_async_callback(server.wait_closed)
            stack.callback(server.close)
            front.nodes[n] = int(server.sockets[0].getsockname()[1])
        yield await stack.enter_async_context(front)


async def served_by(front: ClientFront) -> bytes:
    reader, writer = await asyncio.open_connection(LOOPBACK, front.port)
    writer.write(b"HELLO\n")
    name = await reader.read()
    writer.close()
    return name


async def test_the_balancer_sends_clients_only_to_nodes_whose_readyz_answers_200() -> None:
    backends = [Backend(b"a", 200), Backend(b"b", 503), Backend(b"c", 200)]
    async with front_of(backends) as front:
        await eventually(lambda: front.ready == [True, False, True], what="the first checks")
        assert {await served_by(front) for _ in range(6)} == {b"a", b"c"}
        backends[1].status = 200
        await eventually(lambda: all(front.ready), what="b ready again")
        assert {await served_by(front) for _ in range(6)} == {b"a", b"b", b"c"}


async def test_with_no_node_ready_the_balancer_tries_them_all() -> None:
    async with front_of([Backend(b"a", 503), Backend(b"b", 503)]) as front:
        await eventually(lambda: not any(front.ready), what="the first checks")
        assert {await served_by(front) for _ in range(4)} == {b"a", b"b"}
