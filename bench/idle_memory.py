"""Scenario 2, idle memory: the cost of holding sessions that do nothing.

For each size (10k, and as many as the open-file limit allows) a fresh server gets a
small warm-up batch (so one-time allocations are not charged to the sessions), then
its RSS is read, then the sessions are opened from several client processes and left
idle; RSS is read again. tokend's sessions are full ones (HELLO, WELCOME, a session
in Redis); the bare websockets server (the judged baseline) and the Sans-I/O echo
(websockets' core on a plain asyncio.Protocol: the floor of tokend's design, reported)
hold the same connections after the same HELLO/WELCOME-sized exchange. Redis memory
per session is the ``used_memory`` delta (INFO memory), with a breakdown: session
hashes, deadline sets, event streams.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from redis import asyncio as aioredis

from bench.common import (
    Context,
    Row,
    bare_server,
    client_pool,
    open_all,
    ratio,
    redis_server,
    tokend_server,
)
from tokend.store.keyspace import SHARDS, Keyspace

RSS_TARGET = 0.5  # x bare (websockets.asyncio) per-session RSS (issue 22.5)
REDIS_TARGET = 512  # bytes per session
WARMUP_SESSIONS = 200
SETTLE_S = 2.0
SAMPLE_KEYS = 200


async def hold(
    ctx: Context,
    name: str,
    url: str,
    proto: str,
    rss: Any,
    sessions: int,
    redis: aioredis.Redis | None = None,
) -> dict[str, Any]:
    """Open ``sessions`` idle connections; server RSS (and Redis memory) per session.

    ``rss`` reads the server's RSS in bytes. Tokens ``[0, sessions)`` are used for the
    measured sessions and the next ones for the warm-up.
    """
    sizes = ctx.sizes
    warm = min(WARMUP_SESSIONS, sessions)
    tokens = None if proto == "socketio" else ctx.tokens(sessions + warm)
    async with client_pool(
        ctx,
        f"{name}-warmup",
        url=url,
        proto=proto,
        total=warm,
        procs=1,
        tokens=tokens,
        first=sessions,
    ) as pool:
        await open_all(pool, sizes.concurrency)
    await asyncio.sleep(SETTLE_S)
    rss0 = rss()
    redis0 = await used_memory(redis) if redis else 0
    async with client_pool(
        ctx, name, url=url, proto=proto, total=sessions, procs=sizes.clients, tokens=tokens
    ) as pool:
        opened = await open_all(pool, sizes.concurrency)
        await asyncio.sleep(SETTLE_S)
        rss1 = rss()
        figures: dict[str, Any] = {
            "sessions": opened["opened"],
            "rss_before": rss0,
            "rss_after": rss1,
            "rss_per_session": (rss1 - rss0) / opened["opened"],
            "open_rate": opened["rate"],
        }
        if redis:
            redis1 = await used_memory(redis)
            figures["redis_per_session"] = (redis1 - redis0) / opened["opened"]
            figures["redis_breakdown"] = await breakdown(redis, opened["opened"])
    return figures


async def used_memory(redis: aioredis.Redis) -> int:
    info = await redis.info("memory")
    return int(info["used_memory"])


async def breakdown(redis: aioredis.Redis, sessions: int) -> dict[str, float]:
    """Bytes per session by key kind (MEMORY USAGE; session hashes sampled)."""
    keys = Keyspace("bench")
    sample = [k async for k in redis.scan_iter(match="bench:*:s:*", count=1000)][:SAMPLE_KEYS]
    hashes = [await redis.memory_usage(k, samples=0) or 0 for k in sample]
    due = [await redis.memory_usage(keys.shard_keys(n)[0], samples=0) or 0 for n in range(SHARDS)]
    streams = [await redis.memory_usage(s, samples=0) or 0 for s in keys.streams()]
    return {
        "session_hash": sum(hashes) / max(1, len(hashes)),
        "deadline_sets": sum(due) / sessions,
        "event_streams": sum(streams) / sessions,
    }


async def tokend_figures(ctx: Context, sessions: int) -> dict[str, Any]:
    """tokend holding ``sessions`` idle sessions, once per repetition (Socket.IO reuses it)."""
    key = ("idle", "tokend", sessions)
    if key not in ctx.cache:
        with contextlib.ExitStack() as stack:
            redis = stack.enter_context(redis_server(ctx))
            server = stack.enter_context(tokend_server(ctx, redis.url))
            client = aioredis.from_url(redis.url, decode_responses=True)
            try:
                ctx.cache[key] = await hold(
                    ctx, "tokend", server.url, "tokend", server.rss, sessions, client
                )
            finally:
                await client.aclose()
    result: dict[str, Any] = ctx.cache[key]
    return result


async def run(ctx: Context) -> list[Row]:
    rows = []
    for sessions in ctx.sizes.idle_sessions:
        with bare_server(ctx) as server:
            bare = await hold(ctx, "bare", server.url, "bare", server.rss, sessions)
        with bare_server(ctx, "sansio") as server:
            floor = await hold(ctx, "sansio", server.url, "bare", server.rss, sessions)
        tokend = await tokend_figures(ctx, sessions)
        mem_ratio = ratio(tokend["rss_per_session"], bare["rss_per_session"])
        parts = ", ".join(f"{k} {v:,.0f} B" for k, v in tokend["redis_breakdown"].items())
        rows += [
            Row(
                "idle memory",
                f"server RSS/session, {sessions:,} sessions",
                tokend["rss_per_session"],
                "B",
                f"<= {RSS_TARGET}x bare",
                mem_ratio is not None and mem_ratio <= RSS_TARGET,
                "bare",
                bare["rss_per_session"],
                mem_ratio,
                f"RSS tokend {tokend['rss_before'] / 2**20:.1f} -> "
                f"{tokend['rss_after'] / 2**20:.1f} MiB, bare {bare['rss_before'] / 2**20:.1f} "
                f"-> {bare['rss_after'] / 2**20:.1f} MiB",
                {"tokend": tokend, "bare": bare, "sansio": floor},
            ),
            Row(
                "idle memory",
                f"server RSS/session vs the Sans-I/O echo, {sessions:,} sessions",
                tokend["rss_per_session"],
                "B",
                "(reported)",
                None,
                "sansio",
                floor["rss_per_session"],
                ratio(tokend["rss_per_session"], floor["rss_per_session"]),
            ),
            Row(
                "idle memory",
                f"Redis/session, {sessions:,} sessions",
                tokend["redis_per_session"],
                "B",
                f"<= {REDIS_TARGET} B",
                tokend["redis_per_session"] <= REDIS_TARGET,
                note=f"per session: {parts}",
            ),
        ]
    return rows
