"""The garbage collector's schedule (tokend/ops/collector.py), and the promise it rests on: a
closed connection leaves no cycle behind, so its objects are freed without a pass.

The schedule's tests change this process's collector and put it back afterwards; the
leak test serves real connections (a tokend app, the test Redis) and looks at what a
pass would find with ``gc.DEBUG_SAVEALL``.
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry, Histogram

from testkit.clients import RawClient
from testkit.pure import FakeClock
from testkit.waiting import eventually
from tokend.core import protocol as p
from tokend.core.session import Session
from tokend.edge.handshake import Handshake
from tokend.edge.websocket import WebSocket
from tokend.ops.app import App
from tokend.ops.collector import NEVER, Collector
from tokend.server.connection import Connection
from tokend.server.link import SessionLink
from tokend.tokens.service import TokenService


class Cycle:
    """Garbage only a collection can free: it refers to itself."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def own_collector() -> Iterator[None]:
    """This process's collector as it was, after the test; no automatic pass during it
    (only the passes the test makes free anything)."""
    thresholds = gc.get_threshold()
    gc.disable()
    yield
    gc.enable()
    gc.unfreeze()
    gc.set_threshold(*thresholds)
    gc.collect()


def garbage() -> weakref.ref[Cycle]:
    """A cycle nothing else refers to; the reference dies when it is collected."""
    return weakref.ref(Cycle())


def test_start_freezes_what_is_there_and_turns_the_automatic_whole_pass_off(
    own_collector: None,
) -> None:
    Collector(1.0, 600.0, clock=FakeClock()).start()
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold()[2] == NEVER


def test_an_interval_of_zero_keeps_cpythons_schedule(own_collector: None) -> None:
    before = gc.get_threshold()
    Collector(0.0, 600.0, clock=FakeClock()).start()
    assert gc.get_threshold() == before


def test_a_pass_frees_the_cycles_made_since_the_last_and_freezes_the_rest(
    own_collector: None,
) -> None:
    clock = FakeClock()
    seconds = Histogram("pass_seconds", "", ["kind"], registry=CollectorRegistry())
    collector = Collector(1.0, 600.0, seconds, clock)
    collector.start()
    dropped, kept = garbage(), Cycle()
    frozen = gc.get_freeze_count()
    collector.collect()
    assert dropped() is None
    assert gc.get_freeze_count() > frozen  # what survived is frozen now
    assert kept.me is kept
    assert seconds.labels("recent")._sum.get() > 0


def test_a_cycle_that_outlived_a_pass_waits_for_the_whole_pass(own_collector: None) -> None:
    clock = FakeClock()
    collector = Collector(1.0, 600.0, clock=clock)
    collector.start()
    old = Cycle()
    collector.collect()  # survives: frozen
    dropped = weakref.ref(old)
    del old
    clock.now += 599
    collector.collect()
    assert dropped() is not None  # a recent pass does not look at frozen objects
    clock.now += 1
    collector.collect()  # the whole pass, due now
    assert dropped() is None
    assert gc.get_freeze_count() > 0  # and the survivors frozen again


def test_run_passes_every_interval_until_told_to_stop(own_collector: None) -> None:
    dropped: list[weakref.ref[Cycle]] = []

    async def main() -> None:
        collector = Collector(0.01, 600.0)
        collector.start()
        passes = 0

        def running() -> bool:
            nonlocal passes
            passes += 1
            if passes == 2:
                dropped.append(garbage())  # the next pass frees it
            return passes < 4

        await asyncio.wait_for(collector.run(running), 5)

    asyncio.run(main())
    assert len(dropped) == 1 and dropped[0]() is None


async def test_a_closed_connection_leaves_no_cycle(
    start_app: Callable[..., Awaitable[App]], tokens: TokenService
) -> None:
    """Closed by the client, by the server (BYE; a refused token), or dropped: what the
    server made for the connection is freed by reference counting, not left to a pass
    (tokend.server.connection.Connection.connection_lost)."""
    app = await start_app()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(5):
            async with RawClient.connect(app.port) as client:
                await client.hello(tokens.mint("alice"))
                await client.heartbeat()
            async with RawClient.connect(app.port) as client:
                await client.hello(tokens.mint("bob"))
                await client.send(p.encode(p.Bye()))
                await client.expect_close()
            async with RawClient.connect(app.port) as client:
                await client.send(p.encode(p.Hello("not.a.token")))
                assert (await client.expect_close()).code == p.CloseCode.INVALID_TOKEN
            async with RawClient.connect(app.port) as client:
                await client.hello(tokens.mint("carol"))
                client.ws.transport.abort()  # dropped: no closing handshake
        # Every connection's end seen by the server: none held any more.
        await eventually(lambda: not app.connections, what="every connection closed")
        gc.collect()
        server_side = (Connection, SessionLink, Session, Handshake, WebSocket)
        left = Counter(type(o).__name__ for o in gc.garbage if type(o) in server_side)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert left == Counter()
