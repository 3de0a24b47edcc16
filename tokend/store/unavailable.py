"""Redis not answering: what it looks like, what the store raises for it, and the deadline
every store call runs under."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from redis import exceptions as rexc
from redis.asyncio.cluster import RedisCluster

from tokend.store.redis_client import Client, initialized

if TYPE_CHECKING:
    from tokend.core.store_messages import EndOutcome

T = TypeVar("T")

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


class Deadline:
    """Store calls bounded in time and in number; Redis not answering raises
    :class:`StoreUnavailable`.

    The bound on calls in flight is ``redis_pool_size``: a Cluster client fails instead of
    waiting when a node's connections are all busy (elsewhere the pool would wait here too).
    """

    def __init__(self, redis: Client, timeout: float, concurrency: int) -> None:
        self.redis = redis
        self.timeout = timeout
        self._in_flight = asyncio.Semaphore(concurrency)
        # Only a Cluster client has a slot table to load before its commands: asked once
        # here, not per call (an isinstance of RedisCluster goes through typing's protocol
        # check, on every heartbeat flush).
        self._cluster = isinstance(redis, RedisCluster)

    async def __call__(self, make: Callable[[], Awaitable[T]], timeout: float | None = None) -> T:
        try:
            async with asyncio.timeout(timeout or self.timeout), self._in_flight:
                if self._cluster:
                    await initialized(self.redis)
                return await make()
        except UNAVAILABLE as exc:
            raise StoreUnavailable(type(exc).__name__) from None


class Retry:
    """The wait before the next attempt while Redis is unavailable: ``first``, doubled after
    each failure up to ``most``, and ``first`` again once an attempt succeeds.

    Every loop that waits Redis out (the sweeper, the subscriptions, the event readers)
    paces itself with one, so that they back off alike.
    """

    def __init__(self, first: float = 0.1, most: float = 2.0) -> None:
        self.first = min(first, most)
        self.most = most
        self.delay = self.first

    def succeeded(self) -> None:
        self.delay = self.first

    def failed(self) -> float:
        """How long to wait now; the next failure waits twice as long (up to ``most``)."""
        delay = self.delay
        self.delay = min(delay * 2, self.most)
        return delay

    async def wait(self) -> None:
        """Wait after a failed attempt."""
        await asyncio.sleep(self.failed())
