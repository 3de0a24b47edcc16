"""The store: its Redis client (commands packed with hiredis, byte for byte as redis-py
does), the session hash, and control messages addressed to the node holding a connection."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import hiredis
import pytest
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import BlockingConnectionPool, Connection
from redis.exceptions import DataError

from testkit import replies
from testkit.events import EventLog
from testkit.net import free_port
from testkit.redis_servers import RedisProcess
from testkit.stores import WARN_MS, control, proof_of, redis_ms, started, store, sweep
from tokend.config import Settings
from tokend.core.store_messages import ReleaseOutcome, heartbeat_outcome
from tokend.store.keyspace import Keyspace
from tokend.store.packing import FASTER, HiredisConnection, HiredisPacking
from tokend.store.redis_client import DirectCalls, open_client
from tokend.store.scripts import HEARTBEAT
from tokend.store.sessions import HelloRequest, Store, proof_digest
from tokend.store.unavailable import StoreUnavailable
from tokend.tokens.service import store_digest

__all__ = ["control", "store"]  # fixtures of testkit

COMMANDS: list[tuple[Any, ...]] = [
    ("PING",),
    ("SET", "key", "value"),
    ("SET", "clé", "välue ✓", "PX", 1500),
    ("HSET", b"raw\x00key", b"\xff\xfe", 0, -7, 3.25, 1e20, 2**70),
    ("SCRIPT LOAD", "return 1"),  # a command name of two words
    (b"CONFIG GET", "maxmemory"),
    ("SET", "big", "x" * 100_000),  # above redis-py's buffer cutoff: chunked by redis-py
    ("EVALSHA", HEARTBEAT.sha, 4, "{p:1}:due", "{p:1}:events", "s", "t", "node", 60, "tid"),
    ("SET", "view", bytearray(b"ab"), memoryview(b"cd")),  # hiredis refuses: fallback
]


def python_packed(connection: Connection, command: tuple[Any, ...]) -> bytes:
    return b"".join(Connection.pack_command(connection, *command))


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: str(c[0]))
def test_packs_the_bytes_redis_py_packs(command: tuple[Any, ...]) -> None:
    ours = HiredisConnection()
    assert b"".join(ours.pack_command(*command)) == python_packed(ours, command)


def test_a_pipeline_packs_as_redis_py_does() -> None:
    ours = HiredisConnection()
    expected = b"".join(python_packed(ours, command) for command in COMMANDS)
    assert b"".join(ours.pack_commands(COMMANDS)) == expected


@pytest.mark.parametrize("bad", [True, None, object()])
def test_refuses_what_redis_py_refuses(bad: object) -> None:
    with pytest.raises(DataError):
        HiredisConnection().pack_command("SET", "key", bad)


def test_another_encoding_is_packed_by_redis_py() -> None:
    latin = HiredisConnection(encoding="latin-1")
    assert b"".join(latin.pack_command("SET", "k", "é")).endswith(b"$1\r\n\xe9\r\n")


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:1/0",
        "rediss://127.0.0.1:1/0",
        "unix:///tmp/tokend-test.sock",
        "redis+sentinel://127.0.0.1:1/mymaster",
        "rediss+sentinel://127.0.0.1:1/mymaster",
    ],
)
async def test_every_single_redis_url_gets_hiredis_packing(url: str, settings: Settings) -> None:
    client = open_client(url, settings)
    try:
        assert isinstance(client, Redis)
        assert issubclass(client.connection_pool.connection_class, HiredisPacking)
        assert client.connection_pool.connection_class in FASTER.values()
    finally:
        await client.aclose()


async def test_cluster_nodes_get_hiredis_packing(settings: Settings) -> None:
    client = open_client("redis+cluster://127.0.0.1:1,127.0.0.1:2", settings)
    try:
        assert isinstance(client, RedisCluster)
        nodes = client.nodes_manager.startup_nodes.values()
        assert [node.connection_class for node in nodes] == [HiredisConnection] * 2
        # Nodes the client discovers later are made with these.
        assert client.nodes_manager.connection_kwargs["connection_class"] is HiredisConnection
    finally:
        await client.aclose()


async def test_round_trips_through_real_redis(
    redis_server: RedisProcess, settings: Settings
) -> None:
    client = open_client(redis_server.url, settings)
    try:
        key = f"{settings.key_prefix}:packing"
        await client.hset(key, mapping={"s": "välue", "i": 7, "f": 0.5, "b": b"\x01"})
        assert await client.hgetall(key) == {"s": "välue", "i": "7", "f": "0.5", "b": "\x01"}
        pipe = client.pipeline(transaction=False)
        pipe.incrby(key + ":n", 2)
        pipe.incrbyfloat(key + ":n", 0.5)
        pipe.delete(key, key + ":n")
        assert await pipe.execute() == [2, 2.5, 2]
    finally:
        await client.aclose()


async def test_direct_calls_give_back_what_they_do_not_keep_of_a_small_pool(
    redis_server: RedisProcess, settings: Settings
) -> None:
    """Direct calls in flight at once each hold a pooled connection; after them, a quarter
    of the pool at most stays held: the rest of the node finds the others (a pool of 4
    with 3 kept would leave one for the sweeper, the queries and the pipelines)."""
    client = open_client(redis_server.url, replace(settings, redis_pool_size=4))
    assert isinstance(client, Redis)
    pool = client.connection_pool
    assert isinstance(pool, BlockingConnectionPool)
    pool.timeout = 1  # a pool that cannot serve says so at once
    direct = DirectCalls.usable(client)
    assert direct is not None and direct.keep == 1
    try:
        key = f"{settings.key_prefix}:direct"
        # Three calls at once, each blocked in Redis until its timeout: three connections.
        assert (
            await asyncio.gather(*(direct.call("BLPOP", key, 0.2) for _ in range(3))) == [None] * 3
        )
        assert len(direct.idle) == 1
        # Three at once through the pool: they find three connections.
        assert await asyncio.gather(*(client.blpop([key], 0.2) for _ in range(3))) == [None] * 3
    finally:
        await client.aclose()


async def test_a_direct_call_on_a_connection_redis_closed_is_made_once_more(
    redis_server: RedisProcess, settings: Settings
) -> None:
    """Redis closed the kept connection while it was idle (a restart, a timeout, CLIENT
    KILL): the next call finds out on it, and is made again on a new one."""
    client = open_client(redis_server.url, settings)
    direct = DirectCalls.usable(client)
    assert direct is not None
    try:
        key = f"{settings.key_prefix}:direct"
        assert await direct.call("SET", key, "1") == "OK"
        assert (
            await direct.call_packed(
                b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key.encode()), key.encode())
            )
            == "1"
        )
        [kept] = direct.idle
        assert await client.client_kill_filter(_type="normal", skipme=True) >= 1
        assert await direct.call("INCR", key) == 2
        assert direct.idle == [kept] and kept.is_connected  # connected again
    finally:
        await client.aclose()


async def test_the_session_hash_is_a_listpack_with_its_digests_in_22_characters(
    store: Store, redis: Redis
) -> None:
    """Redis memory per session is mostly this hash (docs/performance.md, "Sizing"): it
    stays in listpack encoding, and its two digests (128 bits each) take 22 characters,
    not hex's 32."""
    tid, now = uuid.uuid4(), int(time.time())
    token = store_digest(b"a token")
    await store.hello(tid, "alice", 5, now, now + 60, "node-a/1", proof=b"p" * 16, token=token)
    key = store.keys.session_keys(tid)[0]
    proof, tok = await redis.hmget(key, "proof", "tok")
    assert (proof, tok) == (proof_digest(b"p" * 16), token)
    assert len(replies.text(proof)) == len(replies.text(tok)) == 22
    assert await redis.object("encoding", key) == "listpack"


async def test_the_session_hash_names_its_node_only_in_conn(store: Store, redis: Redis) -> None:
    tid = await started(store, "node-a/7")
    fields = await redis.hgetall(store.keys.session_keys(tid)[0])
    assert fields["conn"] == "node-a/7" and "node" not in fields
    view = await store.queries.session(tid)
    assert view is not None and (view.node, view.conn) == ("node-a", "node-a/7")


async def test_a_released_session_is_held_by_none_and_shows_the_node_that_held_it_last(
    store: Store, redis: Redis
) -> None:
    tid = await started(store, "node-b/3")
    since = int(replies.text(await redis.hget(store.keys.session_keys(tid)[0], "since")))
    released = await store.releases([store.release_request(tid, "node-b/3", since, "")])
    assert released == [ReleaseOutcome.RELEASED]
    view = await store.queries.session(tid)
    assert view is not None and (view.node, view.conn) == ("node-b", "")


async def test_a_resume_never_takes_over_the_connection_resuming(
    store: Store, control: dict[str, EventLog]
) -> None:
    """A node restarted under its name numbers connections afresh: the client resuming
    may get the very id its old connection had. It must not be told it was taken over;
    a resume from elsewhere still takes over the old connection."""
    tid, other = await started(store, "node-a/1"), await started(store, "node-a/2")
    now = int(time.time())
    proof = proof_of("node-a/1")
    again = await store.hello(tid, "alice", 5, now, now + 60, "node-a/1", proof, proof)
    assert again.outcome == "resumed"
    await store.revoke(other, by="test")  # published after any the resume would have sent
    await control["node-a"].wait_until(lambda: len(control["node-a"].events) >= 1)
    assert control["node-a"].events == [
        {"op": "close", "tid": str(other), "conn": "node-a/2", "code": 4506}
    ]
    # node-a/1 holds it live: the resume shows the proof its key makes.
    elsewhere = await store.hello(tid, "alice", 5, now, now + 60, "node-b/1", proof)
    assert elsewhere.outcome == "resumed"
    await control["node-a"].wait_until(lambda: len(control["node-a"].events) == 2)
    assert control["node-a"].events[1] == {
        "op": "close",
        "tid": str(tid),
        "conn": "node-a/1",
        "code": 4507,
    }


async def test_a_control_message_goes_to_the_connections_node_alone(
    store: Store, control: dict[str, EventLog]
) -> None:
    on_b, on_a = await started(store, "node-b/1"), await started(store, "node-a/1")
    await store.revoke(on_b, by="test")
    await control["node-b"].wait_until(lambda: len(control["node-b"].events) == 1)
    await store.revoke(on_a, by="test")
    await control["node-a"].wait_until(lambda: len(control["node-a"].events) == 1)
    assert control["node-b"].events == [
        {"op": "close", "tid": str(on_b), "conn": "node-b/1", "code": 4506}
    ]
    # node-a heard only its own (node-b's message was published, and delivered, first).
    assert [m["conn"] for m in control["node-a"].events] == ["node-a/1"]


async def test_a_sweep_hands_its_own_connections_back_instead_of_publishing(
    store: Store, control: dict[str, EventLog]
) -> None:
    tids = [await started(store, conn) for conn in ("node-a/1", "node-b/1", "node-a/2")]
    silent_since = await redis_ms(store) - WARN_MS - 5_000
    for tid in tids:
        await store.redis.hset(store.keys.session_keys(tid)[0], "hb", silent_since)
    made = await sweep(store, tids)
    assert made == {
        str(tids[0]): ("warn", "node-a/1"),
        str(tids[1]): ("warn", ""),
        str(tids[2]): ("warn", "node-a/2"),
    }
    await control["node-b"].wait_until(lambda: len(control["node-b"].events) == 1)
    assert control["node-b"].events[0] == {"op": "notice", "tid": str(tids[1]), "conn": "node-b/1"}
    # Swept again at once: nothing more is due, nothing is made twice.
    assert await sweep(store, tids) == {}
    # Then node-a's first message is the next one published for it: no notice came before.
    await store.revoke(tids[0], by="test")
    await control["node-a"].wait_until(lambda: len(control["node-a"].events) >= 1)
    assert [m["op"] for m in control["node-a"].events] == ["close"]


async def test_a_batch_of_hellos_is_one_round_trip(store: Store) -> None:
    round_trips: list[str] = []
    store.observe = lambda script, seconds: round_trips.append(script)
    tids = [uuid.uuid4() for _ in range(20)]
    now = int(time.time())
    results = await store.hellos(
        [HelloRequest(tid, "alice", 5, now, now + 60, f"node-a/{n}") for n, tid in enumerate(tids)]
        + [HelloRequest(tids[0], "mallory", 5, now, now + 60, "node-a/99")]  # after tids[0]'s
    )
    assert [r.outcome for r in results] == ["started"] * 20 + ["mismatch"]
    assert round_trips == ["hello"]
    # Each got its own reply: its session, as it asked.
    for n, tid in enumerate(tids):
        view = await store.queries.session(tid)
        assert view is not None and view.conn == f"node-a/{n}"


async def test_hellos_fail_together_when_redis_is_gone(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings(redis_url=f"redis://127.0.0.1:{free_port()}/0", redis_timeout=0.5)
    client = open_client(settings.redis_url, settings)
    store = Store(client, settings, "node-a")
    now = int(time.time())
    try:
        with pytest.raises(StoreUnavailable):
            await store.hellos(
                [HelloRequest(uuid.uuid4(), "a", 5, now, now + 60, f"node-a/{n}") for n in range(3)]
            )
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    ("replayed", "restore", "token"),
    [((), (), ""), ((False, True, False), (), ""), ((), ("1|2|3|4||süb",) * 3, ""), ((), (), "dg")],
)
def test_a_heartbeat_batch_is_written_as_hiredis_would_pack_it(
    settings: Settings, replayed: tuple[bool, ...], restore: tuple[str, ...], token: str
) -> None:
    """heartbeat.lua's batch on one Redis is written by the store itself (RESP), its
    sessions in groups by shard: byte for byte the command hiredis packs, lengths counted
    in UTF-8 bytes (a key prefix, a node name, a sub that are not ASCII)."""
    unicode = replace(settings, key_prefix="tökend")
    store = Store(open_client("redis://127.0.0.1:1/0", unicode), unicode, "nødé")
    store.wall_clock = lambda: 1_000.0
    assert store._wire is not None
    tids = [uuid.uuid4() for _ in range(40)]  # more than the 16 shards: groups of several
    batch = [store.heartbeat_request(tid, f"nødé/{n}") for n, tid in enumerate(tids)]
    batch[1] = batch[1]._replace(conn="plain/1", token=token)
    replayed = tuple(n % 3 == 1 for n in range(len(batch))) if replayed else ()
    restore = tuple(f"{restore[0]}{n}" for n in range(len(batch))) if restore else ()
    packed, order = store._wire.pack(batch, replayed, restore, store._given_up_at())
    # The command, written out: groups by shard, in the order of their shards.
    assert sorted(order) == list(range(len(batch)))
    assert [batch[i].shard for i in order] == sorted(r.shard for r in batch)
    keys: list[str] = []
    args: list[Any] = [*store._common, *store._heartbeat_args]
    for shard in sorted({r.shard for r in batch}):
        members = [i for i in order if batch[i].shard == shard]
        keys += store._shard_keys[shard]
        args.append(len(members))
        for i in members:
            tid, conn, _, request_token = batch[i]
            hash_prefix, tomb_prefix = store._session_prefixes[shard]
            keys += [hash_prefix + tid, tomb_prefix + tid]
            args += [tid, conn, "1" if replayed and replayed[i] else "0"]
            args += [restore[i] if restore else "", request_token]
    assert packed == hiredis.pack_command(("EVALSHA", HEARTBEAT.sha, len(keys), *keys, *args))


async def test_a_batch_over_many_shards_is_one_script_call_on_one_redis(
    store: Store, redis: Redis
) -> None:
    conns = {await started(store, f"node-a/{n}"): f"node-a/{n}" for n in range(40)}
    assert len({Keyspace.shard(tid) for tid in conns}) > 8  # 40 random tids: ~15 shards
    taken, gone = next(iter(conns)), uuid.uuid4()
    batch = [store.heartbeat_request(tid, conn) for tid, conn in conns.items()]
    batch[0] = store.heartbeat_request(taken, "node-a/elsewhere")
    batch.append(store.heartbeat_request(gone, "node-a/99"))

    async def evalsha_calls() -> int:
        return int((await redis.info("commandstats"))["cmdstat_evalsha"]["calls"])

    await store.load_scripts()  # no NOSCRIPT retry to count
    before = await evalsha_calls()
    results = await store.record_heartbeats(batch)
    assert await evalsha_calls() == before + 1
    assert [heartbeat_outcome(r) for r in results] == ["taken"] + ["ok"] * 39 + ["gone"]
    # A plain OK is the session's exp alone (heartbeat.lua's integer), made into nothing.
    assert all(type(r) is int for r in results[1:-1])
    # Each answer is its own session's: every session's deadline moved to its new one.
    for tid, result in zip(list(conns)[1:], results[1:], strict=False):
        assert await redis.zscore(store.keys.script_keys(tid)[0], str(tid)) == min(
            int(replies.text(await redis.hget(store.keys.session_keys(tid)[0], "hb"))) + WARN_MS,
            result,
        )
