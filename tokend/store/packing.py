"""Redis connections that pack commands with hiredis (C) instead of redis-py's Python.

redis-py's asyncio client packs every command in pure Python
(``AbstractConnection.pack_command``), although ``hiredis.pack_command``, installed
with ``redis[hiredis]``, produces the same bytes in C; only the synchronous client uses
it. The classes here use it, and
fall back to redis-py's packer for what hiredis refuses (a bool, None or bytearray
argument, for which redis-py raises its own DataError or packs it itself) and for an
encoding other than UTF-8. :func:`tokend.store.redis_client.open_client` gives them to every kind of
client: one Redis (TCP, TLS, unix socket), a Cluster's nodes and a Sentinel's master.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar, cast

import hiredis
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.asyncio.sentinel import SentinelManagedConnection, SentinelManagedSSLConnection


class HiredisPacking(AbstractConnection):
    """Mixin: ``pack_command``/``pack_commands`` through ``hiredis.pack_command``."""

    # Whether the client's encoding is UTF-8 (hiredis' own), decided at the first command.
    _utf8: bool | None = None

    def pack_command(self, *args: Any) -> list[bytes]:
        packed = self._packed(args)
        return super().pack_command(*args) if packed is None else [packed]

    def pack_commands(self, commands: Iterable[Iterable[Any]]) -> list[bytes]:
        # One buffer for the whole pipeline: a batch is written in one call.
        return [b"".join(chunk for command in commands for chunk in self.pack_command(*command))]

    def _packed(self, args: tuple[Any, ...]) -> bytes | None:
        utf8 = self._utf8
        if utf8 is None:
            utf8 = self._utf8 = self.encoder.encoding.lower().replace("-", "") == "utf8"
        if not utf8:
            return None
        # As redis-py does: a command name with spaces ("SCRIPT LOAD") is several arguments.
        # Any other is packed as it is (a batch's EVALSHA is not copied once more).
        name = args[0]
        if (isinstance(name, str) and " " in name) or (isinstance(name, bytes) and b" " in name):
            args = (*name.split(), *args[1:])
        try:
            return hiredis.pack_command(args)
        except TypeError:
            return None


class HiredisConnection(HiredisPacking, Connection):
    """TCP."""


class HiredisSSLConnection(HiredisPacking, SSLConnection):
    """TLS (``rediss://``)."""


class HiredisUnixConnection(HiredisPacking, UnixDomainSocketConnection):
    """Unix socket (``unix://``)."""


class HiredisSentinelConnection(HiredisPacking, SentinelManagedConnection):
    """A Sentinel-discovered master, over TCP."""


class HiredisSentinelSSLConnection(HiredisPacking, SentinelManagedSSLConnection):
    """A Sentinel-discovered master, over TLS."""


# redis-py's class for each kind of connection -> ours.
FASTER: dict[type[AbstractConnection], type[AbstractConnection]] = {
    Connection: HiredisConnection,
    SSLConnection: HiredisSSLConnection,
    UnixDomainSocketConnection: HiredisUnixConnection,
    SentinelManagedConnection: HiredisSentinelConnection,
    SentinelManagedSSLConnection: HiredisSentinelSSLConnection,
}


_Connection = TypeVar("_Connection", bound=AbstractConnection)


def faster(connection_class: type[_Connection]) -> type[_Connection]:
    """Our hiredis-packing variant of ``connection_class`` (itself when there is none)."""
    # Each of FASTER's values is a subclass of its key.
    return cast("type[_Connection]", FASTER.get(connection_class, connection_class))


def pack_with_hiredis(client: Redis | RedisCluster) -> None:
    """Make every connection ``client`` opens from now on one of ours (before first use)."""
    if isinstance(client, RedisCluster):
        # The kwargs every ClusterNode is made with, then the nodes made already.
        kwargs = client.nodes_manager.connection_kwargs
        kwargs["connection_class"] = faster(kwargs.get("connection_class", Connection))
        for node in client.nodes_manager.startup_nodes.values():
            node.connection_class = faster(node.connection_class)
    else:
        pool = client.connection_pool
        pool.connection_class = faster(pool.connection_class)
