"""The Redis client: one factory for every topology, and what differs on a Cluster.

:func:`open_client` makes the client for a URL: one Redis (``redis://``, ``rediss://``,
``unix://``), a Redis Cluster (``redis+cluster://``) or the master a Sentinel names
(``redis+sentinel://``); see docs/scaling.md. Everything else in tokend runs unchanged on
all three; where a Cluster differs it is :func:`initialized` and :func:`slot_groups`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Sequence
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis import exceptions as rexc
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import (
    AbstractConnection,
    BlockingConnectionPool,
    SSLConnection,
    parse_url,
)
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.maint_notifications import MaintNotificationsConfig

from tokend.config import ConfigError, Settings
from tokend.store.packing import pack_with_hiredis

# A client for any URL open_client() takes; both kinds answer the same commands.
Client = aioredis.Redis | RedisCluster

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")

# redis-py 8 turns maintenance notifications (a Redis Enterprise feature) on by default,
# and a pool that has them on hands out a pooled connection without checking whether
# Redis closed it: after a Redis restart each one failed its next command (a BYE answered
# 1013). Off, the pool replaces a closed connection before using it.
NO_MAINT_NOTIFICATIONS = MaintNotificationsConfig(enabled=False)


def open_client(url: str, settings: Settings) -> Client:
    """The client for ``url``'s scheme, with the deadline as its socket timeouts.

    Its connections pack commands with hiredis (:mod:`tokend.store.packing`).

    On one Redis and through Sentinel the pool waits (up to the deadline) instead
    of failing when full; a Cluster client cannot wait, so the store bounds its own
    concurrency to ``redis_pool_size`` instead (:class:`tokend.store.unavailable.Deadline`).
    A URL that cannot be used raises ConfigError. Connections are made on first use.
    """
    try:
        client = _client(url, settings)
    except ValueError as exc:  # redis-py's and parse_multi_host_url's word for a bad URL
        raise ConfigError(f"redis_url: {exc}") from None
    pack_with_hiredis(client)
    return client


def _client(url: str, settings: Settings) -> Client:
    options: dict[str, Any] = {
        "decode_responses": True,
        "socket_timeout": settings.redis_timeout,
        "socket_connect_timeout": settings.redis_timeout,
        "health_check_interval": 30,
    }
    scheme = url.partition("://")[0].lower()
    if scheme in CLUSTER_SCHEMES:
        hosts, kwargs, _ = parse_multi_host_url(url, 6379, service=False)
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in hosts],
            # Per cluster node: the Store's calls plus the control subscription.
            max_connections=settings.redis_pool_size + 1,
            **options,
            **kwargs,
        )
    if scheme in SENTINEL_SCHEMES:
        hosts, kwargs, service = parse_multi_host_url(url, 26379, service=True)
        sentinel_options = {k: v for k, v in options.items() if k.startswith("socket_")}
        if kwargs.get("ssl"):
            sentinel_options["ssl"] = True
        sentinel = Sentinel(hosts, sentinel_kwargs=sentinel_options)
        return sentinel.master_for(
            service,
            redis_class=SentinelRedis,
            connection_pool_class=_BlockingSentinelPool,
            max_connections=settings.redis_pool_size,
            timeout=settings.redis_timeout,
            maint_notifications_config=NO_MAINT_NOTIFICATIONS,
            **options,
            **kwargs,
        )
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=settings.redis_pool_size,
        timeout=settings.redis_timeout,
        maint_notifications_config=NO_MAINT_NOTIFICATIONS,
        **options,
    )
    return aioredis.Redis(connection_pool=pool)


class DirectCalls:
    """One command at a time on a connection held for it, outside redis-py's pipeline:
    the store's batch script calls on one Redis (tokend.store.sessions).

    A batch is one EVALSHA; through a pipeline, each paid the pool's checkout and
    return, a pipeline object, redis-py's event dispatch and its per-command bookkeeping
    (bench/results/2026-12-04-hot-path.md). Here a call takes one of the connections it keeps
    (checked out of the client's pool once, so the pool still counts, and closes, them),
    writes the command and reads its reply. Concurrent calls (the batchers' lanes) each
    hold their own; it keeps up to a quarter of the pool between calls, and gives the
    others back. The caller bounds the time (tokend.store.unavailable.Deadline): a
    connection whose call failed or was cancelled midway is disconnected (and connects
    again at its next call); an error reply leaves it as it is. A call on a connection
    that fails before the reply came (Redis restarted, or closed it while idle) is made
    once more, as redis-py's own retry would.
    """

    def __init__(self, pool: BlockingConnectionPool) -> None:
        self.pool = pool
        self.idle: list[AbstractConnection] = []
        # Kept out of the pool at most: the rest of the node (sweeps, queries, the
        # pipelines of a Cluster-less store) must still find connections in a small pool.
        self.keep = max(1, pool.max_connections // 4)

    @staticmethod
    def usable(redis: Client) -> DirectCalls | None:
        """Direct calls for a client to one Redis; None for a Cluster or through Sentinel
        (whose connections find their node themselves: the pool and pipeline are kept)."""
        pool = getattr(redis, "connection_pool", None)
        return DirectCalls(pool) if type(pool) is BlockingConnectionPool else None

    async def call(self, *command: Any) -> Any:
        """Send one command and return its reply; an error reply is raised (ResponseError)."""
        return await self.call_packed(None, command)

    async def call_packed(self, packed: bytes | None, command: tuple[Any, ...] = ()) -> Any:
        """:meth:`call` of a command written already as Redis reads it (RESP), ``packed``;
        None: ``command``, packed by the connection."""
        connection = self.idle.pop() if self.idle else await self.pool.get_connection()
        try:
            try:
                return await self._call(connection, packed, command)
            except (rexc.ConnectionError, OSError):
                return await self._call(connection, packed, command)  # reconnected: once more
        finally:
            if len(self.idle) < self.keep:
                self.idle.append(connection)
            else:
                await self.pool.release(connection)

    @staticmethod
    async def _call(
        connection: AbstractConnection, packed: bytes | None, command: tuple[Any, ...]
    ) -> Any:
        try:
            if not connection.is_connected:
                await connection.connect()
            # Written to the connection's stream itself: send_packed_command wraps the
            # write in asyncio.wait_for(socket_timeout), a task and a timer per call; the
            # caller's deadline bounds the write as the read.
            writer = connection._writer
            assert writer is not None  # connected
            writer.writelines(connection.pack_command(*command) if packed is None else [packed])
            await writer.drain()
            # No timeout of its own: the caller's deadline bounds the call.
            return await connection.read_response(timeout=math.inf)
        except rexc.ResponseError:
            raise
        except BaseException:
            await connection.disconnect(nowait=True)
            raise


class MultiHostUrl(NamedTuple):
    """A ``redis+cluster://`` or ``redis+sentinel://`` URL, split."""

    hosts: list[tuple[str, int]]
    # The connection options of the rest, as redis-py parses a ``redis://`` URL's
    options: dict[str, Any]
    # The Sentinel service name ("" for a Cluster)
    service: str


def parse_multi_host_url(url: str, default_port: int, *, service: bool) -> MultiHostUrl:
    """Split ``scheme://[user:pass@]host:port[,host:port...][/service][/db][?query]``.

    ``ssl`` is set among the options for ``rediss+...``; with ``service``, the path's
    first part is the Sentinel service name, and required. A URL that cannot be used
    raises ValueError.
    """
    parts = urlsplit(url)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    hosts = []
    for item in hostlist.split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon or port.endswith("]"):  # no port (an IPv6 address has colons too)
            host, port = item.strip(), str(default_port)
        hosts.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    name = path.pop(0) if service and path else ""
    if not hosts[0][0] or (service and not name):
        raise ValueError(f"{parts.scheme}:// URL needs host:port" + (" and /service" * service))
    plain_scheme = parts.scheme.partition("+")[0]
    single = f"{plain_scheme}://{userinfo + '@' if userinfo else ''}{hostlist.split(',')[0]}"
    query = f"?{parts.query}" if parts.query else ""
    kwargs: dict[str, Any] = dict(parse_url(single + "/" + "/".join(path) + query))
    for key in ("host", "port"):
        kwargs.pop(key, None)
    if kwargs.pop("connection_class", None) is SSLConnection:
        kwargs["ssl"] = True
    return MultiHostUrl(hosts, kwargs, name)


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """The Sentinel-discovered master, with a pool that waits when full like ours."""


class SentinelRedis(aioredis.Redis):
    """The master's client; closing it also closes the connections to the sentinels."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        pool = self.connection_pool
        assert isinstance(pool, SentinelConnectionPool)  # open_client made it so
        for sentinel in pool.sentinel_manager.sentinels:
            await sentinel.aclose()


async def initialized(redis: Client) -> Client:
    """``redis``, with a Cluster client's slot table loaded (else a no-op, and cheap after).

    redis-py 8.1's Cluster client needs it before :meth:`pubsub` (which picks its node
    from the table) and before its first commands run concurrently (they break each
    other's connections otherwise). An unreachable Cluster raises ConnectionError,
    as an unreachable Redis does.
    """
    if isinstance(redis, RedisCluster):
        try:
            await redis.initialize()
        except rexc.RedisClusterException as exc:
            raise rexc.ConnectionError(str(exc)) from exc
    return redis


async def subscription(redis: Client) -> PubSub:
    """A pub/sub connection (subscribe messages not returned).

    On a Cluster it is to one node: plain PUBLISH reaches every node of a Cluster,
    so one node's subscribers hear every event and control message.
    """
    return (await initialized(redis)).pubsub(ignore_subscribe_messages=True)


async def close_quietly(pubsub: PubSub) -> None:
    """Close a subscription whose connection may be broken, within a second, silently.

    Not to be awaited in a ``finally`` that a cancellation runs: the pool's aclose()
    reclaims the connection then, and pubsub.aclose() while cancelled can block.
    """
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1):
            await pubsub.aclose()


def through_sentinel(redis: Client) -> bool:
    """Whether ``redis`` reaches its master through Sentinel."""
    return isinstance(getattr(redis, "connection_pool", None), SentinelConnectionPool)


async def master_named(redis: Client) -> tuple[str, int] | None:
    """The master Sentinel names now, when ``redis`` reaches Redis through Sentinel."""
    pool = getattr(redis, "connection_pool", None)
    if not isinstance(pool, SentinelConnectionPool):
        return None
    address: tuple[str, int] = await pool.sentinel_manager.discover_master(pool.service_name)
    return address


async def slot_groups(redis: Client, keys: Sequence[str]) -> list[list[str]]:
    """``keys`` in groups that one multi-key command (XREAD) may name together.

    One group on a single Redis; one per hash slot on a Cluster, which refuses a
    command whose keys span slots (CROSSSLOT) even when one node holds them all.
    """
    cluster = await initialized(redis)
    if not isinstance(cluster, RedisCluster):
        return [list(keys)]
    groups: dict[int, list[str]] = {}
    for key in keys:
        groups.setdefault(cluster.keyslot(key), []).append(key)
    return list(groups.values())
