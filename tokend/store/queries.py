"""Read-only queries for operators (admin API, ``tokend sessions``) and for the failover
watch: plain commands, no script, each with the store's deadline."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, cast

from redis.asyncio.cluster import RedisCluster

from tokend.core.store_messages import Ended
from tokend.store.keyspace import SHARDS, Keyspace, node_of
from tokend.store.redis_client import Client
from tokend.store.unavailable import Deadline


@dataclass(frozen=True, slots=True)
class SessionView:
    """A session as the admin API and ``tokend sessions`` show it (times in unix ms)."""

    tid: str
    state: str  # ACTIVE | WARN | ENDED (only a tombstone is left; why in ``ended``)
    sub: str = ""
    exp: int = 0
    last_heartbeat: int = 0
    node: str = ""
    conn: str = ""
    prio: int = 0
    ended: str = ""

    @classmethod
    def of(cls, tid: str, fields: dict[str, str]) -> SessionView:
        """``conn`` is empty once no connection holds the session (its connection ended);
        ``node`` then names the node that held it last. ``last_heartbeat`` of a session
        parked by a planned close lies ahead (docs/protocol.md §5)."""
        conn = fields.get("conn", "")
        return cls(
            tid,
            fields["st"],
            fields["sub"],
            int(fields["exp"]),
            int(fields["hb"]),
            node_of(conn or fields.get("left", "")),
            conn,
            int(fields.get("prio", 0)),
        )

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Counts:
    """Sessions of every node by state (connected or not), and the sessions ended since the
    store began, by tombstone (an :class:`tokend.core.store_messages.Ended` value)."""

    active: int
    warn: int
    ended: dict[str, int]

    def as_json(self) -> dict[str, Any]:
        return {"sessions": {"ACTIVE": self.active, "WARN": self.warn}, "ended": self.ended}


class Queries:
    """What the store holds, read without changing it."""

    def __init__(self, redis: Client, keys: Keyspace, deadline: Deadline) -> None:
        self.redis = redis
        self.keys = keys
        self.deadline = deadline

    async def replication_ids(self) -> dict[str, str]:
        """Each master's replication id, by node name on a Cluster ("" for the one master).

        A replica promoted by a failover, or a master restarted, has a new one.
        """

        async def call() -> dict[str, str]:
            if isinstance(self.redis, RedisCluster):
                masters = self.redis.get_primaries()
                infos = await asyncio.gather(
                    *(self.redis.info("replication", target_nodes=m) for m in masters)
                )
                return {m.name: i["master_replid"] for m, i in zip(masters, infos, strict=True)}
            return {"": (await self.redis.info("replication"))["master_replid"]}

        return await self.deadline(call)

    async def session(self, tid: uuid.UUID) -> SessionView | None:
        """The live session of ``tid``, its tombstone as an ENDED view, or None."""
        hash_key, tomb_key = self.keys.session_keys(tid)

        async def call() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hgetall(hash_key)
            pipe.get(tomb_key)
            return await pipe.execute()

        fields, tomb = await self.deadline(call)
        if fields:
            return SessionView.of(str(tid), fields)
        return SessionView(str(tid), "ENDED", ended=tomb) if tomb else None

    async def counts(self) -> Counts:
        """Sessions of every node by state, and ended sessions by how, from the counts the
        scripts keep per shard (count_key in lua/_prelude.lua): three O(1) reads a shard,
        in one round trip.

        They are read in one transaction (on a Cluster, one per shard: a transaction's keys
        are of one slot), so a shard's ACTIVE, the members of its deadline set not in WARN,
        is never read between one script's change of the two.
        """

        def reads(pipe: Any, shard: int) -> None:
            warn, ended = self.keys.count_keys(shard)
            pipe.zcard(self.keys.shard_keys(shard)[0])
            pipe.scard(warn)
            pipe.hgetall(ended)

        async def transaction(shards: range) -> list[Any]:
            pipe = self.redis.pipeline(transaction=True)
            for shard in shards:
                reads(pipe, shard)
            return list(await pipe.execute())

        async def call() -> list[Any]:
            if isinstance(self.redis, RedisCluster):
                parts = [transaction(range(n, n + 1)) for n in range(SHARDS)]
                return [r for part in await asyncio.gather(*parts) for r in part]
            return await transaction(range(SHARDS))

        replies = await self.deadline(call)
        live = sum(replies[0::3])
        warn = sum(replies[1::3])
        ended: Counter[str] = Counter()
        for shard_ended in replies[2::3]:
            ended.update({how: int(n) for how, n in shard_ended.items()})
        return Counts(live - warn, warn, {how.value: ended[how.value] for how in Ended})

    async def sessions(
        self, state: str | None, cursor: str, limit: int
    ) -> tuple[list[SessionView], str | None]:
        """One page of at most ``limit`` live sessions (of ``state`` if given).

        Sessions come in (shard, tid) order, from the shards' deadline sets; ``cursor``
        is "" for the first page, then the cursor returned, None after the last page.
        Sessions started behind the cursor are not seen. A page reads the tids of a
        whole shard, so it costs O(live sessions / 16). Raises ValueError on a bad cursor.
        """
        shard, after = _parse_cursor(cursor)
        page: list[SessionView] = []
        while shard < SHARDS:
            due_key = self.keys.shard_keys(shard)[0]

            async def members(key: str = due_key) -> list[str]:
                # The client decodes replies: members are str (redis-py types them wider).
                return cast("list[str]", await self.redis.zrange(key, 0, -1))

            tids = sorted(t for t in await self.deadline(members) if t > after)
            for start in range(0, len(tids), limit):
                chunk = tids[start : start + limit]
                for tid, view in zip(chunk, await self._views(shard, chunk), strict=True):
                    if view is not None and state in (None, view.state):
                        page.append(view)
                        if len(page) == limit:
                            return page, f"{shard}:{tid}"
            shard, after = shard + 1, ""
        return page, None

    async def _views(self, shard: int, tids: Sequence[str]) -> list[SessionView | None]:
        async def call() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            for tid in tids:
                pipe.hgetall(self.keys.session_keys_of(shard, tid)[0])
            return await pipe.execute()

        rows = await self.deadline(call)
        return [SessionView.of(t, f) if f else None for t, f in zip(tids, rows, strict=True)]


def _parse_cursor(cursor: str) -> tuple[int, str]:
    if not cursor:
        return 0, ""
    shard, sep, after = cursor.partition(":")
    if not (sep and shard.isdigit() and int(shard) < SHARDS):
        raise ValueError(f"bad cursor {cursor!r}")
    return int(shard), after
