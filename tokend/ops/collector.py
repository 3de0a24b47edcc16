"""The cyclic garbage collector on the node's schedule: a short pass often, a whole one seldom.

CPython collects its oldest generation whenever the objects promoted into it since its
last whole pass reach a quarter of those it holds. A serving process's oldest
generation is its sessions' objects, and every new connection's objects are promoted
there after two young passes; so in a resume storm, or an overload that sheds clients
who come back, whole passes came often and each walked every session's objects while
the loop answered nobody (bench/results/2026-12-04-garbage-collector.md). A closed
connection leaves no cycle to collect
(:meth:`tokend.server.connection.Connection.connection_lost`): those passes found almost
nothing.

So, in ``tokend serve`` (:func:`tokend.ops.app.run`; never in a process that merely
imports tokend): CPython still collects the young generations as it always does, its
automatic whole pass is off, and :class:`Collector`, every ``gc_interval``, collects
what was promoted since its last pass (``gc.collect`` does not look at frozen objects)
and freezes what survived, which keeps each pass as short as the objects made since the
last one. A cycle among objects that had been frozen is found by the whole pass every
``gc_full_interval`` (everything unfrozen, collected, frozen again): until then it
stays, which the leak test of a closed connection (tests/test_collector.py) keeps to
nothing for what a connection makes.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable

from prometheus_client import Histogram

# gc's third threshold when the node collects the oldest generation itself: CPython's
# whole pass comes after this many passes of the second generation, i.e. never.
NEVER = 1 << 30


class Collector:
    """A node's garbage collection schedule (see the module)."""

    def __init__(
        self,
        interval: float,
        full_interval: float,
        seconds: Histogram | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self.full_interval = full_interval
        self.seconds = seconds  # each pass's duration, labelled recent or whole
        self.clock = clock
        self.next_full = clock() + full_interval

    def start(self) -> None:
        """The start-up objects (modules, settings, keys) frozen: no pass looks at them
        again; CPython's own whole pass off, unless ``gc_interval`` is 0."""
        gc.collect()
        gc.freeze()
        if self.interval:
            young, middle, _ = gc.get_threshold()
            gc.set_threshold(young, middle, NEVER)

    def collect(self) -> None:
        """One pass: of what was made since the last (``recent``), or of everything
        (``whole``, every ``full_interval``); what survives it is frozen."""
        now = self.clock()
        whole = bool(self.full_interval) and now >= self.next_full
        if whole:
            self.next_full = now + self.full_interval
            gc.unfreeze()
        began = time.perf_counter()
        gc.collect()
        gc.freeze()
        if self.seconds is not None:
            self.seconds.labels("whole" if whole else "recent").observe(time.perf_counter() - began)

    async def run(self, running: Callable[[], bool]) -> None:
        """A pass every ``interval`` while ``running()``; nothing if the interval is 0."""
        if not self.interval:
            return
        while running():
            await asyncio.sleep(self.interval)
            self.collect()
