"""One tokend node: its live connections and the background work that serves them.

* Its batchers (:mod:`tokend.server.batchers`) carry its connections' HELLOs,
  heartbeats and releases to the store, many in one round trip.
* Its :class:`tokend.store.sweeper.Sweeper` makes the due WARN/EXPIRED transitions of
  every shard; its :class:`tokend.store.control.ControlListener` holds its one
  subscription, on which the scripts ask it to close or warn a connection it holds (a
  transition the node sweeps itself for one of its own connections is acted on
  directly, with no message). Its tasks run in a
  :class:`tokend.server.background.Background`.
* :meth:`Node._refresh_keys` follows the keys directory, off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import structlog

from tokend import logs
from tokend.config import KEYS_REFRESH_INTERVAL, Settings
from tokend.core import lifecycle
from tokend.core.claims import Claims
from tokend.core.protocol import CloseCode
from tokend.core.session import GOING_AWAY, Close, Session
from tokend.core.store_messages import Ended
from tokend.metrics import Metrics
from tokend.server import seams
from tokend.server.background import Background
from tokend.server.batchers import HeartbeatBatcher, HelloBatcher, ReleaseBatcher
from tokend.server.registry import Registry
from tokend.server.shedding import Shedder
from tokend.store.control import ControlListener
from tokend.store.redis_client import Client
from tokend.store.revocations import Revocations
from tokend.store.sessions import ReleaseRequest, Store
from tokend.store.sweeper import Sweeper
from tokend.store.unavailable import NotConfirmed, StoreUnavailable
from tokend.tokens.service import TokenService

log = structlog.get_logger("tokend.node")


class Node:
    """Shared state of a tokend process; :mod:`tokend.ops.app` drives it.

    Its connections see it as a :class:`tokend.server.seams.Node` (their store round trips,
    its :class:`tokend.server.registry.Registry` of live sessions), their sessions as a
    :class:`tokend.core.session.Node`: it verifies and signs their tokens.
    """

    def __init__(
        self, settings: Settings, redis: Client, tokens: TokenService, name: str | None = None
    ) -> None:
        self.settings = settings
        self.name = name or settings.resolved_node_name
        self.redis = redis
        self.store = Store(redis, settings, self.name)
        self.tokens = tokens
        self.heartbeat_batcher = HeartbeatBatcher(
            self.store,
            settings.heartbeat_batch,
            settings.heartbeat_gather,
            leave_after=lifecycle.off_redis_leave_after_ms(
                settings.ms("heartbeat_interval"),
                lifecycle.Clocks(settings.ms("warn_after"), settings.ms("expire_after")),
            )
            / 1000
            if settings.off_redis == "leave"
            else None,
        )
        self.release_batcher = ReleaseBatcher(self.store, settings.expire_after)
        self.hello_batcher = HelloBatcher(self.store, self.release_batcher)
        # The connections' round trips, straight to the batchers (no call in between).
        self.submit_hello = self.hello_batcher.submit
        self.forget_hello = self.hello_batcher.forget
        self.submit_heartbeat = self.heartbeat_batcher.submit
        self.registry = Registry(settings.max_sessions_per_sub)
        self.sessions = self.registry.links  # WELCOMEd links by conn id
        self.metrics = Metrics()
        self.metrics.sessions_by_state = self.registry.sessions_by_state
        self.store.observe = self.metrics.redis_call
        self.revocations = Revocations(self.store, redis, settings.failover_check_interval)
        self.shedder = Shedder(
            settings.shed_lag,
            self.registry.ranks,
            lambda: self.heartbeat_batcher.pending > settings.heartbeat_batch,
            recorded=lambda: self.metrics.acked_heartbeats,
        )
        self.control = ControlListener(
            redis, self.store.keys.control_channel(self.name), self.sessions.get
        )
        self.subscribed = self.control.subscribed
        self.sweeper = Sweeper(
            self.store, settings, self.metrics, self.control.act, self._replay_first
        )
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
            spawn(self.hello_batcher.run(self), "hellos"),
            self._releases,
            spawn(self.sweeper.run(lambda: self.running), "sweeper"),
            spawn(self.control.run(lambda: self.running), "control"),
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

    # As its sessions see it (tokend.core.session.Node)

    def check(self, token: str, signature: bool) -> tuple[Claims, str]:
        return self.tokens.check(token, time.time(), signature=signature)

    def sign(self, claims: Claims, iat_s: int, exp_s: int) -> tuple[bytes, str]:
        return self.tokens.reissue(claims, iat_s, exp_s)

    def sub_is_full(self, claims: Claims) -> bool:
        return self.registry.sub_is_full(claims)

    # As its connections see it (tokend.server.seams.Node)

    def new_conn_id(self) -> str:
        """A connection id, unique across the cluster: ``<node>/<counter>``."""
        return f"{self.name}/{next(self._conn_ids)}"

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self.background.spawn(coro)

    def attach(self, link: seams.SessionLink) -> None:
        """A link was WELCOMEd: it holds a session now, and its heartbeats a request."""
        session = link.session
        assert session.claims is not None
        link.heartbeat_request = self.store.heartbeat_request(session.claims.tid, session.conn)
        self.registry.attach(link)

    def detach(self, link: seams.SessionLink) -> None:
        """A link's connection ended (whether or not it was WELCOMEd)."""
        self.hello_batcher.forget(link)
        self.heartbeat_batcher.forget(link)
        self.release(link)
        self.registry.detach(link)

    def release(self, link: seams.SessionLink) -> None:
        """A closed connection no longer serves its session: the store records it, batched
        (:meth:`tokend.core.session.Session.take_release` says whether, and how)."""
        request = self._release_request(link.session)
        if request is not None:
            self.release_batcher.submit(request)

    def _release_request(self, session: Session) -> ReleaseRequest | None:
        release = session.take_release()
        if release is None:
            return None
        assert session.claims is not None
        return self.store.release_request(
            session.claims.tid, session.conn, session.since_ms, release.reason
        )

    def end(self, link: seams.SessionLink) -> None:
        """BYE: the session ends (end.lua), then the link is told (docs/protocol.md 0x05)."""
        self.background.spawn(self._bye(link))

    async def _bye(self, link: seams.SessionLink) -> None:
        session = link.session
        assert session.claims is not None
        try:
            await self.store.end(
                session.claims.tid,
                conn=session.conn,
                event="SESSION_CLOSED",
                tomb=Ended.CLOSED,
                code=None,
            )
        except NotConfirmed:
            link.bye_answered(confirmed=False)
        except StoreUnavailable:
            link.bye_failed()
        else:
            link.bye_answered(confirmed=True)

    async def going_away(
        self, connections: Sequence[seams.Connection], *, wait: bool = True
    ) -> bool:
        """Close ``connections`` with 1001, a planned close (drain, reload, shutdown).

        Their sessions are released, and parked, in the store first, in one round trip
        (bounded by ``redis_timeout``), and only then are their clients told: a client that
        reconnects at once, to another node, finds its session parked, not held live by a
        connection of this one (4509 without its resume proof). Without ``wait``, or when
        Redis cannot take them, the releases go to the batcher and the closes out at once.
        Returns False when it waited for Redis and Redis did not take them.
        """
        closes: list[tuple[seams.SessionLink, Close | None]] = []
        requests = []
        for connection in connections:
            link = connection.link
            if link is None:  # still in the opening handshake
                connection.close(CloseCode.GOING_AWAY, GOING_AWAY)
                continue
            session = link.session
            closes.append((link, session.close(CloseCode.GOING_AWAY, GOING_AWAY)))
            request = self._release_request(session)
            if request is not None:
                requests.append(request)
        asked = wait and bool(requests)
        recorded = asked and await self.release_batcher.record(requests)
        if not recorded:
            for request in requests:
                self.release_batcher.submit(request)
        for link, close in closes:
            link.send_close(close)
        return recorded or not asked

    # Background work

    def _replay_first(self) -> bool:
        """Whether heartbeats held through an outage are still unstored: they go in (kicked
        here) before the sweeper judges any deadline. The releases owed go again too."""
        self.release_batcher.kick()
        if not self.heartbeat_batcher.unstored:
            return False
        self.heartbeat_batcher.kick()
        return True

    async def _refresh_keys(self) -> None:
        """Follow the keys directory (keys rotated in or deleted by another process, files
        refused), every KEYS_REFRESH_INTERVAL: the files are read in a thread, so that no
        HELLO, renewal or JWKS request waits for the disk."""
        keys = self.tokens.keys
        while self.running:
            await asyncio.sleep(KEYS_REFRESH_INTERVAL)
            keys.apply(await asyncio.to_thread(keys.scan))
