"""Reading session events: live from pub/sub, or replayed from the stream shards.

Live (pub/sub) is at-most-once: a subscriber that is not connected misses
events. The stream shards keep the most recent ``stream_maxlen`` events each,
and are what a consumer that must not miss any should read.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from redis.asyncio import Redis

from tokend.store import Keyspace


async def live(redis: Redis, keys: Keyspace) -> AsyncIterator[dict[str, Any]]:
    """Events as they are published, from now on."""
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(keys.events_channel)
    try:
        async for message in pubsub.listen():
            yield json.loads(message["data"])
    finally:
        await pubsub.aclose()


async def from_start(
    redis: Redis, keys: Keyspace, *, follow: bool = True, block_ms: int = 1000
) -> AsyncIterator[dict[str, Any]]:
    """Every event still in the stream shards, in stream-id order per read, then new ones.

    Reads all shards in one XREAD, which needs every shard on one Redis (not a
    Cluster).
    """
    cursor = {stream: "0" for stream in keys.streams()}
    while True:
        reply = await redis.xread(cursor, count=1000, block=block_ms if follow else None)
        if not reply:
            if follow:
                continue
            return
        entries = []
        for stream, messages in reply:
            for entry_id, fields in messages:
                cursor[stream] = entry_id
                entries.append((_id_key(entry_id), fields["event"]))
        for _, event in sorted(entries):
            yield json.loads(event)


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)
