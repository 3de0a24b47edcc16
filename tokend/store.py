"""The session store: Redis, the source of truth, driven through Lua scripts.

Key layout (documented in docs/protocol.md, "Store layout"). A session lives in
one of :data:`SHARDS` shards, chosen from its tid; every key of a shard carries
the hash tag ``{<prefix>:<shard>}``, so a script that touches a session, its
tombstone, the shard's deadline set and the shard's event stream stays in one
Redis Cluster slot:

* ``<prefix>:{<prefix>:<n>}:s:<tid>``  session hash (sub st hb exp iat prio conn node)
* ``<prefix>:{<prefix>:<n>}:t:<tid>``  tombstone of an ended session, until its exp
* ``<prefix>:{<prefix>:<n>}:due``      deadline set: tid scored by its next transition time
* ``<prefix>:{<prefix>:<n>}:events``   event stream shard
* ``<prefix>:events`` / ``<prefix>:ctl``  pub/sub channels (events; node-to-node control)
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis import exceptions as rexc

from tokend.config import Settings

SHARDS = 16
T = TypeVar("T")


class StoreUnavailable(Exception):
    """Redis did not answer within the deadline, or refused the connection."""


def _source(name: str) -> str:
    return (resources.files("tokend") / "lua" / name).read_text()


class Script:
    """One Lua script (prelude + body), called by SHA and reloaded on NOSCRIPT."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = _source("_prelude.lua") + _source(f"{name}.lua")
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()


HELLO = Script("hello")
HEARTBEAT = Script("heartbeat")
CLAIM = Script("claim")
INSPECT = Script("inspect")
TRANSITION = Script("transition")
END = Script("end")
SCRIPTS = (HELLO, HEARTBEAT, CLAIM, INSPECT, TRANSITION, END)


@dataclass(frozen=True, slots=True)
class Keyspace:
    prefix: str

    @staticmethod
    def shard_of(tid: str) -> int:
        """A canonical tid string's shard: its last four hex digits (two bytes), mod 16."""
        return int(tid[-4:], 16) % SHARDS

    @classmethod
    def shard(cls, tid: uuid.UUID) -> int:
        return cls.shard_of(str(tid))

    def session_keys_of(self, shard: int, tid: str) -> list[str]:
        tag = self._tag(shard)
        return [f"{tag}:s:{tid}", f"{tag}:t:{tid}"]

    def _tag(self, shard: int) -> str:
        return f"{self.prefix}:{{{self.prefix}:{shard}}}"

    def shard_keys(self, shard: int) -> list[str]:
        """KEYS[1..2] of every script: the shard's deadline set and event stream."""
        tag = self._tag(shard)
        return [f"{tag}:due", f"{tag}:events"]

    def session_keys(self, tid: uuid.UUID) -> list[str]:
        return self.session_keys_of(self.shard(tid), str(tid))

    def script_keys(self, tid: uuid.UUID) -> list[str]:
        return self.shard_keys(self.shard(tid)) + self.session_keys(tid)

    def streams(self) -> list[str]:
        return [self.shard_keys(n)[1] for n in range(SHARDS)]

    @property
    def events_channel(self) -> str:
        return f"{self.prefix}:events"

    @property
    def control_channel(self) -> str:
        return f"{self.prefix}:ctl"


@dataclass(frozen=True, slots=True)
class HelloResult:
    outcome: str  # started | resumed | tomb | expired | mismatch
    exp_ms: int = 0
    iat_s: int = 0
    tomb: str = ""


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    outcome: str  # ok | gone | taken
    was_warn: bool = False
    renewed: bool = False
    exp_ms: int = 0
    iat_s: int = 0
    tomb: str = ""


@dataclass(frozen=True, slots=True)
class HeartbeatRequest:
    """A connection's heartbeat for the batch; built once per connection, reused."""

    tid: str
    conn: str
    shard: int
    keys: tuple[str, str]  # session hash, tombstone
    # Received in time but stored late (after an outage): not judged for silence.
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """A session hash as read by the sweeper; strings kept as read for compare-and-set."""

    tid: str
    st: str
    hb: str
    exp: str


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
        return cls(
            tid,
            fields["st"],
            fields["sub"],
            int(fields["exp"]),
            int(fields["hb"]),
            fields.get("node", ""),
            fields.get("conn", ""),
            int(fields.get("prio", 0)),
        )

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def connect(url: str, settings: Settings) -> aioredis.Redis:
    """A client whose pool waits (up to the deadline) instead of failing when full."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        decode_responses=True,
        max_connections=settings.redis_pool_size,
        timeout=settings.redis_timeout,
        socket_timeout=settings.redis_timeout,
        socket_connect_timeout=settings.redis_timeout,
        health_check_interval=30,
    )
    return aioredis.Redis(connection_pool=pool)


class Store:
    """Every session state change, as one script call with a deadline."""

    def __init__(self, redis: aioredis.Redis, settings: Settings, node: str) -> None:
        self.redis = redis
        self.keys = Keyspace(settings.key_prefix)
        self.timeout = settings.redis_timeout
        self.warn_ms = settings.ms("warn_after")
        self.expire_ms = settings.ms("expire_after")
        self.renew_ms = settings.ms("renew_window")
        self.ttl_s = settings.token_ttl_s
        # The session hash outlives its token by this much, so that a late sweep
        # still finds it and emits TOKEN_EXPIRED instead of losing it to PEXPIREAT.
        self.grace_ms = self.expire_ms
        self._common = [
            node,
            self.keys.events_channel,
            self.keys.control_channel,
            str(settings.stream_maxlen),
        ]
        # Told (script name, seconds) after every script round trip; tokend.metrics sets it.
        self.observe: Callable[[str, float], None] = _ignore

    async def _deadline(self, make: Callable[[], Awaitable[T]]) -> T:
        try:
            async with asyncio.timeout(self.timeout):
                return await make()
        except (TimeoutError, rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
            raise StoreUnavailable(type(exc).__name__) from None

    async def _timed(self, name: str, make: Callable[[], Awaitable[T]]) -> T:
        started = time.perf_counter()
        try:
            return await self._deadline(make)
        finally:
            self.observe(name, time.perf_counter() - started)

    async def _eval(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        argv = [*self._common, *args]

        async def call() -> Any:
            try:
                return await self.redis.evalsha(script.sha, len(keys), *keys, *argv)
            except rexc.NoScriptError:
                # Redis restarted or was flushed: load and run once more.
                await self.redis.script_load(script.source)
                return await self.redis.evalsha(script.sha, len(keys), *keys, *argv)

        return await self._timed(script.name, call)

    async def _eval_many(self, calls: Sequence[tuple[Script, list[str], list[Any]]]) -> list[Any]:
        """Run many scripts in one round trip; NOSCRIPT entries are loaded and rerun."""

        async def call() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            for script, keys, args in calls:
                pipe.evalsha(script.sha, len(keys), *keys, *self._common, *args)
            results = await pipe.execute(raise_on_error=False)
            missing = [i for i, r in enumerate(results) if isinstance(r, rexc.NoScriptError)]
            if missing:
                for script in {calls[i][0] for i in missing}:
                    await self.redis.script_load(script.source)
                pipe = self.redis.pipeline(transaction=False)
                for i in missing:
                    script, keys, args = calls[i]
                    pipe.evalsha(script.sha, len(keys), *keys, *self._common, *args)
                for i, result in zip(
                    missing, await pipe.execute(raise_on_error=False), strict=True
                ):
                    results[i] = result
            for result in results:
                if isinstance(result, (rexc.ConnectionError, rexc.TimeoutError)):
                    raise result
                if isinstance(result, Exception):
                    raise RuntimeError(f"script failed: {result}")
            return results

        return await self._timed(calls[0][0].name if calls else "none", call)

    async def load_scripts(self) -> None:
        async def call() -> None:
            for script in SCRIPTS:
                await self.redis.script_load(script.source)

        await self._deadline(call)

    async def ready(self) -> str | None:
        """None when Redis answers and every script is loaded, else what is wrong."""
        try:
            loaded = await self._deadline(
                lambda: self.redis.script_exists(*(s.sha for s in SCRIPTS))
            )
        except StoreUnavailable as exc:
            return f"redis unreachable ({exc})"
        if not all(loaded):
            try:
                await self.load_scripts()
            except StoreUnavailable as exc:
                return f"redis unreachable ({exc})"
        return None

    async def hello(
        self, tid: uuid.UUID, sub: str, prio: int, iat_s: int, exp_s: int, conn: str
    ) -> HelloResult:
        reply = await self._eval(
            HELLO,
            self.keys.script_keys(tid),
            [str(tid), sub, prio, iat_s, exp_s, conn, self.warn_ms, self.grace_ms, self.expire_ms],
        )
        outcome = reply[0]
        if outcome in ("started", "resumed"):
            return HelloResult(outcome, int(reply[1]), int(reply[2]))
        if outcome == "tomb":
            return HelloResult(outcome, tomb=reply[1])
        return HelloResult(outcome)

    def heartbeat_request(self, tid: uuid.UUID, conn: str) -> HeartbeatRequest:
        hash_key, tomb_key = self.keys.session_keys(tid)
        return HeartbeatRequest(str(tid), conn, self.keys.shard(tid), (hash_key, tomb_key))

    async def heartbeats(self, batch: Sequence[HeartbeatRequest]) -> list[HeartbeatResult]:
        """Record many heartbeats: one script call per shard, all in one round trip."""
        by_shard: dict[int, list[int]] = {}
        for i, request in enumerate(batch):
            by_shard.setdefault(request.shard, []).append(i)
        calls = []
        for shard, members in by_shard.items():
            keys = self.keys.shard_keys(shard)
            args: list[Any] = [
                self.warn_ms,
                self.renew_ms,
                self.ttl_s,
                self.grace_ms,
                self.expire_ms,
            ]
            for i in members:
                request = batch[i]
                keys += request.keys
                args += [request.tid, request.conn, "1" if request.replayed else "0"]
            calls.append((HEARTBEAT, keys, args))
        results: list[HeartbeatResult] = [HeartbeatResult("gone")] * len(batch)
        for members, replies in zip(by_shard.values(), await self._eval_many(calls), strict=True):
            for i, reply in zip(members, replies, strict=True):
                results[i] = _heartbeat_result(reply)
        return results

    async def end(
        self, tid: uuid.UUID, *, conn: str, event: str, tomb: str, code: int | None
    ) -> int:
        """BYE (``conn`` set, no code) or revocation (``conn`` empty, code 4506)."""
        return int(
            await self._eval(
                END,
                self.keys.script_keys(tid),
                [str(tid), conn, event, tomb, "" if code is None else int(code), self.ttl_s * 1000],
            )
        )

    async def claim_due(self, limit: int, lease_ms: int) -> tuple[int, list[list[str]]]:
        """Claim due sessions of every shard: Redis time, and the claimed tids by shard."""
        calls = [(CLAIM, self.keys.shard_keys(n), [limit, lease_ms]) for n in range(SHARDS)]
        replies = await self._eval_many(calls)
        return max(int(reply[0]) for reply in replies), [reply[1] for reply in replies]

    async def inspect(self, claimed: Sequence[Sequence[str]]) -> list[SessionRecord | None]:
        """Read claimed sessions (one script call per shard); None for a vanished one."""
        calls, tids = [], []
        for shard, shard_tids in enumerate(claimed):
            if shard_tids:
                tag = self.keys.shard_keys(shard)
                calls.append(
                    (
                        INSPECT,
                        tag + [self.keys.session_keys_of(shard, t)[0] for t in shard_tids],
                        [],
                    )
                )
                tids += shard_tids
        rows = [row for reply in await self._eval_many(calls) for row in reply]
        return [
            SessionRecord(tid, *row) if row else None for tid, row in zip(tids, rows, strict=True)
        ]

    async def transitions(self, moves: Sequence[tuple[SessionRecord, str, str]]) -> list[bool]:
        """Compare-and-set (record, target, reason or deadline); one call per shard.

        Returns which transitions took (always False for a 'LATER' reschedule).
        """
        by_shard: dict[int, list[int]] = {}
        for i, (record, _, _) in enumerate(moves):
            by_shard.setdefault(self.keys.shard_of(record.tid), []).append(i)
        calls = []
        for shard, members in by_shard.items():
            keys, args = self.keys.shard_keys(shard), [self.expire_ms]
            for i in members:
                record, target, detail = moves[i]
                keys += self.keys.session_keys_of(shard, record.tid)
                args += [record.tid, record.st, record.hb, record.exp, target, detail]
            calls.append((TRANSITION, keys, args))
        took = [False] * len(moves)
        for members, reply in zip(by_shard.values(), await self._eval_many(calls), strict=True):
            for i, made in zip(members, reply, strict=True):
                took[i] = bool(made)
        return took

    async def revoke(self, tid: uuid.UUID) -> int:
        """Revoke a token: its session ends wherever it is (close 4506) and it is barred.

        Returns 1 when a live session was ended, 2 when only the bar was written, 0 when
        the token had already ended.
        """
        return await self.end(tid, conn="", event="TOKEN_REVOKED", tomb="revoked", code=4506)

    # Reads for operators (admin API, ``tokend sessions``): plain commands, no script.

    async def session(self, tid: uuid.UUID) -> SessionView | None:
        """The live session of ``tid``, its tombstone as an ENDED view, or None."""
        hash_key, tomb_key = self.keys.session_keys(tid)

        async def call() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hgetall(hash_key)
            pipe.get(tomb_key)
            return await pipe.execute()

        fields, tomb = await self._deadline(call)
        if fields:
            return SessionView.of(str(tid), fields)
        return SessionView(str(tid), "ENDED", ended=tomb) if tomb else None

    async def count_sessions(self) -> int:
        """Live sessions of every node: the sizes of the shards' deadline sets."""

        async def call() -> list[int]:
            pipe = self.redis.pipeline(transaction=False)
            for shard in range(SHARDS):
                pipe.zcard(self.keys.shard_keys(shard)[0])
            return await pipe.execute()

        return sum(await self._deadline(call))

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
            members = await self._deadline(lambda key=due_key: self.redis.zrange(key, 0, -1))
            tids = sorted(t for t in members if t > after)
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

        rows = await self._deadline(call)
        return [SessionView.of(t, f) if f else None for t, f in zip(tids, rows, strict=True)]


def _parse_cursor(cursor: str) -> tuple[int, str]:
    if not cursor:
        return 0, ""
    shard, sep, after = cursor.partition(":")
    if not (sep and shard.isdigit() and int(shard) < SHARDS):
        raise ValueError(f"bad cursor {cursor!r}")
    return int(shard), after


def _ignore(name: str, seconds: float) -> None:
    pass


def _heartbeat_result(reply: list[Any]) -> HeartbeatResult:
    if reply[0] == "ok":
        return HeartbeatResult("ok", bool(reply[1]), bool(reply[2]), int(reply[3]), int(reply[4]))
    if reply[0] == "gone":
        return HeartbeatResult("gone", tomb=reply[1])
    return HeartbeatResult("taken")
