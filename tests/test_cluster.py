"""tokend on a Redis Cluster (three masters) and through Sentinel (docs/scaling.md).

The module's ``redis_server`` is a local Redis Cluster. The conformance, CLI and
event-reader tests listed in tests/conftest.py (``ON_A_CLUSTER_TOO``) run a second
time, unchanged, on one too (their ids end in ``[cluster]``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from importlib import resources
from pathlib import Path

import pytest
import redis as sync_redis
from redis import asyncio as aioredis
from redis import exceptions as rexc
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool

from testkit import replies
from testkit.clients import RawClient, tid_of
from testkit.events import (
    EventLog,
    after_a_full_sweep,
    left_to_judge,
    next_event,
    one_session,
    read_events,
)
from testkit.net import LOOPBACK, free_port, http_get, is_ready
from testkit.redis_servers import RedisClusterProcess, RedisProcess, RedisSentinelProcess
from testkit.tokend_process import CLEAN_ENV, tokend
from testkit.waiting import eventually, eventually_sync
from tokend.config import ConfigError, Settings
from tokend.core import protocol as p
from tokend.core.store_messages import (
    HeartbeatAnswer,
    HeartbeatOutcome,
    HeartbeatReply,
    ReleaseOutcome,
    heartbeat_outcome,
)
from tokend.ops.app import App
from tokend.store import events
from tokend.store.control import SENTINEL_POLL, ControlListener
from tokend.store.keyspace import SHARDS, Keyspace
from tokend.store.redis_client import (
    Client,
    MultiHostUrl,
    open_client,
    parse_multi_host_url,
    slot_groups,
    subscription,
)
from tokend.store.sessions import MoveRequest, Store
from tokend.tokens.service import TokenService


def as_answer(reply: HeartbeatReply) -> HeartbeatAnswer:
    """A heartbeat's reply as an answer (a plain OK is the session's exp alone)."""
    return HeartbeatAnswer(HeartbeatOutcome.OK, exp_ms=reply) if isinstance(reply, int) else reply


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcess]:
    """Overrides conftest's: every app and client of this module is on the cluster."""
    cluster = RedisClusterProcess(tmp_path_factory.mktemp("cluster"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
async def redis(settings: Settings) -> AsyncIterator[Client]:
    client = open_client(settings.redis_url, settings)
    yield client
    await client.aclose()


@pytest.fixture
async def store(redis: Client, settings: Settings) -> Store:
    store = Store(redis, settings, "node-test")
    await store.load_scripts()
    return store


def test_the_shards_span_every_master(redis_server: RedisClusterProcess, settings: Settings):
    """Else the tests below would not show that calls are routed per slot."""
    streams = Keyspace(settings.key_prefix).streams()
    assert {redis_server.master_of(s) for s in streams} == set(range(len(redis_server.nodes)))


async def test_stream_reads_are_grouped_by_slot(redis: Client, settings: Settings):
    groups = await slot_groups(redis, Keyspace(settings.key_prefix).streams())
    assert len(groups) == SHARDS
    assert sorted(s for g in groups for s in g) == sorted(Keyspace(settings.key_prefix).streams())


async def test_live_hears_the_events_of_every_master(
    app: App,
    tokens: TokenService,
    redis: Client,
    keys: Keyspace,
    redis_server: RedisClusterProcess,
):
    """tokend.store.events.live subscribes on one node; PUBLISH on any master reaches it.

    Each session's events come in order; those of sessions on different masters
    may not (each master's messages reach the subscribed node over the cluster bus).
    """

    async def subscribers() -> int:
        counts = await redis.pubsub_numsub(keys.events_channel, target_nodes=RedisCluster.ALL_NODES)
        return int(counts[0][1])

    # Others may listen already (the app's admin event ring): the stream's own
    # subscription is the one more, and only events published after it are heard.
    before = await subscribers()
    stream = events.live(redis, keys)
    first = asyncio.create_task(next_event(stream))

    async def subscribed() -> bool:
        return await subscribers() > before

    await eventually(subscribed)
    masters: set[int] = set()
    expected = []
    for n in range(40):  # random tids: until their shards are on every master
        tid = await one_session(app, tokens, f"u{n}")
        masters.add(redis_server.master_of(keys.shard_keys(Keyspace.shard_of(tid))[1]))
        expected += [("SESSION_STARTED", tid), ("SESSION_CLOSED", tid)]
        if len(masters) == len(redis_server.nodes):
            break
    assert len(masters) == len(redis_server.nodes)
    heard = [await first] + [await next_event(stream) for _ in expected[1:]]
    assert sorted((e["tid"], e["type"]) for e in heard) == sorted((t, k) for k, t in expected)
    for _, tid in expected[::2]:
        assert [e["type"] for e in heard if e["tid"] == tid] == [
            "SESSION_STARTED",
            "SESSION_CLOSED",
        ]
    await stream.aclose()


async def test_cli_events_replays_the_shards_of_every_master(
    home: dict[str, str], redis_server: RedisClusterProcess
):
    """``tokend revoke`` and ``tokend events --from-start`` on the cluster."""
    env = {**home, "TOKEND_REDIS_URL": redis_server.url, "TOKEND_KEY_PREFIX": "clicluster"}
    keyspace = Keyspace("clicluster")
    by_master = {redis_server.master_of(keyspace.shard_keys(n)[1]): n for n in range(SHARDS)}
    tids = [str(tid_in_shard(shard)) for shard in by_master.values()]  # one per master
    for tid in tids:
        assert (await asyncio.to_thread(tokend, "revoke", tid, env=env)).returncode == 0
    reader = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tokend",
        "events",
        "--from-start",
        env={**CLEAN_ENV, **env},
        stdout=asyncio.subprocess.PIPE,
    )
    assert reader.stdout is not None
    try:
        async with asyncio.timeout(15):
            lines = [json.loads(await reader.stdout.readline()) for _ in tids]
    finally:
        reader.kill()
        await reader.wait()
    assert sorted(e["tid"] for e in lines) == sorted(tids)
    assert {e["type"] for e in lines} == {"TOKEN_REVOKED"}


# Every script, through the Store, on sessions of all 16 shards -------------------------


def tid_in_shard(shard: int) -> uuid.UUID:
    """A random tid whose shard (its last hex digits, mod 16) is ``shard``."""
    return uuid.UUID(int=(uuid.uuid4().int & ~0xF) | shard)


async def start_sessions(store: Store) -> list[uuid.UUID]:
    """One live session in each shard (HELLO), as connection ``c-<tid>``."""
    tids = [tid_in_shard(n) for n in range(SHARDS)]
    now = int(time.time())
    for tid in tids:
        result = await store.hello(tid, "sub", 5, now, now + 60, f"c-{tid}")
        assert result.outcome == "started"
    return tids


async def drive_hello(store: Store) -> None:
    await start_sessions(store)


async def drive_heartbeat(store: Store) -> None:
    tids = await start_sessions(store)
    results = await store.record_heartbeats([store.heartbeat_request(t, f"c-{t}") for t in tids])
    assert [heartbeat_outcome(r) for r in results] == ["ok"] * SHARDS


async def drive_sweep(store: Store) -> None:
    tids = await start_sessions(store)
    for tid in tids:  # silent since before warn_after, and due now
        await store.redis.hset(store.keys.session_keys(tid)[0], "hb", 0)
        await store.redis.zadd(store.keys.script_keys(tid)[0], {str(tid): 0})
    made = (await store.sweep(100)).made
    # Expired (silent for expire_after too); no connection of this node to close.
    assert sorted(made) == sorted((str(t), "heartbeat_timeout", "") for t in tids)


async def drive_end(store: Store) -> None:
    tids = await start_sessions(store)
    for tid in tids:
        ended = await store.end(tid, conn=f"c-{tid}", event="SESSION_CLOSED", tomb="bye", code=None)
        assert ended == 1


async def drive_release(store: Store) -> None:
    tids = await start_sessions(store)
    # Half closed by the server (1001: parked), half ended otherwise.
    reasons = ["going_away" if n % 2 else "" for n in range(len(tids))]
    outcomes = await store.releases(
        [
            store.release_request(tid, f"c-{tid}", int(replies.text(since)), reason)
            for tid, reason in zip(tids, reasons, strict=True)
            for since in [await store.redis.hget(store.keys.session_keys(tid)[0], "since")]
        ]
    )
    assert outcomes == [ReleaseOutcome.PARKED if r else ReleaseOutcome.RELEASED for r in reasons]


async def drive_move(store: Store) -> None:
    tids = await start_sessions(store)
    sinces = [
        int(replies.text(await store.redis.hget(store.keys.session_keys(t)[0], "since")))
        for t in tids
    ]
    moved = await store.moves(
        [
            MoveRequest.of(t, f"c-{t}", since, f"d-{t}")
            for t, since in zip(tids, sinces, strict=True)
        ]
    )
    assert all(moved)
    # And back.
    back = await store.moves(
        [MoveRequest.of(t, f"d-{t}", moved[i], f"c-{t}") for i, t in enumerate(tids)]
    )
    assert all(back)


DRIVERS: dict[str, Callable[[Store], Awaitable[None]]] = {
    "hello": drive_hello,
    "heartbeat": drive_heartbeat,
    "sweep": drive_sweep,
    "end": drive_end,
    "release": drive_release,
    "move": drive_move,
}
LUA_SCRIPTS = sorted(
    Path(f.name).stem
    for f in (resources.files("tokend.store") / "lua").iterdir()
    if f.name.endswith(".lua") and not f.name.startswith("_")
)


@pytest.mark.parametrize("script", LUA_SCRIPTS)
async def test_every_script_runs_on_the_cluster_without_crossslot(store: Store, script: str):
    """Each tokend/store/lua script, called through the Store for a session in every shard.

    A new script fails here until it has a driver: a CROSSSLOT (keys of several
    slots in one call) would raise from the Store.
    """
    assert script in DRIVERS, f"no cluster test drives tokend/store/lua/{script}.lua; add one"
    await DRIVERS[script](store)


async def test_scripts_reload_on_every_master_after_a_flush(store: Store, redis: Client):
    """Each master has its own script cache: NOSCRIPT on any of them is recovered."""
    tids = await start_sessions(store)
    await redis.script_flush()  # on every primary
    results = await store.record_heartbeats([store.heartbeat_request(t, f"c-{t}") for t in tids])
    assert [heartbeat_outcome(r) for r in results] == ["ok"] * SHARDS
    assert await store.ready() is None


# Two nodes on the cluster ------------------------------------------------------------------


async def test_two_nodes_resume_across_and_close_the_old_connection_with_4507(
    start_app: Callable[..., Awaitable[App]], tokens: TokenService, events: EventLog
):
    node_a = await start_app(node_name="node-a")
    node_b = await start_app(node_name="node-b")
    token = tokens.mint("roamer")
    async with RawClient.connect(node_a.port) as first, RawClient.connect(node_b.port) as second:
        welcome = await first.hello(token)
        # The first holds it live: the proof of its key (spec "Resume proof").
        resumed = await second.hello(token, p.resume_proof(welcome.session_key, welcome.tid))
        assert resumed.resumed and resumed.tid == welcome.tid
        assert (await first.expect_close(timeout=2)).code == p.CloseCode.TAKEN_OVER
        assert isinstance(await second.heartbeat(), p.HeartbeatAck)
    resumes = await events.wait_for("SESSION_RESUMED", tid_of(welcome))
    assert resumes[0]["node"] == "node-b"


async def test_two_sweeping_nodes_expire_a_session_exactly_once(
    start_app: Callable[..., Awaitable[App]],
    tokens: TokenService,
    events: EventLog,
    redis: Client,
):
    node_a = await start_app(node_name="node-a")
    node_b = await start_app(node_name="node-b")
    tids = []
    for n in range(4):  # several sessions, so both sweepers race for some
        async with RawClient.connect(node_a.port) as client:
            tids.append(tid_of(await client.hello(tokens.mint(f"quiet-{n}"))))
    for tid in tids:
        await events.wait_for("TOKEN_EXPIRED", tid, timeout=5)
    assert node_a.admin is not None and node_b.admin is not None
    await after_a_full_sweep(node_a.admin.port, node_b.admin.port)
    assert await left_to_judge(redis, node_a.settings.key_prefix, tids) == []
    stream = await read_events(redis, node_a.settings.key_prefix)
    for kind in ("SESSION_WARN", "TOKEN_EXPIRED"):
        assert sorted(e["tid"] for e in stream if e["type"] == kind) == sorted(tids), kind


async def test_readyz_on_the_cluster(app: App):
    status, body = await http_get(app.port, "/readyz")
    assert status == 200, body


# Sentinel ----------------------------------------------------------------------------------


# Sentinel is a mode of the server binary (--sentinel), so wherever the tests can start
# a redis-server they can start a sentinel: no separate binary to skip on.
@pytest.fixture(scope="module")
def sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisSentinelProcess]:
    directory = tmp_path_factory.mktemp("sentinel")
    master = RedisProcess(directory / "master")
    master.start()
    watcher = RedisSentinelProcess(directory / "sentinel", master)
    watcher.start()
    yield watcher
    watcher.stop()
    master.stop()


async def test_serves_a_session_through_sentinel(
    start_app: Callable[..., Awaitable[App]],
    tokens: TokenService,
    sentinel: RedisSentinelProcess,
):
    app = await start_app(redis_url=sentinel.url)
    status, body = await http_get(app.port, "/readyz")
    assert status == 200, body
    settings = app.settings
    client = open_client(settings.redis_url, settings)
    try:
        async with EventLog(client, f"{settings.key_prefix}:events") as events:
            async with RawClient.connect(app.port) as raw:
                welcome = await raw.hello(tokens.mint("watched"))
                assert (await raw.heartbeat()).seq == 1
                await raw.send(p.encode(p.Bye()))
                assert (await raw.expect_close()).code == p.CloseCode.NORMAL
            await events.wait_for("SESSION_CLOSED", tid_of(welcome))
        master = sentinel.master
        assert isinstance(client, aioredis.Redis)
        pool = client.connection_pool
        assert isinstance(pool, SentinelConnectionPool)
        assert (await pool.get_master_address())[1] == master.port
    finally:
        await client.aclose()


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[tuple[RedisProcess, RedisProcess, RedisSentinelProcess]]:
    """A master, its replica, and a sentinel that knows both: a failover can happen."""
    master = RedisProcess(tmp_path / "master")
    master.start()
    replica = RedisProcess(
        tmp_path / "replica", extra_args=("--replicaof", LOOPBACK, str(master.port))
    )
    replica.start()
    watcher = RedisSentinelProcess(tmp_path / "sentinel", master)
    watcher.start()
    asking = sync_redis.Redis(host=LOOPBACK, port=watcher.port, decode_responses=True)
    eventually_sync(  # learnt from the master's INFO
        lambda: asking.sentinel_slaves(watcher.service), 20, interval=0.05, what="replica seen"
    )
    asking.close()
    yield master, replica, watcher
    watcher.stop()
    replica.stop()
    master.kill()


async def test_the_control_subscription_retries_as_soon_as_sentinel_names_a_new_master(
    start_app: Callable[..., Awaitable[App]],
    replicated: tuple[RedisProcess, RedisProcess, RedisSentinelProcess],
):
    """Its wait before subscribing again (doubling while it fails) ends as soon as
    Sentinel names another master: /readyz is back with the new master, not a doubled
    wait later."""
    master, replica, watcher = replicated
    app = await start_app(redis_url=watcher.url)
    node = app.node
    assert node is not None and node.subscribed.is_set()
    sentinel = aioredis.Redis(host=LOOPBACK, port=watcher.port, decode_responses=True)

    async def unsubscribed() -> bool:
        return not node.subscribed.is_set()

    async def promoted() -> bool:
        named = await sentinel.execute_command(
            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", watcher.service
        )
        return bool(named) and int(named[1]) == replica.port

    try:
        dead = (LOOPBACK, master.port)
        master.kill()
        await eventually(unsubscribed)
        # While Sentinel names the master the failed try was for, a wait lasts its length,
        # asking Sentinel every SENTINEL_POLL (on a clock of the test's own).
        slept: list[float] = []

        async def sleep(seconds: float) -> None:
            slept.append(seconds)

        listener = ControlListener(
            node.redis, "unheard", lambda conn: None, clock=lambda: sum(slept), sleep=sleep
        )
        await listener.until_retry(0.3, dead)
        assert sum(slept) == pytest.approx(0.3) and len(slept) == round(0.3 / SENTINEL_POLL)
        waiting = asyncio.create_task(node.control.until_retry(60, dead))

        async def failing_over() -> bool:
            try:
                await sentinel.execute_command("SENTINEL", "FAILOVER", watcher.service)
            except rexc.ResponseError:  # NOGOODSLAVE until it has a replica it may promote
                return False
            return True

        await eventually(failing_over, timeout=30)
        await eventually(promoted, timeout=30)
        await asyncio.wait_for(waiting, 10)  # at once, not after its 60 s
        await eventually(lambda: is_ready(app.port), 10)
    finally:
        await sentinel.aclose()


# Two nodes renewing one session at once ------------------------------------------------------


async def test_concurrent_renewals_from_two_nodes_never_shorten_the_token(
    make_settings: Callable[..., Settings], redis: Client
):
    """Two Stores heartbeat one session together inside its renew window.

    Spec 0x03 HEARTBEAT, "Renewal" (atomic in the store) and "Events" (each change
    emits exactly once).

    Each renewal boundary (the token's new exp moves on by whole seconds) is won by
    exactly one of them, with one TOKEN_RENEWED; exp and the key's expiry never go back.
    """
    # Renewed exps are whole seconds 3 s ahead; each is inside the window 0.5 s later.
    settings = make_settings(token_ttl=3, renew_window=2.5)
    clients = [open_client(settings.redis_url, settings) for _ in range(2)]
    stores = [Store(client, settings, f"node-{n}") for n, client in enumerate(clients)]
    tid = tid_in_shard(3)
    hash_key = stores[0].keys.session_keys(tid)[0]
    now = int(time.time())
    try:
        assert (await stores[0].hello(tid, "both", 5, now, now + 2, "c")).outcome == "started"
        request = stores[0].heartbeat_request(tid, "c")
        exps, expiries, wins = [now * 1000 + 2000], [await redis.pexpiretime(hash_key)], 0
        async with asyncio.timeout(10):
            while wins < 2:
                replies = await asyncio.gather(*(s.record_heartbeats([request]) for s in stores))
                # A plain OK (not renewed) is the exp alone: as an answer here.
                results = [as_answer(reply[0]) for reply in replies]
                assert [r.outcome for r in results] == ["ok", "ok"]
                # Both win only when they straddle a second: then each moved exp to its own
                # boundary (a loaded machine can put the two calls a second apart).
                winners = [r.exp_ms for r in results if r.renewed]
                assert len(set(winners)) == len(winners)
                wins += sum(r.renewed for r in results)
                exps += sorted(r.exp_ms for r in results)
                expiries.append(await redis.pexpiretime(hash_key))
                await asyncio.sleep(0.2)  # the heartbeat cadence, well inside expire_after
        assert exps == sorted(exps), "a renewal shortened the token"
        assert expiries == sorted(expiries), "a renewal shortened the session's expiry"
        assert len(set(exps)) == wins + 1  # each new exp came from exactly one win
        renewed = [
            e
            for e in await read_events(redis, settings.key_prefix)
            if e["tid"] == str(tid) and e["type"] == "TOKEN_RENEWED"
        ]
        assert len(renewed) == wins
    finally:
        for client in clients:
            await client.aclose()


# URL schemes (docs/scaling.md) -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "hosts", "options"),
    [
        (
            "redis+cluster://10.0.0.1:7000,10.0.0.2:7001",
            [("10.0.0.1", 7000), ("10.0.0.2", 7001)],
            {},
        ),
        (
            "rediss+cluster://u:p%40ss@a.example,[::1]:7002/0?ssl_cert_reqs=none",
            [("a.example", 6379), ("::1", 7002)],
            {"username": "u", "password": "p@ss", "ssl": True, "db": 0, "ssl_cert_reqs": "none"},
        ),
    ],
)
def test_cluster_url(url: str, hosts: list[tuple[str, int]], options: dict[str, object]):
    assert parse_multi_host_url(url, 6379, service=False) == MultiHostUrl(hosts, options, "")


def test_sentinel_url_names_its_service_and_db():
    assert parse_multi_host_url(
        "redis+sentinel://:secret@s1:26380,s2/mymaster/2", 26379, service=True
    ) == MultiHostUrl([("s1", 26380), ("s2", 26379)], {"password": "secret", "db": 2}, "mymaster")


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis+sentinel://s1:26379", "needs host:port and /service"),
        ("redis+sentinel:///svc", "needs host:port and /service"),
        ("redis+cluster://a:70x0", "invalid literal"),
        ("redis+cluster://", "needs host:port"),
        ("mysql://a:3306", "scheme"),
    ],
)
def test_an_unusable_url_is_a_configuration_error(url: str, problem: str, settings: Settings):
    with pytest.raises(ConfigError, match=f"^redis_url: .*{problem}"):
        open_client(url, settings)


def test_cli_reports_an_unusable_url_in_one_line(home: dict[str, str]):
    tid = str(uuid.uuid4())
    result = tokend("revoke", tid, env={**home, "TOKEND_REDIS_URL": "redis+sentinel://s1"})
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "tokend: configuration error: redis_url: redis+sentinel:// URL needs host:port and /service"
    ]


async def test_an_unreachable_cluster_is_an_outage_not_a_crash(
    make_settings: Callable[..., Settings],
):
    """As with one Redis: /readyz says so, and the control listener's retry loop goes on."""
    settings = make_settings(redis_url=f"redis+cluster://{LOOPBACK}:{free_port()}")
    client = open_client(settings.redis_url, settings)
    try:
        problem = await Store(client, settings, "node-test").ready()
        assert problem is not None and problem.startswith("redis unreachable")
        with pytest.raises(rexc.ConnectionError):
            await subscription(client)
    finally:
        await client.aclose()
