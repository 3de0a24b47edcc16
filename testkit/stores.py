"""The store (tokend/store/sessions.py) of node-a on the test Redis, with clocks long
enough that no session changes state while a test reads it; sessions started in it
directly, and the control messages each node hears. For tests/test_store.py and the
tests that use the store the same way (the Lua contract, capacity fixes).

The fixtures ``store`` and ``control`` need tests/conftest.py's ``make_settings`` and
``redis``; a test module imports them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
from redis.asyncio import Redis

from testkit.events import EventLog
from tokend.config import Settings
from tokend.core.lifecycle import Clocks
from tokend.store.redis_client import open_client
from tokend.store.sessions import Store

WARN_MS, EXPIRE_MS = 20_000, 40_000
CLOCKS = Clocks(WARN_MS, EXPIRE_MS)
HEARTBEAT_MS, RESTART_GRACE_MS = 5_000, 30_000


@pytest.fixture
async def store(make_settings: Callable[..., Settings]) -> AsyncIterator[Store]:
    """The store of node-a (the settings' node name)."""
    settings = make_settings(
        heartbeat_interval=HEARTBEAT_MS / 1000,
        warn_after=WARN_MS / 1000,
        expire_after=EXPIRE_MS / 1000,
        restart_grace=RESTART_GRACE_MS / 1000,
    )
    client = open_client(settings.redis_url, settings)
    yield Store(client, settings, "node-a")
    await client.aclose()


@pytest.fixture
async def control(redis: Redis, store: Store) -> AsyncIterator[dict[str, EventLog]]:
    """The control messages each node hears, by node name."""
    async with (
        EventLog(redis, store.keys.control_channel("node-a")) as node_a,
        EventLog(redis, store.keys.control_channel("node-b")) as node_b,
    ):
        yield {"node-a": node_a, "node-b": node_b}


def proof_of(conn: str) -> bytes:
    """A resume proof for connection ``conn`` to keep with its session (any 16 bytes do)."""
    return conn.encode().ljust(16, b".")[:16]


async def started(store: Store, conn: str) -> uuid.UUID:
    """A session of "alice" started on connection ``conn``, for 60 s."""
    tid = uuid.uuid4()
    now = int(time.time())
    answer = await store.hello(tid, "alice", 5, now, now + 60, conn, proof=proof_of(conn))
    assert answer.outcome == "started"
    return tid


async def redis_ms(store: Store) -> int:
    seconds, micros = await store.redis.time()
    return seconds * 1000 + micros // 1000


async def sweep(store: Store, tids: list[uuid.UUID]) -> dict[str, tuple[str, str]]:
    """Make ``tids`` due now and sweep: the transitions made, by tid."""
    for tid in tids:
        await store.redis.zadd(store.keys.script_keys(tid)[0], {str(tid): 0})
    swept = await store.sweep(100)
    return {tid: (what, conn) for tid, what, conn in swept.made}
