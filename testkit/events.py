"""Reading what tokend emits: the pub/sub channel (:class:`EventLog`), the durable
stream shards, the sweep fence that makes counting them exact, and a session that
makes two events (started, closed)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import redis

from testkit import replies
from testkit.net import http_request, url_of
from testkit.waiting import eventually
from tokend.ops.app import App
from tokend.store.events import Event
from tokend.store.keyspace import Keyspace
from tokend.store.redis_client import Client, subscription
from tokend.tokens.service import TokenService
from tokend_client import Backoff, connect

READ_CHUNK = 5000  # stream entries per XRANGE call


class EventLog:
    """Collects the events published on the channel, for awaiting and counting."""

    def __init__(self, client: Client, channel: str) -> None:
        self.client = client
        self.channel = channel
        self.events: list[dict[str, Any]] = []
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> EventLog:
        subscribed = asyncio.Event()
        self._task = asyncio.create_task(self._run(subscribed))
        await subscribed.wait()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self, subscribed: asyncio.Event) -> None:
        """Collect events; resubscribe if Redis goes away (events meanwhile are missed)."""
        while True:
            try:
                pubsub = await subscription(self.client)
                await pubsub.subscribe(self.channel)
                subscribed.set()
                async for message in pubsub.listen():
                    async with self._changed:
                        self.events.append(json.loads(message["data"]))
                        self._changed.notify_all()
            except (redis.ConnectionError, OSError):
                await asyncio.sleep(0.1)

    def of(self, kind: str, tid: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind and (tid is None or e["tid"] == tid)]

    async def wait_for(
        self, kind: str, tid: str | None = None, count: int = 1, timeout: float = 5.0
    ) -> list[dict[str, Any]]:
        await self.wait_until(lambda: len(self.of(kind, tid)) >= count, timeout)
        return self.of(kind, tid)

    async def wait_until(self, condition: Callable[[], bool], timeout: float = 5.0) -> None:
        """Until ``condition()`` holds over the messages received (``self.events``)."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(condition)


async def read_events(
    client: Client, prefix: str, since_ms: int = 0, positions: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """The events in the stream shards from ``since_ms`` (Redis time), oldest first; with
    ``positions``, only those after the entry ids it holds, which it then advances (to
    read a growing stream a piece at a time)."""
    events = []
    for stream in Keyspace(prefix).streams():
        start = f"({positions[stream]}" if positions and stream in positions else f"{since_ms}-0"
        while entries := replies.entries(await client.xrange(stream, start, "+", count=READ_CHUNK)):
            events += [json.loads(fields["event"]) for _, fields in entries]
            start = f"({entries[-1][0]}"
            if positions is not None:
                positions[stream] = entries[-1][0]
    return sorted(events, key=lambda e: e["at"])


async def sweeps_begun(admin_port: int) -> int:
    """How many sweeps a node has begun, from its metrics: one sweep.lua round trip each."""
    metrics = (await http_request(admin_port, "GET", "/metrics")).body.decode()
    found = re.search(r'^tokend_redis_call_seconds_count\{script="sweep"\} (\S+)$', metrics, re.M)
    return int(float(found[1])) if found else 0


async def after_a_full_sweep(*admin_ports: int, timeout: float = 10.0) -> None:
    """Return once each node has made a whole sweep begun after this call.

    A node makes one sweep at a time, each finding and judging due sessions in one
    atomic script per shard, so by then whatever was due before this call has been
    judged, and each event made is in the streams. With :func:`left_to_judge` empty
    too, no script can emit for those sessions again: the fence to count their events
    at, instead of a pause "long enough for a duplicate to show".
    """
    # b + 1: the sweep under way has finished; b + 2: a later one too.
    begun = {port: await sweeps_begun(port) for port in admin_ports}

    async def swept() -> bool:
        return all([await sweeps_begun(port) >= b + 2 for port, b in begun.items()])

    await eventually(swept, timeout)


async def left_to_judge(client: Client, prefix: str, tids: Sequence[str]) -> list[str]:
    """Of ``tids``, those with a session hash or a deadline entry still in Redis: the
    only things a sweep, and so a duplicate event, could come from."""
    keys = Keyspace(prefix)
    left = []
    for tid in tids:
        shard = keys.shard_of(tid)
        session_key = keys.session_keys_of(shard, tid)[0]
        due = keys.shard_keys(shard)[0]
        if await client.exists(session_key) or await client.zscore(due, tid) is not None:
            left.append(tid)
    return left


async def one_session(app: App, tokens: TokenService, sub: str) -> str:
    """Start a session and log it out: SESSION_STARTED then SESSION_CLOSED. Returns its tid."""
    async with connect(url_of(app.port), tokens.mint(sub), backoff=Backoff(0.05, 0.5)) as session:
        pass
    return str(session.tid)


async def next_event(stream: AsyncIterator[Event], timeout: float = 5.0) -> Event:
    return await asyncio.wait_for(anext(stream), timeout)
