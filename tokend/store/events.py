"""Reading session events: live from pub/sub, replayed from the stream shards, or
consumed through a consumer group.

Every event is a JSON object (spec "Events"), published on ``<prefix>:events``
and appended, in the same atomic step, to the stream shard of its session (16
shards, :meth:`tokend.store.keyspace.Keyspace.streams`; one field, ``event``).

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

All three want a client made by :func:`tokend.store.redis_client.open_client` (or any with
``decode_responses=True``): one Redis, a Redis Cluster or a Sentinel-named master.
On a Cluster the shards live in different slots, so the stream readers send one
read per slot (:func:`tokend.store.redis_client.slot_groups`) instead of one for all 16, and
keep each in flight until it answers (:class:`_Reads`). Plain PUBLISH reaches
every Cluster node over the cluster bus (not one without a working link to it), so
:func:`live` subscribes on any one. See ``docs/events.md``
and ``docs/scaling.md``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, cast

from redis import exceptions as rexc

from tokend.store.keyspace import Keyspace
from tokend.store.redis_client import Client, slot_groups, subscription
from tokend.store.unavailable import UNAVAILABLE, Retry

Event = dict[str, Any]
# (stream, entry id, fields or None when the entry was trimmed away), as read
_Entry = tuple[str, str, dict[str, str] | None]
# The same with the event decoded
_Delivery = tuple[str, str, Event | None]
_Reader = Callable[[list[str]], Awaitable[list[_Entry]]]
# An XREAD or XREADGROUP reply as the client decodes it (RESP2; redis-py types it wider).
_StreamsReply = list[tuple[str, list[tuple[str, dict[str, str] | None]]]] | None


def _entries(reply: object) -> list[_Entry]:
    """The entries of an XREAD or XREADGROUP reply, each with its stream."""
    streams = cast("_StreamsReply", reply)
    return [
        (stream, entry_id, fields)
        for stream, entries in streams or []
        for entry_id, fields in entries
    ]


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


async def live(redis: Client, keys: Keyspace) -> AsyncGenerator[Event, None]:
    """Events as they are published, from now on (at-most-once)."""
    pubsub = await subscription(redis)
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
    redis: Client, keys: Keyspace, *, follow: bool = True, block_ms: int = 1000
) -> AsyncGenerator[Event, None]:
    """Every event still in the stream shards, in stream-id order per read, then new ones.

    One XREAD covers all shards on one Redis; on a Cluster, one per slot.
    """
    cursor = {stream: "0" for stream in keys.streams()}
    groups = await slot_groups(redis, keys.streams())

    async def read(streams: list[str], block: int | None) -> list[_Entry]:
        return _entries(await redis.xread({s: cursor[s] for s in streams}, count=1000, block=block))

    reads = _Reads(groups, lambda streams: read(streams, block_ms))
    try:
        while True:
            if follow:
                batch = await reads.next()
            else:
                batch = await _gathered(groups, lambda streams: read(streams, None))
            _honour_cancellation()
            if not batch and not follow:
                return
            for stream, entry_id, _ in batch:
                cursor[stream] = entry_id
            for _, _, event in batch:
                if event is not None:
                    yield event
    finally:
        await reads.aclose()


async def durable(
    redis: Client,
    keys: Keyspace,
    group: str,
    consumer: str,
    *,
    start: str = "0",
    claim_idle_ms: int = 30_000,
    block_ms: int = 500,
    count: int = 100,
) -> AsyncGenerator[Event, None]:
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
    groups = await slot_groups(redis, streams)
    own_pending = True
    next_claim = 0.0
    retry = Retry()
    new_entries = _Reads(
        groups,
        lambda group_streams: _read(redis, group_streams, group, consumer, ">", count, block_ms),
    )
    try:
        while True:
            try:
                await _create_group(redis, streams, group, start)
                while True:
                    if own_pending:
                        batch = await _gathered(
                            groups,
                            lambda group_streams: _read(
                                redis, group_streams, group, consumer, "0", count, None
                            ),
                        )
                        own_pending = bool(batch)
                    elif time.monotonic() >= next_claim:
                        next_claim = time.monotonic() + claim_idle_ms / 2000
                        batch = await _claim(redis, streams, group, consumer, claim_idle_ms, count)
                    else:
                        batch = await new_entries.next()
                    _honour_cancellation()
                    retry.succeeded()
                    for stream, entry_id, event in batch:
                        if event is not None:
                            yield event
                        await redis.xack(stream, group, entry_id)
                        _honour_cancellation()
            except UNAVAILABLE:
                # Reads still in flight may have taken entries: they are this
                # consumer's pending entries now, read again first.
                await new_entries.aclose()
                own_pending = True
                await retry.wait()
            except rexc.ResponseError as exc:
                if "NOGROUP" not in str(exc):  # the streams were lost (Redis without persistence)
                    raise
                await new_entries.aclose()
                own_pending = True
    finally:
        await new_entries.aclose()


class _Reads:
    """Blocking reads, one per slot group, each kept in flight until it answers.

    :meth:`next` returns what the reads that have answered delivered (at least
    one answers, with entries or at its block timeout). On one Redis there is one
    group, so this is one read at a time; on a Cluster a quiet shard's read does
    not hold back a busy one's entries, and no answered read is thrown away.
    """

    def __init__(self, groups: list[list[str]], read: _Reader) -> None:
        self._groups = groups
        self._read = read
        self._in_flight: dict[int, asyncio.Future[list[_Entry]]] = {}

    async def next(self) -> list[_Delivery]:
        for n, streams in enumerate(self._groups):
            if n not in self._in_flight:
                self._in_flight[n] = asyncio.ensure_future(self._read(streams))
        await asyncio.wait(self._in_flight.values(), return_when=asyncio.FIRST_COMPLETED)
        answered: list[_Entry] = []
        for n, task in list(self._in_flight.items()):
            if task.done():
                del self._in_flight[n]
                answered += task.result()  # an error: the caller closes, then retries
        return _ordered(answered)

    async def aclose(self) -> None:
        """Stop the reads in flight (what a stopped read took is left pending)."""
        tasks = list(self._in_flight.values())
        self._in_flight.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _gathered(groups: list[list[str]], read: _Reader) -> list[_Delivery]:
    """One non-blocking read per slot group, concurrently, merged in stream-id order."""
    replies = await asyncio.gather(*(read(streams) for streams in groups))
    return _ordered(delivery for reply in replies for delivery in reply)


async def _create_group(redis: Client, streams: Sequence[str], group: str, start: str) -> None:
    for stream in streams:
        try:
            await redis.xgroup_create(stream, group, id=start, mkstream=True)
        except rexc.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        _honour_cancellation()


async def _read(
    redis: Client,
    streams: Sequence[str],
    group: str,
    consumer: str,
    cursor: str,
    count: int,
    block_ms: int | None,
) -> list[_Entry]:
    return _entries(
        await redis.xreadgroup(
            group, consumer, dict.fromkeys(streams, cursor), count=count, block=block_ms
        )
    )


async def _claim(
    redis: Client, streams: Sequence[str], group: str, consumer: str, idle_ms: int, count: int
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
