"""The script runner: the Lua scripts, loaded by name and called by SHA with a deadline.

Each script is the constants generated from Python's enums (:func:`lua_constants`), the
prelude (``lua/_prelude.lua``: the calling convention, ``load_session``, ``finish``) and
its own body (``lua/<name>.lua``). A script Redis does not know (NOSCRIPT: it restarted
or was flushed) is loaded and called again.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from enum import Enum
from importlib import resources
from typing import Any, TypeVar

from redis import exceptions as rexc

from tokend.config import Settings
from tokend.core.lifecycle import ExpiryReason, State
from tokend.core.protocol import CloseCode
from tokend.core.store_messages import (
    Ended,
    EndOutcome,
    HeartbeatOutcome,
    HelloOutcome,
    ReleaseOutcome,
    Swept,
)
from tokend.store.durability import known_replicas, then_wait
from tokend.store.keyspace import HEARTBEAT_FIELDS, NUMERIC_FIELDS, SESSION_FIELDS, Keyspace
from tokend.store.redis_client import Client
from tokend.store.unavailable import UNAVAILABLE, Deadline, StoreUnavailable

T = TypeVar("T")

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
    "RELEASE_OUTCOME": ReleaseOutcome,
    "SWEPT": Swept,
}


def _lua_value(value: object) -> str:
    if isinstance(value, int):
        return str(value)
    assert isinstance(value, str) and value.isidentifier(), value
    return f"'{value}'"


def lua_constants() -> str:
    """The Lua that declares :data:`LUA_CONSTANTS`, :data:`SESSION_FIELDS`,
    :data:`HEARTBEAT_FIELDS` and ``session_fields(values)``: HMGET's reply of those fields
    (or of the first of them) as a table by name, built by one table constructor (the
    cheapest way in Lua: a heartbeat reads one)."""
    lines = [
        f"local {name} = {{" + ", ".join(f"{m.name} = {_lua_value(m.value)}" for m in enum) + "}"
        for name, enum in LUA_CONSTANTS.items()
    ]
    lines.append("local SESSION_FIELDS = {" + ", ".join(map(_lua_value, SESSION_FIELDS)) + "}")
    lines.append(f"local HEARTBEAT_FIELDS = {HEARTBEAT_FIELDS}")
    by_name = (
        f"{name} = tonumber(v[{i}])" if name in NUMERIC_FIELDS else f"{name} = v[{i}]"
        for i, name in enumerate(SESSION_FIELDS, 1)
    )
    lines.append(f"local function session_fields(v) return {{{', '.join(by_name)}}} end")
    return "\n".join(lines) + "\n"


def _source(name: str) -> str:
    return (resources.files("tokend.store") / "lua" / name).read_text()


class Script:
    """One Lua script (constants, prelude, body), called by SHA and reloaded on NOSCRIPT."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = lua_constants() + _source("_prelude.lua") + _source(f"{name}.lua")
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()


HELLO = Script("hello")
HEARTBEAT = Script("heartbeat")
SWEEP = Script("sweep")
END = Script("end")
RELEASE = Script("release")
SCRIPTS = (HELLO, HEARTBEAT, SWEEP, END, RELEASE)

# One script call: the script, its keys, its arguments (after the common ones).
ScriptCall = tuple[Script, list[str], list[Any]]


class ScriptRunner:
    """Script calls of one node, each with a deadline, timed, and (for :meth:`_eval_durably`)
    confirmed by the replicas; :class:`tokend.store.sessions.Store` is one."""

    def __init__(self, redis: Client, settings: Settings, node: str) -> None:
        self.redis = redis
        self.node = node
        self.keys = Keyspace(settings.key_prefix)
        self.timeout = settings.redis_timeout
        self.deadline = Deadline(redis, settings.redis_timeout, settings.redis_pool_size)
        self._prelude_args = [
            node,
            self.keys.events_channel,
            self.keys.control_prefix,
            str(settings.stream_maxlen),
        ]
        # Told (script name, seconds) after every script round trip; tokend.metrics sets it.
        self.observe: Callable[[str, float], None] = _ignore
        # How long after sending a request it may still act (see lua/_prelude.lua).
        self.given_up_after_ms = settings.ms("redis_timeout") + settings.ms("leeway")
        # This node's wall clock: it only dates requests, never judges a session.
        self.wall_clock: Callable[[], float] = time.time
        # Replicas to WAIT for after a revocation or BYE (None: ask the deployment).
        self.durable_replicas = settings.durable_replica_count
        self.durable_timeout = settings.durable_timeout

    @property
    def _common(self) -> list[str]:
        """ARGV[1..5] of every script: the prelude's, then this request's deadline."""
        return [*self._prelude_args, self._given_up_at()]

    def _given_up_at(self) -> str:
        """ARGV[5]: the time (ms, this node's clock) after which Redis is to do nothing
        of this request (see lua/_prelude.lua)."""
        return str(int(self.wall_clock() * 1000) + self.given_up_after_ms)

    async def _timed(
        self, name: str, make: Callable[[], Awaitable[T]], timeout: float | None = None
    ) -> T:
        started = time.perf_counter()
        try:
            return await self.deadline(make, timeout)
        finally:
            self.observe(name, time.perf_counter() - started)

    @staticmethod
    def _answered(result: Any) -> Any:
        """A script's reply; None (Lua false) means the prelude found it past its deadline."""
        if result is None:
            # Only while we still wait when this node's clock is far behind Redis's.
            raise StoreUnavailable("request past its deadline: is this node's clock behind?")
        return result

    async def _reloading(self, script: Script, send: Callable[[], Awaitable[Any]]) -> Any:
        """``send()``, a call of ``script``; if Redis lacks the script (NOSCRIPT: it
        restarted or was flushed), load it and send once more."""
        try:
            return await send()
        except rexc.NoScriptError:
            await self.redis.script_load(script.source)
            return await send()

    async def _eval(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        argv = [*self._common, *args]

        async def send() -> Any:
            return await self.redis.evalsha(script.sha, len(keys), *keys, *argv)

        reply = await self._timed(script.name, lambda: self._reloading(script, send))
        return self._answered(reply)

    async def _eval_durably(
        self, script: Script, keys: Sequence[str], args: Sequence[Any]
    ) -> tuple[Any, int, int]:
        """:meth:`_eval`, then WAIT for ``durable_replicas`` (tokend.store.durability).

        Returns the reply, how many replicas acknowledged it and how many were wanted.
        """
        wanted = self.durable_replicas
        if wanted is None:
            wanted = await self.deadline(lambda: known_replicas(self.redis, keys[0]))
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

        await self.deadline(call)

    async def ready(self) -> str | None:
        """None when Redis answers and every script is loaded, else what is wrong."""
        try:
            loaded = await self.deadline(
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


def _ignore(name: str, seconds: float) -> None:
    pass
