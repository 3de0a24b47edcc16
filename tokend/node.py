"""One tokend node: its live connections and the background work that serves them.

* :class:`HeartbeatBatcher` stores the heartbeats of many connections in one
  Redis round trip per flush and writes their ACKs from the flush; it holds and
  later replays those Redis could not take. :class:`HelloBatcher` does the same
  for HELLOs, :class:`ReleaseBatcher` for the sessions of connections that ended
  (flushed once more when the node stops).
* :meth:`Node._sweep` claims due sessions from every shard's deadline set and
  makes their WARN/EXPIRED transitions (decided in the script, as
  :mod:`tokend.clocks` decides).
  Every node sweeps, so no clock dies with a node.
* :meth:`Node._listen` holds the node's single pub/sub subscription, to its own
  control channel, on which the scripts ask it to close or warn a connection it
  holds. (A transition the node sweeps itself for one of its own connections is
  acted on directly, with no message.)
* :meth:`Node._refresh_keys` follows the keys directory, off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
import time
import uuid
from collections import Counter
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import structlog

from tokend import logs
from tokend.answers import ReleaseOutcome, Swept
from tokend.clocks import State
from tokend.config import KEYS_REFRESH_INTERVAL, Settings
from tokend.metrics import Metrics
from tokend.protocol import CloseCode
from tokend.revocations import Revocations
from tokend.session import GOING_AWAY, Close, Session
from tokend.shedding import Shedder
from tokend.store.redis_client import (
    Client,
    close_quietly,
    master_named,
    subscription,
    through_sentinel,
)
from tokend.store.sessions import HelloRequest, ReleaseRequest, Store
from tokend.store.unavailable import UNAVAILABLE, Retry, StoreUnavailable
from tokend.tokens import Claims, TokenService

if TYPE_CHECKING:
    from tokend.connection import Connection

log = structlog.get_logger("tokend.node")

SWEEP_BATCH = 1000
# Shortest pause between sweeps that found work ahead: bounds the round trips a node
# spends on deadlines falling due one by one.
MIN_SWEEP_PAUSE = 0.005
# Through Sentinel, how often the master's name is asked while the subscription is down.
SENTINEL_POLL = 0.1

Item = TypeVar("Item")


class Background:
    """Tasks that run until :meth:`stop` cancels them (a node's, its admin listener's)."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None], name: str | None = None) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def stop(self, timeout: float = 5) -> None:
        """Cancel every task and wait for them to end, up to ``timeout``."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)


class Batcher(Generic[Item]):
    """Connections (or requests) waiting for one store round trip; the next starts when one
    ends.

    A lone request waits for no timer, while a busy node sends large batches. An item
    waits at most once (a dict keyed by it, in arrival order).
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.waiting: dict[Item, None] = {}
        self._wake = asyncio.Event()

    def submit(self, item: Item) -> None:
        self.waiting[item] = None
        self._wake.set()

    def forget(self, item: Item) -> None:
        self.waiting.pop(item, None)

    async def run(self, node: Node, lanes: int = 1) -> None:
        """Flush until the node stops, with up to ``lanes`` round trips in flight at once:
        while Redis runs one batch's scripts, the node reads and answers the next."""
        await asyncio.gather(*(self._lane(node) for _ in range(lanes)))

    async def _lane(self, node: Node) -> None:
        while node.running:
            await self._wake.wait()
            self._wake.clear()
            await self.flush()

    async def flush(self) -> None:
        raise NotImplementedError


class HelloBatcher(Batcher["Connection"]):
    """HELLOs to start or resume sessions, answered with WELCOME (or a close) from the flush."""

    async def flush(self) -> None:
        batch, self.waiting = list(self.waiting), {}
        requests = []
        for connection in batch:
            session = connection.session
            assert session is not None and session.claims is not None
            c = session.claims
            requests.append(
                HelloRequest(
                    c.tid,
                    c.sub,
                    c.prio,
                    c.iat,
                    c.exp,
                    session.conn,
                    session.shown_proof,
                    session.next_proof,
                    session.token_digest,
                    session.unverified is None,
                )
            )
        try:
            answers = await self.store.hellos(requests)
        except Exception as exc:  # StoreUnavailable (1013) or a script error (1011)
            if not isinstance(exc, StoreUnavailable):
                log.exception("hello flush failed")
            for connection in batch:
                connection.hello_failed(exc)
            return
        for connection, answer in zip(batch, answers, strict=True):
            connection.hello_answered(answer)


class HeartbeatBatcher(Batcher["Connection"]):
    """Heartbeats of many connections in one store call per flush; ACKs written from it.

    A flush takes at most ``batch_size`` connections; when more wait (Redis or the
    node is overloaded), the best-ranked go first (``Session.batch_rank``: on cadence, then
    :func:`tokend.clocks.serving_rank`)
    and the rest wait for the next flush.

    While Redis is unavailable the heartbeats are acknowledged from what the session
    knows and kept in :attr:`unstored`; they are stored, marked as replayed (not
    judged late), in the first flush after Redis is back. The outage is logged once
    when it starts and once when it ends, with counts.
    """

    def __init__(self, store: Store, batch_size: int) -> None:
        super().__init__(store)
        self.batch_size = batch_size
        # Connections with heartbeats acknowledged during an outage, not yet stored.
        self.unstored: dict[Connection, None] = {}
        self.held = 0  # heartbeats acknowledged unstored since the outage began

    def submit(self, connection: Connection) -> None:
        # A connection whose heartbeats are in a flight already is submitted again
        # when that flush answers (see flush): one flight per connection at a time.
        if not connection.session.storing:  # type: ignore[union-attr]
            super().submit(connection)

    def forget(self, connection: Connection) -> None:
        super().forget(connection)
        self.unstored.pop(connection, None)

    def kick(self) -> None:
        if self.unstored:
            self._wake.set()

    def _take(self) -> list[Connection]:
        """Remove and return the next flush's connections, best-ranked first."""
        if len(self.waiting) <= self.batch_size:  # all of them: no copy
            taken, self.waiting = list(self.waiting), {}
        else:
            taken = heapq.nsmallest(
                self.batch_size,
                self.waiting,
                key=lambda c: c.session.batch_rank,  # type: ignore[union-attr]
            )
            self._wake.set()  # the rest go in the next flush
            for connection in taken:
                del self.waiting[connection]
        for connection in taken:
            connection.session.take_heartbeats()  # type: ignore[union-attr]
        return taken

    async def flush(self) -> None:
        batch = self._take()
        unstored = self.unstored
        replays = []
        if unstored:
            taken = set(batch)
            replays = [c for c in unstored if c not in taken]
        # A connection whose earlier heartbeat is still unstored was not silent, whatever
        # Redis last recorded: its new heartbeat is not judged late either.
        connections = batch + replays
        requests = [c.heartbeat_request for c in connections]
        replayed = [c in unstored for c in batch] + [True] * len(replays) if unstored else ()
        try:
            answers = await self.store.record_heartbeats(
                requests,  # type: ignore[arg-type]
                replayed,
                lambda i: connections[i].known(),
            )
        except StoreUnavailable as exc:
            if not self.held:
                log.warning("store unavailable: acknowledging heartbeats unstored", error=str(exc))
            for connection in batch:
                self.held += len(connection.session.unanswered)  # type: ignore[union-attr]
                unstored[connection] = None
                connection.heartbeats_held()
            return
        except Exception:  # a script error: close these connections, keep serving the rest
            log.exception("heartbeat flush failed")
            for connection in batch:
                connection.close(CloseCode.INTERNAL_ERROR, "internal_error")
            return
        if self.held:
            log.warning("store back: heartbeats held stored", held=self.held, replayed=len(replays))
            self.held = 0
        for connection, answer in zip(batch, answers, strict=False):
            if unstored:
                unstored.pop(connection, None)
            connection.heartbeats_stored(answer)
            session = connection.session
            if session is not None and session.unanswered:  # more came in meanwhile
                self.submit(connection)
        for connection, answer in zip(replays, answers[len(batch) :], strict=True):
            unstored.pop(connection, None)
            connection.replayed(answer)


class ReleaseBatcher(Batcher[ReleaseRequest]):
    """Sessions whose connection ended, released in one store call per flush (release.lua):
    no connection holds them now, and those the server closed with 1001 are parked
    (docs/protocol.md §5, "When a connection ends").

    A release Redis could not take is not retried: its session keeps its clocks, and
    counts as held live by the ended connection (spec "Resume proof") until that has been
    silent for ``heartbeat_interval`` + 15 s. An outage is logged when it starts and
    when it ends, with the count; the node's stop (:meth:`finish`) once, with its own.
    """

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.in_flight = 0  # releases sent to Redis and not answered yet
        self.lost = 0  # releases Redis could not take since the outage began
        self.stopping = False
        self.released: Counter[ReleaseOutcome] = Counter()
        self.round_trips = 0  # answered, and the seconds they took
        self.seconds = 0.0

    async def record(self, batch: list[ReleaseRequest]) -> bool:
        """Release ``batch`` in one round trip; False when Redis could not take it."""
        self.in_flight += len(batch)  # still counted if the stop cancels the call
        started = time.perf_counter()
        try:
            outcomes = await self.store.releases(batch)
        except Exception as exc:  # StoreUnavailable, or a script error
            self.in_flight -= len(batch)
            if not isinstance(exc, StoreUnavailable):
                log.exception("release failed")
            return False
        self.in_flight -= len(batch)
        self.round_trips += 1
        self.seconds += time.perf_counter() - started
        self.released.update(outcomes)
        if self.lost and not self.stopping:
            log.warning("store back: sessions not released meanwhile", count=self.lost)
            self.lost = 0
        return True

    async def flush(self) -> None:
        batch, self.waiting = list(self.waiting), {}
        if batch and not await self.record(batch):
            if not self.lost and not self.stopping:
                log.warning("store unavailable: sessions not released", count=len(batch))
            self.lost += len(batch)

    async def finish(self, lanes: asyncio.Task[None] | None, timeout: float) -> None:
        """At the node's stop (it no longer runs): record the releases under way and those
        waiting, within ``timeout``; what Redis could not take is logged once, counted."""
        self.stopping = True
        lost_before = self.lost
        self._wake.set()  # a lane waiting for work flushes what waits, then ends
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                if lanes is not None:
                    await lanes  # the flush under way, if any, ends first
                await self.flush()  # what came in meanwhile
        lost = self.lost - lost_before + self.in_flight + len(self.waiting)
        if lost:
            log.warning("sessions not released at stop: store unavailable", count=lost)
        if self.released:
            log.info(
                "sessions released",
                parked=self.released[ReleaseOutcome.PARKED],
                released=self.released[ReleaseOutcome.RELEASED],
                not_held=self.released[ReleaseOutcome.NOT_HELD],
                round_trips=self.round_trips,
                seconds=round(self.seconds, 3),
            )


class Node:
    """Shared state of a tokend process; :mod:`tokend.server` drives it.

    It is also the :class:`tokend.session.Host` of its sessions: it verifies and signs
    their tokens and keeps the per-sub session counts.
    """

    def __init__(
        self, settings: Settings, redis: Client, tokens: TokenService, name: str | None = None
    ) -> None:
        self.settings = settings
        self.name = name or settings.resolved_node_name
        self.redis = redis
        self.store = Store(redis, settings, self.name)
        self.tokens = tokens
        self.heartbeat_batcher = HeartbeatBatcher(self.store, settings.heartbeat_batch)
        self.hello_batcher = HelloBatcher(self.store)
        self.release_batcher = ReleaseBatcher(self.store)
        self.metrics = Metrics()
        self.metrics.sessions_by_state = self.sessions_by_state
        self.store.observe = self.metrics.redis_call
        self.revocations = Revocations(self.store, redis, settings.failover_check_interval)
        self.sessions: dict[str, Connection] = {}  # WELCOMEd connections by conn id
        self.shedder = Shedder(
            settings.shed_lag,
            lambda: (c.session.rank for c in self.sessions.values()),  # type: ignore[union-attr]
            lambda: len(self.heartbeat_batcher.waiting) > settings.heartbeat_batch,
        )
        # Connections per tid, per sub: for the max_sessions_per_sub cap.
        self.sub_sessions: dict[str, Counter[uuid.UUID]] = {}
        self.subscribed = asyncio.Event()
        self._conn_ids = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        self._releases: asyncio.Task[None] | None = None
        # Loops also check this: on Python 3.11 a cancel that lands as an inner
        # asyncio.timeout() expires can be swallowed (fixed in 3.12).
        self.running = False
        # Its own tasks (those of _tasks among them), cancelled when it stops.
        self.background = Background()

    # Lifecycle

    async def start(self) -> None:
        logs.serving_as(self.name)
        try:
            await self.store.load_scripts()
        except StoreUnavailable:
            log.warning("redis unavailable at start; scripts load on first use")
        self.running = True
        spawn = self.background.spawn
        lanes = self.settings.flush_lanes
        self._releases = spawn(self.release_batcher.run(self), "releases")
        self._tasks = [
            spawn(self.heartbeat_batcher.run(self, lanes), "heartbeats"),
            spawn(self.hello_batcher.run(self, lanes), "hellos"),
            self._releases,
            spawn(self._sweep(), "sweeper"),
            spawn(self._listen(), "control"),
            spawn(self.revocations.run(lambda: self.running), "revocations"),
            spawn(self._refresh_keys(), "keys"),
        ]
        if self.settings.shed_lag:
            self._tasks.append(spawn(self.shedder.run(lambda: self.running), "shedder"))
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
        # Before Redis is closed: a session released here (its connection closed by the
        # drain) must not wait out its old clocks (ReleaseBatcher).
        await self.release_batcher.finish(self._releases, self.settings.redis_timeout)
        await self.background.stop()
        await self.redis.aclose()

    # The sessions' host (tokend.session.Host)

    def check(self, token: str, signature: bool) -> tuple[Claims, str]:
        return self.tokens.check(token, time.time(), signature=signature)

    def sign(self, claims: Claims) -> str:
        return self.tokens.sign(claims)

    def sub_is_full(self, claims: Claims) -> bool:
        cap = self.settings.max_sessions_per_sub
        return bool(cap) and self.other_sessions_of(claims.sub, claims.tid) >= cap

    # Connections

    def new_conn_id(self) -> str:
        """A connection id, unique across the cluster: ``<node>/<counter>``."""
        return f"{self.name}/{next(self._conn_ids)}"

    def attach(self, connection: Connection) -> None:
        """A connection was WELCOMEd: it holds a session now."""
        session = connection.session
        assert session is not None and session.claims is not None
        self.sessions[session.conn] = connection
        if self.settings.max_sessions_per_sub:
            self.sub_sessions.setdefault(session.claims.sub, Counter())[session.claims.tid] += 1

    def detach(self, connection: Connection) -> None:
        """A connection ended (whether or not it was WELCOMEd)."""
        self.hello_batcher.forget(connection)
        self.heartbeat_batcher.forget(connection)
        session = connection.session
        if session is None:
            return
        self.release(connection)
        if self.sessions.get(session.conn) is not connection:
            return
        del self.sessions[session.conn]
        if not self.settings.max_sessions_per_sub or session.claims is None:
            return
        tids = self.sub_sessions[session.claims.sub]
        tids[session.claims.tid] -= 1
        if not tids[session.claims.tid]:
            del tids[session.claims.tid]
            if not tids:
                del self.sub_sessions[session.claims.sub]

    def release(self, connection: Connection) -> None:
        """A closed connection no longer serves its session: the store records it, batched
        (:meth:`tokend.session.Session.take_release` says whether, and how)."""
        request = self._release_request(connection.session)
        if request is not None:
            self.release_batcher.submit(request)

    def _release_request(self, session: Session | None) -> ReleaseRequest | None:
        release = session.take_release() if session is not None else None
        if release is None:
            return None
        assert session is not None and session.claims is not None
        return self.store.release_request(
            session.claims.tid, session.conn, session.since_ms, release.reason
        )

    async def going_away(self, connections: Sequence[Connection], *, wait: bool = True) -> bool:
        """Close ``connections`` with 1001, a planned close (drain, reload, shutdown).

        Their sessions are released, and parked, in the store first, in one round trip
        (bounded by ``redis_timeout``), and only then are their clients told: a client that
        reconnects at once, to another node, finds its session parked, not held live by a
        connection of this one (4509 without its resume proof). Without ``wait``, or when
        Redis cannot take them, the releases go to the batcher and the closes out at once.
        Returns False when it waited for Redis and Redis did not take them.
        """
        closes: list[tuple[Connection, Close | None]] = []
        requests = []
        for connection in connections:
            session = connection.session
            if session is None:  # still in the opening handshake
                connection.close(CloseCode.GOING_AWAY, GOING_AWAY)
                continue
            closes.append((connection, session.close(CloseCode.GOING_AWAY, GOING_AWAY)))
            request = self._release_request(session)
            if request is not None:
                requests.append(request)
        asked = wait and bool(requests)
        recorded = asked and await self.release_batcher.record(requests)
        if not recorded:
            for request in requests:
                self.release_batcher.submit(request)
        for connection, close in closes:
            connection.send_close(close)
        return recorded or not asked

    def sessions_by_state(self) -> dict[str, int]:
        warned = sum(1 for c in self.sessions.values() if c.session and c.session.warned)
        return {State.ACTIVE.value: len(self.sessions) - warned, State.WARN.value: warned}

    def other_sessions_of(self, sub: str, tid: uuid.UUID) -> int:
        """Sessions of ``sub`` held here, not counting ``tid`` itself (a resume)."""
        tids = self.sub_sessions.get(sub)
        return len(tids) - (tid in tids) if tids else 0

    # Background work

    async def _sweep(self) -> None:
        """Claim due sessions and make their transitions, forever."""
        interval = self.settings.sweep_interval
        lease_ms = max(1000, 10 * self.settings.ms("sweep_interval"))
        retry = Retry(first=2 * interval)
        while self.running:
            pause = interval
            try:
                if self.heartbeat_batcher.unstored:
                    # Heartbeats held through an outage go in before any deadline is
                    # judged, or their sessions would be warned or expired wrongly.
                    self.heartbeat_batcher.kick()
                else:
                    pause = await self._sweep_once(lease_ms, interval)
                retry.succeeded()
            except StoreUnavailable as exc:
                log.warning("sweep skipped: store unavailable", error=str(exc))
                pause = retry.failed()
            except Exception:
                log.exception("sweep failed")
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
            if what is Swept.GONE:
                # Only when no node swept for expire_after past the token's exp: the
                # script dropped the orphaned deadline entry.
                vanished += 1
            elif what is Swept.WARN:
                log.warning("session warn", tid=tid)
                if conn:
                    self._act("notice", tid, conn, None)
            else:
                expired[what] += 1
                self.metrics.expired(what)
                if conn:
                    self._act("close", tid, conn, CloseCode.SESSION_EXPIRED)
        if vanished:
            log.warning("sessions vanished unswept", count=vanished)
        if expired:
            log.info("sessions expired", count=expired.total(), reasons=dict(expired))

    async def _refresh_keys(self) -> None:
        """Follow the keys directory (keys rotated in or deleted by another process, files
        refused), every KEYS_REFRESH_INTERVAL: the files are read in a thread, so that no
        HELLO, renewal or JWKS request waits for the disk."""
        keys = self.tokens.keys
        while self.running:
            await asyncio.sleep(KEYS_REFRESH_INTERVAL)
            keys.apply(await asyncio.to_thread(keys.scan))

    async def _listen(self) -> None:
        """The node's one subscription: control messages for connections it holds."""
        retry = Retry()
        channel = self.store.keys.control_channel(self.name)
        while self.running:
            pubsub = named = None
            try:
                named = await master_named(self.redis)
                pubsub = await subscription(self.redis)
                await pubsub.subscribe(channel)
                self.subscribed.set()
                retry.succeeded()
                while self.running:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None:
                        self._control(message["data"])
            except UNAVAILABLE as exc:
                self.subscribed.clear()
                log.warning("control subscription lost", error=type(exc).__name__)
            # Not in a finally: on cancellation (stop) the pool's aclose() reclaims the
            # connection, and awaiting pubsub.aclose() while cancelled can block.
            if pubsub is not None:
                await close_quietly(pubsub)
            await self._until_retry(retry.failed(), named)

    async def _until_retry(self, backoff: float, named: tuple[str, int] | None) -> None:
        """Wait ``backoff`` before subscribing again; through Sentinel, only until it names
        another master than ``named`` (asked before the try that failed): a failover is
        done, so retry now rather than after a wait that doubled while the old master was
        named. Sentinel is asked every SENTINEL_POLL."""
        if not through_sentinel(self.redis):
            await asyncio.sleep(backoff)
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(backoff):
                while True:
                    # No master named (it is down, not yet replaced) is no change.
                    with contextlib.suppress(*UNAVAILABLE):
                        if await master_named(self.redis) != named:
                            return
                    await asyncio.sleep(SENTINEL_POLL)

    def _control(self, data: str) -> None:
        try:
            message = json.loads(data)
            op, tid, conn = message["op"], message["tid"], message["conn"]
        except (ValueError, KeyError, TypeError):
            log.warning("malformed control message")
            return
        self._act(op, tid, conn, message.get("code"))

    def _act(self, op: str, tid: str, conn: str, code: int | None) -> None:
        """Close (``op`` "close", with ``code``) or warn ("notice") a connection held here."""
        connection = self.sessions.get(conn)
        session = connection.session if connection is not None else None
        # A node restarted under the same name numbers its connections afresh: a
        # message about a connection of its previous life must not reach a new one.
        if session is None or session.claims is None or str(session.claims.tid) != tid:
            return
        assert connection is not None
        if op == "close":
            connection.told_to_close(code)
        elif op == "notice":
            connection.warn()
