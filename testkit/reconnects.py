"""Reconnection scenarios the Python and browser SDK tests share: a session held live by
a connection its client lost (the resume proof), and a drained node's clients spread
over the going-away window behind a balancer."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass

from testkit.events import EventLog
from testkit.net import url_of
from testkit.proxies import RoundRobinProxy
from tokend.ops.app import App

StartApp = Callable[..., Awaitable[App]]


# A held session stays "live" for heartbeat_interval + 15 s after its last heartbeat
# (spec "Resume proof"); WARN and expiry are further off, so only the proof decides.
PROOF_CLOCKS = {"heartbeat_interval": 0.5, "warn_after": 20, "expire_after": 40}
HELD_LIVE_FOR = PROOF_CLOCKS["heartbeat_interval"] + 15

# No stampede after a drain.
SPREAD_WINDOW = 3.0  # s: the going_away_window of the drained clients
SPREAD_SESSIONS = 16
# drain_period 0: every 1001 at once. A spread reconnect cannot harm these clocks: the
# session can spare (expire - heartbeat) / 2 = 9.75 s, more than the window.
SPREAD_CLOCKS = {"heartbeat_interval": 0.5, "warn_after": 10, "expire_after": 20, "drain_period": 0}


@dataclass
class Balanced:
    """Two tokend nodes on one Redis behind a TCP balancer that sends every client to the
    first, until it is drained."""

    first: App
    second: App
    balancer: RoundRobinProxy

    @property
    def url(self) -> str:
        return url_of(self.balancer.port)

    async def drain_first(self) -> float:
        """New connections to the second node; drain the first (1001 to all its clients at
        once). The wall-clock time just before its closes."""
        self.balancer.backends = [self.second.port]
        began = time.time()
        await self.first.drain(asyncio.Event())
        return began


@contextlib.asynccontextmanager
async def balanced(start_app: StartApp) -> AsyncIterator[Balanced]:
    first = await start_app(**SPREAD_CLOCKS)
    second = await start_app(**SPREAD_CLOCKS, node_name="node-b")
    async with RoundRobinProxy([first.port]) as balancer:
        yield Balanced(first, second, balancer)


async def resumed_at(events: EventLog, tids: list[str], timeout: float) -> dict[str, int]:
    """When the server resumed each session: its SESSION_RESUMED's ``at`` (epoch ms)."""
    await events.wait_until(lambda: all(events.of("SESSION_RESUMED", t) for t in tids), timeout)
    return {tid: events.of("SESSION_RESUMED", tid)[0]["at"] for tid in tids}


def assert_spread(
    began: float, delays: Mapping[str, float], resumed: Mapping[str, int], window: float
) -> None:
    """The sessions drew their waits over the window, and the server saw each back no sooner
    than its wait after the closes began: over a third of the window at least, both (16
    uniform draws fall within a third of their range with odds of 1 in 10^6; a browser,
    which opens one WebSocket at a time per host, spreads even waits it did not draw)."""
    for tid, delay in delays.items():
        assert 0 <= delay <= window, (tid, delay)
        # ``at`` is Redis's clock in whole milliseconds (floored).
        assert resumed[tid] + 1 >= (began + delay) * 1000, (tid, delay, resumed[tid] / 1000 - began)
    drawn = max(delays.values()) - min(delays.values())
    assert drawn >= window / 3, f"all {len(delays)} drew waits within {drawn:.3f} s"
    span = (max(resumed.values()) - min(resumed.values())) / 1000
    assert span >= window / 3, f"all {len(resumed)} resumed within {span:.3f} s"
