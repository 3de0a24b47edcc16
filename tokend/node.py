"""One tokend node: its live connections and the background work that serves them.

* :class:`HeartbeatBatcher` stores the heartbeats of many connections in one
  Redis round trip per flush, and replays those Redis could not take.
* :meth:`Node._sweep` claims due sessions from every shard's deadline set and
  makes their WARN/EXPIRED transitions (decided in the script, as
  :mod:`tokend.clocks` decides).
  Every node sweeps, so no clock dies with a node.
* :meth:`Node._listen` holds the node's single pub/sub subscription, to its own
  control channel, on which the scripts ask it to close or warn a connection it
  holds. (A transition the node sweeps itself for one of its own connections is
  acted on directly, with no message.)
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import uuid
from collections import Counter
from collections.abc import Coroutine
from typing import Any

import structlog
from redis import exceptions as rexc

from tokend.clocks import State
from tokend.config import Settings
from tokend.metrics import Metrics
from tokend.protocol import CloseCode
from tokend.revocations import Revocations
from tokend.session import Close, Session
from tokend.store import (
    Client,
    HeartbeatRequest,
    HeartbeatResult,
    Store,
    StoreUnavailable,
    subscription,
)
from tokend.tokens import TokenService

log = structlog.get_logger("tokend.node")

SWEEP_BATCH = 1000
# Shortest pause between sweeps that found work ahead: bounds the round trips a node
# spends on deadlines falling due one by one.
MIN_SWEEP_PAUSE = 0.005
MAX_BACKOFF = 2.0


# Heartbeats waiting for a flush, by connection: (request, its future, serving rank).
Waiting = dict[str, tuple[HeartbeatRequest, asyncio.Future[HeartbeatResult], int]]


class HeartbeatBatcher:
    """Coalesces concurrent heartbeats into one store call per flush.

    A flush starts as soon as the previous one ends, so a lone heartbeat waits for
    no timer while a busy node sends large batches. A flush takes at most
    ``batch_size`` heartbeats; when more wait (Redis or the node is overloaded), the
    best-ranked go first (:func:`tokend.clocks.serving_rank`) and the rest wait for the next flush.
    """

    def __init__(self, store: Store, batch_size: int) -> None:
        self.store = store
        self.batch_size = batch_size
        self._waiting: Waiting = {}
        # Heartbeats acknowledged during an outage, to be stored when Redis is back.
        self.unstored: dict[str, HeartbeatRequest] = {}
        self._wake = asyncio.Event()

    def submit(self, request: HeartbeatRequest, rank: int) -> asyncio.Future[HeartbeatResult]:
        future: asyncio.Future[HeartbeatResult] = asyncio.get_running_loop().create_future()
        self._waiting[request.conn] = (request, future, rank)
        self._wake.set()
        return future

    def _take(self) -> Waiting:
        """Remove and return the next flush's heartbeats, best-ranked first."""
        if len(self._waiting) <= self.batch_size:  # all of them: no copy
            taken, self._waiting = self._waiting, {}
            return taken
        best = heapq.nsmallest(self.batch_size, self._waiting.items(), key=lambda e: e[1][2])
        self._wake.set()  # the rest go in the next flush
        for conn, _ in best:
            del self._waiting[conn]
        return dict(best)

    def forget(self, conn: str) -> None:
        self.unstored.pop(conn, None)

    def kick(self) -> None:
        if self.unstored:
            self._wake.set()

    async def run(self, node: Node) -> None:
        while node.running:
            await self._wake.wait()
            self._wake.clear()
            waiting = self._take()
            replays = {c: r.replay() for c, r in self.unstored.items() if c not in waiting}
            # A connection whose earlier heartbeat is still unstored was not silent, whatever
            # Redis last recorded: its new heartbeat is not judged late either.
            unstored = self.unstored
            requests = [
                r.replay() if c in unstored else r for c, (r, _, _) in waiting.items()
            ] + list(replays.values())
            try:
                results = await self.store.heartbeats(requests)
            except StoreUnavailable as exc:
                for conn, (request, future, _) in waiting.items():
                    self.unstored[conn] = request
                    if not future.done():
                        future.set_exception(exc)
                continue
            except Exception as exc:  # a script error: fail these, keep serving
                log.exception("heartbeat flush failed")
                for _, future, _ in waiting.values():
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (conn, (_, future, _)), result in zip(waiting.items(), results, strict=False):
                if unstored:
                    unstored.pop(conn, None)
                if not future.done():
                    future.set_result(result)
            for conn, result in zip(replays, results[len(waiting) :], strict=True):
                self.unstored.pop(conn, None)
                node.replayed(conn, result)


class Node:
    """Shared state of a tokend process; :mod:`tokend.server` drives it."""

    def __init__(
        self, settings: Settings, redis: Client, tokens: TokenService, name: str | None = None
    ) -> None:
        self.settings = settings
        self.name = name or settings.resolved_node_name
        self.redis = redis
        self.store = Store(redis, settings, self.name)
        self.tokens = tokens
        self.heartbeats = HeartbeatBatcher(self.store, settings.heartbeat_batch)
        self.metrics = Metrics()
        self.metrics.sessions_by_state = self.sessions_by_state
        self.store.observe = self.metrics.redis_call
        self.revocations = Revocations(self.store, redis, settings.failover_check_interval)
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
            asyncio.create_task(self.revocations.run(lambda: self.running), name="revocations"),
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
        interval = self.settings.sweep_interval
        lease_ms = max(1000, 10 * self.settings.ms("sweep_interval"))
        backoff = interval
        while self.running:
            pause = interval
            try:
                if self.heartbeats.unstored:
                    # Heartbeats held through an outage go in before any deadline is
                    # judged, or their sessions would be warned or expired wrongly.
                    self.heartbeats.kick()
                else:
                    pause = await self._sweep_once(lease_ms, interval)
                backoff = interval
            except StoreUnavailable as exc:
                self.log.warning("sweep skipped: store unavailable", error=str(exc))
                pause = backoff = min(backoff * 2, MAX_BACKOFF)
            except Exception:
                self.log.exception("sweep failed")
            if pause:
                await asyncio.sleep(pause)

    async def _sweep_once(self, lease_ms: int, interval: float) -> float:
        """Claim the due sessions, then judge and transition them: two round trips.

        Returns how long to wait before the next sweep: none when a shard filled its
        batch (more may be due there), else until the earliest deadline left, within
        [MIN_SWEEP_PAUSE, interval]: a deadline is met within a few milliseconds
        rather than up to a whole interval late.
        """
        loop = asyncio.get_running_loop()
        claimed_at = loop.time()
        now, claimed, next_due = await self.store.claim_due(SWEEP_BATCH, lease_ms)
        if any(claimed):
            await self._judge(claimed)
        if any(len(tids) >= SWEEP_BATCH for tids in claimed):
            return 0.0
        # The earliest deadline as of the claim, less the time the sweep took since.
        until_due = interval if next_due is None else (next_due - now) / 1000
        until_due -= loop.time() - claimed_at
        return min(interval, max(MIN_SWEEP_PAUSE, until_due))

    async def _judge(self, claimed: list[list[str]]) -> None:
        """Make the claimed sessions' due transitions; warn or close those held here.

        transition.lua decides in Redis, by the rules of :func:`tokend.clocks.due_transition`
        (spec "Session states and clocks").
        """
        expired: Counter[str] = Counter()
        vanished = 0
        # Logged by the one node whose script made them: each WARN (the spec asks for
        # it), the expiries of a sweep in one line.
        for tid, what, conn in await self.store.transitions(claimed):
            if what == "gone":
                # Only when no node swept for expire_after past the token's exp: the
                # script dropped the orphaned deadline entry.
                vanished += 1
            elif what == "warn":
                self.log.warning("session warn", tid=tid)
                if conn:
                    self._act("notice", tid, conn, None)
            else:
                expired[what] += 1
                self.metrics.expired(what)
                if conn:
                    self._act("close", tid, conn, CloseCode.SESSION_EXPIRED)
        if vanished:
            self.log.warning("sessions vanished unswept", count=vanished)
        if expired:
            self.log.info("sessions expired", count=expired.total(), reasons=dict(expired))

    async def _listen(self) -> None:
        """The node's one subscription: control messages for connections it holds."""
        backoff = 0.1
        channel = self.store.keys.control_channel(self.name)
        while self.running:
            pubsub = None
            try:
                pubsub = await subscription(self.redis)
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
            if pubsub is not None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1):
                        await pubsub.aclose()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)

    def _control(self, data: str) -> None:
        try:
            message = json.loads(data)
            op, tid, conn = message["op"], message["tid"], message["conn"]
        except (ValueError, KeyError, TypeError):
            self.log.warning("malformed control message")
            return
        self._act(op, tid, conn, message.get("code"))

    def _act(self, op: str, tid: str, conn: str, code: int | None) -> None:
        """Close (``op`` "close", with ``code``) or warn ("notice") a connection held here."""
        session = self.sessions.get(conn)
        # A node restarted under the same name numbers its connections afresh: a
        # message about a connection of its previous life must not reach a new one.
        if session is None or session.claims is None or str(session.claims.tid) != tid:
            return
        if op == "close":
            try:
                close_code = CloseCode(code)
            except ValueError:
                close_code = CloseCode.INTERNAL_ERROR
            self._spawn(session.close(Close(close_code, close_code.describe())))
        elif op == "notice":
            self._spawn(session.notify_warn())
