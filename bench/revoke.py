"""Scenario 7, revocations: what WAIT costs where tokend waits for the replicas.

One Store, the path of ``tokend revoke`` and of the admin API's DELETE, revokes
``sizes.connects`` tokens (each a bar and a TOKEN_REVOKED event) with
``sizes.concurrency`` calls in flight: revocations per second and the latency of
each. tokend runs with the run's ``durable_replicas`` (``--set``; default "auto", which
waits for the replica that ``--replica`` adds); the baseline is the same calls with
``durable_replicas`` 0 (no WAIT) on the same Redis. BYE takes the same path (end.lua,
then WAIT).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from bench.common import Context, Row, latency_summary, ratio, redis_server
from tokend import config
from tokend.store.redis_client import open_client
from tokend.store.sessions import Store
from tokend.store.unavailable import NotConfirmed


async def revocations(ctx: Context, url: str, durable_replicas: str) -> dict[str, Any]:
    values = {**ctx.settings, "redis_url": url, "key_prefix": "bench"}
    settings = config.load({**values, "durable_replicas": durable_replicas}, environ={})
    client = open_client(url, settings)
    store = Store(client, settings, "bench")
    in_flight = asyncio.Semaphore(ctx.sizes.concurrency)
    latencies: list[int] = []
    unconfirmed = 0

    async def revoke() -> None:
        nonlocal unconfirmed
        async with in_flight:
            began = time.perf_counter()
            try:
                await store.revoke(uuid.uuid4(), by="bench")
            except NotConfirmed:
                unconfirmed += 1
            latencies.append(round((time.perf_counter() - began) * 1e6))

    try:
        await store.load_scripts()
        began = time.perf_counter()
        await asyncio.gather(*(revoke() for _ in range(ctx.sizes.connects)))
        seconds = time.perf_counter() - began
    finally:
        await client.aclose()
    return {
        "revoked": len(latencies),
        "unconfirmed": unconfirmed,
        "seconds": round(seconds, 3),
        "rate": len(latencies) / seconds,
        **latency_summary(latencies),
    }


def describe(name: str, figures: dict[str, Any]) -> str:
    return (
        f"{name}: {figures['revoked']:,} in {figures['seconds']:.2f} s "
        f"({figures['unconfirmed']:,} not confirmed), p50 {figures['p50_ms']:.2f} ms, "
        f"p99 {figures['p99_ms']:.2f} ms"
    )


async def run(ctx: Context) -> list[Row]:
    durable = ctx.settings.get("durable_replicas", config.Settings().durable_replicas)
    with redis_server(ctx) as store:
        bare = await revocations(ctx, store.url, "0")
        tokend = await revocations(ctx, store.url, durable)
    in_flight = ctx.sizes.concurrency
    return [
        Row(
            "revoke",
            f"revocations/s, durable_replicas {durable} ({in_flight} in flight)",
            tokend["rate"],
            "/s",
            "-",
            None,
            "no WAIT",
            bare["rate"],
            ratio(tokend["rate"], bare["rate"]),
            " | ".join([describe("tokend", tokend), describe("no WAIT", bare)]),
            {"tokend": tokend, "no_wait": bare},
        )
    ]
