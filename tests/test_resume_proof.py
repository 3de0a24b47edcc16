"""A copied token cannot take a live session (spec "Resume proof", revision 2).

Real tokend apps on the test Redis, clients built from the spec's bytes (testkit's
RawClient): a thief who holds only the token against the rightful client, which drops
its network (its old TCP connection still open on the server, silent) and comes back
with the proof of its last WELCOME's key, on the same node or another.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import pytest
from redis.asyncio import Redis

from testkit.clients import Closed, RawClient, proof_of, resumes, tid_of
from testkit.events import EventLog
from testkit.waiting import eventually
from tokend.core import protocol as p
from tokend.core.lifecycle import HELD_LIVE_SLACK_MS
from tokend.ops.app import App
from tokend.tokens.service import TokenService

StartApp = Callable[..., Awaitable[App]]
# Clocks under which a silent session outlives the held-live window by far (it is
# heartbeat_interval + 15 s), so that only that window decides.
CLOCKS = {"heartbeat_interval": 0.5, "warn_after": 25.0, "expire_after": 40.0}
WINDOW_S = CLOCKS["heartbeat_interval"] + HELD_LIVE_SLACK_MS / 1000


async def refused(port: int, token: str, proof: bytes | None = None) -> Closed:
    """A new connection's HELLO, answered with a close: that close."""
    async with RawClient.connect(port) as client:
        await client.send(p.encode(p.Hello(token, proof=proof)))
        return await client.expect_close()


@contextlib.asynccontextmanager
async def heartbeating(client: RawClient) -> AsyncIterator[list[p.HeartbeatAck]]:
    """The client heartbeats on its cadence meanwhile: the ACKs it got, as they come."""
    acks: list[p.HeartbeatAck] = []

    async def beat() -> None:
        while True:
            acks.append(await client.heartbeat())
            await asyncio.sleep(CLOCKS["heartbeat_interval"])

    task = asyncio.create_task(beat())
    try:
        await eventually(lambda: acks, what="a first ACK")
        yield acks
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_thief_with_the_token_alone_is_4509_and_the_rightful_client_goes_on(
    start_app: StartApp, tokens: TokenService, events: EventLog
) -> None:
    app = await start_app(**CLOCKS)
    token = tokens.mint("alice")
    async with RawClient.connect(app.port) as rightful:
        tid = tid_of(await rightful.hello(token))
        async with heartbeating(rightful) as acks:
            for _ in range(3):  # a thief that keeps trying gets nowhere
                closed = await refused(app.port, token)
                assert (closed.code, closed.reason) == (4509, "session_in_use")
            before = len(acks)
            await eventually(lambda: len(acks) >= before + 2, what="more ACKs")
        assert rightful.ws.close_code is None  # untouched
        await rightful.send(p.encode(p.Bye()))
        assert (await rightful.expect_close()).code == p.CloseCode.NORMAL
    # The session's events come in order: a resume by a thief would be before its close.
    await events.wait_for("SESSION_CLOSED", tid)
    assert events.of("SESSION_RESUMED", tid) == []


async def test_the_rightful_client_back_from_a_dropped_network_takes_over_at_once(
    start_app: StartApp, tokens: TokenService, events: EventLog
) -> None:
    """Its old TCP connection is still open on the server and silent, so the session is
    held live: a HELLO with the proof of the last WELCOME takes it over at once (the old
    connection 4507), one without is 4509, before and after."""
    app = await start_app(**CLOCKS)
    token = tokens.mint("alice")
    async with RawClient.connect(app.port) as old:
        first = await old.hello(token)
        await old.heartbeat()  # then its network drops: nothing more from it
        assert (await refused(app.port, token)).code == p.CloseCode.SESSION_IN_USE
        async with RawClient.connect(app.port) as back:
            started = time.monotonic()
            second = await back.hello(token, proof_of(first))
            assert second.resumed and second.session_key != first.session_key
            closed = await old.expect_close()
            assert (closed.code, closed.reason) == (4507, "taken_over")
            assert time.monotonic() - started < 5  # at once, not after a window
            assert (await refused(app.port, token)).code == p.CloseCode.SESSION_IN_USE
            assert (await back.heartbeat()).seq == 1
    assert len(events.of("SESSION_RESUMED", tid_of(first))) == 1


async def test_a_stale_proof_is_4509_while_the_session_is_held_live(
    start_app: StartApp, tokens: TokenService
) -> None:
    """The proof of an older WELCOME (the client missed the newer one) is no proof."""
    app = await start_app(**CLOCKS)
    token = tokens.mint("alice")
    async with RawClient.connect(app.port) as first_conn:
        first = await first_conn.hello(token)
        async with RawClient.connect(app.port) as second_conn:
            second = await second_conn.hello(token, proof_of(first))
            async with heartbeating(second_conn):
                closed = await refused(app.port, token, proof_of(first))
                assert (closed.code, closed.reason) == (4509, "session_in_use")
                async with RawClient.connect(app.port) as third_conn:
                    assert (await third_conn.hello(token, proof_of(second))).resumed


async def test_a_v1_hello_resumes_a_session_whose_connection_is_gone(
    start_app: StartApp, tokens: TokenService, redis: Redis
) -> None:
    """Its connection ended: its node released the session (no ``conn``), so a HELLO
    without a proof resumes it at once."""
    app = await start_app(**CLOCKS)
    token = tokens.mint("alice")
    async with RawClient.connect(app.port) as gone:
        tid = tid_of(await gone.hello(token))
        await gone.heartbeat()
    key = app.node.store.keys.session_keys(uuid.UUID(tid))[0]
    await eventually(lambda: _released(redis, key), what="the session released")
    async with RawClient.connect(app.port) as client:
        assert (await client.hello(token)).resumed


async def _released(redis: Redis, key: str) -> bool:
    return not await redis.hexists(key, "conn") and await redis.hexists(key, "left")


async def test_a_v1_hello_resumes_a_session_silent_past_the_window(
    start_app: StartApp, tokens: TokenService
) -> None:
    """The holding connection stays open and says nothing: a HELLO without a proof is
    4509 until heartbeat_interval + 15 s after its last heartbeat, then it resumes (a v1
    client, or a thief who waited that long: docs/security.md)."""
    app = await start_app(**CLOCKS)
    token = tokens.mint("alice")
    async with RawClient.connect(app.port) as silent:
        await silent.hello(token)
        await silent.heartbeat()
        last_ack = time.monotonic()
        assert (await refused(app.port, token)).code == p.CloseCode.SESSION_IN_USE

        await eventually(
            partial(resumes, app.port, token), WINDOW_S + 10, interval=1.0, what="a resume"
        )
        # Not before the window: the node answered within it by Redis time, give or take
        # the round trips around the ACK that the test's clock cannot see.
        assert time.monotonic() - last_ack >= WINDOW_S - 1
        assert (await silent.expect_close()).code == p.CloseCode.TAKEN_OVER


async def test_a_proof_made_on_one_node_is_checked_on_another(
    start_app: StartApp, tokens: TokenService
) -> None:
    """node-b never saw the key node-a made: the store's digest decides."""
    a = await start_app(node_name="node-a", **CLOCKS)
    b = await start_app(node_name="node-b", **CLOCKS)
    token = tokens.mint("alice")
    async with RawClient.connect(a.port) as on_a:
        welcome = await on_a.hello(token)
        await on_a.heartbeat()
        assert (await refused(b.port, token)).code == p.CloseCode.SESSION_IN_USE
        async with RawClient.connect(b.port) as on_b:
            assert (await on_b.hello(token, proof_of(welcome))).resumed
            closed = await on_a.expect_close()
            assert (closed.code, closed.reason) == (4507, "taken_over")
            assert (await on_b.heartbeat()).seq == 1


@pytest.mark.parametrize("proof", [None, bytes(16)], ids=["v1", "any-proof"])
async def test_a_new_session_starts_with_or_without_a_proof(
    start_app: StartApp, tokens: TokenService, proof: bytes | None
) -> None:
    app = await start_app(**CLOCKS)
    async with RawClient.connect(app.port) as client:
        assert not (await client.hello(tokens.mint("bob"), proof)).resumed
