"""Graceful drain on SIGTERM (tokend/ops/app.py App.drain) with real tokend processes, and what
a planned close does to the sessions it closes (parked: docs/protocol.md §5)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from redis.asyncio import Redis
from websockets.frames import Frame, Opcode

from testkit import replies, tokend_process
from testkit.clients import RawClient, WireClient, tid_of
from testkit.events import EventLog, read_events
from testkit.net import http_request
from testkit.tokend_process import CALM_CLOCKS, SHORT_CLOCKS, TokendProcess
from testkit.waiting import eventually
from tokend.config import Settings
from tokend.core import protocol as p
from tokend.ops.app import App
from tokend.tokens.service import TokenService

SESSIONS = 50
DRAIN_PERIOD = 2.0
# Time allowed past the drain period for the last closing handshakes and the exit.
EXIT_MARGIN = 3.0


@pytest.fixture
def node_env(make_settings: Callable[..., Settings], tmp_path: Path) -> dict[str, str]:
    """Settings of the tokend processes: the test Redis and keys; clocks long enough that
    a session survives the drain and its move, short enough that a lost one would expire."""
    return tokend_process.node_env(
        make_settings(heartbeat_interval=1, warn_after=4, expire_after=8, drain_period=DRAIN_PERIOD)
    )


def start_node(env: dict[str, str], name: str, **more: str) -> TokendProcess:
    node = TokendProcess({**env, "TOKEND_NODE_NAME": name, **more})
    node.start()
    return node


async def exit_status(node: TokendProcess, timeout: float) -> int:
    assert node.process is not None
    return await asyncio.to_thread(node.process.wait, timeout)


async def test_sigterm_spreads_closes_and_sessions_resume_elsewhere(
    node_env: dict[str, str], tokens: TokenService, events: EventLog
) -> None:
    a, b = start_node(node_env, "node-a"), start_node(node_env, "node-b")
    try:
        connected = asyncio.Semaphore(0)
        closed_at: list[float] = []
        resumed: list[str] = []

        async def session(n: int) -> None:
            token = tokens.mint(f"user-{n}")
            async with RawClient.connect(a.port) as client:
                await client.hello(token)
                connected.release()
                closed = await client.expect_close(timeout=DRAIN_PERIOD + EXIT_MARGIN + 5)
            closed_at.append(time.monotonic())
            assert closed.code == p.CloseCode.GOING_AWAY, closed
            # node-a records its release when the connection has ended, which may be after
            # this HELLO reaches Redis: a client shows the proof of its key (spec "Resume proof").
            assert client.welcome is not None
            proof = p.resume_proof(client.welcome.session_key, client.welcome.tid)
            async with RawClient.connect(b.port) as client:
                welcome = await client.hello(token, proof)
                assert welcome.resumed
                await client.heartbeat()
                resumed.append(str(uuid.UUID(bytes=welcome.tid)))

        clients = [asyncio.create_task(session(n)) for n in range(SESSIONS)]
        async with asyncio.timeout(20):
            for _ in range(SESSIONS):
                await connected.acquire()
        assert a.process is not None
        a.process.send_signal(signal.SIGTERM)
        # How soon it exits is the drain bench's (python -m bench drain): here, that it does.
        assert await exit_status(a, DRAIN_PERIOD + EXIT_MARGIN + 20) == 0
        async with asyncio.timeout(10):
            await asyncio.gather(*clients)
        await events.wait_for("SESSION_RESUMED", count=SESSIONS, timeout=5)

        assert max(closed_at) - min(closed_at) >= DRAIN_PERIOD / 2, "closes not spread"
        assert sorted(e["tid"] for e in events.of("SESSION_RESUMED")) == sorted(resumed)
        for kind in ("TOKEN_EXPIRED", "SESSION_CLOSED", "TOKEN_REVOKED"):
            assert events.of(kind) == [], kind
    finally:
        for node in (a, b):
            node.stop(signal.SIGKILL)


# A drain so long that its second close would come long after any wait of the test.
LONG_DRAIN_PERIOD = 3600


async def test_second_signal_closes_everything_at_once(
    node_env: dict[str, str], tokens: TokenService
) -> None:
    a = start_node(node_env, "node-a", TOKEND_DRAIN_PERIOD=str(LONG_DRAIN_PERIOD))
    try:
        async with RawClient.connect(a.port) as first, RawClient.connect(a.port) as second:
            await first.hello(tokens.mint("first"))
            await second.hello(tokens.mint("second"))
            assert a.process is not None
            a.process.send_signal(signal.SIGTERM)
            # One of two closes at once, the other half an hour later: draining, not ready.
            timeout = EXIT_MARGIN + 20
            closes = [asyncio.create_task(c.expect_close(timeout)) for c in (first, second)]
            _, pending = await asyncio.wait(closes, return_when=asyncio.FIRST_COMPLETED)
            assert len(pending) == 1
            ready = await http_request(a.admin_port, "GET", "/readyz")
            assert ready.status == 503 and "drain" in ready.json(), ready
            a.process.send_signal(signal.SIGINT)
            # The second close comes now, not in half an hour; and the process exits.
            assert await exit_status(a, timeout) == 0
            codes = [(await task).code for task in closes]
            assert codes == [p.CloseCode.GOING_AWAY] * 2
    finally:
        a.stop(signal.SIGKILL)


async def test_the_connections_not_yet_closed_are_served_during_the_drain(
    start_app: Callable[..., Awaitable[App]], tokens: TokenService
) -> None:
    """Between two batches the loop serves the rest: a heartbeat is ACKed while the
    drain waits for its next batch; a hurry closes it at once."""
    app = await start_app(drain_period=LONG_DRAIN_PERIOD)
    async with RawClient.connect(app.port) as one, RawClient.connect(app.port) as two:
        for n, client in enumerate((one, two)):
            await client.hello(tokens.mint(f"drained-{n}"))
        hurry = asyncio.Event()
        drain = asyncio.create_task(app.drain(hurry))
        await eventually(lambda: len(app.connections) == 1, what="the first batch closed")
        (left,) = app.connections
        remaining = next(c for c in (one, two) if left.peer == "{}:{}".format(*c.ws.local_address))
        assert isinstance(await remaining.heartbeat(), p.HeartbeatAck)
        assert not drain.done()
        hurry.set()
        assert (await remaining.expect_close()).code == p.CloseCode.GOING_AWAY
        await drain


# A reload's old worker waits for the new workers (tokend/server/drain.py AcceptQueue) ---------

# Connections an old worker lets wait in the accept queue before it holds its 1001s.
QUEUE_LIMIT = 2


async def replaced_app_with_waiting_connects(
    start_app: Callable[..., Awaitable[App]],
    tokens: TokenService,
    period: float,
    stack: contextlib.AsyncExitStack,
) -> tuple[App, list[RawClient], list[socket.socket]]:
    """An app holding three sessions whose slot has a new worker (stop_accepting), with
    more connect attempts than QUEUE_LIMIT waiting in the listening socket's accept queue
    (nobody accepts them: the "new workers" are behind)."""
    app = await start_app(
        **CALM_CLOCKS, reload_drain_period=period, reload_accept_queue=QUEUE_LIMIT
    )
    clients = []
    for n in range(3):
        client = await stack.enter_async_context(RawClient.connect(app.port))
        await client.hello(tokens.mint(f"reloaded-{n}"))
        clients.append(client)
    port = app.port
    app.stop_accepting()
    queue = app.accept_queue
    assert queue is not None
    waiting = []
    for _ in range(QUEUE_LIMIT + 2):
        waiting.append(stack.enter_context(socket.create_connection(("127.0.0.1", port))))
    await eventually(lambda: queue.length() == len(waiting), what="the connects queued")
    return app, clients, waiting


async def test_a_reload_drain_holds_its_closes_while_the_new_workers_are_behind(
    start_app: Callable[..., Awaitable[App]],
    tokens: TokenService,
    tokend_logs: list[dict[str, str]],
) -> None:
    """No 1001 while more than reload_accept_queue connections wait to be accepted; once
    they are accepted the schedule goes on (its first batch at once)."""
    async with contextlib.AsyncExitStack() as stack:
        app, clients, waiting = await replaced_app_with_waiting_connects(
            start_app, tokens, LONG_DRAIN_PERIOD, stack
        )
        hurry = asyncio.Event()
        stack.callback(hurry.set)
        drain = asyncio.create_task(app.drain(hurry))
        # Unheld, the first batch would be closed at once: every client still gets ACKs.
        for _ in range(3):
            for client in clients:
                assert isinstance(await client.heartbeat(), p.HeartbeatAck)
        assert len(app.connections) == len(clients)
        assert any(e["event"].startswith("drain held") for e in tokend_logs), tokend_logs
        queue = app.accept_queue
        assert queue is not None
        for _ in waiting:
            queue.socket.accept()[0].close()
        await eventually(
            lambda: len(app.connections) < len(clients) or any(c.closing for c in app.connections),
            what="the first batch closing",
        )
        hurry.set()
        for client in clients:
            assert (await client.expect_close()).code == p.CloseCode.GOING_AWAY
        async with asyncio.timeout(10):
            await drain


async def test_a_held_reload_drain_ends_by_itself(
    start_app: Callable[..., Awaitable[App]], tokens: TokenService
) -> None:
    """New workers that never catch up hold the drain reload_drain_period at most: then
    every connection is closed on schedule, 1001, and the drain ends."""
    period = 1.0
    async with contextlib.AsyncExitStack() as stack:
        app, clients, _ = await replaced_app_with_waiting_connects(start_app, tokens, period, stack)
        drain = asyncio.create_task(app.drain(asyncio.Event()))
        for client in clients:
            closed = await client.expect_close(timeout=2 * period + 10)
            assert closed.code == p.CloseCode.GOING_AWAY
        async with asyncio.timeout(10):
            await drain


# A planned close costs no session (docs/protocol.md §5, "Planned close") --------

# A session silent for PARK_AT_S of its EXPIRE_S when the drain closes it: still ACTIVE
# (WARN_S away), and expired by its old clocks long before the grace runs out.
PARK_CLOCKS = {"heartbeat_interval": 1.0, "warn_after": 12.0, "expire_after": 13.0}
PARK_AT_S = 6.0
PARKED = 20


async def test_a_whole_restart_of_sessions_silent_most_of_their_clocks_costs_none(
    make_settings: Callable[..., Settings], tokens: TokenService, events: EventLog
) -> None:
    """`tokend serve` SIGTERMed while its sessions have been silent most of expire_after,
    no node serving for longer than their old clocks, then a node started again: every one
    resumes there; SESSION_PARKED for each, no WARN, no TOKEN_EXPIRED (a node back holds
    parked sessions while their clients come back: tokend.core.lifecycle.parked_hold)."""
    env = tokend_process.node_env(make_settings(**PARK_CLOCKS, drain_period=1.0))
    a = start_node(env, "node-a")
    back = None
    try:
        minted = [tokens.mint(f"parked-{n}") for n in range(PARKED)]
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(RawClient.connect(a.port)) for _ in minted]
            first_hello = time.monotonic()
            tids = [tid_of(await c.hello(token)) for c, token in zip(clients, minted, strict=True)]
            last_hello = time.monotonic()
            await asyncio.sleep(first_hello + PARK_AT_S - time.monotonic())  # silent
            assert a.process is not None
            a.process.send_signal(signal.SIGTERM)
            assert await exit_status(a, 10) == 0
            closed = time.monotonic()
            for client in clients:
                assert (await client.expect_close()).code == p.CloseCode.GOING_AWAY
        assert closed - last_hello < PARK_CLOCKS["warn_after"], "drained too late"
        # No node for longer than their clocks run, even from the close, then one back.
        await asyncio.sleep(closed + PARK_CLOCKS["expire_after"] + 2 - time.monotonic())
        back = start_node(env, "node-a")
        await asyncio.sleep(2)  # its sweeper runs: the parked sessions are due
        for token in minted:
            async with RawClient.connect(back.port) as client:
                assert (await client.hello(token)).resumed
        parked = events.of("SESSION_PARKED")
        assert sorted(e["tid"] for e in parked) == sorted(tids)
        assert {(e["reason"], e["node"]) for e in parked} == {("going_away", "node-a")}
        assert events.of("TOKEN_EXPIRED") == events.of("SESSION_WARN") == []
    finally:
        for node in (a, back):
            if node is not None:
                node.stop(signal.SIGKILL)


async def test_parked_sessions_whose_clients_never_come_back_end_within_expire_after(
    make_settings: Callable[..., Settings], tokens: TokenService, events: EventLog
) -> None:
    """A node drains and never comes back, another serves all along and no client
    returns: no restart resumes the shard's parked sessions, so each ends expire_after
    after its close (its heartbeat), one sweep late at most."""
    env = tokend_process.node_env(make_settings(**PARK_CLOCKS, drain_period=0.2))
    b = start_node(env, "node-b")
    await asyncio.sleep(PARK_CLOCKS["warn_after"])  # node-b has served longer than the hold
    a = start_node(env, "node-a")
    try:
        minted = [tokens.mint(f"gone-{n}") for n in range(5)]
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(RawClient.connect(a.port)) for _ in minted]
            tids = [tid_of(await c.hello(token)) for c, token in zip(clients, minted, strict=True)]
            assert a.process is not None
            a.process.send_signal(signal.SIGTERM)
            assert await exit_status(a, 10) == 0
        parked = {e["tid"]: e["at"] for e in events.of("SESSION_PARKED")}
        assert sorted(parked) == sorted(tids)
        for tid in tids:
            (expired,) = await events.wait_for("TOKEN_EXPIRED", tid, timeout=30)
            lag = expired["at"] - parked[tid] - PARK_CLOCKS["expire_after"] * 1000
            assert 0 <= lag < 1_500, expired
    finally:
        for node in (a, b):
            node.stop(signal.SIGKILL)


async def test_a_warn_session_closed_by_the_drain_keeps_its_clocks(
    start_app: Callable[..., Awaitable[App]], tokens: TokenService, events: EventLog
) -> None:
    """Silent past warn_after before the close: it expires on its old schedule (swept by
    the other node), while an ACTIVE one closed by the same drain is parked."""
    clocks = {
        **SHORT_CLOCKS,
        "warn_after": 1.5,
        "expire_after": 4.0,
        "drain_period": 0.1,
    }
    a = await start_app(node_name="node-a", **clocks)
    b = await start_app(node_name="node-b", **clocks)
    async with RawClient.connect(a.port) as silent, RawClient.connect(a.port) as active:
        warned = tid_of(await silent.hello(tokens.mint("silent")))
        silent_since = (await events.wait_for("SESSION_STARTED", warned))[0]["at"]
        kept = tid_of(await active.hello(tokens.mint("active")))
        await events.wait_for("SESSION_WARN", warned)
        await active.heartbeat()
        await a.drain(asyncio.Event())
        for client in (silent, active):
            assert (await client.expect_close()).code == p.CloseCode.GOING_AWAY
    (expired,) = await events.wait_for("TOKEN_EXPIRED", warned, timeout=10)
    # On its old schedule: expire_after after its last sign of life, one sweep late at most.
    assert 0 <= expired["at"] - silent_since - 4_000 < 1_000, expired
    assert events.of("SESSION_PARKED", warned) == []
    assert [e["reason"] for e in events.of("SESSION_PARKED", kept)] == ["going_away"]
    async with RawClient.connect(b.port) as client:
        assert (await client.hello(tokens.mint("active", tid=uuid.UUID(kept)))).resumed
    assert events.of("TOKEN_EXPIRED", kept) == []


async def test_the_session_is_parked_before_its_client_hears_the_1001(
    start_app: Callable[..., Awaitable[App]],
    tokens: TokenService,
    redis: Redis,
    events: EventLog,
) -> None:
    """The client that reconnects at once, with a v1 HELLO, to another node finds its
    session parked, not held live by the connection being closed (4509): here the client
    does not even answer the close, so that connection lingers on node-a."""
    a = await start_app(node_name="node-a", drain_period=0.1)
    b = await start_app(node_name="node-b")
    token = tokens.mint("quick")
    client = await WireClient.open(a.port)
    try:
        await client.send(Frame(Opcode.BINARY, p.encode(p.Hello(token))))
        tid = tid_of(await client.welcome())
        drain = asyncio.create_task(a.drain(asyncio.Event()))
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(5):  # read the close frame, and answer nothing
            while client.protocol.close_rcvd is None:
                client.protocol.receive_data(await loop.sock_recv(client.sock, 65536))
                list(client.protocol.events_received())
        assert client.protocol.close_rcvd.code == p.CloseCode.GOING_AWAY
        fields = replies.fields(
            await redis.hgetall(a.node.store.keys.session_keys(uuid.UUID(tid))[0])
        )
        assert "conn" not in fields and fields["left"].startswith("node-a/")
        async with RawClient.connect(b.port) as again:
            assert (await again.hello(token)).resumed
        assert [e["reason"] for e in events.of("SESSION_PARKED", tid)] == ["going_away"]
        await drain
    finally:
        client.close()


async def test_an_unplanned_end_releases_the_session_and_changes_no_clock(
    start_app: Callable[..., Awaitable[App]], tokens: TokenService, redis: Redis
) -> None:
    """The client's network drops (the server sees its TCP connection end): no connection
    holds the session now, its clocks and deadline are as they were, nothing is emitted."""
    app = await start_app(heartbeat_interval=1, warn_after=20, expire_after=30)
    async with RawClient.connect(app.port) as client:
        tid = tid_of(await client.hello(tokens.mint("dropped")))
        await client.heartbeat()
        hash_key = app.node.store.keys.session_keys(uuid.UUID(tid))[0]
        due_key = app.node.store.keys.script_keys(uuid.UUID(tid))[0]
        before = await redis.hgetall(hash_key)
        deadline = await redis.zscore(due_key, tid)
        assert client.ws.transport is not None
        client.ws.transport.abort()  # a reset, no closing handshake

        async def released() -> dict[str, str] | None:
            fields = replies.fields(await redis.hgetall(hash_key))
            return fields if "conn" not in fields else None

        after = await eventually(released, what="the session released")
    assert after == {**{k: v for k, v in before.items() if k != "conn"}, "left": before["conn"]}
    assert await redis.zscore(due_key, tid) == deadline
    stream = await read_events(redis, app.settings.key_prefix)  # written with the release
    assert [e["type"] for e in stream if e["tid"] == tid] == ["SESSION_STARTED"]
