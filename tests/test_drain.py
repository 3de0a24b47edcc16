"""Graceful drain on SIGTERM (tokend/server.py App.drain) with real tokend processes."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from testkit import tokend_process
from testkit.clients import RawClient
from testkit.events import EventLog
from testkit.net import http_request
from testkit.tokend_process import TokendProcess
from tokend import protocol as p
from tokend.config import Settings
from tokend.tokens import TokenService

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
            async with RawClient.connect(b.port) as client:
                welcome = await client.hello(token)
                assert welcome.resumed
                await client.heartbeat()
                resumed.append(str(uuid.UUID(bytes=welcome.tid)))

        clients = [asyncio.create_task(session(n)) for n in range(SESSIONS)]
        async with asyncio.timeout(20):
            for _ in range(SESSIONS):
                await connected.acquire()
        assert a.process is not None
        signalled = time.monotonic()
        a.process.send_signal(signal.SIGTERM)
        assert await exit_status(a, DRAIN_PERIOD + EXIT_MARGIN + 5) == 0
        exited = time.monotonic() - signalled
        async with asyncio.timeout(10):
            await asyncio.gather(*clients)
        await events.wait_for("SESSION_RESUMED", count=SESSIONS, timeout=5)

        assert exited <= DRAIN_PERIOD + EXIT_MARGIN, exited
        assert max(closed_at) - min(closed_at) >= DRAIN_PERIOD / 2, "closes not spread"
        assert sorted(e["tid"] for e in events.of("SESSION_RESUMED")) == sorted(resumed)
        for kind in ("TOKEN_EXPIRED", "SESSION_CLOSED", "TOKEN_REVOKED"):
            assert events.of(kind) == [], kind
    finally:
        for node in (a, b):
            node.stop(signal.SIGKILL)


async def test_second_signal_closes_everything_at_once(
    node_env: dict[str, str], tokens: TokenService
) -> None:
    a = start_node(node_env, "node-a", TOKEND_DRAIN_PERIOD="60")
    try:
        async with RawClient.connect(a.port) as first, RawClient.connect(a.port) as second:
            await first.hello(tokens.mint("first"))
            await second.hello(tokens.mint("second"))
            assert a.process is not None
            a.process.send_signal(signal.SIGTERM)
            # One of two closes at once, the other 30 s later: draining, and not ready.
            closes = [asyncio.create_task(c.expect_close(timeout=10)) for c in (first, second)]
            _, pending = await asyncio.wait(closes, return_when=asyncio.FIRST_COMPLETED)
            assert len(pending) == 1
            ready = await http_request(a.admin_port, "GET", "/readyz")
            assert ready.status == 503 and "drain" in ready.json(), ready
            signalled = time.monotonic()
            a.process.send_signal(signal.SIGINT)
            assert await exit_status(a, 10) == 0
            assert time.monotonic() - signalled < EXIT_MARGIN
            codes = [(await task).code for task in closes]
            assert codes == [p.CloseCode.GOING_AWAY] * 2
    finally:
        a.stop(signal.SIGKILL)
