"""Scenario ``drain``: N sessions heartbeating on one worker, then SIGTERM.

The clients hold ``drain_connections`` sessions (as many as one worker holds, up to
19,000) at a cadence of the drain period (10 s; 1,900 heartbeats a second at 19,000),
so that each beats once in the window before the signal (after a warm-up window) and
about half of them again while the drain closes the others. Measured: the ACK round
trip over the window before the signal (the unloaded figure) and from the signal until
the last connection is closed (the heartbeats of the connections not yet closed), and
the seconds from SIGTERM to the exit of ``tokend serve``. Targets (issue 20.3): ACK p99
during the drain within 4x the unloaded p99; drain + exit within ``drain_period`` + 5 s.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

from bench.common import (
    BenchError,
    Context,
    Row,
    client_pool,
    latency_summary,
    open_all,
    ratio,
    redis_server,
    tokend_server,
)

DRAIN_PERIOD_S = 10.0
# The cadence: every session beats once in the window before the signal, and again
# (2 s of the soak's grace later) in the drain, about half of them before their close.
CADENCE_S = DRAIN_PERIOD_S
P99_TARGET = 4.0  # x the p99 before the drain
EXIT_MARGIN_S = 5.0  # drain + exit within drain_period + this


async def soak(pool: Any, interval: float, duration: float) -> dict[str, Any]:
    """Heartbeats at ``interval`` for ``duration``; ACK latency and closes, merged."""
    replies = await pool.ask("soak", timeout=duration + 60, interval=interval, duration=duration)
    closes: dict[str, int] = {}
    for reply in replies:
        for code, count in reply["closes"].items():
            closes[code] = closes.get(code, 0) + count
    return {
        "acks": sum(r["acks"] for r in replies),
        "closes": closes,
        **latency_summary([x for r in replies for x in r["latencies_us"]]),
    }


async def run(ctx: Context) -> list[Row]:
    sizes = ctx.sizes
    n, period = sizes.drain_connections, DRAIN_PERIOD_S
    interval = CADENCE_S
    with redis_server(ctx) as store:
        server = tokend_server(
            ctx,
            store.url,
            drain_period=period,
            heartbeat_interval=interval,
        )
        with server as tokend:
            async with client_pool(
                ctx,
                "tokend",
                url=tokend.url,
                proto="tokend",
                total=n,
                procs=sizes.clients,
                tokens=ctx.tokens(n),
            ) as pool:
                opened = await open_all(pool, sizes.concurrency, retry_for=60.0)
                await soak(pool, interval, interval)  # warm-up: the opening's tail settles
                before = await soak(pool, interval, interval)
                process = tokend.process
                assert process is not None
                during_task = asyncio.create_task(soak(pool, interval, period + EXIT_MARGIN_S))
                await asyncio.sleep(0.2)  # the soak's first heartbeats are out
                signalled = time.monotonic()
                process.send_signal(signal.SIGTERM)
                code = await asyncio.to_thread(process.wait, period + 60)
                drained_s = time.monotonic() - signalled
                during = await during_task
    if code != 0:
        raise BenchError(f"tokend exited with {code} after SIGTERM; see its log")
    going_away = during["closes"].get("1001", 0)
    p99_ratio = ratio(during["p99_ms"], before["p99_ms"])
    note = (
        f"{n:,} sessions opened in {opened['seconds']:.1f} s; cadence {interval:g} s; "
        f"before: {before['acks']:,} ACKs, p50 {before['p50_ms']:.2f} ms, "
        f"p99 {before['p99_ms']:.2f} ms; during the drain: {during['acks']:,} ACKs, "
        f"p50 {during['p50_ms']:.2f} ms, p99 {during['p99_ms']:.2f} ms, "
        f"max {during['max_ms']:.1f} ms; closes {during['closes']} "
        f"({going_away:,} of {n:,} with 1001); drain + exit {drained_s:.2f} s"
    )
    details = {"opened": opened, "before": before, "during": during, "drain_exit_s": drained_s}
    return [
        Row(
            "drain",
            f"ACK p99 during the drain, {n:,} conns (p50 {during['p50_ms']:.2f} ms)",
            during["p99_ms"],
            "ms",
            f"<= {P99_TARGET:g}x before",
            p99_ratio is not None and p99_ratio <= P99_TARGET,
            "before the drain",
            before["p99_ms"],
            p99_ratio,
            note,
            details,
        ),
        Row(
            "drain",
            f"drain + exit, drain_period {period:g} s",
            drained_s,
            "s",
            f"<= {period + EXIT_MARGIN_S:g} s",
            drained_s <= period + EXIT_MARGIN_S,
        ),
    ]
