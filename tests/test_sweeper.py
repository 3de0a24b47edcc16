"""The sweeper (tokend/store/sweeper.py, sweep.lua) on a real Redis: each due transition made
exactly once, whoever sweeps and whatever is lost on the way, WARN before EXPIRED, and at
most a batch a shard per call (docs/protocol.md "Session states and clocks", Sweeping).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio import Redis

from testkit.clients import RawClient, tid_of
from testkit.events import after_a_full_sweep, left_to_judge, read_events
from testkit.proxies import LatencyProxy
from testkit.redis_servers import RedisProcess
from testkit.waiting import eventually
from tokend.config import Settings
from tokend.metrics import Metrics
from tokend.ops.app import App
from tokend.store.redis_client import open_client
from tokend.store.sessions import HelloRequest, Store
from tokend.store.sweeper import Sweeper
from tokend.store.unavailable import StoreUnavailable
from tokend.tokens.service import TokenService

# Long clocks: nothing falls due unless a test makes it due.
WARN_MS, EXPIRE_MS = 30_000, 60_000
BATCH = 5


@pytest.fixture
def long_settings(make_settings: Callable[..., Settings]) -> Callable[..., Settings]:
    def make(**overrides: Any) -> Settings:
        return make_settings(warn_after=WARN_MS / 1000, expire_after=EXPIRE_MS / 1000, **overrides)

    return make


@pytest.fixture
async def open_store(long_settings: Callable[..., Settings]) -> AsyncIterator[Callable[..., Store]]:
    """Stores of nodes on one keyspace, each with its own Redis client; closed at teardown."""
    stores: list[Store] = []

    def open_one(node: str, **overrides: Any) -> Store:
        settings = long_settings(**overrides)
        store = Store(open_client(settings.redis_url, settings), settings, node)
        stores.append(store)
        return store

    yield open_one
    for store in stores:
        await store.redis.aclose()


def tid_in_shard(shard: int) -> uuid.UUID:
    """A random tid whose shard (its last hex digits, mod 16) is ``shard``."""
    return uuid.UUID(int=(uuid.uuid4().int & ~0xF) | shard)


async def silent_sessions(
    store: Store, tids: list[uuid.UUID], silent_ms: int, conn_node: str = "node-z"
) -> list[str]:
    """Start a session for each tid (held by a connection of ``conn_node``), silent for
    ``silent_ms`` and due now."""
    now = int(time.time())
    requests = [
        HelloRequest(tid, "sub", 5, now, now + 600, f"{conn_node}/{n}")
        for n, tid in enumerate(tids)
    ]
    assert {a.outcome for a in await store.hellos(requests)} == {"started"}
    seconds, micros = await store.redis.time()
    hb = seconds * 1000 + micros // 1000 - silent_ms
    for tid in tids:
        await store.redis.hset(store.keys.session_keys(tid)[0], "hb", hb)
        await store.redis.zadd(store.keys.script_keys(tid)[0], {str(tid): 0})
    return [str(tid) for tid in tids]


async def expired_in_streams(store: Store) -> Counter[str]:
    """TOKEN_EXPIRED events per tid in the durable streams."""
    events = await read_events(store.redis, store.keys.prefix)
    return Counter(e["tid"] for e in events if e["type"] == "TOKEN_EXPIRED")


async def sweep_until_done(store: Store, made: Counter[str], most: int = 100) -> None:
    """Sweep with ``store`` until no shard filled its batch (at most ``most`` sweeps)."""
    for _ in range(most):
        swept = await store.sweep(BATCH)
        made.update(tid for tid, _, _ in swept.made)
        if not swept.full:
            return
    raise AssertionError(f"still sweeping after {most} sweeps")


async def test_two_nodes_sweeping_at_once_expire_each_session_once(
    open_store: Callable[..., Store],
) -> None:
    """Four sweep loops of two nodes race over the same due sessions, a few a shard per
    call: each session is expired by exactly one of them, with one TOKEN_EXPIRED."""
    node_a, node_b = open_store("node-a"), open_store("node-b")
    tids = await silent_sessions(node_a, [uuid.uuid4() for _ in range(200)], EXPIRE_MS + 1_000)
    made: Counter[str] = Counter()
    await asyncio.gather(*(sweep_until_done(s, made) for s in (node_a, node_b) * 2))
    assert made == Counter(tids)
    assert await expired_in_streams(node_a) == Counter(tids)
    assert await left_to_judge(node_a.redis, node_a.keys.prefix, tids) == []


class LossyLink(LatencyProxy):
    """A TCP proxy to Redis that, once :meth:`cut`, drops what one side sends: the requests
    (Redis never gets them) or the replies (Redis runs them; the node never hears)."""

    dropping: str | None = None  # "request" or "reply"

    def cut(self, what: str) -> None:
        self.dropping = what

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, delayed: bool
    ) -> None:
        side = "request" if delayed else "reply"  # LatencyProxy delays the requests
        with contextlib.suppress(OSError):
            while chunk := await reader.read(65536):
                if self.dropping != side:
                    writer.write(chunk)
                    await writer.drain()
        writer.close()


@pytest.mark.parametrize("lost", ["request", "reply"])
async def test_a_sweep_cut_from_redis_neither_loses_nor_doubles_an_expiry(
    open_store: Callable[..., Store], redis_server: RedisProcess, lost: str
) -> None:
    """Node A's sweep is cut from Redis on its way there (nothing done) or on its way back
    (done, A never hears): either way node B's sweep then leaves each session expired
    once, at once (no lease to wait out)."""
    node_b = open_store("node-b")
    tids = await silent_sessions(node_b, [uuid.uuid4() for _ in range(40)], EXPIRE_MS + 1_000)
    await node_b.load_scripts()
    async with LossyLink(redis_server.port) as link:
        node_a = open_store("node-a", redis_url=link.url, redis_timeout=0.5)
        await node_a.redis.ping()  # connected through the link, before the cut
        link.cut(lost)
        with pytest.raises(StoreUnavailable):
            await node_a.sweep(BATCH * 10)
    made: Counter[str] = Counter()
    await sweep_until_done(node_b, made)
    assert made == (Counter(tids) if lost == "request" else Counter())
    assert await expired_in_streams(node_b) == Counter(tids)
    assert await left_to_judge(node_b.redis, node_b.keys.prefix, tids) == []


async def test_two_sweeping_nodes_warn_then_expire_each_session_once(
    start_app: Callable[..., Awaitable[App]], tokens: TokenService, redis: Redis
) -> None:
    """Sessions left silent on node A, both nodes sweeping: each is warned once, then
    expired once, in that order, in the streams."""
    node_a = await start_app(node_name="node-a")
    node_b = await start_app(node_name="node-b")
    tids = []
    for n in range(12):
        async with RawClient.connect(node_a.port) as client:
            tids.append(tid_of(await client.hello(tokens.mint(f"quiet-{n}"))))
    prefix = node_a.settings.key_prefix

    async def all_expired() -> bool:
        events = await read_events(redis, prefix)
        return {e["tid"] for e in events if e["type"] == "TOKEN_EXPIRED"} >= set(tids)

    await eventually(all_expired, 10)
    assert node_a.admin is not None and node_b.admin is not None
    await after_a_full_sweep(node_a.admin.port, node_b.admin.port)
    assert await left_to_judge(redis, prefix, tids) == []
    kinds = ("SESSION_WARN", "TOKEN_EXPIRED")
    events = [e for e in await read_events(redis, prefix) if e["type"] in kinds]
    for tid in tids:
        assert [e["type"] for e in events if e["tid"] == tid] == list(kinds), tid


async def test_a_sweep_judges_at_most_its_batch_a_shard_and_sweeps_again_at_once(
    open_store: Callable[..., Store], long_settings: Callable[..., Settings]
) -> None:
    """2 x BATCH + 1 due sessions in one shard: a sweep judges BATCH of them and the
    sweeper goes again without a pause, until the last one is judged."""
    store = open_store("node-a")
    shard = 3
    tids = await silent_sessions(
        store, [tid_in_shard(shard) for _ in range(2 * BATCH + 1)], EXPIRE_MS + 1_000, "node-a"
    )
    other = await silent_sessions(store, [tid_in_shard(shard + 1)], EXPIRE_MS + 1_000, "node-a")
    acted: list[tuple[str, str, str, int | None]] = []
    sweeper = Sweeper(
        store,
        long_settings(),
        Metrics(),
        lambda *told: acted.append(told),
        lambda: False,
        batch=BATCH,
    )
    pauses = [await sweeper.sweep_once() for _ in range(3)]
    assert pauses[:2] == [0.0, 0.0] and pauses[2] > 0
    assert len(acted) == len(tids) + len(other)
    assert {tid for _, tid, _, _ in acted} == set(tids + other)
    # Its own connections (node-a's) are closed directly, with 4505; none published.
    assert {(op, code) for op, _, _, code in acted} == {("close", 4505)}
    assert await expired_in_streams(store) == Counter(tids + other)
