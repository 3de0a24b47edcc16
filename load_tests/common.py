"""What soak.py and overload.py share: client source addresses, the embedded Redis of
the server under test, heartbeat figures, and how a run ends (report, JSON, status)."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from redis import asyncio as aioredis

from bench.common import Child, latency_summary
from tokend.ops.embedded import socket_url


def sources(count: int) -> list[str]:
    """Loopback source addresses, one per client process: 127.0.0.2, 127.0.0.3, ..."""
    return [f"127.0.{(2 + i) // 256}.{(2 + i) % 256}" for i in range(count)]


def pool_redis(server: Child) -> aioredis.Redis:
    """A client of the embedded Redis of ``server`` (its data directory's socket)."""
    return aioredis.from_url(socket_url(server.log.parent), decode_responses=True)


def merged(replies: Sequence[dict[str, Any]], key: str) -> dict[str, int]:
    """The load generators' counters under ``key``, summed."""
    total: Counter[str] = Counter()
    for reply in replies:
        total.update(reply[key])
    return dict(total)


def heartbeat_figures(replies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Heartbeats sent and ACKed, closes and ACK latency over the load generators' replies
    to ``soak``."""
    return {
        "sent": sum(r["sent"] for r in replies),
        "acks": sum(r["acks"] for r in replies),
        "closes": merged(replies, "closes"),
        "ack_latency": latency_summary([x for r in replies for x in r["latencies_us"]]),
        "client_loop_lag": client_loop_lag(replies),
    }


def client_loop_lag(replies: Sequence[dict[str, Any]]) -> dict[str, float]:
    """How late the load generators' own loops ran: p50/p99/max (ms) of the most each
    process was late in each second. An ACK is timed when its client's loop reads it, so
    a late client loop makes an ACK look that much slower."""
    return latency_summary([entry[3] for r in replies for entry in r["timeline"].values()])


TIMELINE_BUCKET_S = 5


def timeline(replies: Sequence[dict[str, Any]], since: float) -> list[dict[str, Any]]:
    """ACKs, those slower than 250 ms, the slowest, the load generators' own loop lag
    (the most of any process: an ACK read late by a busy client counts as slow), and
    resumes, in buckets of :data:`TIMELINE_BUCKET_S` seconds from ``since``
    (wall-clock): where a window's slow ACKs and its resumes fall."""
    rows: dict[int, dict[str, Any]] = {}

    def row(at: float) -> dict[str, Any]:
        start = int((at - since) // TIMELINE_BUCKET_S) * TIMELINE_BUCKET_S
        return rows.setdefault(
            start,
            {"t": start, "acks": 0, "slow": 0, "max_ms": 0.0, "client_lag_ms": 0.0, "resumed": 0},
        )

    for reply in replies:
        for second, (acks, slow, slowest_us, lag_us) in reply["timeline"].items():
            entry = row(int(second))
            entry["acks"] += acks
            entry["slow"] += slow
            entry["max_ms"] = max(entry["max_ms"], round(slowest_us / 1000, 1))
            entry["client_lag_ms"] = max(entry["client_lag_ms"], round(lag_us / 1000, 1))
        for tenth, resumed in reply["resumed_at"].items():
            row(int(tenth) / 10)["resumed"] += resumed
    return [rows[t] for t in sorted(rows)]


def latency_line(latency: dict[str, float], client_lag: dict[str, float] | None = None) -> str:
    """An ACK latency summary, and beside it how late the clients' loops ran, if given."""
    line = (
        f"p50 {latency['p50_ms']:.2f} ms, p99 {latency['p99_ms']:.2f} ms, "
        f"max {latency['max_ms']:.2f} ms"
    )
    if client_lag:
        line += (
            f" (client loop lag p99 {client_lag['p99_ms']:.0f} ms, "
            f"max {client_lag['max_ms']:.0f} ms)"
        )
    return line


@contextlib.contextmanager
def scratch(prefix: str, *, keep: bool = False) -> Iterator[Path]:
    """A temporary directory for everything a run starts (data, logs), removed at the end
    unless ``keep``: once it is gone, so is every process that ran in it."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield workdir
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


def finish(figures: dict[str, Any], problems: list[str], report: str, to: Path | None) -> int:
    """Print the report, write the figures (and problems) as JSON to ``to`` if given; the
    exit status: 0 when nothing failed."""
    print(report)
    if to:
        to.write_text(json.dumps({**figures, "problems": problems}, indent=2))
    return 1 if problems else 0
