"""Reading session events: live from pub/sub, replayed from the stream shards, or
consumed through a consumer group.

Every event is a JSON object (spec "Events"), published on ``<prefix>:events``
and appended, in the same atomic step, to the stream shard of its session (16
shards, :meth:`tokend.store.Keyspace.streams`; one field, ``event``).

* :func:`live` - pub/sub, **at-most-once**: what is published while you are
  subscribed, nothing from before, nothing while disconnected. For dashboards,
  tailing, tests.
* :func:`from_start` - plain XREAD of the shards from their start, then new
  entries: a replay of what is still kept (``stream_maxlen`` per shard), with no
  record of what was read.
* :func:`durable` - XREADGROUP over the shards, **at-least-once**: an entry is
  acknowledged only after the loop body that received it has finished; entries a
  crashed consumer left pending are claimed by the others. For anything that
  must not miss an event (audit, billing, revocation lists); handlers must
  tolerate seeing an event twice.

All three read the shards of one Redis (not a Cluster) and want a client made
with ``decode_responses=True`` (as :func:`tokend.store.connect` makes). See
``docs/events.md``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from redis import exceptions as rexc
from redis.asyncio import Redis

from tokend.store import Keyspace

# Waits between attempts while Redis is unreachable (durable consumer).
_RETRY_FIRST = 0.1
_RETRY_MAX = 2.0
_RETRYABLE = (rexc.ConnectionError, rexc.TimeoutError, OSError)

Event = dict[str, Any]
# (stream, entry id, event or None when the entry was trimmed away)
_Delivery = tuple[str, str, Event | None]


def _honour_cancellation() -> None:
    """Raise the cancellation of this task if a library call swallowed it.

    On Python 3.11, redis-py sends each command through ``asyncio.wait_for`` (its
    ``socket_timeout``, 5 s by default), which drops a cancellation that arrives
    just as the send completes (CPython gh-86296, fixed in 3.12). The task then
    runs on while still marked as cancelling: a reader loop would never stop.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def live(redis: Redis, keys: Keyspace) -> AsyncIterator[Event]:
    """Events as they are published, from now on (at-most-once)."""
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(keys.events_channel)
    try:
        while True:
            message = await pubsub.get_message(timeout=1.0)
            _honour_cancellation()
            if message is not None:
                yield json.loads(message["data"])
    finally:
        await pubsub.aclose()


async def from_start(
    redis: Redis, keys: Keyspace, *, follow: bool = True, block_ms: int = 1000
) -> AsyncIterator[Event]:
    """Every event still in the stream shards, in stream-id order per read, then new ones.

    Reads all shards in one XREAD, which needs every shard on one Redis (not a
    Cluster).
    """
    cursor = {stream: "0" for stream in keys.streams()}
    while True:
        reply = await redis.xread(cursor, count=1000, block=block_ms if follow else None)
        _honour_cancellation()
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


async def durable(
    redis: Redis,
    keys: Keyspace,
    group: str,
    consumer: str,
    *,
    start: str = "0",
    claim_idle_ms: int = 30_000,
    block_ms: int = 500,
    count: int = 100,
) -> AsyncIterator[Event]:
    """Events through consumer group ``group`` as member ``consumer`` (at-least-once).

    The group is created on every shard if missing (MKSTREAM), starting at
    ``start``: ``"0"`` for every event the shards still hold, ``"$"`` for new
    ones only. Deliveries, in this order of preference:

    1. this consumer's own pending entries (delivered before a restart under the
       same name, never acknowledged), at start and after every Redis outage;
    2. entries pending on any consumer for longer than ``claim_idle_ms``
       (XAUTOCLAIM), checked every ``claim_idle_ms / 2``: what a crashed consumer
       left behind;
    3. new entries (XREADGROUP ``>``), waiting up to ``block_ms`` - keep it below
       the client's socket timeout.

    An entry is acknowledged (XACK) when the loop asks for the next one, that is
    after the body that received it finished. Leaving the loop (break, an
    exception, cancellation) leaves the entry in hand pending: it comes again.
    ``claim_idle_ms`` must exceed the longest time a body takes, or a slow entry
    is claimed (and handled) twice. Redis outages are waited out with backoff.
    """
    streams = keys.streams()
    own_pending = True
    next_claim = 0.0
    backoff = _RETRY_FIRST
    while True:
        try:
            await _create_group(redis, streams, group, start)
            while True:
                if own_pending:
                    batch = await _read(redis, streams, group, consumer, "0", count, None)
                    own_pending = bool(batch)
                elif time.monotonic() >= next_claim:
                    next_claim = time.monotonic() + claim_idle_ms / 2000
                    batch = await _claim(redis, streams, group, consumer, claim_idle_ms, count)
                else:
                    batch = await _read(redis, streams, group, consumer, ">", count, block_ms)
                _honour_cancellation()
                backoff = _RETRY_FIRST
                for stream, entry_id, event in batch:
                    if event is not None:
                        yield event
                    await redis.xack(stream, group, entry_id)
                    _honour_cancellation()
        except _RETRYABLE:
            own_pending = True
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _RETRY_MAX)
        except rexc.ResponseError as exc:
            if "NOGROUP" not in str(exc):  # the streams were lost (Redis without persistence)
                raise
            own_pending = True


async def _create_group(redis: Redis, streams: Sequence[str], group: str, start: str) -> None:
    for stream in streams:
        try:
            await redis.xgroup_create(stream, group, id=start, mkstream=True)
        except rexc.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        _honour_cancellation()


async def _read(
    redis: Redis,
    streams: Sequence[str],
    group: str,
    consumer: str,
    cursor: str,
    count: int,
    block_ms: int | None,
) -> list[_Delivery]:
    reply = await redis.xreadgroup(
        group, consumer, dict.fromkeys(streams, cursor), count=count, block=block_ms
    )
    return _ordered(
        (stream, entry_id, fields)
        for stream, entries in reply or []
        for entry_id, fields in entries
    )


async def _claim(
    redis: Redis, streams: Sequence[str], group: str, consumer: str, idle_ms: int, count: int
) -> list[_Delivery]:
    """One page of long-pending entries per shard, now owned by ``consumer``."""
    claimed = []
    for stream in streams:
        reply = await redis.xautoclaim(stream, group, consumer, idle_ms, "0-0", count=count)
        _honour_cancellation()
        claimed += [(stream, entry_id, fields) for entry_id, fields in reply[1]]
    return _ordered(claimed)


def _ordered(entries: Any) -> list[_Delivery]:
    """Deliveries in stream-id order across shards; a trimmed entry carries None."""
    out = [
        (stream, entry_id, json.loads(fields["event"]) if fields else None)
        for stream, entry_id, fields in entries
    ]
    out.sort(key=lambda delivery: _id_key(delivery[1]))
    return out


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)
