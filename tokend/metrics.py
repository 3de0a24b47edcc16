"""A node's metrics: Prometheus exposition and the dashboard's rolling percentiles.

Every :class:`Metrics` has its own ``CollectorRegistry`` (tests run many nodes in
one process; the global registry would refuse the second). Names and labels are
listed in docs/operations.md.

Hot-path cost is kept low: counters are plain ints read at scrape time, and the
per-stage heartbeat timings go into the histograms for one heartbeat in
:data:`STAGE_SAMPLE_EVERY` (an observation takes a lock; four per heartbeat would be a
visible share of a heartbeat's CPU).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

STAGES = ("decode", "verify", "store", "send")
# One heartbeat in this many has its stage timings recorded.
STAGE_SAMPLE_EVERY = 16
# Recent samples behind the dashboard's p50/p95 (per stage, per script).
WINDOW = 512
# Seconds; heartbeat stages run from microseconds (decode) to a Redis round trip.
LATENCY_BUCKETS = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
CONTENT_TYPE = CONTENT_TYPE_LATEST
# Connections refused, by (code, reason): HTTP 429 or 503 instead of the WebSocket
# handshake, close 4029 after it. Each is exported from 0, so that a rate has a start.
REFUSALS = (
    (429, "per_ip"),
    (503, "shedding"),
    (503, "penalty"),
    (503, "open_files"),
    (503, "pending_hellos"),
    (4029, "too_many_sessions"),
    (4029, "too_many_frames"),
    (4029, "too_many_pings"),
)
RATE_LIMITED = 4029
# The values of the other labelled counters: expiry reasons (tokend.core.lifecycle's
# ExpiryReason), token prios (tokend.core.claims.PRIO_RANGE), why a connection was dropped,
# how a TLS reload ended.
EXPIRY_REASONS = ("heartbeat_timeout", "token_expired")
PRIOS = range(10)
DROP_REASONS = ("not_reading",)
TLS_RELOAD_RESULTS = ("ok", "failed")
# How sessions end, as the store counts them (tokend.core.store_messages.Ended's values).
ENDED = ("expired", "revoked", "closed")


@dataclass(slots=True)
class Looked:
    """What a node's monitor (tokend.ops.monitor) found at its last look, once a second:
    exported as gauges. ``cluster`` is None while the store's counts cannot be read."""

    redis_up: bool = False
    redis_seconds: float = 0.0  # one PING's round trip
    ready: bool = False
    loop_lag: float = 0.0  # mean lateness of a timer over the last look's second
    loop_lag_max: float = 0.0
    cluster_active: int = 0
    cluster_warn: int = 0
    cluster_ended: dict[str, int] | None = None


class Window:
    """The last :data:`WINDOW` samples of one latency, for percentiles on demand."""

    __slots__ = ("samples",)

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=WINDOW)

    def summary(self) -> dict[str, float | int]:
        """p50 and p95 in milliseconds (nearest rank) and the sample count."""
        ordered = sorted(self.samples)
        if not ordered:
            return {"p50": 0.0, "p95": 0.0, "count": 0}

        def rank(q: float) -> float:
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3)

        return {"p50": rank(0.5), "p95": rank(0.95), "count": len(ordered)}


class Metrics:
    """Counters, histograms and windows of one node; the node and server feed it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.redis_seconds = Histogram(
            "tokend_redis_call_seconds",
            "Redis round trip of one script call (a pipeline of them counts once).",
            ["script"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.stage_seconds = Histogram(
            "tokend_heartbeat_stage_seconds",
            f"Time of one heartbeat stage (one heartbeat in {STAGE_SAMPLE_EVERY} sampled).",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.gc_seconds = Histogram(
            "tokend_gc_pass_seconds",
            "One garbage collection pass of the serving process (tokend.ops.collector): of the "
            "objects made since the last (recent) or of every object (whole).",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._stage_children = [self.stage_seconds.labels(stage) for stage in STAGES]
        self.stage_windows = {stage: Window() for stage in STAGES}
        self._stage_window_list = [self.stage_windows[stage] for stage in STAGES]
        self.redis_windows: dict[str, Window] = {}
        self._redis_observed: dict[str, tuple[Histogram, Window]] = {}
        self.acked_heartbeats = 0
        # Messages until the next one sampled for the stage timings (SessionLink.message
        # counts it down in place: one call less per heartbeat).
        self.until_sample = STAGE_SAMPLE_EVERY
        self.renewals = 0
        # The labelled counters start at 0 for each value they know (EXPIRY_REASONS...),
        # so that a rate has a start and a dashboard finds every series.
        self.expiries: Counter[str] = Counter(dict.fromkeys(EXPIRY_REASONS, 0))
        self.close_codes: Counter[int] = Counter()
        # Connections dropped without a close frame (none could reach the client), by why.
        self.dropped: Counter[str] = Counter(dict.fromkeys(DROP_REASONS, 0))
        # Load shed (tokend.server.shedding): sessions refused with 1013 by token prio, and
        # handshakes refused with 503 meanwhile.
        self.shed: Counter[int] = Counter(dict.fromkeys(PRIOS, 0))
        self.shed_handshakes = 0
        # Heartbeats left unanswered while shedding (spec revision 3), by token prio; and
        # connections whose reading was paused for it (shed_pause).
        self.shed_heartbeats: Counter[int] = Counter(dict.fromkeys(PRIOS, 0))
        self.shed_pauses = 0
        # Connections refused (REFUSALS), by (code, reason).
        self.refusals: Counter[tuple[int, str]] = Counter(dict.fromkeys(REFUSALS, 0))
        # TLS certificate reloads by result (ok, failed) and whether the files on disk
        # failed to load last, so that the previous certificate is still served.
        self.tls_reloads: Counter[str] = Counter(dict.fromkeys(TLS_RELOAD_RESULTS, 0))
        self.tls_failing = False
        # A rolling reload's handoff (tokend.server.handoff): connections this worker
        # handed to its slot's new worker, those that fell back to a close (1001) by
        # reason, and those it took from an old worker.
        self.handoff_moved = 0
        self.handoff_fell_back: Counter[str] = Counter()
        self.handoff_taken = 0
        # Filled in by the node and the server: live values read at scrape time.
        self.sessions_by_state: Callable[[], dict[str, int]] = dict
        self.connections: Callable[[], int] = int
        # Set by the node's monitor; None until its first look.
        self.looked: Looked | None = None
        # Shedding: whether some class is shed, and whether handshakes are refused too.
        self.shedding: Callable[[], tuple[bool, bool]] = _not_shedding
        self.registry.register(_LiveCollector(self))

    def stages(self, marks: Sequence[float]) -> None:
        """A sampled heartbeat's ``time.perf_counter()`` readings: received, decoded,
        verified, stored, sent (the ends of the stages of :data:`STAGES`)."""
        for i, (child, window) in enumerate(
            zip(self._stage_children, self._stage_window_list, strict=True)
        ):
            took = marks[i + 1] - marks[i]
            child.observe(took)
            window.samples.append(took)

    def redis_call(self, script: str, seconds: float) -> None:
        observed = self._redis_observed.get(script)
        if observed is None:
            # labels() takes a lock and builds a key: once per script, not once per call.
            window = self.redis_windows[script] = Window()
            observed = self._redis_observed[script] = (self.redis_seconds.labels(script), window)
        observed[0].observe(seconds)
        observed[1].samples.append(seconds)

    def expired(self, reason: str) -> None:
        self.expiries[reason] += 1

    def closed(self, code: int, reason: str = "") -> None:
        self.close_codes[code] += 1
        if code == RATE_LIMITED:
            self.refusals[code, reason] += 1

    def refused(self, code: int, reason: str) -> None:
        """A connection refused: HTTP ``code`` (429, 503) instead of its handshake."""
        self.refusals[code, reason] += 1

    def exposition(self) -> bytes:
        """The Prometheus text format of everything (serve with :data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)


class _LiveCollector(Collector):
    """The plain-int counters and the live gauges, read when scraped."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        sessions = GaugeMetricFamily(
            "tokend_sessions", "Sessions held by this node, by state.", labels=["state"]
        )
        by_state = m.sessions_by_state()
        for state in ("ACTIVE", "WARN"):
            sessions.add_metric([state], by_state.get(state, 0))
        yield sessions
        yield GaugeMetricFamily(
            "tokend_connections", "Open WebSocket connections.", value=m.connections()
        )
        yield CounterMetricFamily(
            "tokend_heartbeats", "Heartbeats stored and acknowledged.", value=m.acked_heartbeats
        )
        yield CounterMetricFamily(
            "tokend_renewals", "Tokens renewed by a heartbeat.", value=m.renewals
        )
        yield _labelled(
            "tokend_expiries", "Sessions this node's sweeper expired.", "reason", m.expiries.items()
        )
        yield _labelled(
            "tokend_close_codes",
            "WebSocket close codes sent.",
            "code",
            ((str(code), n) for code, n in m.close_codes.items()),
        )
        yield _labelled(
            "tokend_shed",
            "Heartbeats and HELLOs refused with 1013 under overload, by token prio.",
            "prio",
            ((str(prio), n) for prio, n in m.shed.items()),
        )
        yield _labelled(
            "tokend_shed_heartbeats",
            "Heartbeats checked and left unanswered under overload, by token prio.",
            "prio",
            ((str(prio), n) for prio, n in m.shed_heartbeats.items()),
        )
        yield CounterMetricFamily(
            "tokend_shed_pauses",
            "Connections whose reading paused (shed_pause) under overload.",
            value=m.shed_pauses,
        )
        yield CounterMetricFamily(
            "tokend_shed_handshakes",
            "Handshakes (503) and HELLOs (1013) refused while shedding or a shed penalty held.",
            value=m.shed_handshakes,
        )
        yield _labelled(
            "tokend_tls_reloads",
            "TLS certificate reloads after its files changed, by result.",
            "result",
            m.tls_reloads.items(),
        )
        yield GaugeMetricFamily(
            "tokend_tls_reload_failing",
            "1 while the TLS files on disk do not load and the previous certificate is served.",
            value=int(m.tls_failing),
        )
        yield CounterMetricFamily(
            "tokend_handoff_moved",
            "Connections handed to the slot's new worker in a rolling reload.",
            value=m.handoff_moved,
        )
        yield _labelled(
            "tokend_handoff_fell_back",
            "Connections a rolling reload could not hand over (closed with 1001), by reason.",
            "reason",
            m.handoff_fell_back.items(),
        )
        yield CounterMetricFamily(
            "tokend_handoff_taken",
            "Connections taken from the slot's old worker in a rolling reload.",
            value=m.handoff_taken,
        )
        yield _labelled(
            "tokend_dropped_connections",
            "Connections dropped without a close frame.",
            "reason",
            m.dropped.items(),
        )
        refused = CounterMetricFamily(
            "tokend_refused",
            "Connections refused: HTTP 429 or 503 instead of the handshake, close 4029 after it.",
            labels=["code", "reason"],
        )
        for (code, reason), count in sorted(m.refusals.items()):
            refused.add_metric([str(code), reason], count)
        yield refused
        shedding, refusing = m.shedding()
        yield GaugeMetricFamily(
            "tokend_shedding", "1 while the node sheds a class of sessions.", value=int(shedding)
        )
        yield GaugeMetricFamily(
            "tokend_shedding_handshakes",
            "1 while the node sheds every class but its best and refuses new handshakes (503).",
            value=int(refusing),
        )
        if m.looked is not None:
            yield from _looked(m.looked)


def _looked(looked: Looked) -> Iterator[Metric]:
    """The gauges of the monitor's last look (tokend.ops.monitor)."""
    yield GaugeMetricFamily(
        "tokend_redis_up", "1 when Redis answered the last PING.", value=int(looked.redis_up)
    )
    yield GaugeMetricFamily(
        "tokend_redis_ping_seconds",
        "Round trip of the last PING to Redis (while it answers).",
        value=looked.redis_seconds,
    )
    yield GaugeMetricFamily("tokend_ready", "1 while /readyz answers 200.", value=int(looked.ready))
    lag = GaugeMetricFamily(
        "tokend_event_loop_lag_seconds",
        "How late the event loop ran a timer over the last second: mean and max.",
        labels=["stat"],
    )
    lag.add_metric(["mean"], looked.loop_lag)
    lag.add_metric(["max"], looked.loop_lag_max)
    yield lag
    if looked.cluster_ended is None:
        return  # the store's counts could not be read: no stale value is exported
    sessions = GaugeMetricFamily(
        "tokend_cluster_sessions",
        "Sessions of every node by state, connected or not, from the store (every node "
        "reports the same: aggregate with max, not sum).",
        labels=["state"],
    )
    sessions.add_metric(["ACTIVE"], looked.cluster_active)
    sessions.add_metric(["WARN"], looked.cluster_warn)
    yield sessions
    yield _labelled(
        "tokend_cluster_ended",
        "Sessions of every node ended since the store began, by reason, from the store "
        "(every node reports the same: aggregate with max, not sum).",
        "reason",
        looked.cluster_ended.items(),
    )


def _not_shedding() -> tuple[bool, bool]:
    return False, False


def _labelled(
    name: str, documentation: str, label: str, values: Iterable[tuple[str, int]]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=[label])
    for value, count in sorted(values):
        family.add_metric([value], count)
    return family
