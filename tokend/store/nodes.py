"""The nodes sharing a store, as each tells the others: its latest view, kept while it
runs, and its recent history (tokend.ops.monitor writes both; the admin API reads them).

All of it lives under one hash tag (``Keyspace.node_keys``), so on a Cluster every read
and write here is of one slot: one round trip reads every node's view.
"""

from __future__ import annotations

import json
from typing import Any, cast

from tokend.store.keyspace import Keyspace
from tokend.store.redis_client import Client
from tokend.store.unavailable import Deadline

View = dict[str, Any]
Sample = dict[str, Any]


class NodeBoard:
    """What the nodes of one store tell each other of themselves."""

    def __init__(self, redis: Client, keys: Keyspace, deadline: Deadline) -> None:
        self.redis = redis
        self.keys = keys
        self.deadline = deadline

    async def publish(self, node: str, view: View, ttl_ms: int) -> None:
        """``node``'s latest view, gone ``ttl_ms`` after this unless published again."""
        view_key, _ = self.keys.node_keys(node)

        async def call() -> None:
            pipe = self.redis.pipeline(transaction=False)
            pipe.set(view_key, json.dumps(view), px=ttl_ms)
            pipe.sadd(self.keys.node_names, node)
            await pipe.execute()

        await self.deadline(call)

    async def record(self, node: str, sample: Sample, keep: int, ttl_ms: int) -> None:
        """Add ``sample`` to ``node``'s history, which keeps the last ``keep`` and is gone
        ``ttl_ms`` after the last one."""
        _, history_key = self.keys.node_keys(node)

        async def call() -> None:
            pipe = self.redis.pipeline(transaction=False)
            pipe.rpush(history_key, json.dumps(sample))
            pipe.ltrim(history_key, -keep, -1)
            pipe.pexpire(history_key, ttl_ms)
            pipe.sadd(self.keys.node_names, node)
            await pipe.execute()

        await self.deadline(call)

    async def views(self) -> list[View]:
        """The views of the nodes that run (published within their ttl), by name. A node
        whose view and history are both gone is forgotten here."""
        names, views, histories = await self._read(include_history=False)
        gone = [n for n, v, h in zip(names, views, histories, strict=True) if v is None and not h]
        if gone:
            await self.deadline(lambda: self.redis.srem(self.keys.node_names, *gone))
        return [json.loads(v) for v in views if v is not None]

    async def history(self, node: str) -> list[Sample]:
        _, history_key = self.keys.node_keys(node)
        rows = await self.deadline(lambda: self.redis.lrange(history_key, 0, -1))
        return [json.loads(row) for row in rows]

    async def histories(self) -> dict[str, list[Sample]]:
        """Every node's history that the store still holds, by node name."""
        names, _, histories = await self._read(include_history=True)
        return {
            name: [json.loads(row) for row in rows]
            for name, rows in zip(names, histories, strict=True)
            if rows
        }

    async def _read(self, include_history: bool) -> tuple[list[str], list[Any], list[Any]]:
        """The node names, and for each its view (or None) and its history (the rows, or
        with ``include_history`` false only whether there is one)."""

        async def call() -> tuple[list[str], list[Any], list[Any]]:
            # The client decodes replies: names are str (redis-py types them wider).
            names = sorted(cast("set[str]", await self.redis.smembers(self.keys.node_names)))
            if not names:
                return [], [], []
            pipe = self.redis.pipeline(transaction=False)
            for name in names:
                view_key, history_key = self.keys.node_keys(name)
                pipe.get(view_key)
                if include_history:
                    pipe.lrange(history_key, 0, -1)
                else:
                    pipe.exists(history_key)
            replies = await pipe.execute()
            return names, replies[0::2], replies[1::2]

        return await self.deadline(call)
