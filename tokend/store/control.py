"""A node's control channel: the one subscription on which the scripts ask it to close or
warn a connection it holds (docs/protocol.md "Store layout", control messages).

Through Sentinel, the wait before subscribing again ends as soon as Sentinel names another
master than the one the failed try was for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Protocol

import structlog

from tokend.core.session import Session
from tokend.store.redis_client import (
    Client,
    close_quietly,
    master_named,
    subscription,
    through_sentinel,
)
from tokend.store.unavailable import UNAVAILABLE, Retry

log = structlog.get_logger("tokend.control")


class SessionLink(Protocol):
    """A connection that holds a session on this node, as the control channel acts on it
    (the server's link satisfies it)."""

    session: Session

    def told_to_close(self, code: int | None) -> None: ...

    def warn(self) -> None: ...


# Through Sentinel, how often the master's name is asked while the subscription is down.
SENTINEL_POLL = 0.1


class ControlListener:
    """Listens on the node's control channel and acts on the connections it holds.

    ``link_of`` finds a connection held here (:class:`SessionLink`) by its id.
    ``clock`` and ``sleep`` (the event loop's by default) pace the wait before
    subscribing again; a test gives its own to count the waits instead of timing them.
    """

    def __init__(
        self,
        redis: Client,
        channel: str,
        link_of: Callable[[str], SessionLink | None],
        *,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.redis = redis
        self.channel = channel
        self.link_of = link_of
        self.clock = clock
        self.sleep = sleep
        self.subscribed = asyncio.Event()

    async def run(self, running: Callable[[], bool]) -> None:
        """The node's one subscription: control messages for connections it holds."""
        retry = Retry()
        while running():
            pubsub = named = None
            try:
                named = await master_named(self.redis)
                pubsub = await subscription(self.redis)
                await pubsub.subscribe(self.channel)
                self.subscribed.set()
                retry.succeeded()
                while running():
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None:
                        self.control(message["data"])
            except UNAVAILABLE as exc:
                self.subscribed.clear()
                log.warning("control subscription lost", error=type(exc).__name__)
            # Not in a finally: on cancellation (stop) the pool's aclose() reclaims the
            # connection, and awaiting pubsub.aclose() while cancelled can block.
            if pubsub is not None:
                await close_quietly(pubsub)
            await self.until_retry(retry.failed(), named)

    async def until_retry(self, backoff: float, named: tuple[str, int] | None) -> None:
        """Wait ``backoff`` before subscribing again; through Sentinel, only until it names
        another master than ``named`` (asked before the try that failed): a failover is
        done, so retry now rather than after a wait that doubled while the old master was
        named. Sentinel is asked every SENTINEL_POLL."""
        if not through_sentinel(self.redis):
            await self.sleep(backoff)
            return
        clock = self.clock or asyncio.get_running_loop().time
        ends = clock() + backoff
        while (left := ends - clock()) > 0:
            # No master named (it is down, not yet replaced), or no answer within the
            # wait, is no change.
            with contextlib.suppress(TimeoutError, *UNAVAILABLE):
                async with asyncio.timeout(left):
                    if await master_named(self.redis) != named:
                        return
            await self.sleep(min(SENTINEL_POLL, max(0.0, ends - clock())))

    def control(self, data: str) -> None:
        """Act on one control message (JSON: op, tid, conn, code)."""
        try:
            message = json.loads(data)
            op, tid, conn = message["op"], message["tid"], message["conn"]
        except (ValueError, KeyError, TypeError):
            log.warning("malformed control message")
            return
        self.act(op, tid, conn, message.get("code"))

    def act(self, op: str, tid: str, conn: str, code: int | None) -> None:
        """Close (``op`` "close", with ``code``) or warn ("notice") a connection held here."""
        link = self.link_of(conn)
        # A node restarted under the same name numbers its connections afresh: a
        # message about a connection of its previous life must not reach a new one.
        if link is None or link.session.claims is None or str(link.session.claims.tid) != tid:
            return
        if op == "close":
            link.told_to_close(code)
        elif op == "notice":
            link.warn()
