"""One tokend node: its live connections and the background work that serves them.

* :class:`HeartbeatBatcher` stores the heartbeats of many connections in one
  Redis round trip per flush, and replays those Redis could not take.
* :meth:`Node._sweep` claims due sessions from every shard's deadline set and
  makes their WARN/EXPIRED transitions, deciding with :mod:`tokend.clocks`.
  Every node sweeps, so no clock dies with a node.
* :meth:`Node._listen` holds the node's single pub/sub subscription, on which
  the scripts ask the node holding a connection to close it or warn it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections import Counter
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any

import structlog
from redis import exceptions as rexc
from redis.asyncio import Redis

from tokend.clocks import Clocks, State, deadline, due_transition
from tokend.config import Settings
from tokend.metrics import Metrics
from tokend.protocol import CloseCode
from tokend.session import Close, Session
from tokend.store import (
    HeartbeatRequest,
    HeartbeatResult,
    SessionRecord,
    Store,
    StoreUnavailable,
)
from tokend.tokens import TokenService

log = structlog.get_logger("tokend.node")

SWEEP_BATCH = 1000
HEARTBEAT_BATCH = 2000
MAX_BACKOFF = 2.0


class HeartbeatBatcher:
    """Coalesces concurrent heartbeats into one store call per flush.

    A flush starts as soon as the previous one ends, so a lone heartbeat waits for
    no timer while a busy node sends large batches.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._waiting: dict[str, tuple[HeartbeatRequest, asyncio.Future[HeartbeatResult]]] = {}
        # Heartbeats acknowledged during an outage, to be stored when Redis is back.
        self.unstored: dict[str, HeartbeatRequest] = {}
        self._wake = asyncio.Event()

    def submit(self, request: HeartbeatRequest) -> asyncio.Future[HeartbeatResult]:
        future: asyncio.Future[HeartbeatResult] = asyncio.get_running_loop().create_future()
        self._waiting[request.conn] = (request, future)
        self._wake.set()
        return future

    def forget(self, conn: str) -> None:
        self.unstored.pop(conn, None)

    def kick(self) -> None:
        if self.unstored:
            self._wake.set()

    async def run(self, node: Node) -> None:
        while node.running:
            await self._wake.wait()
            self._wake.clear()
            waiting = dict(list(self._waiting.items())[:HEARTBEAT_BATCH])
            for conn in waiting:
                del self._waiting[conn]
            if len(self._waiting):
                self._wake.set()
            replays = {
                c: replace(r, replayed=True) for c, r in self.unstored.items() if c not in waiting
            }
            requests = [r for r, _ in waiting.values()] + list(replays.values())
            try:
                results = await self.store.heartbeats(requests)
            except StoreUnavailable as exc:
                for conn, (request, future) in waiting.items():
                    self.unstored[conn] = request
                    if not future.done():
                        future.set_exception(exc)
                continue
            except Exception as exc:  # a script error: fail these, keep serving
                log.exception("heartbeat flush failed")
                for _, future in waiting.values():
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (conn, (_, future)), result in zip(waiting.items(), results, strict=False):
                self.unstored.pop(conn, None)
                if not future.done():
                    future.set_result(result)
            for conn, result in zip(replays, results[len(waiting) :], strict=True):
                self.unstored.pop(conn, None)
                node.replayed(conn, result)


class Node:
    """Shared state of a tokend process; :mod:`tokend.server` drives it."""

    def __init__(
        self, settings: Settings, redis: Redis, tokens: TokenService, name: str | None = None
    ) -> None:
        self.settings = settings
        self.name = name or settings.resolved_node_name
        self.redis = redis
        self.store = Store(redis, settings, self.name)
        self.tokens = tokens
        self.clocks = Clocks(settings.ms("warn_after"), settings.ms("expire_after"))
        self.heartbeats = HeartbeatBatcher(self.store)
        self.metrics = Metrics()
        self.metrics.sessions_by_state = self.sessions_by_state
        self.store.observe = self.metrics.redis_call
        self.sessions: dict[str, Session] = {}  # by conn id
        # Connections per tid, per sub: for the max_sessions_per_sub cap.
        self.sub_sessions: dict[str, Counter[uuid.UUID]] = {}
        self.subscribed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # Loops also check this: on Python 3.11 a cancel that lands as an inner
        # asyncio.timeout() expires can be swallowed (fixed in 3.12).
        self.running = False
        self._background: set[asyncio.Task[Any]] = set()
        self.log = log.bind(node=self.name)

    # Lifecycle

    async def start(self) -> None:
        try:
            await self.store.load_scripts()
        except StoreUnavailable:
            self.log.warning("redis unavailable at start; scripts load on first use")
        self.running = True
        self._tasks = [
            asyncio.create_task(self.heartbeats.run(self), name="heartbeats"),
            asyncio.create_task(self._sweep(), name="sweeper"),
            asyncio.create_task(self._listen(), name="control"),
        ]
        # Ready means subscribed; if Redis is down, start anyway and say so in /readyz.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.redis_timeout):
                await self.subscribed.wait()

    def failed_task(self) -> str | None:
        """The name of a background task that ended on its own (a bug), if any."""
        for task in self._tasks:
            if task.done():
                return task.get_name()
        return None

    async def stop(self) -> None:
        self.running = False
        tasks = self._tasks + list(self._background)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        await self.redis.aclose()

    # Connections

    def attach(self, session: Session) -> None:
        assert session.claims is not None
        self.sessions[session.conn] = session
        if self.settings.max_sessions_per_sub:
            self.sub_sessions.setdefault(session.claims.sub, Counter())[session.claims.tid] += 1

    def detach(self, session: Session) -> None:
        if self.sessions.pop(session.conn, None) is None or session.claims is None:
            return
        self.heartbeats.forget(session.conn)
        if not self.settings.max_sessions_per_sub:
            return
        tids = self.sub_sessions[session.claims.sub]
        tids[session.claims.tid] -= 1
        if not tids[session.claims.tid]:
            del tids[session.claims.tid]
            if not tids:
                del self.sub_sessions[session.claims.sub]

    def sessions_by_state(self) -> dict[str, int]:
        warned = sum(1 for session in self.sessions.values() if session.warned)
        return {State.ACTIVE.value: len(self.sessions) - warned, State.WARN.value: warned}

    def other_sessions_of(self, sub: str, tid: uuid.UUID) -> int:
        """Sessions of ``sub`` held here, not counting ``tid`` itself (a resume)."""
        tids = self.sub_sessions.get(sub)
        return len(tids) - (tid in tids) if tids else 0

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def replayed(self, conn: str, result: HeartbeatResult) -> None:
        """A heartbeat stored late (after an outage) came back."""
        session = self.sessions.get(conn)
        if session is None:
            return
        try:
            session.apply(result)
        except Close as close:
            self._spawn(session.close(close))

    # Background work

    async def _sweep(self) -> None:
        """Claim due sessions and make their transitions, forever."""
        lease_ms = max(1000, 10 * self.settings.ms("sweep_interval"))
        backoff = self.settings.sweep_interval
        while self.running:
            try:
                if self.heartbeats.unstored:
                    # Heartbeats held through an outage go in before any deadline is
                    # judged, or their sessions would be warned or expired wrongly.
                    self.heartbeats.kick()
                    claimed = 0
                else:
                    claimed = await self._sweep_once(lease_ms)
                backoff = self.settings.sweep_interval
            except StoreUnavailable as exc:
                self.log.warning("sweep skipped: store unavailable", error=str(exc))
                backoff = min(backoff * 2, MAX_BACKOFF)
                claimed = 0
            except Exception:
                self.log.exception("sweep failed")
                claimed = 0
            if claimed < SWEEP_BATCH:
                await asyncio.sleep(backoff)

    async def _sweep_once(self, lease_ms: int) -> int:
        """Claim, inspect, judge with clocks.py, compare-and-set: three round trips."""
        now, claimed = await self.store.claim_due(SWEEP_BATCH, lease_ms)
        if not any(claimed):
            return 0
        moves: list[tuple[SessionRecord, str, str]] = []
        vanished = 0
        for tid, record in zip(
            (t for shard in claimed for t in shard), await self.store.inspect(claimed), strict=True
        ):
            if record is None:
                # Only when no node swept for expire_after past the token's exp: the
                # script drops the orphaned deadline entry.
                vanished += 1
                moves.append((SessionRecord(tid, "", "", ""), "GONE", ""))
                continue
            state, hb, exp = State(record.st), int(record.hb), int(record.exp)
            transition = due_transition(state, hb, exp, now, self.clocks)
            if transition is None:
                moves.append((record, "LATER", str(deadline(state, hb, exp, self.clocks))))
            else:
                moves.append((record, transition.to.value, transition.reason or ""))
        if vanished:
            self.log.warning("sessions vanished unswept", count=vanished)
        for (record, target, reason), made in zip(
            moves, await self.store.transitions(moves), strict=True
        ):
            if made:  # logged by the one node whose compare-and-set took
                log_at = self.log.warning if target == State.WARN else self.log.info
                log_at("session " + target.lower(), tid=record.tid, reason=reason or None)
                if target == State.EXPIRED:
                    self.metrics.expired(reason)
        return sum(map(len, claimed))

    async def _listen(self) -> None:
        """The node's one subscription: control messages for connections it holds."""
        backoff = 0.1
        channel = self.store.keys.control_channel
        while self.running:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                self.subscribed.set()
                backoff = 0.1
                while self.running:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None:
                        self._control(message["data"])
            except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
                self.subscribed.clear()
                self.log.warning("control subscription lost", error=type(exc).__name__)
            # Not in a finally: on cancellation (stop) the pool's aclose() reclaims the
            # connection, and awaiting pubsub.aclose() while cancelled can block.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1):
                    await pubsub.aclose()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)

    def _control(self, data: str) -> None:
        try:
            message = json.loads(data)
            session = self.sessions.get(message["conn"])
        except (ValueError, KeyError, TypeError):
            self.log.warning("malformed control message")
            return
        if session is None:
            return
        if message.get("op") == "close":
            try:
                code = CloseCode(message.get("code"))
            except ValueError:
                code = CloseCode.INTERNAL_ERROR
            self._spawn(session.close(Close(code, code.describe())))
        elif message.get("op") == "notice":
            self._spawn(session.notify_warn())
