"""The recent events the dashboard pages through (``GET /v1/events``)."""

from __future__ import annotations

from collections import deque
from typing import Any

from tokend.store import events
from tokend.store.keyspace import Keyspace
from tokend.store.redis_client import Client
from tokend.store.unavailable import UNAVAILABLE, Retry

# Events kept for GET /v1/events.
EVENT_RING = 500


class EventRing:
    """The last :data:`EVENT_RING` events seen on the events channel, numbered from 1."""

    def __init__(self, size: int = EVENT_RING) -> None:
        self.events: deque[dict[str, Any]] = deque(maxlen=size)
        self.seq = 0

    def add(self, event: dict[str, Any]) -> None:
        self.seq += 1
        self.events.append({"seq": self.seq, **event})

    def after(self, seq: int, limit: int) -> dict[str, Any]:
        page = [e for e in self.events if e["seq"] > seq][:limit]
        return {"events": page, "next": page[-1]["seq"] if page else max(seq, 0)}

    async def follow(self, redis: Client, keys: Keyspace) -> None:
        """Fill the ring from the events channel (at-most-once: gaps across outages)."""
        retry = Retry()
        while True:
            try:
                async for event in events.live(redis, keys):
                    self.add(event)
                    retry.succeeded()
            except UNAVAILABLE:
                await retry.wait()
