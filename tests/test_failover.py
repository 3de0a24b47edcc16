"""Durability across a Redis failover (docs/scaling.md, "What survives a failover").

Redis replicates asynchronously: a write the master acknowledged can be missing from the
replica promoted after it. The first tests take one piece at a time on a lone Redis (the
loss made by hand: a key deleted, a replication id changed, a replica stopped); the last
ones provoke the real thing, through Sentinel and on a Cluster: the replica stalled and its
link cut, sessions started, renewed and revoked, the master SIGKILLed and the stale replica
promoted.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis import asyncio as aioredis
from websockets.exceptions import ConnectionClosed

from testkit import replies
from testkit.clients import Closed, RawClient, tid_of
from testkit.events import EventLog, read_events
from testkit.net import LOOPBACK, http_request
from testkit.redis_servers import (
    RedisClusterProcess,
    RedisProcess,
    RedisSentinelProcess,
    wait_sentinels_settled,
)
from testkit.tokend_process import tokend
from testkit.tokens import WallClockTokens
from testkit.waiting import eventually, eventually_sync
from tokend import config
from tokend.config import ConfigError, Settings
from tokend.core import protocol as p
from tokend.core.store_messages import HeartbeatAnswer
from tokend.ops.app import App
from tokend.store.keyspace import Keyspace
from tokend.store.redis_client import open_client
from tokend.store.sessions import Known, Store
from tokend.store.unavailable import NotConfirmed
from tokend.tokens.service import TokenService

StartApp = Callable[..., Awaitable[App]]
ADMIN_TOKEN = "failover-admin-token-of-32-characters"
# Every heartbeat of a token minted for 30 s renews it (renew_window 50 of token_ttl 60),
# once: the renewed token has 60 s left.
RENEWING: dict[str, Any] = {"token_ttl": 60, "renew_window": 50}
# A master's first sync to a new replica starts at once (not 5 s later, the default).
NO_SYNC_DELAY = ("--repl-diskless-sync-delay", "0")


def session_keys(app: App, tid: str) -> tuple[str, str, str]:
    """(session hash, tombstone, deadline set) of ``tid``."""
    keys = app.node.store.keys
    hash_key, tomb_key = keys.session_keys(uuid.UUID(tid))
    return hash_key, tomb_key, keys.script_keys(uuid.UUID(tid))[0]


def cli_env(settings: Settings) -> dict[str, str]:
    return {
        config.env_name(name): str(getattr(settings, name))
        for name in ("redis_url", "key_prefix", "durable_replicas", "durable_timeout")
    }


# A session or a hold on it that Redis lost is restored by the node holding it ------------


async def test_a_session_redis_lost_is_restored_by_the_node_holding_it(
    app: App, tokens: TokenService, redis: aioredis.Redis, events: EventLog
):
    async with RawClient.connect(app.port) as client:
        welcome = await client.hello(tokens.mint("lost"))
        tid = tid_of(welcome)
        hash_key, _, due_key = session_keys(app, tid)
        before = await redis.hgetall(hash_key)
        # What a failover to a replica that never got the HELLO leaves: nothing.
        await redis.delete(hash_key)
        await redis.zrem(due_key, tid)
        assert (await client.heartbeat()).exp_ms == welcome.exp_ms
        after = await redis.hgetall(hash_key)
        kept = ("sub", "exp", "iat", "prio", "conn", "since", "st", "proof")
        assert {k: after[k] for k in kept} == {k: before[k] for k in kept}
        assert await redis.zscore(due_key, tid) is not None  # swept again
        assert await redis.pexpiretime(hash_key) == welcome.exp_ms + app.settings.ms("expire_after")
        await client.heartbeat()
        await client.send(p.encode(p.Bye()))
        assert (await client.expect_close()).code == p.CloseCode.NORMAL
    # Pub/sub keeps one publisher's order: all of the session's events are in by its last.
    await events.wait_for("SESSION_CLOSED", tid)
    assert [e["type"] for e in events.events if e["tid"] == tid] == [
        "SESSION_STARTED",
        "SESSION_RESTORED",
        "SESSION_CLOSED",
    ]


async def test_a_lost_session_that_ended_or_expired_is_not_restored(
    app: App, tokens: TokenService, redis: aioredis.Redis, store_of: Callable[[App], Store]
):
    # Its tombstone survived (the close control message was what got lost): 4506 as before.
    async with RawClient.connect(app.port) as client:
        tid = tid_of(await client.hello(tokens.mint("revoked")))
        hash_key, tomb_key, _ = session_keys(app, tid)
        await redis.delete(hash_key)
        await redis.set(tomb_key, "revoked", px=60_000)
        await client.send(client.heartbeat_bytes())
        assert (await client.expect_close()).code == p.CloseCode.TOKEN_REVOKED
        assert not await redis.exists(hash_key)
    # What the node knows has expired: gone, nothing written.
    store = store_of(app)
    gone_tid = uuid.uuid4()
    now_ms = int(time.time() * 1000)
    past = Known(
        "gone", 5, iat_s=now_ms // 1000 - 60, exp_ms=now_ms - 1000, since_ms=now_ms, proof=bytes(16)
    )
    request = store.heartbeat_request(gone_tid, "node-a/9")
    (answer,) = await store.record_heartbeats([request], known=lambda i: past)
    assert isinstance(answer, HeartbeatAnswer) and answer.outcome == "gone"
    assert not await redis.exists(store.keys.session_keys(gone_tid)[0])


async def test_a_resume_redis_lost_is_taken_back_from_the_older_connection(
    start_app: StartApp, tokens: TokenService, redis: aioredis.Redis, events: EventLog
):
    node_a = await start_app(node_name="node-a")
    node_b = await start_app(node_name="node-b")
    token = tokens.mint("roamer")
    async with RawClient.connect(node_a.port) as first, RawClient.connect(node_b.port) as second:
        tid = tid_of(welcome := await first.hello(token))
        hash_key = session_keys(node_a, tid)[0]
        held_by_first = await redis.hmget(hash_key, ["conn", "since"])
        # The first holds it live: the proof of its key (spec "Resume proof").
        assert (await second.hello(token, p.resume_proof(welcome.session_key, welcome.tid))).resumed
        assert (await first.expect_close(timeout=2)).code == p.CloseCode.TAKEN_OVER
        # A failover to a replica that never got the resume: Redis names the first again.
        held = dict(zip(("conn", "since"), map(replies.text, held_by_first), strict=True))
        await redis.hset(hash_key, mapping=replies.mapping(held))
        assert isinstance(await second.heartbeat(), p.HeartbeatAck)
        assert replies.text(await redis.hget(hash_key, "conn")).startswith("node-b/")
        restored = await events.wait_for("SESSION_RESTORED", tid)
        assert restored[0]["node"] == "node-b"
        assert isinstance(await second.heartbeat(), p.HeartbeatAck)


async def test_a_renewed_token_redis_lost_keeps_working(
    start_app: StartApp, tokens: TokenService, redis: aioredis.Redis
):
    app = await start_app(**RENEWING)
    async with RawClient.connect(app.port) as client:
        welcome = await client.hello(tokens.mint("renewer", ttl_s=30))
        ack = await client.heartbeat()
        assert ack.renewed and ack.exp_ms > welcome.exp_ms
        renewed = ack.token
        assert renewed is not None
    hash_key = session_keys(app, tid_of(welcome))[0]
    # A failover to a replica that never got the renewal: the old exp again.
    await redis.hset(hash_key, "exp", welcome.exp_ms)
    async with RawClient.connect(app.port) as client:
        resumed = await client.hello(renewed)
        assert resumed.resumed and resumed.exp_ms == ack.exp_ms
        assert (await client.heartbeat()).exp_ms >= ack.exp_ms
    assert int(replies.text(await redis.hget(hash_key, "exp"))) >= ack.exp_ms


@pytest.fixture
async def store_of() -> AsyncIterator[Callable[[App], Store]]:
    """A Store of the test's own on an app's Redis, as `tokend revoke` makes one."""
    clients: list[Any] = []

    def make(app: App) -> Store:
        client = open_client(app.settings.redis_url, app.settings)
        clients.append(client)
        return Store(client, app.settings, "test")

    yield make
    for client in clients:
        await client.aclose()


# A revocation or BYE is reported done only once the replicas hold it ----------------------


async def test_without_the_replicas_asked_for_nothing_is_reported_done(
    start_app: StartApp,
    tokens: TokenService,
    redis: aioredis.Redis,
    store_of: Callable[[App], Store],
):
    """durable_replicas 1 on a Redis without replicas: every revocation and BYE is made on
    the master and reported not confirmed, in each caller's own way."""
    app = await start_app(durable_replicas="1", durable_timeout=0.1, admin_token=ADMIN_TOKEN)
    store = store_of(app)
    tids = [str(uuid.uuid4()) for _ in range(3)]
    with pytest.raises(NotConfirmed) as raised:
        await store.revoke(uuid.UUID(tids[0]), by="test")
    assert (raised.value.outcome, raised.value.acknowledged, raised.value.wanted) == (2, 0, 1)

    reply = await http_request(
        app.admin.port if app.admin else 0,
        "DELETE",
        f"/v1/sessions/{tids[1]}",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    assert reply.status == 504
    body = reply.json()
    assert (body["error"], body["tid"], body["acknowledged"], body["wanted"]) == (
        "not_confirmed",
        tids[1],
        0,
        1,
    )
    assert "revoked" not in body  # never a result to read as done

    result = await asyncio.to_thread(tokend, "revoke", tids[2], env=cli_env(app.settings))
    assert result.returncode == 3, result.stderr
    assert result.stdout == ""
    assert "not confirmed" in result.stderr and "0 of 1 replicas" in result.stderr

    for tid in tids:  # the master has each of them
        assert await redis.get(session_keys(app, tid)[1]) == "revoked"

    # The command's flags set both for one call, over the environment's.
    tid = str(uuid.uuid4())
    unwaited = await asyncio.to_thread(
        tokend, "revoke", tid, "--durable-replicas", "0", env=cli_env(app.settings)
    )
    assert (unwaited.returncode, unwaited.stdout) == (0, "revoked (no live session)\n")
    env = {**cli_env(app.settings), config.env_name("durable_replicas"): "0"}
    waited = await asyncio.to_thread(
        tokend,
        "revoke",
        str(uuid.uuid4()),
        "--durable-replicas",
        "1",
        "--durable-timeout",
        "0.05",
        env=env,
    )
    assert waited.returncode == 3 and "0 of 1 replicas" in waited.stderr, waited.stderr

    async with RawClient.connect(app.port) as client:
        tid = tid_of(await client.hello(tokens.mint("leaving")))
        await client.send(p.encode(p.Bye()))
        closed = await client.expect_close()
        assert closed.code == p.CloseCode.TRY_AGAIN_LATER
        assert closed.reason == "bye_not_confirmed"
    assert await redis.get(session_keys(app, tid)[1]) == "closed"


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[tuple[RedisProcess, RedisProcess]]:
    """A master and its replica, in sync, on a plain URL (no Sentinel)."""
    master = RedisProcess(tmp_path / "master", extra_args=NO_SYNC_DELAY)
    master.start()
    replica = RedisProcess(
        tmp_path / "replica", extra_args=("--replicaof", LOOPBACK, str(master.port))
    )
    try:
        replica.start()
        master.wait_replicas(1)
        yield master, replica
    finally:
        if replica.process is not None:
            replica.process.send_signal(signal.SIGCONT)
        replica.kill()
        master.kill()


async def test_auto_waits_for_the_connected_replica_of_a_plain_master(
    make_settings: Callable[..., Settings], replicated: tuple[RedisProcess, RedisProcess]
):
    """durable_replicas auto on a plain master: WAIT for the one replica it has, for
    durable_timeout, as the master itself sees the command."""
    master, replica = replicated
    # A durable_timeout the replica of a busy machine surely meets when it is running.
    settings = make_settings(redis_url=master.url, durable_timeout=1.0, redis_timeout=3.0)
    client = open_client(settings.redis_url, settings)
    watcher = aioredis.from_url(master.url, decode_responses=True)
    store = Store(client, settings, "test")
    try:
        assert await store.revoke(uuid.uuid4(), by="test") == 2  # the replica acknowledged it
        assert replica.process is not None
        replica.process.send_signal(signal.SIGSTOP)  # still connected, acknowledging nothing
        async with watcher.monitor() as monitor:  # every command the master runs from now
            with pytest.raises(NotConfirmed, match="0 of 1 replicas"):
                await store.revoke(uuid.uuid4(), by="test")
            async with asyncio.timeout(5):
                while not (command := (await monitor.next_command())["command"]).startswith("WAIT"):
                    pass
        assert command == "WAIT 1 1000"  # one replica, durable_timeout in ms
    finally:
        await client.aclose()
        await watcher.aclose()


# Nodes keep the revocations they hear, and write them again after a failover ----------------


@pytest.fixture
def debug_redis(tmp_path: Path) -> Iterator[RedisProcess]:
    """A Redis of this test alone that takes DEBUG (to change its replication id)."""
    server = RedisProcess(tmp_path / "debug-redis", extra_args=("--enable-debug-command", "yes"))
    server.start()
    yield server
    server.kill()


async def test_revocations_lost_by_a_failover_are_written_again(
    start_app: StartApp,
    tokens: TokenService,
    debug_redis: RedisProcess,
    store_of: Callable[[App], Store],
):
    app = await start_app(redis_url=debug_redis.url, failover_check_interval=0.1)
    redis = aioredis.from_url(debug_redis.url, decode_responses=True)
    store = store_of(app)
    try:
        async with EventLog(redis, f"{app.settings.key_prefix}:events") as events:
            async with RawClient.connect(app.port) as client:
                live = tokens.mint("revoked-live")
                live_tid = tid_of(await client.hello(live))
                hash_key, _, due_key = session_keys(app, live_tid)
                session = replies.fields(await redis.hgetall(hash_key))
                unused_tid = str(uuid.uuid4())  # a token never used: only barred
                kept_tid = str(uuid.uuid4())  # its tombstone will survive
                for tid in (live_tid, unused_tid, kept_tid):
                    await store.revoke(uuid.UUID(tid), by="test")
                assert (await client.expect_close()).code == p.CloseCode.TOKEN_REVOKED
            # Every node heard them (end.lua tells them all).
            known = app.node.revocations
            await eventually(lambda: known.knows(live_tid) and known.knows(unused_tid))
            # A failover that lost two of them: one's session is back as it was before.
            lost = [live_tid, unused_tid]
            for tid in lost:
                await redis.delete(session_keys(app, tid)[1])
            await redis.hset(hash_key, mapping=replies.mapping(session))
            await redis.zadd(due_key, {live_tid: int(session["hb"]) + 60_000})
            # Until the node sees the failover, it refuses the token by what it knows.
            async with RawClient.connect(app.port) as client:
                await client.send(p.encode(p.Hello(live)))
                assert (await client.expect_close()).code == p.CloseCode.TOKEN_REVOKED
            await redis.execute_command("DEBUG", "CHANGE-REPL-ID")  # a replica promoted
            for tid in lost:
                await eventually(functools.partial(redis.exists, session_keys(app, tid)[1]))
            assert not await redis.exists(hash_key)  # ended again
            await events.wait_for("TOKEN_REVOKED", live_tid, count=2)
            await events.wait_for("TOKEN_REVOKED", unused_tid, count=2)
            # Pub/sub keeps one publisher's order: a re-emitted kept_tid would be in by now.
            assert len(events.of("TOKEN_REVOKED", kept_tid)) == 1
    finally:
        await redis.aclose()


# Settings --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"durable_replicas": "all"}, "durable_replicas: must be auto or a number"),
        ({"durable_replicas": "-1"}, "durable_replicas: must be auto or a number"),
        ({"durable_replicas": "²"}, "durable_replicas: must be auto or a number"),
        ({"durable_timeout": 2.5}, "durable_timeout: must be less than redis_timeout"),
        ({"durable_timeout": 0}, "durable_timeout: must be more than 0"),
        ({"failover_check_interval": 0}, "failover_check_interval: must be more than 0"),
    ],
)
def test_durability_settings_are_checked(values: dict[str, Any], problem: str):
    with pytest.raises(ConfigError, match=f"^{problem}"):
        config.load(values, environ={})


def test_durable_replicas_reads_as_a_count():
    assert config.load({}, environ={}).durable_replica_count is None  # auto
    assert config.load({"durable_replicas": "2"}, environ={}).durable_replica_count == 2


# The real thing: a stale replica promoted, through Sentinel and on a Cluster -----------------

# Calm clocks (no WARN while Redis fails over), a failover seen within 0.2 s, and replicas
# given 0.3 s to confirm.
FAILOVER_SETTINGS: dict[str, Any] = {
    **RENEWING,
    "heartbeat_interval": 0.5,
    "warn_after": 10,
    "expire_after": 15,
    "hello_timeout": 2,
    "durable_timeout": 0.3,
    "failover_check_interval": 0.2,
    "admin_token": ADMIN_TOKEN,
}
# The client's cadence while holding a session, shorter than heartbeat_interval.
BEAT_EVERY = 0.25
TERMINAL = {"TOKEN_EXPIRED", "TOKEN_REVOKED", "SESSION_CLOSED"}


@dataclass
class Topology:
    """A master with one replica, which a failover promotes."""

    master: RedisProcess
    replica: RedisProcess
    url: str

    def tid(self) -> uuid.UUID:
        """A tid whose session lives on the master that fails."""
        return uuid.uuid4()

    def cut(self) -> None:
        """Stall the replica (SIGSTOP) and cut its link on the master (CLIENT KILL): what
        the master acknowledges from now on is not replicated. (A stall alone loses nothing
        on loopback: the kernel buffers the stream for the sleeping replica.)"""
        assert self.replica.process is not None
        self.replica.process.send_signal(signal.SIGSTOP)
        master = self.master.client()
        master.execute_command("CLIENT", "KILL", "TYPE", "replica")
        eventually_sync(
            lambda: not master.info("replication")["connected_slaves"], 20, what="link cut"
        )

    def fail_over(self) -> None:
        """SIGKILL the master, wake the stale replica, return once it serves as the master."""
        self.master.kill()
        assert self.replica.process is not None
        self.replica.process.send_signal(signal.SIGCONT)
        self.promote()

    def promote(self) -> None:
        raise NotImplementedError

    def forget_the_old_master(self) -> None:
        """The operator's step after a failover, if any, so that the dead old master no
        longer counts as a replica to wait for (docs/scaling.md)."""


@dataclass
class SentinelTopology(Topology):
    sentinels: list[RedisSentinelProcess]

    def promote(self) -> None:
        """Sentinel does it: the master down for 300 ms, two of three agree, one leads."""
        clients = [s.client() for s in self.sentinels]
        eventually_sync(
            lambda: all(
                replies.address(c.sentinel_get_master_addr_by_name("tokend"))[1]
                == self.replica.port
                for c in clients
            ),
            20,
            what="sentinels promote the replica",
        )
        eventually_sync(
            lambda: self.replica.client().info("replication")["role"] == "master", 20, what="role"
        )

    def forget_the_old_master(self) -> None:
        # The sentinels list the dead master as a replica of the new one until it is back
        # or forgotten; durable_replicas "auto" waits for every replica they list.
        for sentinel in self.sentinels:
            sentinel.client().execute_command("SENTINEL", "RESET", "tokend")


FORCE_AGAIN_S = 5.0


@dataclass
class ClusterTopology(Topology):
    cluster: RedisClusterProcess
    prefix: str

    def tid(self) -> uuid.UUID:
        while True:  # random tids until one is in a shard of master 0 (a third of them)
            tid = uuid.uuid4()
            shard_key = Keyspace(self.prefix).script_keys(tid)[0]
            if self.cluster.master_of(shard_key) == 0:
                return tid

    def promote(self) -> None:
        """CLUSTER FAILOVER FORCE on the replica: the two live masters vote it in. Asked
        again every FORCE_AGAIN_S while the replica is still one: Redis abandons a forced
        election that timed out (a busy machine) and does not try it again."""
        replica = self.replica.client()
        others = [n.client() for n in self.cluster.nodes[1:]]
        asked = 0.0

        def promoted() -> bool:
            nonlocal asked
            if all(_owner_of_slot_0(c) == self.replica.port for c in others):
                return True
            is_replica = replica.info("replication")["role"] == "slave"
            if is_replica and time.monotonic() - asked >= FORCE_AGAIN_S:
                replica.execute_command("CLUSTER", "FAILOVER", "FORCE")
                asked = time.monotonic()
            return False

        eventually_sync(
            promoted,
            30,
            interval=0.1,
            what="the other masters see the replica serve master 0's slots",
        )


def _owner_of_slot_0(client: Any) -> int:
    return next(int(r[2][1]) for r in client.execute_command("CLUSTER", "SLOTS") if int(r[0]) == 0)


@pytest.fixture
def sentinel_topology(tmp_path: Path) -> Iterator[SentinelTopology]:
    """A master, its replica in sync, three sentinels (quorum 2) that know both and each
    other, and fail over after 300 ms of silence."""
    master = RedisProcess(tmp_path / "master", extra_args=NO_SYNC_DELAY)
    replica = RedisProcess(
        tmp_path / "replica", extra_args=("--replicaof", LOOPBACK, str(master.port))
    )
    options = {"down-after-milliseconds": 300, "failover-timeout": 5000}
    sentinels = [
        RedisSentinelProcess(tmp_path / f"sentinel-{n}", master, quorum=2, options=options)
        for n in range(3)
    ]
    try:
        master.start()
        replica.start()
        master.wait_replicas(1)
        for sentinel in sentinels:
            sentinel.start()
        wait_sentinels_settled(sentinels, 1, 20)
        hosts = ",".join(f"{LOOPBACK}:{s.port}" for s in sentinels)
        yield SentinelTopology(master, replica, f"redis+sentinel://{hosts}/tokend/0", sentinels)
    finally:
        for sentinel in sentinels:
            sentinel.stop()
        if replica.process is not None:
            replica.process.send_signal(signal.SIGCONT)
        replica.kill()
        master.kill()


@pytest.fixture
def cluster_topology(
    tmp_path: Path, make_settings: Callable[..., Settings]
) -> Iterator[ClusterTopology]:
    """The three-master test cluster, master 0 with a replica in sync."""
    cluster = RedisClusterProcess(tmp_path / "cluster")
    try:
        cluster.start()
        replica = cluster.add_replica(0)
        prefix = make_settings().key_prefix
        yield ClusterTopology(cluster.nodes[0], replica, cluster.url, cluster, prefix)
    finally:
        for replica in cluster.replicas:
            if replica.process is not None:
                replica.process.send_signal(signal.SIGCONT)
        cluster.stop()


class Holder:
    """A client holding a session: a heartbeat every BEAT_EVERY until stopped or closed."""

    def __init__(self, client: RawClient, tid: str) -> None:
        self.client = client
        self.tid = tid
        self.acks = 0
        self.task = asyncio.create_task(self._beat())

    async def _beat(self) -> int | None:
        """The close code, once the server closes the connection."""
        try:
            while True:
                await self.client.heartbeat()
                self.acks += 1
                await asyncio.sleep(BEAT_EVERY)  # the client's cadence
        except Closed as closed:
            return closed.code
        except ConnectionClosed as exc:  # closed as it sent
            return exc.rcvd.code if exc.rcvd else None

    @property
    def closed(self) -> int | None:
        return self.task.result() if self.task.done() else None

    def acked_more_than(self, acks: int) -> bool:
        return self.acks > acks

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def provoke(topology: Topology, start_app: StartApp, tokens: WallClockTokens) -> None:
    """Sessions started, renewed and revoked while the replica is cut off, the master
    killed, the stale replica promoted: what each client and operator was told, and what
    holds after, including the events."""
    app = await start_app(redis_url=topology.url, **FAILOVER_SETTINGS)
    settings = app.settings
    admin_port = app.admin.port if app.admin else 0
    redis = open_client(settings.redis_url, settings)
    operator = Store(redis, settings, "operator")
    async with contextlib.AsyncExitStack() as stack:
        live = await stack.enter_async_context(EventLog(redis, f"{settings.key_prefix}:events"))

        async def hello(token: str) -> tuple[RawClient, str]:
            client = await stack.enter_async_context(RawClient.connect(app.port))
            return client, tid_of(await client.hello(token))

        def mint(name: str, ttl_s: int = 60) -> tuple[str, uuid.UUID]:
            tid = topology.tid()
            return tokens.mint(name, ttl_s=ttl_s, tid=tid), tid

        # Before: replicated. Sessions whose first heartbeat (a renewal) comes in the window;
        # one revoked now, with the replica in sync: confirmed.
        renewing = [await hello(mint(f"renewing-{n}", ttl_s=30)[0]) for n in range(3)]
        early, early_tid = mint("revoked-early")
        await hello(early)
        result = await asyncio.to_thread(tokend, "revoke", str(early_tid), env=cli_env(settings))
        assert (result.returncode, result.stdout) == (0, "revoked live session\n"), result.stderr

        # In a thread: the node and its clients run in this loop all along.
        await asyncio.to_thread(topology.cut)

        # The window: started, renewed, revoked and logged out on the master alone.
        window = [await hello(mint(f"window-{n}")[0]) for n in range(4)]
        renewed_tokens = {}
        for client, tid in renewing:
            ack = await client.heartbeat()
            assert ack.renewed and ack.token
            renewed_tokens[tid] = ack.token
        holders = [Holder(client, tid) for client, tid in renewing + window]
        by_cli, by_admin = window[0][1], renewing[0][1]
        unused = topology.tid()  # a token never used, barred
        cli_revoke = asyncio.to_thread(tokend, "revoke", by_cli, env=cli_env(settings))
        admin_revoke = http_request(
            admin_port,
            "DELETE",
            f"/v1/sessions/{by_admin}",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        )
        result, reply = await asyncio.gather(cli_revoke, admin_revoke)
        assert result.returncode == 3 and "not confirmed" in result.stderr, result.stderr
        assert (reply.status, reply.json()["error"]) == (504, "not_confirmed")
        with pytest.raises(NotConfirmed):
            await operator.revoke(unused, by="test")
        revoked = {by_cli, by_admin, str(unused)}
        leaving = holders[-1]
        await leaving.stop()
        await leaving.client.send(p.encode(p.Bye()))
        closed = await leaving.client.expect_close()
        assert (closed.code, closed.reason) == (1013, "bye_not_confirmed")
        await eventually(lambda: all(map(app.node.revocations.knows, revoked)))
        for holder in holders:
            if holder.tid in revoked:
                assert await holder.task == p.CloseCode.TOKEN_REVOKED  # wherever it was held
        holding = [h for h in holders if h.tid not in revoked and h is not leaving]

        await asyncio.to_thread(topology.fail_over)

        # After: Redis lost the window. Each session still held is restored by its node,
        # each revocation is written again, and no client that did nothing wrong is closed.
        fresh = open_client(settings.redis_url, settings)
        stack.push_async_callback(fresh.aclose)

        async def on_the_new_master(tid: str) -> bool:
            hash_key, tomb_key = Keyspace(settings.key_prefix).session_keys(uuid.UUID(tid))
            if tid in revoked:
                return await fresh.get(tomb_key) == "revoked" and not await fresh.exists(hash_key)
            return replies.text(await fresh.hget(hash_key, "conn") or "").startswith("node-a/")

        for tid in [h.tid for h in holding] + sorted(revoked):
            await eventually(functools.partial(on_the_new_master, tid), timeout=20)
        for holder in holding:
            # Answered by the new master.
            await eventually(functools.partial(holder.acked_more_than, holder.acks))
            assert holder.closed is None, f"{holder.tid} closed with {holder.closed}"
        for tid in (*revoked, str(early_tid)):
            client = await stack.enter_async_context(RawClient.connect(app.port))
            await client.send(p.encode(p.Hello(tokens.mint("again", tid=uuid.UUID(tid)))))
            assert (await client.expect_close()).code == p.CloseCode.TOKEN_REVOKED, tid
        # The client told 1013 resumes (a new start: its session was lost) and logs out.
        await asyncio.to_thread(topology.forget_the_old_master)
        client, tid = await hello(tokens.mint("window-3", tid=uuid.UUID(leaving.tid)))
        await client.send(p.encode(p.Bye()))
        assert (await client.expect_close()).code == p.CloseCode.NORMAL
        # A renewed token that Redis lost keeps working: resumed at least until its exp.
        renewed_tid = renewing[1][1]
        renewed_holder = next(h for h in holding if h.tid == renewed_tid)
        await renewed_holder.stop()
        # Its connection is still open, and held it live: the proof of its key.
        welcome = renewed_holder.client.welcome
        assert welcome is not None
        proof = p.resume_proof(welcome.session_key, welcome.tid)
        client = await stack.enter_async_context(RawClient.connect(app.port))
        resumed = await client.hello(renewed_tokens[renewed_tid], proof)
        assert resumed.resumed
        assert resumed.exp_ms >= tokens.verify(renewed_tokens[renewed_tid]).exp * 1000

        # Events: what was published on the old master alone is missing from the streams;
        # what is there is consistent.
        stream = await read_events(fresh, settings.key_prefix)
        in_stream = [(e["type"], e["tid"]) for e in stream]
        for _, tid in window[1:3]:
            assert ("SESSION_STARTED", tid) in [(e["type"], e["tid"]) for e in live.events]
            assert ("SESSION_STARTED", tid) not in in_stream  # lost with the old master
            assert in_stream.count(("SESSION_RESTORED", tid)) == 1
        for tid in revoked:  # lost, then emitted again when written again
            assert in_stream.count(("TOKEN_REVOKED", tid)) == 1
        assert in_stream.count(("TOKEN_REVOKED", str(early_tid))) == 1  # not again
        for _, tid in renewing:
            assert ("SESSION_STARTED", tid) in in_stream  # before the cut: replicated
        assert not [e for e in stream if e["type"] == "TOKEN_EXPIRED"]
        for tid in {e["tid"] for e in stream}:
            kinds = [e["type"] for e in stream if e["tid"] == tid]
            ends = [n for n, kind in enumerate(kinds) if kind in TERMINAL]
            assert ends in ([], [len(kinds) - 1]), (tid, kinds)  # nothing after the end
        for holder in holding:
            await holder.stop()
    await redis.aclose()


async def test_sentinel_failover_to_a_stale_replica(
    sentinel_topology: SentinelTopology, start_app: StartApp, tokens: WallClockTokens
):
    await provoke(sentinel_topology, start_app, tokens)


async def test_cluster_failover_to_a_stale_replica(
    cluster_topology: ClusterTopology, start_app: StartApp, tokens: WallClockTokens
):
    await provoke(cluster_topology, start_app, tokens)


async def test_on_a_cluster_wait_follows_the_script_on_its_masters_connection(
    cluster_topology: ClusterTopology, make_settings: Callable[..., Settings]
):
    """A replica stalled but still connected acknowledges nothing new: WAIT on the
    connection that ran the script counts 0 of 1; on any other connection (or node) it
    would count what that one wrote before, and confirm."""
    settings = make_settings(redis_url=cluster_topology.url, durable_timeout=0.2)
    client = open_client(settings.redis_url, settings)
    store = Store(client, settings, "test")
    replica = cluster_topology.replica.process
    assert replica is not None
    try:
        assert (
            await store.revoke(cluster_topology.tid(), by="test") == 2
        )  # confirmed by the replica
        replica.send_signal(signal.SIGSTOP)
        with pytest.raises(NotConfirmed, match="0 of 1 replicas"):
            await store.revoke(cluster_topology.tid(), by="test")
        replica.send_signal(signal.SIGCONT)
        assert await store.revoke(cluster_topology.tid(), by="test") == 2
    finally:
        replica.send_signal(signal.SIGCONT)
        await client.aclose()
