"""The store's Redis client: commands packed with hiredis, byte for byte as redis-py does."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from tests.support import RedisProcess
from tokend.config import Settings
from tokend.packing import FASTER, HiredisConnection, HiredisPacking
from tokend.store import HEARTBEAT, connect

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
    client = connect(url, settings)
    try:
        assert isinstance(client, Redis)
        assert issubclass(client.connection_pool.connection_class, HiredisPacking)
        assert client.connection_pool.connection_class in FASTER.values()
    finally:
        await client.aclose()


async def test_cluster_nodes_get_hiredis_packing(settings: Settings) -> None:
    client = connect("redis+cluster://127.0.0.1:1,127.0.0.1:2", settings)
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
    client = connect(redis_server.url, settings)
    try:
        key = f"{settings.key_prefix}:packing"
        await client.hset(key, mapping={"s": "välue", "i": 7, "f": 0.5, "b": b"\x01"})
        assert await client.hgetall(key) == {"s": "välue", "i": "7", "f": "0.5", "b": "\x01"}
        pipe = client.pipeline(transaction=False)
        pipe.incrby(key + ":n", 2).incrbyfloat(key + ":n", 0.5).delete(key, key + ":n")
        assert await pipe.execute() == [2, 2.5, 2]
    finally:
        await client.aclose()
