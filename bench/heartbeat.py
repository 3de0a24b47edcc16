"""Scenario 1, heartbeat throughput and latency: N connections in a closed loop.

Each connection sends a heartbeat, waits for its ACK, sends the next. The same client
process and the same bytes go to (a) tokend (with its Redis) and (b) the bare
websockets + uvloop server of :mod:`bench.bare_server`. Reported: ACKs/s and the
p50/p99 round trip inside the measured window, after a warm-up, and the CPU of every
process involved over that window.

The same client also runs against (c) the Sans-I/O echo of :mod:`bench.bare_server`
(websockets' core on a plain asyncio.Protocol, as tokend drives it: the floor of its
design, reported beside the judged baseline (b)), and against the picows server: its
rate there is the load generator's ceiling, which must stay far above all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from bench.common import (
    BenchError,
    ClientPool,
    Context,
    Row,
    bare_server,
    client_pool,
    cpu_summary,
    latency_summary,
    open_all,
    ratio,
    redis_pid,
    redis_server,
    tokend_server,
)
from testkit.procs import CpuMeter

THROUGHPUT_TARGET = 1.0  # x bare ACKs/s
P99_TARGET = 1.0  # x bare p99


async def closed_loop(ctx: Context, pool: ClientPool, pids: dict[str, int]) -> dict[str, Any]:
    """Run the loop on an opened pool; ACKs/s, latency and CPU% over the window."""
    sizes = ctx.sizes
    meter = CpuMeter({**pids, "client": pool.pids[0]})

    async def window() -> dict[str, float]:
        await asyncio.sleep(sizes.warmup)
        meter.start()
        await asyncio.sleep(sizes.duration)
        return meter.stop()

    cpu = asyncio.create_task(window())
    [reply] = await pool.ask(
        "loop",
        timeout=sizes.warmup + sizes.duration + 30,
        warmup=sizes.warmup,
        duration=sizes.duration,
    )
    if reply["lost"] or reply["unfinished"]:
        raise BenchError(
            f"{pool.name}: {reply['lost']} connections closed and {reply['unfinished']} "
            "unanswered during the loop; see the server log"
        )
    return {
        "connections": sum(pool.counts),
        "rate": reply["acks"] / reply["window_s"],
        "acks": reply["acks"],
        "unfinished": reply["unfinished"],
        "lost": reply["lost"],
        # The heartbeats signed and masked before the loop (their CPU), and past them in it.
        "prebuild_cpu_s": reply["prebuild_cpu_s"],
        "built_live": reply["built_live"],
        "cpu_pct": await cpu,
        **latency_summary(reply["latencies_us"]),
    }


async def roundtrip(
    ctx: Context, name: str, url: str, proto: str, pids: dict[str, int]
) -> dict[str, Any]:
    """Open ``sizes.connections`` connections from one client process and loop.

    ``pids`` names the server processes whose CPU is reported (server first).
    """
    sizes = ctx.sizes
    tokens = None if proto == "socketio" else ctx.tokens(sizes.connections)
    async with client_pool(
        ctx, name, url=url, proto=proto, total=sizes.connections, procs=1, tokens=tokens
    ) as pool:
        await open_all(pool, sizes.concurrency)
        return await closed_loop(ctx, pool, pids)


async def tokend_figures(ctx: Context, *, tls: bool = False) -> dict[str, Any]:
    """tokend's closed loop (over TLS with ``tls``), measured once per repetition
    (Socket.IO and the TLS scenario compare with it)."""
    key = ("roundtrip", "tokend", tls)
    if key not in ctx.cache:
        with contextlib.ExitStack() as stack:
            redis = stack.enter_context(redis_server(ctx))
            # A closed loop sends far more than a client's real cadence (one per
            # heartbeat_interval): lift the per-connection frame rate limit.
            server = stack.enter_context(tokend_server(ctx, redis.url, tls=tls, max_frame_rate=0))
            pids = {"tokend": server.pid, "redis": redis_pid(redis)}
            ctx.cache[key] = await roundtrip(ctx, "tokend", server.url, "tokend", pids)
    result: dict[str, Any] = ctx.cache[key]
    return result


async def bare_figures(
    ctx: Context, impl: str = "websockets", *, tls: bool = False
) -> dict[str, Any]:
    """A bare server's closed loop (over TLS with ``tls``), measured once per repetition."""
    key = ("roundtrip", f"bare-{impl}", tls)
    if key not in ctx.cache:
        with bare_server(ctx, impl, tls=tls) as server:
            pids = {"bare": server.pid}
            ctx.cache[key] = await roundtrip(ctx, f"bare-{impl}", server.url, "bare", pids)
    result: dict[str, Any] = ctx.cache[key]
    return result


def describe(name: str, figures: dict[str, Any]) -> str:
    """One line: rate, latency, CPU of each process and the server's CPU per ACK."""
    return (
        f"{name}: {figures['rate']:,.0f} ACK/s, p50 {figures['p50_ms']:.2f} ms, "
        f"p99 {figures['p99_ms']:.2f} ms; " + cpu_summary(figures, "ACK")
    )


async def run(ctx: Context) -> list[Row]:
    ceiling = await bare_figures(ctx, "picows")
    bare = await bare_figures(ctx)
    floor = await bare_figures(ctx, "sansio")
    tokend = await tokend_figures(ctx)
    n = ctx.sizes.connections
    # A rate within half the client's ceiling may be the client's, not the server's.
    judged_bound = max(tokend["rate"], bare["rate"]) * 2 > ceiling["rate"]
    floor_bound = floor["rate"] * 2 > ceiling["rate"]
    rate_ratio = ratio(tokend["rate"], bare["rate"])
    p99_ratio = ratio(tokend["p99_ms"], bare["p99_ms"])
    details = {"tokend": tokend, "bare": bare, "sansio": floor, "client_ceiling": ceiling}
    note = " | ".join(
        [
            describe("tokend", tokend),
            describe("bare", bare),
            describe("sansio echo", floor),
            describe("client ceiling", ceiling),
        ]
    )
    return [
        Row(
            "heartbeat",
            f"ACKs/s, {n} conns" + (" (client-bound)" if judged_bound else ""),
            tokend["rate"],
            "/s",
            f">= {THROUGHPUT_TARGET}x bare",
            rate_ratio is not None and rate_ratio >= THROUGHPUT_TARGET,
            "bare",
            bare["rate"],
            rate_ratio,
            note,
            details,
        ),
        Row(
            "heartbeat",
            f"p99 ACK latency (p50 {tokend['p50_ms']:.2f} vs {bare['p50_ms']:.2f} ms)",
            tokend["p99_ms"],
            "ms",
            f"<= {P99_TARGET}x bare",
            p99_ratio is not None and p99_ratio <= P99_TARGET,
            "bare",
            bare["p99_ms"],
            p99_ratio,
        ),
        Row(
            "heartbeat",
            f"ACKs/s vs the Sans-I/O echo (the design's floor), {n} conns"
            # Within half the ceiling, the echo's rate is the client's: a lower bound
            # only, and no ratio is drawn from it.
            + (" (floor client-bound: no ratio)" if floor_bound else ""),
            tokend["rate"],
            "/s",
            "(reported)",
            None,
            "sansio",
            floor["rate"],
            None if floor_bound else ratio(tokend["rate"], floor["rate"]),
        ),
    ]
