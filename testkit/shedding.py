"""A shed period on a real tokend, for the SDKs' flood clients (tests/test_client.py,
tests/test_browser.py): the node sheds the flood's class, then everything it can
(reading paused), then serves it again; the flood client must stay connected and
keep getting an ACK at least every half interval."""

from __future__ import annotations

from collections.abc import Callable

from testkit.waiting import eventually
from tokend.core.lifecycle import serving_rank
from tokend.ops.app import App

# Settings of the node: no loop probe (the test steps the shedder), a 2 s interval (a
# heartbeat is recorded at most every second from a flood), WARN far off.
SHED_SETTINGS = {
    "shed_lag": 0,
    "heartbeat_interval": 2,
    "warn_after": 6,
    "expire_after": 8,
}
# The flood client's pace, s: four times its half interval, within max_frame_rate.
FLOOD_S = 0.25
FLOOD_PRIO, BEST_PRIO = 0, 9
# Heartbeats the node answers the flood in each phase: one per half interval at least.
ACKS_PER_PHASE = 2


async def shed_period(app: App, acks: Callable[[], int], timeout: float = 20) -> None:
    """With a session of ``BEST_PRIO`` and the flood client's (``FLOOD_PRIO``) held:
    shed the flood's class until it has left heartbeats unanswered and ``acks()`` (the
    flood client's ACKs) grew by :data:`ACKS_PER_PHASE`; then shed all the node can, its
    reading paused, for as long again; then serve every class again."""
    shedder, metrics = app.node.shedder, app.node.metrics
    await eventually(lambda: len(app.node.sessions) == 2, timeout, what="both sessions held")
    shedder.step_down(lag=1.0)
    assert shedder.shed_from == serving_rank(FLOOD_PRIO, warned=False)
    before = acks()
    await eventually(
        lambda: metrics.shed_heartbeats[FLOOD_PRIO] >= 4 and acks() >= before + ACKS_PER_PHASE,
        timeout,
        what="flood heartbeats left unanswered, and some answered",
    )
    shedder.step_down(lag=1.0)  # nothing more to shed: reading paused
    assert shedder.saturated
    before = acks()
    await eventually(
        lambda: metrics.shed_pauses >= 1 and acks() >= before + ACKS_PER_PHASE,
        timeout,
        what="the flood's reading paused, and heartbeats answered",
    )
    shedder.step_up()
    assert not shedder.active
