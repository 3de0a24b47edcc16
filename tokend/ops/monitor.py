"""A node's look at itself and at the store, for the dashboard, the admin API and /metrics.

Once a :data:`STEP` the :class:`Monitor` of a node pings Redis (reachable, latency), reads
the store's state counts (sessions of every node by state, sessions ended: exact, from the
counts the scripts keep; tokend.store.queries.Queries.counts), asks the node's readiness,
reads the event loop's lateness and the open files, and publishes its **view** of the node
to the store, where every other node's admin API finds it (tokend.store.nodes).

Every ``history_interval`` (on the wall clock's multiples of it, so that nodes sample
together) it keeps a **sample**: what happened since the last one (heartbeats, renewals,
expiries, closes by code, refusals by code; sessions ended in the cluster, by reason) and
the levels at its end (connections, sessions held by state; sessions of the cluster by
state). It keeps ``history_span`` of them in memory, bounded, and in the store (for the
other nodes' pages), so that a page shows the last minutes from its first load.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import resource
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any

import structlog
from redis.exceptions import RedisError

from tokend.core.lifecycle import shed_classes
from tokend.metrics import ENDED, Looked, Metrics
from tokend.server import health
from tokend.server.admission import Admission
from tokend.server.node import Node
from tokend.store.nodes import NodeBoard, Sample, View
from tokend.store.queries import Counts
from tokend.store.unavailable import StoreUnavailable

log = structlog.get_logger("tokend.monitor")

# Seconds between two looks of a node at itself; its view in the store outlives a look by
# VIEW_TTL_S, so a node that stopped (or was killed) drops off the list within that.
STEP = 1.0
VIEW_TTL_S = 5.0
# The event loop's lateness is sampled by a timer this often.
LAG_TICK = 0.05
# Seconds between two counts of the open descriptors: listing /proc/self/fd costs the
# kernel about half a microsecond a descriptor, ~9 ms for a worker holding 19,000
# connections (1 % of a core if counted at every look).
OPEN_FILES_EVERY = 10.0
STATES = ("ACTIVE", "WARN")


class LoopLag:
    """How late the event loop runs a timer: sampled every :data:`LAG_TICK`, taken as the
    mean and the worst since the last :meth:`take`."""

    def __init__(self) -> None:
        self.total = self.worst = 0.0
        self.samples = 0

    async def run(self, running: Callable[[], bool]) -> None:
        loop = asyncio.get_running_loop()
        while running():
            expected = loop.time() + LAG_TICK
            await asyncio.sleep(LAG_TICK)
            late = max(0.0, loop.time() - expected)
            self.total += late
            self.worst = max(self.worst, late)
            self.samples += 1

    def take(self) -> tuple[float, float]:
        """Mean and worst lateness (seconds) since the last take."""
        mean = self.total / self.samples if self.samples else 0.0
        worst = self.worst
        self.total = self.worst = 0.0
        self.samples = 0
        return mean, worst


def open_files() -> int | None:
    """Descriptors this process has open (Linux: /proc/self/fd; None elsewhere)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself held
    except OSError:
        return None


class Totals:
    """A node's running counts at one moment, to take the difference of two."""

    def __init__(self, metrics: Metrics) -> None:
        self.heartbeats = metrics.acked_heartbeats
        self.renewals = metrics.renewals
        self.expiries = metrics.expiries.total()
        self.closes = Counter(metrics.close_codes)
        self.refusals: Counter[int] = Counter()
        for (code, _), count in metrics.refusals.items():
            self.refusals[code] += count

    def since(self, before: Totals) -> dict[str, Any]:
        return {
            "heartbeats": self.heartbeats - before.heartbeats,
            "renewals": self.renewals - before.renewals,
            "expiries": self.expiries - before.expiries,
            "closes": _positive(self.closes - before.closes),
            "refused": _positive(self.refusals - before.refusals),
        }


def _positive(counts: Counter[int]) -> dict[str, int]:
    return {str(key): n for key, n in sorted(counts.items()) if n > 0}


def ended_since(now: dict[str, int], before: dict[str, int] | None) -> dict[str, int] | None:
    """Sessions ended between two readings of the store's counts. A count that went down
    started again (a Redis that lost its data): all of it is new, as with a counter reset
    in Prometheus. None without an earlier reading."""
    if before is None:
        return None
    return {how: now[how] - before[how] if now[how] >= before[how] else now[how] for how in ENDED}


def merged(histories: Iterable[list[Sample]], interval_ms: int) -> list[Sample]:
    """The histories of several nodes as one: the samples of one moment (each node samples
    on the wall clock's multiples of the interval) added up, node by node. What is the
    cluster's (its sessions by state, the sessions it ended) is the same in each node's
    sample: taken once."""
    by_moment: dict[int, Sample] = {}
    for samples in histories:
        for sample in samples:
            moment = round(sample["at"] / interval_ms)
            into = by_moment.get(moment)
            if into is None:
                by_moment[moment] = {
                    **sample,
                    "at": moment * interval_ms,
                    "closes": dict(sample["closes"]),
                    "refused": dict(sample["refused"]),
                    "held": dict(sample["held"]),
                    "nodes": 1,
                }
                continue
            into["nodes"] += 1
            for field in ("heartbeats", "renewals", "expiries", "connections"):
                into[field] += sample[field]
            for field in ("closes", "refused", "held"):
                for key, n in sample[field].items():
                    into[field][key] = into[field].get(key, 0) + n
            for field in ("sessions", "ended"):
                if into[field] is None:
                    into[field] = sample[field]
    return [by_moment[moment] for moment in sorted(by_moment)]


class Monitor:
    """A node's looks at itself (every :data:`STEP`) and its history (module docstring)."""

    def __init__(self, node: Node, admission: Admission) -> None:
        self.node = node
        self.admission = admission
        self.metrics = node.metrics
        settings = node.settings
        self.interval = settings.history_interval
        self.keep = max(1, math.ceil(settings.history_span / self.interval))
        self.samples: deque[Sample] = deque(maxlen=self.keep)
        self.board = NodeBoard(node.redis, node.store.keys, node.store.deadline)
        self.lag = LoopLag()
        self.looked = Looked()
        self.metrics.looked = self.looked
        shedder = node.shedder
        self.metrics.shedding = lambda: (shedder.active, shedder.saturated)
        self.counts: Counts | None = None  # the last counts read, and when (unix ms)
        self.counts_at = 0
        self.redis_error = "not asked yet"
        self.problems: dict[str, Any] = {"node": "starting"}
        self.open_files: int | None = None
        self._open_files_due = -math.inf  # time.monotonic() of the next count
        self._totals = Totals(self.metrics)
        self._ended: dict[str, int] | None = None  # the counts at the last sample
        self._last: Sample | None = None

    @property
    def interval_ms(self) -> int:
        return round(self.interval * 1000)

    async def run(self, running: Callable[[], bool]) -> None:
        """Look every :data:`STEP` and sample every ``history_interval`` while ``running()``."""
        lag = asyncio.create_task(self.lag.run(running), name="loop lag")
        # A node restarted under its name goes on with the history it left in the store.
        with contextlib.suppress(StoreUnavailable, RedisError):
            self.samples.extend(await self.board.history(self.node.name))
        try:
            next_look = next_sample = 0.0
            while running():
                now = time.time()
                if now >= next_look:
                    await self._guarded(self.look)
                    next_look = now + STEP
                if now >= next_sample:
                    if next_sample:  # the first boundary starts the first interval
                        await self._guarded(self.sample)
                    else:
                        self._totals = Totals(self.metrics)
                    next_sample = (math.floor(now / self.interval) + 1) * self.interval
                await asyncio.sleep(max(0.0, min(next_look, next_sample) - time.time()))
        finally:
            lag.cancel()

    async def _guarded(self, step: Callable[[], Any]) -> None:
        try:
            await step()
        except Exception:  # a bug here must not end the node's view of itself
            log.exception("monitor step failed", step=step.__name__)

    # A look: every STEP

    async def look(self) -> None:
        looked = self.looked
        started = time.perf_counter()
        try:
            await self.node.store.deadline(self.node.redis.ping)
        except (StoreUnavailable, RedisError) as exc:
            looked.redis_up = False
            self.redis_error = str(exc) or type(exc).__name__
        else:
            looked.redis_up = True
            looked.redis_seconds = time.perf_counter() - started
            self.redis_error = ""
        if looked.redis_up:
            await self.read_counts()
        answer = await health.readiness(self.node, self.admission.draining)
        looked.ready = answer.status == 200
        self.problems = {k: v for k, v in answer.body.items() if k != "status"}
        looked.loop_lag, looked.loop_lag_max = self.lag.take()
        if time.monotonic() >= self._open_files_due:
            self._open_files_due = time.monotonic() + OPEN_FILES_EVERY
            self.open_files = await asyncio.to_thread(open_files)
        if looked.redis_up:
            # Redis gone meanwhile: the next look's PING tells.
            with contextlib.suppress(StoreUnavailable, RedisError):
                await self.board.publish(self.node.name, self.view(), round(VIEW_TTL_S * 1000))

    async def read_counts(self) -> Counts | None:
        """The store's state counts, read now; None when Redis does not answer (the
        gauges of /metrics then drop them; ``counts`` keeps the last read, ``counts_at``
        says when)."""
        try:
            counts = await self.node.store.queries.counts()
        except (StoreUnavailable, RedisError):
            self.looked.cluster_ended = None
            return None
        self.counts, self.counts_at = counts, int(time.time() * 1000)
        looked = self.looked
        looked.cluster_active, looked.cluster_warn = counts.active, counts.warn
        looked.cluster_ended = counts.ended
        return counts

    # A sample: every history_interval

    async def sample(self) -> None:
        totals = Totals(self.metrics)
        counts = await self.read_counts() if self.looked.redis_up else None
        held = self.metrics.sessions_by_state()
        sample: Sample = {
            "at": round(time.time() / self.interval) * self.interval_ms,
            **totals.since(self._totals),
            "connections": self.metrics.connections(),
            "held": {state: held.get(state, 0) for state in STATES},
            "sessions": None,
            "ended": None,
        }
        if counts is not None:
            sample["sessions"] = {"ACTIVE": counts.active, "WARN": counts.warn}
            sample["ended"] = ended_since(counts.ended, self._ended)
            self._ended = counts.ended
        self._totals = totals
        self.samples.append(sample)
        self._last = sample
        if self.looked.redis_up:
            with contextlib.suppress(StoreUnavailable, RedisError):
                await self.board.record(
                    self.node.name,
                    sample,
                    self.keep,
                    round(self.interval * self.keep * 1000),
                )

    # What the admin API answers

    def view(self) -> View:
        """This node as its page (and every other node's) shows it."""
        node, metrics, looked = self.node, self.metrics, self.looked
        held = metrics.sessions_by_state()
        shedding, refusing = metrics.shedding()
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        stages = {s: w.summary() for s, w in metrics.stage_windows.items()}
        scripts = {s: w.summary() for s, w in sorted(metrics.redis_windows.items())}
        refused: dict[str, dict[str, int]] = {}
        for (code, reason), count in sorted(metrics.refusals.items()):
            refused.setdefault(str(code), {})[reason] = count
        last = self._last
        per_second = 1 / self.interval
        return {
            "node": node.name,
            "at": int(time.time() * 1000),
            "ready": looked.ready,
            "problems": self.problems,
            "connections": metrics.connections(),
            "held": {state: held.get(state, 0) for state in STATES},
            "heartbeats_total": metrics.acked_heartbeats,
            "renewals_total": metrics.renewals,
            "expiries_total": dict(metrics.expiries),
            "close_codes": {str(code): n for code, n in sorted(metrics.close_codes.items())},
            "refused": refused,
            "history_interval": self.interval,
            "rates": {
                "heartbeats": last["heartbeats"] * per_second,
                "renewals": last["renewals"] * per_second,
                "expiries": last["expiries"] * per_second,
                "closes": {code: n * per_second for code, n in last["closes"].items()},
            }
            if last
            else None,
            "redis": {
                "reachable": looked.redis_up,
                "latency_ms": round(looked.redis_seconds * 1000, 3) if looked.redis_up else None,
                "error": self.redis_error,
            },
            "shedding": {
                "active": shedding,
                "classes": shed_classes(node.shedder.shed_from),
                "refusing_handshakes": refusing,
            },
            "loop_lag_ms": {
                "mean": round(looked.loop_lag * 1000, 3),
                "max": round(looked.loop_lag_max * 1000, 3),
            },
            "open_files": {
                "open": self.open_files,
                "limit": None if soft == resource.RLIM_INFINITY else soft,
                "connection_cap": min(self.admission.max_open_connections, 1 << 31),
            },
            "heartbeat_stage_ms": stages,
            "redis_ms": scripts,
            "store_stage": self._store_stage(stages, scripts),
        }

    def _store_stage(
        self, stages: dict[str, dict[str, Any]], scripts: dict[str, dict[str, Any]]
    ) -> dict[str, Any]:
        """The heartbeat's store stage split: the heartbeat script's round trip, and the
        rest (the gather's wait, up to heartbeat_gather, and the wait for a lane)."""
        gather_ms = round(self.node.settings.heartbeat_gather * 1000, 3)
        script = scripts.get("heartbeat")
        if not (stages["store"]["count"] and script):  # nothing timed yet
            return {"gather_ms": gather_ms, "store_p50_ms": None, "script_p50_ms": None,
                    "wait_p50_ms": None}  # fmt: skip
        store = stages["store"]["p50"]
        return {
            "gather_ms": gather_ms,
            "store_p50_ms": store,
            "script_p50_ms": script["p50"],
            "wait_p50_ms": round(max(0.0, store - script["p50"]), 3),
        }

    async def stats(self) -> dict[str, Any]:
        """``GET /v1/stats``: this node's view and the cluster's counts, read now (when
        Redis does not answer: the last read, ``fresh`` false)."""
        fresh = await self.read_counts()
        counts = fresh or self.counts
        cluster: dict[str, Any] = {"sessions": None, "ended": None, "at": None, "fresh": False}
        if counts is not None:
            cluster = {**counts.as_json(), "at": self.counts_at, "fresh": fresh is not None}
        return {**self.view(), "cluster": cluster}

    async def nodes(self) -> list[View]:
        """The views of every node sharing the store, this one's read now; only this one's
        when Redis does not answer."""
        try:
            others = [v for v in await self.board.views() if v["node"] != self.node.name]
        except (StoreUnavailable, RedisError):
            others = []
        return sorted([self.view(), *others], key=lambda view: str(view["node"]))

    async def history(self, node: str, after: int) -> list[Sample]:
        """The samples after ``after`` (unix ms) of ``node``: this one's from memory,
        another's from the store; ``"all"`` for every node's added up (:func:`merged`).
        Raises StoreUnavailable for another node's while Redis does not answer."""
        if node == self.node.name:
            samples = list(self.samples)
        elif node == "all":
            stored = await self.board.histories()
            stored[self.node.name] = list(self.samples)
            samples = merged(stored.values(), self.interval_ms)
        else:
            samples = await self.board.history(node)
        return [s for s in samples if s["at"] > after]
