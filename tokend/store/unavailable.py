"""Redis not answering: what it looks like, what the store raises for it, and the deadline
every store call runs under."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from redis import exceptions as rexc

from tokend.store.redis_client import Client, initialized

if TYPE_CHECKING:
    from tokend.answers import EndOutcome

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

    async def __call__(self, make: Callable[[], Awaitable[T]], timeout: float | None = None) -> T:
        try:
            async with asyncio.timeout(timeout or self.timeout), self._in_flight:
                await initialized(self.redis)
                return await make()
        except UNAVAILABLE as exc:
            raise StoreUnavailable(type(exc).__name__) from None
