"""The session store: Redis, the source of truth, driven through Lua scripts.

Key layout (documented in docs/protocol.md, "Store layout"). A session lives in
one of :data:`SHARDS` shards, chosen from its tid; every key of a shard carries
the hash tag ``{<prefix>:<shard>}``, so a script that touches a session, its
tombstone, the shard's deadline set and the shard's event stream stays in one
Redis Cluster slot:

* ``<prefix>:{<prefix>:<n>}:s:<tid>``  session hash (sub st hb exp iat prio conn)
* ``<prefix>:{<prefix>:<n>}:t:<tid>``  tombstone of an ended session, until its exp
* ``<prefix>:{<prefix>:<n>}:due``      deadline set: tid scored by its next transition time
* ``<prefix>:{<prefix>:<n>}:events``   event stream shard
* ``<prefix>:events``  pub/sub channel of the events
* ``<prefix>:ctl:<node>``  pub/sub channel of node-to-node control, one per node
* ``<prefix>:ctl``  pub/sub channel of revocations, heard by every node (tokend.revocations)

:func:`connect` makes the client for a URL: one Redis (``redis://``, ``rediss://``,
``unix://``), a Redis Cluster (``redis+cluster://``) or the master a Sentinel
names (``redis+sentinel://``); see docs/scaling.md. Everything else here runs
unchanged on all three; where a Cluster differs it is :func:`initialized` and
:func:`slot_groups`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from importlib import resources
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlsplit

import redis.asyncio as aioredis
import structlog
from redis import exceptions as rexc
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import BlockingConnectionPool, SSLConnection, parse_url
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

from tokend.answers import (
    Ended,
    EndOutcome,
    HeartbeatAnswer,
    HeartbeatOutcome,
    HelloAnswer,
    HelloOutcome,
    Swept,
)
from tokend.clocks import ExpiryReason, State
from tokend.config import ConfigError, Settings
from tokend.durability import known_replicas, then_wait
from tokend.packing import pack_with_hiredis
from tokend.protocol import CloseCode

log = structlog.get_logger("tokend.store")

SHARDS = 16
T = TypeVar("T")

# A client for any URL connect() takes; both kinds answer the same commands.
Client = aioredis.Redis | RedisCluster

# What "Redis is not answering" looks like, on one Redis, a Cluster or via Sentinel
# (MasterNotFoundError is a ConnectionError).
UNAVAILABLE: tuple[type[BaseException], ...] = (
    TimeoutError,
    OSError,
    rexc.ConnectionError,
    rexc.TimeoutError,
    rexc.ClusterDownError,
    rexc.SlotNotCoveredError,
)

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")


# One script call: the script, its keys, its arguments (after the common ones).
ScriptCall = tuple["Script", list[str], list[Any]]
# A HELLO for hello.lua: tid, sub, prio, iat (s), exp (s), conn.
HelloRequest = tuple[uuid.UUID, str, int, int, int, str]
# One session's part of a batch script call: its shard, its keys, its arguments.
SessionPart = tuple[int, Sequence[str], Sequence[Any]]


class StoreUnavailable(Exception):
    """Redis did not answer within the deadline, or refused the connection."""


class NotConfirmed(StoreUnavailable):
    """The master made the change, but fewer replicas than ``durable_replicas`` acknowledged
    it within ``durable_timeout``: a failover may still undo it."""

    def __init__(self, outcome: EndOutcome, acknowledged: int, wanted: int, timeout: float) -> None:
        super().__init__(f"{acknowledged} of {wanted} replicas acknowledged it within {timeout} s")
        self.outcome = outcome
        self.acknowledged = acknowledged
        self.wanted = wanted


# The session hash's fields (docs/protocol.md "Store layout"); the scripts read them by
# these names only (load_session in _prelude.lua).
SESSION_FIELDS = ("sub", "st", "hb", "exp", "iat", "prio", "conn", "since")

# The Python values the scripts use, as Lua tables of the same names: a close code, a
# state or an outcome is spelt in one place, and a reply is one of the enum's values.
LUA_CONSTANTS: dict[str, type[Enum]] = {
    "CLOSE": CloseCode,
    "STATE": State,
    "EXPIRY": ExpiryReason,
    "ENDED": Ended,
    "HELLO_OUTCOME": HelloOutcome,
    "HEARTBEAT_OUTCOME": HeartbeatOutcome,
    "END_OUTCOME": EndOutcome,
    "SWEPT": Swept,
}


def _lua_value(value: object) -> str:
    if isinstance(value, int):
        return str(value)
    assert isinstance(value, str) and value.isidentifier(), value
    return f"'{value}'"


def lua_constants() -> str:
    """The Lua that declares :data:`LUA_CONSTANTS` and :data:`SESSION_FIELDS`."""
    lines = [
        f"local {name} = {{" + ", ".join(f"{m.name} = {_lua_value(m.value)}" for m in enum) + "}"
        for name, enum in LUA_CONSTANTS.items()
    ]
    lines.append("local SESSION_FIELDS = {" + ", ".join(map(_lua_value, SESSION_FIELDS)) + "}")
    return "\n".join(lines) + "\n"


def _source(name: str) -> str:
    return (resources.files("tokend") / "lua" / name).read_text()


class Script:
    """One Lua script (constants, prelude, body), called by SHA and reloaded on NOSCRIPT."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = lua_constants() + _source("_prelude.lua") + _source(f"{name}.lua")
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()


HELLO = Script("hello")
HEARTBEAT = Script("heartbeat")
CLAIM = Script("claim")
TRANSITION = Script("transition")
END = Script("end")
SCRIPTS = (HELLO, HEARTBEAT, CLAIM, TRANSITION, END)


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
        hash_prefix, tomb_prefix = self.session_prefixes(shard)
        return [hash_prefix + tid, tomb_prefix + tid]

    def session_prefixes(self, shard: int) -> tuple[str, str]:
        """What a shard's session hash and tombstone keys start with (the tid follows)."""
        tag = self._tag(shard)
        return f"{tag}:s:", f"{tag}:t:"

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
    def control_prefix(self) -> str:
        """The scripts address a node's control messages to ``<this>:<node>``."""
        return f"{self.prefix}:ctl"

    def control_channel(self, node: str) -> str:
        return f"{self.control_prefix}:{node}"

    @property
    def revocations_channel(self) -> str:
        """end.lua tells every node of a revocation on the control prefix itself (no node)."""
        return self.control_prefix


class HeartbeatRequest(NamedTuple):
    """A connection's heartbeat for the batch; built once per connection, reused.

    Small on purpose: every idle session keeps one. Its keys are made at each flush.
    """

    tid: str
    conn: str
    shard: int


class Known(NamedTuple):
    """What a live connection knows of its session: enough for heartbeat.lua to restore
    it should a failover have lost it (or lost this connection's resume of it)."""

    sub: str
    prio: int
    iat_s: int
    exp_ms: int
    since_ms: int  # Redis time at which this connection took the session (HELLO's answer)

    @property
    def encoded(self) -> str:
        """heartbeat.lua's restore argument."""
        return f"{self.prio}|{self.iat_s}|{self.exp_ms}|{self.since_ms}|{self.sub}"


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
            node_of(fields.get("conn", "")),
            fields.get("conn", ""),
            int(fields.get("prio", 0)),
        )

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def connect(url: str, settings: Settings) -> Client:
    """The client for ``url``'s scheme, with the deadline as its socket timeouts.

    Its connections pack commands with hiredis (:mod:`tokend.packing`).

    On one Redis and through Sentinel the pool waits (up to the deadline) instead
    of failing when full; a Cluster client cannot wait, so :class:`Store` bounds
    its own concurrency to ``redis_pool_size`` instead. A URL that cannot be used
    raises ConfigError. Connections are made on first use.
    """
    try:
        client = _client(url, settings)
    except ValueError as exc:  # redis-py's and _multi_host's word for a bad URL
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
        hosts, kwargs, _ = _multi_host(url, 6379, service=False)
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in hosts],
            # Per cluster node: the Store's calls plus the control subscription.
            max_connections=settings.redis_pool_size + 1,
            **options,
            **kwargs,
        )
    if scheme in SENTINEL_SCHEMES:
        hosts, kwargs, service = _multi_host(url, 26379, service=True)
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
            **options,
            **kwargs,
        )
    pool = BlockingConnectionPool.from_url(
        url, max_connections=settings.redis_pool_size, timeout=settings.redis_timeout, **options
    )
    return aioredis.Redis(connection_pool=pool)


def _multi_host(
    url: str, default_port: int, *, service: bool
) -> tuple[list[tuple[str, int]], dict[str, Any], str]:
    """Split ``scheme://[user:pass@]host:port[,host:port...][/service][/db][?query]``.

    Returns the hosts, the connection options of the rest (parsed as redis-py parses
    a ``redis://`` URL; ``ssl`` set for ``rediss+...``) and, when ``service``, the
    Sentinel service name (the path's first part, required).
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
    kwargs = parse_url(single + "/" + "/".join(path) + (f"?{parts.query}" if parts.query else ""))
    for key in ("host", "port"):
        kwargs.pop(key, None)
    if kwargs.pop("connection_class", None) is SSLConnection:
        kwargs["ssl"] = True
    return hosts, kwargs, name


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """The Sentinel-discovered master, with a pool that waits when full like ours."""


class SentinelRedis(aioredis.Redis):
    """The master's client; closing it also closes the connections to the sentinels."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        for sentinel in self.connection_pool.sentinel_manager.sentinels:
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


async def slot_groups(redis: Client, keys: Sequence[str]) -> list[list[str]]:
    """``keys`` in groups that one multi-key command (XREAD) may name together.

    One group on a single Redis; one per hash slot on a Cluster, which refuses a
    command whose keys span slots (CROSSSLOT) even when one node holds them all.
    """
    if not isinstance(await initialized(redis), RedisCluster):
        return [list(keys)]
    groups: dict[int, list[str]] = {}
    for key in keys:
        groups.setdefault(redis.keyslot(key), []).append(key)
    return list(groups.values())


class Store:
    """Every session state change, as one script call with a deadline."""

    def __init__(self, redis: Client, settings: Settings, node: str) -> None:
        self.redis = redis
        # Calls in flight at once: a Cluster client fails instead of waiting when a
        # node's connections are all busy (elsewhere the pool would wait here too).
        self._in_flight = asyncio.Semaphore(settings.redis_pool_size)
        self.keys = Keyspace(settings.key_prefix)
        self.timeout = settings.redis_timeout
        self.warn_ms = settings.ms("warn_after")
        self.expire_ms = settings.ms("expire_after")
        self.renew_ms = settings.ms("renew_window")
        self.ttl_s = settings.token_ttl_s
        # The session hash outlives its token by this much, so that a late sweep
        # still finds it and emits TOKEN_EXPIRED instead of losing it to PEXPIREAT.
        self.grace_ms = self.expire_ms
        self._prelude_args = [
            node,
            self.keys.events_channel,
            self.keys.control_prefix,
            str(settings.stream_maxlen),
        ]
        self._shard_keys = [self.keys.shard_keys(n) for n in range(SHARDS)]
        self._session_prefixes = [self.keys.session_prefixes(n) for n in range(SHARDS)]
        # A Cluster refuses a call whose keys span slots (CROSSSLOT).
        self._one_slot_per_call = isinstance(redis, RedisCluster)
        self._hello_args = [self.warn_ms, self.grace_ms, self.expire_ms]
        self._heartbeat_args = [
            self.warn_ms,
            self.renew_ms,
            self.ttl_s,
            self.grace_ms,
            self.expire_ms,
        ]
        # Told (script name, seconds) after every script round trip; tokend.metrics sets it.
        self.observe: Callable[[str, float], None] = _ignore
        # How long after sending a request it may still act (see _prelude.lua).
        self.given_up_after_ms = settings.ms("redis_timeout") + settings.ms("leeway")
        # This node's wall clock: it only dates requests, never judges a session.
        self.wall_clock: Callable[[], float] = time.time
        self.node = node
        # Replicas to WAIT for after a revocation or BYE (None: ask the deployment).
        self.durable_replicas = settings.durable_replica_count
        self.durable_timeout = settings.durable_timeout
        # Whether this node knows the token as revoked (tokend.revocations sets it): such a
        # HELLO is refused without asking Redis, which a failover may have made forget it.
        self.known_revoked: Callable[[str], bool] = _never

    @property
    def _common(self) -> list[str]:
        """ARGV[1..5] of every script: the prelude's, then this request's deadline."""
        given_up_at = int(self.wall_clock() * 1000) + self.given_up_after_ms
        return [*self._prelude_args, str(given_up_at)]

    async def _deadline(self, make: Callable[[], Awaitable[T]], timeout: float | None = None) -> T:
        try:
            async with asyncio.timeout(timeout or self.timeout), self._in_flight:
                await initialized(self.redis)
                return await make()
        except UNAVAILABLE as exc:
            raise StoreUnavailable(type(exc).__name__) from None

    async def _timed(
        self, name: str, make: Callable[[], Awaitable[T]], timeout: float | None = None
    ) -> T:
        started = time.perf_counter()
        try:
            return await self._deadline(make, timeout)
        finally:
            self.observe(name, time.perf_counter() - started)

    @staticmethod
    def _answered(result: Any) -> Any:
        """A script's reply; None (Lua false) means the prelude found it past its deadline."""
        if result is None:
            # Only while we still wait when this node's clock is far behind Redis's.
            raise StoreUnavailable("request past its deadline: is this node's clock behind?")
        return result

    async def _eval(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        argv = [*self._common, *args]

        async def call() -> Any:
            try:
                return await self.redis.evalsha(script.sha, len(keys), *keys, *argv)
            except rexc.NoScriptError:
                # Redis restarted or was flushed: load and run once more.
                await self.redis.script_load(script.source)
                return await self.redis.evalsha(script.sha, len(keys), *keys, *argv)

        return self._answered(await self._timed(script.name, call))

    async def _eval_durably(
        self, script: Script, keys: Sequence[str], args: Sequence[Any]
    ) -> tuple[Any, int, int]:
        """:meth:`_eval`, then WAIT for ``durable_replicas`` (tokend.durability).

        Returns the reply, how many replicas acknowledged it and how many were wanted.
        """
        wanted = self.durable_replicas
        if wanted is None:
            wanted = await self._deadline(lambda: known_replicas(self.redis, keys[0]))
        if not wanted:
            return await self._eval(script, keys, args), 0, 0
        command = ("EVALSHA", script.sha, len(keys), *keys, *self._common, *args)
        timeout_ms = max(1, math.floor(self.durable_timeout * 1000))  # WAIT 0 would never end

        async def call() -> tuple[Any, int]:
            reply, acknowledged = await then_wait(self.redis, keys[0], command, wanted, timeout_ms)
            if isinstance(reply, rexc.NoScriptError):
                await self.redis.script_load(script.source)
                reply, acknowledged = await then_wait(
                    self.redis, keys[0], command, wanted, timeout_ms
                )
            if isinstance(reply, Exception):
                raise reply
            return reply, acknowledged

        # The WAIT may take durable_timeout on top of the call's own deadline.
        reply, acknowledged = await self._timed(
            script.name, call, self.timeout + self.durable_timeout
        )
        return self._answered(reply), acknowledged, wanted

    async def _eval_many(self, calls: Sequence[ScriptCall]) -> list[Any]:
        """Run many scripts in one round trip; NOSCRIPT entries are loaded and rerun."""

        common = self._common

        async def run(indices: Sequence[int]) -> list[Any]:
            # A Cluster pipeline sends each call to its slot's node, all concurrently.
            # (Through execute_command: its evalsha() method is refused on a Cluster.)
            pipe = self.redis.pipeline(transaction=False)
            for i in indices:
                script, keys, args = calls[i]
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *common, *args)
            return list(await pipe.execute(raise_on_error=False))

        async def call() -> list[Any]:
            results = await run(range(len(calls)))
            missing = [i for i, r in enumerate(results) if isinstance(r, rexc.NoScriptError)]
            if missing:
                # SCRIPT LOAD goes to every primary: each Cluster node has its own cache.
                for script in {calls[i][0] for i in missing}:
                    await self.redis.script_load(script.source)
                for i, result in zip(missing, await run(missing), strict=True):
                    results[i] = result
            for result in results:
                if isinstance(result, UNAVAILABLE):
                    raise result
                if isinstance(result, Exception):
                    raise RuntimeError(f"script failed: {result}")
            return [self._answered(result) for result in results]

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
    ) -> HelloAnswer:
        """Start or resume one session (hello.lua)."""
        return (await self.hellos([(tid, sub, prio, iat_s, exp_s, conn)]))[0]

    async def hellos(self, batch: Sequence[HelloRequest]) -> list[HelloAnswer]:
        """Start or resume many sessions in one round trip: one hello.lua call on one
        Redis, one per shard on a Cluster (see :meth:`_per_shard`).

        In a connect storm a round trip per HELLO, with its pool checkout and deadline,
        costs more than the script itself; the node sends the HELLOs that arrive while
        one round trip is out together in the next.
        """
        if any(self.known_revoked(str(request[0])) for request in batch):
            # Refused without asking Redis, which a failover may have made forget them.
            return await self._hellos_but_revoked(batch)
        prefixes = self._session_prefixes
        members = []
        for tid, sub, prio, iat_s, exp_s, conn in batch:
            tid_text = str(tid)
            shard = Keyspace.shard_of(tid_text)
            hash_prefix, tomb_prefix = prefixes[shard]
            members.append(
                (
                    shard,
                    (hash_prefix + tid_text, tomb_prefix + tid_text),
                    (tid_text, sub, prio, iat_s, exp_s, conn),
                )
            )
        replies = await self._per_shard(HELLO, self._hello_args, members)
        return [_hello_answer(reply) for reply in replies]

    async def _hellos_but_revoked(self, batch: Sequence[HelloRequest]) -> list[HelloAnswer]:
        """:meth:`hellos`, answering those this node knows as revoked itself."""
        barred = [self.known_revoked(str(request[0])) for request in batch]
        asked = iter(await self.hellos([r for r, b in zip(batch, barred, strict=True) if not b]))
        return [_REVOKED if b else next(asked) for b in barred]

    def heartbeat_request(self, tid: uuid.UUID, conn: str) -> HeartbeatRequest:
        tid_text = str(tid)
        return HeartbeatRequest(tid_text, conn, Keyspace.shard_of(tid_text))

    async def heartbeats(
        self,
        batch: Sequence[HeartbeatRequest],
        replayed: Sequence[bool] = (),
        known: Callable[[int], Known | None] | None = None,
    ) -> list[HeartbeatAnswer]:
        """Record many heartbeats in one round trip (two when Redis lost some sessions).

        ``replayed[i]`` marks a heartbeat received in time but stored late (after an
        outage): the script does not judge it for silence. One heartbeat.lua call for
        the whole batch on one Redis; on a Cluster, one per shard (a call's keys must be
        of one slot there).

        A session the store answers gone without a tombstone, or taken, is asked about
        again with what its connection knows (``known(i)``): Redis may have lost it, or
        this connection's resume of it, in a failover; heartbeat.lua then restores it
        (SESSION_RESTORED, docs/scaling.md "What survives a failover").
        """
        answers = await self._beat(batch, replayed, ())
        if known is None:
            return answers
        again, knowledge = [], []
        for i, answer in enumerate(answers):
            outcome = answer.outcome
            if outcome is _OK or (outcome is HeartbeatOutcome.GONE and answer.ended is not None):
                continue
            what = known(i)
            if what is not None and what.since_ms:
                again.append(i)
                knowledge.append(what.encoded)
        if again:
            retried = await self._beat(
                [batch[i] for i in again],
                [bool(replayed) and replayed[i] for i in again],
                knowledge,
            )
            for i, answer in zip(again, retried, strict=True):
                answers[i] = answer
                if answer.outcome is _OK:
                    log.warning("session restored", tid=batch[i].tid, conn=batch[i].conn)
        return answers

    async def _beat(
        self, batch: Sequence[HeartbeatRequest], replayed: Sequence[bool], restore: Sequence[str]
    ) -> list[HeartbeatAnswer]:
        prefixes = self._session_prefixes
        members = []
        for i, (tid, conn, shard) in enumerate(batch):
            hash_prefix, tomb_prefix = prefixes[shard]
            members.append(
                (
                    shard,
                    (hash_prefix + tid, tomb_prefix + tid),
                    (
                        tid,
                        conn,
                        "1" if replayed and replayed[i] else "0",
                        restore[i] if restore else "",
                    ),
                )
            )
        replies = await self._per_shard(HEARTBEAT, self._heartbeat_args, members)
        return [_heartbeat_answer(reply) for reply in replies]

    async def _per_shard(
        self, script: Script, fixed: list[Any], members: Sequence[SessionPart]
    ) -> list[Any]:
        """Run a batch script (hello.lua, heartbeat.lua) for many sessions in one round trip.

        ``members`` are (shard, the session's keys, its arguments). The script takes
        them in groups, one per shard: the group's keys (the shard's deadline set and
        stream, then its sessions' keys) and its arguments (the number of sessions, then
        theirs), after the ``fixed`` arguments. On one Redis, one call holds every
        group; on a Cluster, one call per group (a call's keys must be of one slot).
        Returns the script's replies in the order of ``members``.
        """
        groups: dict[int, tuple[list[str], list[Any], list[int]]] = {}
        for i, (shard, keys, args) in enumerate(members):
            group = groups.get(shard)
            if group is None:
                group = groups[shard] = (self._shard_keys[shard][:], [0], [])
            group[0].extend(keys)
            group[1].extend(args)
            group[2].append(i)
        for _, args, positions in groups.values():
            args[0] = len(positions)
        parts = list(groups.values())
        batches = (
            [[part] for part in parts] if self._one_slot_per_call else [parts] if parts else []
        )
        calls = [
            (
                script,
                [key for keys, _, _ in b for key in keys],
                fixed + [arg for _, args, _ in b for arg in args],
            )
            for b in batches
        ]
        replies = (reply for call in await self._eval_many(calls) for reply in call)
        order = (i for _, _, positions in groups.values() for i in positions)
        results: list[Any] = [None] * len(members)
        for i, reply in zip(order, replies, strict=True):
            results[i] = reply
        return results

    async def end(
        self,
        tid: uuid.UUID,
        *,
        conn: str,
        event: str,
        tomb: str,
        code: CloseCode | None,
        by: str = "",
    ) -> EndOutcome:
        """BYE (``conn`` set, no code) or revocation (``conn`` empty, code TOKEN_REVOKED,
        ``by`` who asked).

        Returns end.lua's outcome once ``durable_replicas`` replicas hold it; raises
        :class:`NotConfirmed` when they did not acknowledge it in time (a BYE that
        recorded nothing has nothing to confirm).
        """
        code_arg = "" if code is None else int(code)
        args = [str(tid), conn, event, tomb, code_arg, self.ttl_s * 1000, by]
        reply, acknowledged, wanted = await self._eval_durably(
            END, self.keys.script_keys(tid), args
        )
        outcome = EndOutcome(reply)
        if acknowledged < wanted and not (conn and not outcome):
            raise NotConfirmed(outcome, acknowledged, wanted, self.durable_timeout)
        return outcome

    async def claim_due(self, limit: int, lease_ms: int) -> tuple[int, list[list[str]], int | None]:
        """Claim due sessions of every shard.

        Returns Redis time, the claimed tids by shard, and the earliest deadline left
        in any shard (None when no session is left to judge).
        """
        calls = [(CLAIM, self.keys.shard_keys(n), [limit, lease_ms]) for n in range(SHARDS)]
        replies = await self._eval_many(calls)
        upcoming = [int(float(reply[2])) for reply in replies if reply[2]]
        return (
            max(int(reply[0]) for reply in replies),
            [reply[1] for reply in replies],
            min(upcoming, default=None),
        )

    async def transitions(self, claimed: Sequence[Sequence[str]]) -> list[tuple[str, Swept, str]]:
        """Judge the claimed sessions (tids by shard) and make the transitions due.

        One script call per shard (transition.lua), all in one round trip. Returns the
        transitions made, as (tid, what, conn): ``conn`` is the connection of this node
        to warn or close (the script sends no control message for it), or "".
        """
        calls, tids = [], []
        for shard, shard_tids in enumerate(claimed):
            if shard_tids:
                keys = self._shard_keys[shard][:]
                for tid in shard_tids:
                    keys += self.keys.session_keys_of(shard, tid)
                calls.append((TRANSITION, keys, [self.warn_ms, self.expire_ms, *shard_tids]))
                tids += shard_tids
        made = []
        replies = (reply for shard in await self._eval_many(calls) for reply in shard)
        for tid, reply in zip(tids, replies, strict=True):
            if reply:
                made.append((tid, Swept(reply[0]), reply[1]))
        return made

    async def revoke(self, tid: uuid.UUID, by: str) -> EndOutcome:
        """Revoke a token: its session ends wherever it is (close TOKEN_REVOKED) and it is
        barred.

        ``by`` names who asked, in the TOKEN_REVOKED event (docs/events.md). Raises
        :class:`NotConfirmed` as :meth:`end` does.
        """
        return await self.end(
            tid,
            conn="",
            event="TOKEN_REVOKED",
            tomb=Ended.REVOKED,
            code=CloseCode.TOKEN_REVOKED,
            by=by,
        )

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

        return await self._deadline(call)

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


def node_of(conn: str) -> str:
    """The node of a connection id ``<node>/<counter>`` ("" for none)."""
    return conn.rpartition("/")[0]


def _parse_cursor(cursor: str) -> tuple[int, str]:
    if not cursor:
        return 0, ""
    shard, sep, after = cursor.partition(":")
    if not (sep and shard.isdigit() and int(shard) < SHARDS):
        raise ValueError(f"bad cursor {cursor!r}")
    return int(shard), after


def _ignore(name: str, seconds: float) -> None:
    pass


def _never(tid: str) -> bool:
    return False


_REVOKED = HelloAnswer(HelloOutcome.ENDED, ended=Ended.REVOKED)


def _hello_answer(reply: list[Any]) -> HelloAnswer:
    outcome = HelloOutcome(reply[0])
    if outcome is HelloOutcome.STARTED or outcome is HelloOutcome.RESUMED:
        return HelloAnswer(outcome, int(reply[1]), int(reply[2]), int(reply[3]))
    if outcome is HelloOutcome.ENDED:
        return HelloAnswer(outcome, ended=_ended(reply[1]))
    return HelloAnswer(outcome)


_TAKEN = HeartbeatAnswer(HeartbeatOutcome.TAKEN)
_OK = HeartbeatOutcome.OK


def _heartbeat_answer(reply: int | list[Any]) -> HeartbeatAnswer:
    if type(reply) is int:  # stored; only the exp, and iat unchanged (heartbeat.lua)
        return HeartbeatAnswer(_OK, False, False, reply)
    assert isinstance(reply, list)
    if reply[0] == _OK:
        return HeartbeatAnswer(_OK, bool(reply[1]), bool(reply[2]), int(reply[3]), int(reply[4]))
    if reply[0] == HeartbeatOutcome.GONE:
        return HeartbeatAnswer(HeartbeatOutcome.GONE, ended=_ended(reply[1]))
    return _TAKEN


def _ended(tomb: str) -> Ended | None:
    """A tombstone's reason; None for none (or one this version does not know)."""
    try:
        return Ended(tomb)
    except ValueError:
        return None
