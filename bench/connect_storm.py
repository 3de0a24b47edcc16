"""Scenario 5, connect storm: sessions opened per second.

Several client processes open connections as fast as they can with a fixed number in
flight each, and keep them open. For tokend an opened session is handshake + HELLO +
token verification + the HELLO script in Redis + WELCOME. The bare websockets server
gets the same handshake and the same HELLO, checks the token's Ed25519 signature (the
work no server can skip; ~86 us here, most of a session's cost) and answers with a
WELCOME-sized frame, so the ratio isolates what else tokend does per session. The same
clients against the picows server of :mod:`bench.bare_server` give the load
generator's own ceiling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from bench.common import (
    Child,
    ClientPool,
    Context,
    Row,
    bare_server,
    client_pool,
    cpu_summary,
    open_all,
    ratio,
    redis_pid,
    redis_server,
    tokend_server,
)
from testkit.procs import CpuMeter

RATE_TARGET = 1.0  # x bare handshake + HELLO with its signature checked


def session_pool(
    ctx: Context, proto: str, server: Child
) -> contextlib.AbstractAsyncContextManager[ClientPool]:
    """The storm's clients: ``connects`` sessions (``proto`` tokend or bare) over
    ``clients`` processes."""
    sizes = ctx.sizes
    return client_pool(
        ctx,
        proto,
        url=server.url,
        proto=proto,
        total=sizes.connects,
        procs=sizes.clients,
        tokens=ctx.tokens(sizes.connects),
    )


async def storm(ctx: Context, proto: str, server: Child, pids: dict[str, int]) -> dict[str, Any]:
    """Open ``sizes.connects`` sessions (``proto`` tokend or bare); rate, latency, CPU."""
    sizes = ctx.sizes
    async with session_pool(ctx, proto, server) as pool:
        meter = CpuMeter({proto: server.pid, **pids})
        meter.start()
        figures = await open_all(pool, sizes.concurrency)
        cpu = meter.stop()
    cpu["clients"] = round(100 * figures["client_cpu_s"] / figures["seconds"], 1)
    return {**figures, "cpu_pct": cpu}


Storm = Callable[[Context, str, Child, dict[str, int]], Awaitable[dict[str, Any]]]


async def figures(
    ctx: Context, server: str, *, tls: bool = False, measure: Storm = storm
) -> dict[str, Any]:
    """The storm (``measure``: this module's, or bench.resume's) against ``server``
    (tokend, bare: the websockets server verifying each HELLO, or picows: the clients'
    ceiling), over TLS with ``tls``; measured once per repetition."""
    key = (measure.__module__, server, tls)
    if key not in ctx.cache:
        with contextlib.ExitStack() as stack:
            if server == "tokend":
                store = stack.enter_context(redis_server(ctx))
                child = stack.enter_context(tokend_server(ctx, store.url, tls=tls))
                ctx.cache[key] = await measure(ctx, "tokend", child, {"redis": redis_pid(store)})
            else:
                impl = "picows" if server == "picows" else "websockets"
                child = stack.enter_context(
                    bare_server(ctx, impl, verify=server == "bare", tls=tls)
                )
                ctx.cache[key] = await measure(ctx, "bare", child, {})
    result: dict[str, Any] = ctx.cache[key]
    return result


def describe(name: str, figures: dict[str, Any], unit: str = "session") -> str:
    """One line: sessions, time, latency, CPU of each process, server CPU per ``unit``."""
    return (
        f"{name}: {figures['opened']:,} in {figures['seconds']:.2f} s, connect p50 "
        f"{figures['p50_ms']:.1f} ms, p99 {figures['p99_ms']:.1f} ms; " + cpu_summary(figures, unit)
    )


async def run(ctx: Context) -> list[Row]:
    ceiling = await figures(ctx, "picows")
    bare = await figures(ctx, "bare")
    tokend = await figures(ctx, "tokend")
    rate_ratio = ratio(tokend["rate"], bare["rate"])
    in_flight = ctx.sizes.clients * ctx.sizes.concurrency
    return [
        Row(
            "connect storm",
            f"sessions opened/s, {ctx.sizes.connects:,} ({in_flight} in flight)",
            tokend["rate"],
            "/s",
            f">= {RATE_TARGET}x bare",
            rate_ratio is not None and rate_ratio >= RATE_TARGET,
            "bare handshake+HELLO+verify",
            bare["rate"],
            rate_ratio,
            " | ".join(
                [
                    describe("tokend", tokend),
                    describe("bare", bare),
                    describe("client ceiling (picows server)", ceiling),
                ]
            ),
            {"tokend": tokend, "bare": bare, "client_ceiling": ceiling},
        )
    ]
