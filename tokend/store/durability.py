"""Waiting for replicas (Redis WAIT) after a script whose effect must survive a failover.

Redis replicates asynchronously: a write the master acknowledged can be missing from the
replica that Sentinel or a Cluster promotes. WAIT counts the replicas holding every write
made so far *on the connection it is sent on*, so it must follow the script on the same
connection: in one pipeline on one Redis or through Sentinel, and on a Cluster on one
connection to the node that owns the script's slot. (A Cluster pipeline would not do: after
a redirection it sends a command again, on another connection, and WAIT would then count
the wrong writes.) docs/scaling.md, "What survives a failover".
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from redis import exceptions as rexc
from redis.asyncio import Redis
from redis.asyncio.cluster import PipelineCommand, RedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool

from tokend.store.unavailable import UNAVAILABLE

# Replies that mean a Cluster script did not run where it was sent (the slot moved or is
# being failed over): the caller's attempt failed like a connection does.
_NOT_RUN = (rexc.MovedError, rexc.AskError, rexc.TryAgainError, rexc.ClusterDownError)


async def known_replicas(redis: Redis | RedisCluster, key: str) -> int:
    """The replicas of ``key``'s master that a failover could promote.

    Through Sentinel: every replica the sentinels list for the service, connected or not;
    on a Cluster: every replica of the key's master in its node table, failed or not. A
    replica cut off from its master is the one that would lose a write, so it counts (a
    count of connected replicas would be 0 then, and WAIT 0 would confirm anything). On a
    plain URL there is only the master's view: the replicas connected to it now.
    """
    if isinstance(redis, RedisCluster):
        table = await redis.execute_command(
            "CLUSTER", "NODES", target_nodes=redis.get_node_from_key(key)
        )
        rows = [line.split() for line in table.splitlines() if line.strip()]
        me = next(row[0] for row in rows if "myself" in row[2].split(","))
        return sum(1 for row in rows if row[3] == me)
    pool = redis.connection_pool
    if isinstance(pool, SentinelConnectionPool):
        for sentinel in pool.sentinel_manager.sentinels:
            with contextlib.suppress(*UNAVAILABLE):
                return len(await sentinel.sentinel_slaves(pool.service_name))
        raise rexc.ConnectionError("no sentinel answered")
    return len((await redis.execute_command("ROLE"))[2])


async def then_wait(
    redis: Redis | RedisCluster, key: str, command: Sequence[Any], replicas: int, timeout_ms: int
) -> tuple[Any, int]:
    """Run ``command`` (a script call on ``key``'s slot), then WAIT on the same connection.

    Returns the command's reply (the exception, if it failed) and how many replicas
    acknowledged it within ``timeout_ms``.
    """
    wait = ("WAIT", replicas, timeout_ms)
    if isinstance(redis, RedisCluster):
        commands = [PipelineCommand(0, *command), PipelineCommand(1, *wait)]
        try:
            node = redis.get_node_from_key(key)
            if node is None:
                raise rexc.SlotNotCoveredError(f"no node serves the slot of {key}")
            await node.execute_pipeline(commands)
        except UNAVAILABLE:
            await _relearn(redis)
            raise
        reply, acknowledged = (c.result for c in commands)
        if isinstance(reply, _NOT_RUN):
            await _relearn(redis)
            raise rexc.ConnectionError(f"slot not served here: {reply}")
    else:
        pipe = redis.pipeline(transaction=False)
        pipe.execute_command(*command)
        pipe.execute_command(*wait)
        reply, acknowledged = await pipe.execute(raise_on_error=False)
    if isinstance(acknowledged, Exception):  # a replica's answer: not the master (any more)
        raise rexc.ConnectionError(f"WAIT refused: {acknowledged}")
    return reply, int(acknowledged)


async def _relearn(redis: RedisCluster) -> None:
    """Read the Cluster's slot table again (failed over or resharded), if it answers."""
    with contextlib.suppress(rexc.RedisError, rexc.RedisClusterException, OSError):
        await redis.nodes_manager.initialize()
