"""The cluster-wide state counts (Queries.counts) against a full count of the store.

The scripts move each shard's counts in the same atomic step as the states they count
(count_key in tokend/store/lua/_prelude.lua). Here every script that changes a state runs,
in a seeded random order, on a few sessions, and after each step the counts must equal a
census: every session hash read by one script, in one atomic step of Redis, and the ended
sessions counted from the events in the streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis import asyncio as aioredis
from redis.asyncio import Redis
from websockets.exceptions import ConnectionClosed

from testkit import replies
from testkit.clients import Closed, RawClient, proof_of
from testkit.net import admin_json
from testkit.redis_servers import RedisProcess
from testkit.stores import EXPIRE_MS, WARN_MS, redis_ms, store, sweep
from testkit.tokend_process import TokendProcess, running_nodes
from testkit.waiting import eventually
from tokend.config import Settings
from tokend.core import protocol as p
from tokend.core.store_messages import Ended, Known
from tokend.store.keyspace import SHARDS, Keyspace
from tokend.store.queries import Counts
from tokend.store.sessions import HelloRequest, Store
from tokend.tokens.service import TokenService

__all__ = ["store"]  # a fixture of testkit

SEED = int(os.environ.get("TOKEND_COUNTS_SEED", "1"))
STEPS = 400
TIDS = 12  # few, so that each is met in many states

# Every session hash of the prefix by state, and every WARN set and deadline set size,
# in one step of Redis: nothing can change between the reads.
CENSUS = """
local states = {}
for _, key in ipairs(redis.call('KEYS', ARGV[1] .. ':{' .. ARGV[1] .. ':*}:s:*')) do
  local st = redis.call('HGET', key, 'st')
  states[st] = (states[st] or 0) + 1
end
return cjson.encode(states)
"""

TRANSITIONS = {
    "SESSION_STARTED",
    "SESSION_RESUMED",
    "SESSION_WARN",
    "SESSION_RECOVERED",
    "SESSION_PARKED",
    "SESSION_RESTORED",
    "SESSION_CLOSED",
    "TOKEN_EXPIRED",
    "TOKEN_REVOKED",
}
EVENT_OF = {
    Ended.EXPIRED: "TOKEN_EXPIRED",
    Ended.REVOKED: "TOKEN_REVOKED",
    Ended.CLOSED: "SESSION_CLOSED",
}


async def events(keys: Keyspace, redis: Redis) -> list[dict[str, Any]]:
    return [
        json.loads(fields["event"])
        for stream in keys.streams()
        for _, fields in replies.entries(await redis.xrange(stream))
    ]


async def census(keys: Keyspace, redis: Redis) -> Counts:
    """The counts as a full reading of the store finds them."""
    states = json.loads(await redis.eval(CENSUS, 0, keys.prefix))
    # A session's end event (a token barred unused has no sub).
    ended = Counter(e["type"] for e in await events(keys, redis) if "sub" in e)
    return Counts(
        states.get("ACTIVE", 0),
        states.get("WARN", 0),
        {how.value: ended[event] for how, event in EVENT_OF.items()},
    )


@dataclass
class Held:
    """What the test knows of a session it started: the connection holding it."""

    conn: str
    since_ms: int
    exp_s: int


class Driver:
    """Random steps through every script that changes a state."""

    def __init__(self, store: Store, redis: Redis, rng: random.Random) -> None:
        self.store = store
        self.redis = redis
        self.rng = rng
        self.tids = [uuid.uuid4() for _ in range(TIDS)]
        self.held: dict[uuid.UUID, Held] = {}
        self.conns = 0
        self.made: Counter[str] = Counter()

    def _conn(self) -> str:
        self.conns += 1
        return f"node-{self.rng.choice('ab')}/{self.conns}"

    async def hello(self, tid: uuid.UUID) -> None:
        """Start a session, or resume it on a new connection (with its proof)."""
        now_s = int(time.time())
        conn = self._conn()
        answer = (
            await self.store.hellos(
                [HelloRequest(tid, "s", 5, now_s, now_s + 3600, conn, b"p" * 16, b"p" * 16)]
            )
        )[0]
        if answer.since_ms:
            self.held[tid] = Held(conn, answer.since_ms, now_s + 3600)

    async def heartbeat(self, tid: uuid.UUID) -> None:
        held = self.held.get(tid)
        conn = held.conn if held else self._conn()
        known = Known("s", 5, 0, held.exp_s * 1000, held.since_ms, b"p" * 16) if held else None
        await self.store.record_heartbeats(
            [self.store.heartbeat_request(tid, conn)], [], lambda _: known
        )

    async def silence(self, tid: uuid.UUID) -> None:
        """Time passes for the session: its last heartbeat long ago (WARN or EXPIRED due),
        or its token's exp passed; then a sweep."""
        now = await redis_ms(self.store)
        key = self.store.keys.session_keys(tid)[0]
        field, back = self.rng.choice(
            [("hb", WARN_MS + 1000)] * 2 + [("hb", EXPIRE_MS + 1000), ("exp", 1000)]
        )
        if await self.redis.exists(key):
            await self.redis.hset(key, field, now - back)
        await sweep(self.store, [tid])

    async def lapse(self, tid: uuid.UUID) -> None:
        """The session hash expires in Redis before any sweep judged it (no node swept
        for expire_after past its exp); the next sweep finds it gone."""
        await self.redis.pexpireat(self.store.keys.session_keys(tid)[0], 1)  # gone at once
        await sweep(self.store, [tid])

    async def bye(self, tid: uuid.UUID) -> None:
        held = self.held.get(tid)
        await self.store.end(
            tid,
            conn=held.conn if held else "node-a/0",
            event="SESSION_CLOSED",
            tomb=Ended.CLOSED,
            code=None,
        )

    async def revoke(self, tid: uuid.UUID) -> None:
        await self.store.revoke(tid, by="test")

    async def release(self, tid: uuid.UUID) -> None:
        held = self.held.get(tid)
        if held:
            reason = self.rng.choice(["", "going_away"])
            await self.store.releases(
                [self.store.release_request(tid, held.conn, held.since_ms, reason)]
            )

    async def step(self) -> str:
        tid = self.rng.choice(self.tids)
        action = self.rng.choice(
            [self.hello] * 3 + [self.heartbeat] * 4 + [self.silence] * 3
            + [self.release] * 2 + [self.lapse, self.bye, self.revoke]
        )  # fmt: skip
        await action(tid)
        self.made[action.__name__] += 1
        if await self.redis.exists(self.store.keys.session_keys(tid)[1]):
            # Ended: its token is barred; a fresh one keeps sessions coming.
            self.tids[self.tids.index(tid)] = uuid.uuid4()
            self.held.pop(tid, None)
        return f"{action.__name__} {tid}"


async def test_the_counts_equal_a_census_after_every_script(store: Store, redis: Redis) -> None:
    driver = Driver(store, redis, random.Random(SEED))
    for n in range(STEPS):
        what = await driver.step()
        counts, full = await store.queries.counts(), await census(store.keys, redis)
        assert counts == full, f"seed {SEED}, step {n}: {what}"
    # The walk made every transition, or it proves little.
    made = Counter(event["type"] for event in await events(store.keys, redis))
    assert min(made.values()) >= 3 and len(made) == len(TRANSITIONS), made
    assert min(driver.made.values()) >= 10, driver.made


async def test_the_counts_are_where_the_keyspace_names_them(store: Store, redis: Redis) -> None:
    """The scripts write the counts under the shard's own hash tag (one slot per shard),
    at the keys Keyspace.count_keys names."""
    tid = uuid.uuid4()
    now_s = int(time.time())
    await store.hello(tid, "s", 5, now_s, now_s + 60, "node-a/1")
    warn, ended = store.keys.count_keys(store.keys.shard(tid))
    await redis.hset(store.keys.session_keys(tid)[0], "hb", await redis_ms(store) - WARN_MS)
    await sweep(store, [tid])
    assert await redis.smembers(warn) == {str(tid)}
    await store.revoke(tid, by="test")
    assert await redis.smembers(warn) == set()
    assert await redis.hgetall(ended) == {Ended.REVOKED.value: "1"}
    counted = {key for n in range(SHARDS) for key in store.keys.count_keys(n)}
    written = {key async for key in redis.scan_iter(f"{store.keys.prefix}:*")}
    assert written & counted == {ended}
    assert await store.queries.counts() == Counts(0, 0, {"expired": 0, "revoked": 1, "closed": 0})


# --- live: nodes and Redis failing --------------------------------------------------------

ADMIN_TOKEN = "counts-admin-token-of-32-characters"
LIVE_CLOCKS = {
    "heartbeat_interval": 0.5,
    "warn_after": 2.0,
    "expire_after": 4.0,
    "sweep_interval": 0.05,
    "redis_timeout": 1.0,
}


async def beating(client: RawClient) -> None:
    """Heartbeats at twice the cadence until cancelled or the connection ends."""
    with contextlib.suppress(Closed, ConnectionClosed, TimeoutError):
        while True:
            await client.heartbeat()
            await asyncio.sleep(0.25)


async def test_the_counts_stay_exact_through_a_node_kill_and_a_redis_restart(
    make_settings: Callable[..., Settings], tokens: TokenService, own_redis: RedisProcess
) -> None:
    """Two ``tokend serve`` on a Redis persisting to an AOF: node-a is SIGKILLed (half of
    its sessions resume on node-b, the others go WARN then EXPIRED), then Redis is killed
    and restarted. At each stage node-b's /v1/stats equals a census of the store."""
    settings = make_settings(redis_url=own_redis.url, admin_token=ADMIN_TOKEN, **LIVE_CLOCKS)
    keys = Keyspace(settings.key_prefix)
    redis = aioredis.from_url(own_redis.url, decode_responses=True)

    async def agreed(node: TokendProcess, active: int, warn: int, **ended: int) -> Counts:
        """Until the node's counts and a census agree, and are these."""
        expected = Counts(active, warn, {how.value: ended.get(how.value, 0) for how in Ended})

        async def both() -> bool:
            cluster = (await admin_json(node.admin_port, ADMIN_TOKEN, "/v1/stats"))["cluster"]
            if not cluster["fresh"]:
                return False
            shown = Counts(
                cluster["sessions"]["ACTIVE"], cluster["sessions"]["WARN"], cluster["ended"]
            )
            return shown == await census(keys, redis) == expected

        await eventually(both, 15, interval=0.05, what=f"{expected}")
        return expected

    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(redis.aclose)
        a, b = stack.enter_context(running_nodes(settings, "node-a", "node-b"))
        beats: list[asyncio.Task[None]] = []
        stack.callback(lambda: [task.cancel() for task in beats])

        async def held(node: TokendProcess, token: str, proof: bytes | None = None) -> RawClient:
            client = await stack.enter_async_context(RawClient.connect(node.port))
            await client.hello(token, proof)
            beats.append(asyncio.create_task(beating(client)))
            return client

        on_a = {token: await held(a, token) for token in (tokens.mint(f"a-{n}") for n in range(6))}
        for n in range(4):
            await held(b, tokens.mint(f"b-{n}"))
        await agreed(b, 10, 0)

        assert a.kill() == -signal.SIGKILL
        moved = list(on_a)[:3]
        for token in moved:  # resumed on node-b at once, with their proofs
            welcome = on_a[token].welcome
            assert welcome is not None
            await held(b, token, proof_of(welcome))
        # The other three: held by no node, WARN, then EXPIRED by node-b's sweeper.
        await agreed(b, 7, 3)
        await agreed(b, 7, 0, expired=3)

        own_redis.kill()
        await asyncio.to_thread(own_redis.start)  # same port, same AOF
        await agreed(b, 7, 0, expired=3)
        # And the scripts go on moving them: a BYE after the restart.
        bye = await held(b, tokens.mint("after"))
        await agreed(b, 8, 0, expired=3)
        # Its heartbeats stop first: their task reads the connection too (an ACK each).
        beats[-1].cancel()
        await asyncio.gather(beats[-1], return_exceptions=True)
        await bye.send(p.encode(p.Bye()))
        await bye.expect_close()
        await agreed(b, 7, 0, expired=3, closed=1)
